"""Simulated hosts for tests, the demo and fleet benchmarks: host trees written in the kernel's own
file formats, so every reader runs exactly as it does on a real machine."""


def install_backends() -> None:
    """Make the simulated kernel, its daemons and MIG available at driverd.backends (idempotent).
    Only the composition root (the CLI, for a simulated tree or --kernel-backend sim) and tests call this."""
    from driverd import backends
    from driverd.sim.kernel import SimKernel
    from driverd.sim.services import SimMig, SimServices
    backends.register(backends.KERNELS, "sim", SimKernel)
    backends.register(backends.SERVICES, "sim", SimServices)
    backends.register(backends.MIG, "sim", SimMig)
