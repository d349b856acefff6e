"""The rollout quality step's implementation, registered with deployments.rollouts when Django starts."""


def register() -> None:
    """Called once from EvalsConfig.ready."""
