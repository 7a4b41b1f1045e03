"""numba's ``njit`` as every cpu kernel compiles with it: the numpy error model.

numba's default ("python") checks each float division for a zero divisor so it can
raise ZeroDivisionError: a branch to an exception inside the loop, which keeps LLVM
from vectorising it. GELU's rational erf, sigmoid, SiLU and tanh ran one element at a
time that way (about 10 ns an element against 1 when vectorised). IEEE results (inf,
nan) for a zero divisor are what ONNX asks of Div anyway.
"""

from __future__ import annotations

import functools

import numba

ERROR_MODEL = "numpy"
njit = functools.partial(numba.njit, error_model=ERROR_MODEL)
