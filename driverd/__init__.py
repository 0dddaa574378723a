"""driverd: take a bare NVIDIA GPU host to workload-ready and keep it there."""

__version__ = "0.1.0"
