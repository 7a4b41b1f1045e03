"""The cpu backend: numba kernels (kernels.py, nhwc.py, the generated gemm_tiles.py on the
explicit SIMD vectors of simd.py), their calling convention shared with the AOT build
(abi.py), which build runs (native.py), and the binds (backend.py)."""
