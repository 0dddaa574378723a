"""Simulated hosts for tests, the demo and fleet benchmarks: host trees written in the kernel's own
file formats, so every reader runs exactly as it does on a real machine."""
