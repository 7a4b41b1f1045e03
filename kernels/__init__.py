"""Kernels: a NumPy reference for every op, numba CPU kernels, one dispatch table."""
