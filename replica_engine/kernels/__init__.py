"""Compiled kernels for where torch's eager ops fall short of the hardware (CPU decode today)."""
