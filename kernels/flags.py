"""Bits of the kernels' ``flags`` argument, the same on every backend and in the AOT
build's signatures: which optional epilogue inputs a call has, and where its bias and
scale run."""

HAS_BIAS, HAS_SCALE, HAS_RES = 1, 2, 4
# The GEMM's bias and scale run along its columns (channels-last convs: rows are
# pixels, columns output channels) instead of its rows.
PER_COL = 8
