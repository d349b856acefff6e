from deployments.replicas.drivers.base import DriverError


def driver_for(name: str):
    """The driver object for a deployment's `driver` field."""
    if name == "local":
        from deployments.replicas.drivers.local import LocalProcessDriver

        return LocalProcessDriver()
    if name == "kubernetes":
        from deployments.replicas.drivers.kubernetes import KubernetesDriver

        return KubernetesDriver()
    raise DriverError(f"unknown driver {name!r}")
