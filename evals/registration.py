"""Scoring a new model version on its model's default eval sets by itself."""


def connect() -> None:
    """Called once from EvalsConfig.ready."""
