"""Kubernetes-coordinated rolling upgrades: the DriverRollout, admission, the per-node state machine."""
