from runtime.drivers.base import DriverError


def driver_for(name: str):
    """The driver object for a deployment's `driver` field."""
    if name == "local":
        from runtime.drivers.local import LocalProcessDriver

        return LocalProcessDriver()
    if name == "kubernetes":
        from runtime.drivers.kubernetes import KubernetesDriver

        return KubernetesDriver()
    raise DriverError(f"unknown driver {name!r}")
