"""The device runtime: bundle reader (mmap), arena executor, local CLI.

Imports only numpy and numba (and threadpoolctl when present): nothing from the
packager, no onnx.
"""
