"""numba CPU kernels. Each is validated against ``reference.py`` by tests/test_kernels.py.

Conventions: activations are float32 and C-contiguous; optional inputs are passed as
1-element (or 1x1) dummy arrays plus a bit in ``flags`` so that every call has one
type signature (kernels/cpu/abi.py lists them for the ahead-of-time build).

No ``fastmath``: without reassociation or FMA contraction every element is computed
in the same order whatever the vector width, so the JIT build, the AOT build shipped
in device executables, and builds for other CPUs give bit-identical results. Loops
are written so the vectoriser can still work (elementwise inner loops).
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange, types
from numba.extending import overload

from ..activations import (
    ERF_P,
    ERF_Q,
    EXP_HI,
    EXP_LN2_HI,
    EXP_LN2_LO,
    EXP_LO,
    EXP_LOG2E,
    EXP_TAYLOR,
    TANH_CLAMP,
    TANH_P,
    TANH_Q,
)
from ..flags import HAS_BIAS, HAS_RES, HAS_SCALE
from ..layout import PANEL
from ..portable import math_fn as _math_fn_py
from .jit import njit
from .simd import Ops, pow2i_f32

# numba folds module-level floats into the kernels as constants
_P0, _P1, _P2, _P3, _P4, _P5, _P6 = ERF_P
_E0, _E1, _E2, _E3, _E4, _E5, _E6, _E7 = EXP_TAYLOR
_T0, _T1, _T2, _T3, _T4, _T5, _T6 = TANH_P
_U0, _U1, _U2, _U3 = TANH_Q
_Q0, _Q1, _Q2, _Q3, _Q4 = ERF_Q
_V8 = Ops(8)  # eight lanes on every CPU, as llm.py
_vzero, _vsplat, _vfma, _vadd = _V8.vzero, _V8.vsplat, _V8.vfma, _V8.vadd
_vload_n, _vstore_n = _V8.vload_n, _V8.vstore_n
_vload, _vstore, _vsub, _vmul, _vdiv = _V8.vload, _V8.vstore, _V8.vsub, _V8.vmul, _V8.vdiv
_vmax, _vmin = _V8.vmax, _V8.vmin
_V16 = Ops(16)  # panel_slab: 64-wide panel rows, legal on every ISA (split as needed)
_vstore16, _vloadw16 = _V16.vstore, _V16.vloadw


@njit(inline="always")
def _clamp01(v, lo, hi):
    """v clamped to [lo, hi], a NaN kept (as ONNX Runtime's Relu, Clip, HardSigmoid)."""
    v = lo if v < lo else v
    return hi if v > hi else v


@njit(inline="always")
def act_scalar(v, act, a, b):
    if act == 0:
        return v
    if act == 1:
        return np.float32(0) if v <= 0 else v  # NaN fails the test: kept
    if act == 2:
        return v if v >= 0 else v * a
    if act == 3:
        return _clamp01(v, a, b)
    if act == 4:
        return sigmoid_f32(v)
    if act == 5:
        return tanh_f32(v)
    if act == 6:
        return _clamp01(v * a + b, np.float32(0), np.float32(1))
    if act == 7:
        # ONNX's HardSwish, alpha = 1/6: a multiply (a divide a vector costs 5x, Zen 3)
        return v * _clamp01(v * np.float32(1 / 6) + np.float32(0.5), np.float32(0), np.float32(1))
    if act == 8:  # silu, x / (1 + exp(-x)): 0 far below 0, NaN at -inf (x * sigmoid(x))
        return v / (np.float32(1) + exp_f32(-v))
    return _gelu(v)  # 9


_ROUND = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to an integer


@njit(inline="always")
def exp_f32(v):
    """e^v in float32 without a libm call, so loops around it vectorise
    (kernels/activations.py EXP_*); a NaN stays NaN, past EXP_HI it is inf (so
    SiLU's -inf / (1 + inf) is NaN, as x * sigmoid(x) in ONNX Runtime). v is made
    float32 first: the rounding to n needs float32's 2^23 (a float64 v gave 2^x)."""
    v = np.float32(v)
    big = v > np.float32(EXP_HI)
    v = np.float32(EXP_LO) if v < np.float32(EXP_LO) else v
    v = np.float32(EXP_HI) if big else v
    n = (v * np.float32(EXP_LOG2E) + np.float32(_ROUND)) - np.float32(_ROUND)
    r = v - n * np.float32(EXP_LN2_HI)
    r = r - n * np.float32(EXP_LN2_LO)
    p = np.float32(_E0)
    p = p * r + np.float32(_E1)
    p = p * r + np.float32(_E2)
    p = p * r + np.float32(_E3)
    p = p * r + np.float32(_E4)
    p = p * r + np.float32(_E5)
    p = p * r + np.float32(_E6)
    p = p * r + np.float32(_E7)
    return np.float32(np.inf) if big else p * pow2i_f32(n)


@njit(inline="always")
def _horner7(x, c0, c1, c2, c3, c4, c5, c6):
    """c0 x^6 + c1 x^5 + ... + c6 in float32, Horner's order (the rational tanh and erf
    share it)."""
    p = np.float32(c0)
    p = p * x + np.float32(c1)
    p = p * x + np.float32(c2)
    p = p * x + np.float32(c3)
    p = p * x + np.float32(c4)
    p = p * x + np.float32(c5)
    return p * x + np.float32(c6)


@njit(inline="always")
def tanh_f32(v):
    """tanh in float32 as a rational function (kernels/activations.py TANH_*)."""
    x = _clamp01(v, np.float32(-TANH_CLAMP), np.float32(TANH_CLAMP))
    x2 = x * x
    p = _horner7(x2, _T0, _T1, _T2, _T3, _T4, _T5, _T6)
    q = ((np.float32(_U0) * x2 + np.float32(_U1)) * x2 + np.float32(_U2)) * x2 + np.float32(_U3)
    return x * p / q


@njit(inline="always")
def sigmoid_f32(v):
    return np.float32(1) / (np.float32(1) + exp_f32(-v))


@njit(inline="always")
def _gelu(v):
    """x * (1 + erf(x / sqrt 2)) / 2, erf as kernels/activations.py ERF_P / ERF_Q (a
    NaN stays NaN: the clamp keeps it)."""
    t = _clamp01(v * np.float32(0.7071067811865476), np.float32(-4.0), np.float32(4.0))
    t2 = t * t
    p = _horner7(t2, _P0, _P1, _P2, _P3, _P4, _P5, _P6)
    q = (np.float32(_Q0) * t2 + np.float32(_Q1)) * t2 + np.float32(_Q2)
    q = (q * t2 + np.float32(_Q3)) * t2 + np.float32(_Q4)
    return np.float32(0.5) * v * (np.float32(1) + t * p / q)


@njit(inline="always")
def _im2col_pair(x, cols, r, c, i, j, sh, pt, pl, dh, oh, ow):
    """Rows r and r + 1 of cols (taps j and j + 1) at stride 2, dilation 1: the two taps
    read neighbouring input columns, which LLVM loads as one interleaved pair with
    shuffles instead of two gathers (5x on a micro-test)."""
    h, w = x.shape[1], x.shape[2]
    shift = j - pl
    lo, hi = valid_cols(shift, 2, w, ow)
    lo1, hi1 = valid_cols(shift + 1, 2, w, ow)
    both_lo = max(lo, lo1)
    both_hi = max(min(hi, hi1), both_lo)  # columns where both taps are inside
    for oy in range(oh):
        iy = oy * sh - pt + i * dh
        base = oy * ow
        if iy < 0 or iy >= h:
            for ox in range(ow):
                cols[r, np.uintp(base + ox)] = 0.0
                cols[r + 1, np.uintp(base + ox)] = 0.0
            continue
        for ox in range(both_lo, both_hi):
            b = 2 * ox + shift
            v0 = x[c, iy, np.uintp(b)]
            v1 = x[c, iy, np.uintp(b + 1)]
            cols[r, np.uintp(base + ox)] = v0
            cols[r + 1, np.uintp(base + ox)] = v1
        for t in range(2):  # each tap's columns outside the joint range, checked
            for ob in range(ow - (both_hi - both_lo)):
                ox = ob if ob < both_lo else ob + (both_hi - both_lo)
                ix = 2 * ox + shift + t
                cols[r + t, ox + base] = x[c, iy, ix] if ix >= 0 and ix < w else 0.0


@njit(parallel=True, cache=True)
def im2col(x, cols, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow):
    """x[C,H,W] -> cols[C*kh*kw, oh*ow], zero outside the image (implicit padding).

    Per row of cols the valid output columns depend only on the tap's column, so they
    are found once (``valid_cols`` divides at stride > 1); the copy loops then run
    without bounds tests on unsigned indices. At stride 2 (dilation 1) neighbouring
    taps are copied in pairs (``_im2col_pair``).
    """
    c_, h, w = x.shape
    khw = kh * kw
    pairs = sw == 2 and dw == 1
    for r in prange(c_ * khw):
        c = r // khw
        i = (r % khw) // kw
        j = r % kw
        if pairs:
            if j % 2 == 0 and j + 1 < kw:
                _im2col_pair(x, cols, r, c, i, j, sh, pt, pl, dh, oh, ow)
            if j % 2 == 0 and j + 1 < kw or j % 2 == 1:
                continue  # done, or done by its pair
        shift = j * dw - pl
        lo, hi = valid_cols(shift, sw, w, ow)
        hi = max(hi, lo)
        for oy in range(oh):
            iy = oy * sh - pt + i * dh
            base = oy * ow
            if iy < 0 or iy >= h:
                for ox in range(ow):
                    cols[r, np.uintp(base + ox)] = 0.0
                continue
            for ox in range(lo):
                cols[r, np.uintp(base + ox)] = 0.0
            if sw == 1:
                for ox in range(lo, hi):
                    cols[r, np.uintp(base + ox)] = x[c, iy, np.uintp(ox + shift)]
            else:
                for ox in range(lo, hi):
                    cols[r, np.uintp(base + ox)] = x[c, iy, np.uintp(ox * sw + shift)]
            for ox in range(hi, ow):
                cols[r, np.uintp(base + ox)] = 0.0


@njit(parallel=True, cache=True)
def im2row(x, rows, kh, kw, sh, sw, pt, pl, dh, dw, oy0, ow):
    """Channels-last im2col: rows[p, (i*kw + j)*C + c] = x[iy, ix, c] for the band's
    output pixels p = (oy - oy0)*ow + ox, (iy, ix) = (oy*sh - pt + i*dh, ox*sw - pl +
    j*dw), zeros outside the image. A tap is a contiguous run of C channels; with dw =
    1 a whole kernel row is one run of kw*C (the stem's 3 channels)."""
    h, wd, c_ = x.shape
    kk = rows.shape[1]
    xf = x.reshape(-1)
    rf = rows.reshape(-1)
    run = kw * c_
    for p in prange(rows.shape[0]):
        oy = oy0 + p // ow
        ox = p % ow
        ix0 = ox * sw - pl
        whole = dw == 1 and ix0 >= 0 and ix0 + kw <= wd
        for i in range(kh):
            iy = oy * sh - pt + i * dh
            d0 = p * kk + i * run
            if iy < 0 or iy >= h:
                for q in range(run):
                    rf[np.uintp(d0 + q)] = 0.0
            elif whole:
                s0 = (iy * wd + ix0) * c_
                for q in range(run):
                    rf[np.uintp(d0 + q)] = xf[np.uintp(s0 + q)]
            else:
                for j in range(kw):
                    ix = ix0 + j * dw
                    o = d0 + j * c_
                    if ix < 0 or ix >= wd:
                        for c in range(c_):
                            rf[np.uintp(o + c)] = 0.0
                    else:
                        s0 = (iy * wd + ix) * c_
                        for c in range(c_):
                            rf[np.uintp(o + c)] = xf[np.uintp(s0 + c)]


@njit(inline="always")
def _vact_lin(v, act, a):
    """ReLU (act 1) or leaky ReLU (2) on a vector: max/min as selects that keep a NaN
    (simd.Ops); leaky as max(v, 0) + a * min(v, 0)."""
    zero = _vzero()
    if act == 1:
        return _vmax(zero, v)
    return _vadd(_vmax(zero, v), _vmul(_vsplat(a), _vmin(zero, v)))


@njit(inline="always")
def _act_row_lin(row, act, a):
    """ReLU or leaky ReLU in place, in explicit vectors. As a plain loop, LLVM turned
    ``row[i] = 0 if v <= 0 else v`` into a store only where the value changes, which
    does not vectorise: an in-place ReLU of 38400 floats took 21 us, 4 so."""
    n = row.size
    i = 0
    while i + 32 <= n:  # four vectors an iteration, as LLVM's own loops interleave
        v0, v1 = _vload(row, i), _vload(row, i + 8)
        v2, v3 = _vload(row, i + 16), _vload(row, i + 24)
        _vstore(row, i, _vact_lin(v0, act, a))
        _vstore(row, i + 8, _vact_lin(v1, act, a))
        _vstore(row, i + 16, _vact_lin(v2, act, a))
        _vstore(row, i + 24, _vact_lin(v3, act, a))
        i += 32
    while i + 8 <= n:
        _vstore(row, i, _vact_lin(_vload(row, i), act, a))
        i += 8
    whole = i
    if whole < n:
        k = n - whole
        _vstore_n(row, whole, _vact_lin(_vload_n(row, whole, k), act, a), k)


@njit(inline="always")
def act_row(row, act, a, b):
    """Activation in place over a contiguous 1-D view.

    One loop per activation with the code a constant inside it: a runtime switch in
    the inner loop keeps LLVM from vectorising (it cost 10x on MobileNetV2's epilogues).
    The piecewise-linear ones are inlined into each kernel (ReLU and leaky ReLU in
    explicit vectors, _act_row_lin); the polynomial ones are a call (_act_row_poly):
    inlined too, they doubled the cold compile of a conv kernel (one dwconv test 20.5
    -> 39.5 s), and a call per row is small beside the polynomial.
    """
    if act == 0:
        return
    n = row.size
    if act == 1:
        _act_row_lin(row, 1, a)
    elif act == 2:
        _act_row_lin(row, 2, a)
    elif act == 3:  # these always store what they compute: LLVM vectorises them
        for i in range(n):
            row[i] = act_scalar(row[i], 3, a, b)
    elif act == 6:
        for i in range(n):
            row[i] = act_scalar(row[i], 6, a, b)
    elif act == 7:
        for i in range(n):
            row[i] = act_scalar(row[i], 7, a, b)
    else:
        _act_row_poly(row, act, a, b)


@njit
def _act_row_poly(row, act, a, b):
    n = row.size
    if act == 4:
        for i in range(n):
            row[i] = act_scalar(row[i], 4, a, b)
    elif act == 5:
        for i in range(n):
            row[i] = act_scalar(row[i], 5, a, b)
    elif act == 8:
        for i in range(n):
            row[i] = act_scalar(row[i], 8, a, b)
    else:
        for i in range(n):
            row[i] = act_scalar(row[i], 9, a, b)


@njit(inline="always")
def epilogue_row(row, s, bb, res_row, has_res, act, a, b):
    """row = act(row * s + bb [+ res_row]) in place, in vectorisable passes."""
    n = row.size
    if has_res:
        for i in range(n):
            row[i] = row[i] * s + bb + res_row[i]
    else:
        for i in range(n):
            row[i] = row[i] * s + bb
    act_row(row, act, a, b)


@njit(parallel=True, cache=True)
def epilogue_rows(y, bias, scale, res, flags, act, a, b):
    """In place on y[R, P]: per-row scale and bias, optional residual, activation."""
    r_ = y.shape[0]
    has_res = (flags & HAS_RES) != 0
    rstep = 1 if has_res else 0  # the dummy residual has one row
    for r in prange(r_):
        s = scale[r] if flags & HAS_SCALE else np.float32(1)
        bb = bias[r] if flags & HAS_BIAS else np.float32(0)
        epilogue_row(y[r], s, bb, res[r * rstep], has_res, act, a, b)


@njit(inline="always")
def linear_epilogue_row(row, bias, scale, flags, act, a, b):
    """In place on one output row of a linear layer: per-column scale and bias, then the
    activation (the GEMV kernels' own pass over y, and epilogue_cols')."""
    for n in range(row.shape[0]):
        s = scale[n] if flags & HAS_SCALE else np.float32(1)
        bb = bias[n] if flags & HAS_BIAS else np.float32(0)
        row[n] = row[n] * s + bb
    act_row(row, act, a, b)


@njit(parallel=True, cache=True)
def epilogue_cols(y, bias, scale, flags, act, a, b):
    """In place on y[M, N]: per-column scale and bias, activation (linear layers)."""
    for m in prange(y.shape[0]):
        linear_epilogue_row(y[m], bias, scale, flags, act, a, b)


_math_fn = njit(inline="always")(_math_fn_py)


@njit(parallel=True, cache=True)
def math_into(x, y, code, a, b):
    """y = the math op's function ``code`` (kernels/mathfns.py) of x, flat arrays, in
    float64 rounded once (x and y may be the same buffer)."""
    n = x.size
    chunk = 16384
    for c in prange((n + chunk - 1) // chunk):
        for i in range(c * chunk, min(c * chunk + chunk, n)):
            y[i] = _math_fn(code, np.float64(x[i]), a, b)


@njit(parallel=True, cache=True)
def act_into(x, y, act, a, b):
    """y = act(x) elementwise over flat arrays (x and y may be the same buffer: then
    nothing is copied; the copy loop, its vector form refused by LLVM's run-time
    overlap check, had doubled an in-place hard-swish)."""
    n = x.size
    chunk = 16384
    same = x.ctypes.data == y.ctypes.data
    for c in prange((n + chunk - 1) // chunk):
        lo = c * chunk
        hi = min(lo + chunk, n)
        row = y[lo:hi]
        if not same:
            src = x[lo:hi]
            for i in range(hi - lo):
                row[i] = src[i]
        act_row(row, act, a, b)


@njit(inline="always")
def panel_share(m_, n_, workers, sl, mr, w_bytes, io_bytes):
    """(t_lo, t_hi, m_lo, m_hi): worker sl's share of a GEMM of m_ rows by n_ columns
    in weight panels of PANEL, w_bytes of weights, io_bytes of input and output
    activations. Whole panels (each worker then reads only its own weights) when
    they divide evenly among the workers, share the columns evenly too (every panel
    full, or 8 or more a worker: a partial last one then costs its worker at most
    1/8), and the weights outweigh the activations (w_bytes >= 2 io_bytes); else rows
    in whole tiles of mr (empty when m_lo >= m_hi).

    Why rows unless the weights dominate: split by columns, every worker reads the
    whole input, which the workers of the layer before wrote by rows, and the layer
    after reads every column of its rows, so about half of both crosses between
    cores; split by rows, each core keeps reading the rows it wrote. ResNet-18 int8
    at 2 threads (its 28x28 stage now by rows), old and new rule alternated: 5.69-5.80
    -> 5.61-5.66 ms; MobileNetV2 unchanged (docs/cpu-kernels.md, "Two threads on
    these VMs"). MobileNetV2's 112x112 16 -> 96 conv split as 64 + 32 columns took
    0.52-0.58 ms at 2 threads, 0.41 at 1; split by rows, 0.38-0.41."""
    np_ = (n_ + PANEL - 1) // PANEL
    if (np_ % workers == 0 and (n_ % PANEL == 0 or np_ // workers >= 8)
            and w_bytes >= 2 * io_bytes):  # fmt: skip
        per_t = np_ // workers
        return sl * per_t, sl * per_t + per_t, 0, m_
    per_m = ((m_ + mr - 1) // mr + workers - 1) // workers * mr
    m_lo = sl * per_m
    return 0, np_, m_lo, min(m_, m_lo + per_m)


def panel_slab(wq, s0, n, buf):
    """(floats, offset, in place): where a GEMM tile reads the n weights of a panel slab
    starting at wq[s0]. float32 panels are read in place: (wq, s0, True). Stored
    weights of another type (fp16 as uint16 bits, bf16 as int16 bits, int8 by value:
    simd's ``vloadw``) are widened into ``buf`` first: (buf, 0, False). A slab is
    KD x PANEL weights at most (40 KB of float32), widened once per pass of up to MC
    rows over it, so the widening is 1/240 of the slab's fma steps, and the whole
    weight tensor is never copied wide (the per-call copy had made ResNet-18's fp16
    512-channel 3x3 convs 2.2-2.3 ms against 1.7 in fp32). ``buf`` comes typed
    read-only, as the weights do, so
    the tiles compiled for float32 panels serve every type: its writes go through the
    vstore intrinsic. n is a multiple of 16 (slabs are whole PANEL-wide rows)."""
    raise TypeError("panel_slab runs inside compiled kernels only")


@overload(panel_slab, inline="always")
def _panel_slab(wq, s0, n, buf):
    if isinstance(wq.dtype, types.Float):
        return lambda wq, s0, n, buf: (wq, s0, True)

    def widened(wq, s0, n, buf):
        for i in range(0, n, 16):
            _vstore16(buf, i, _vloadw16(wq, s0 + i))
        return buf, 0, False

    return widened


def floats_or(w, alt):
    """(w, True) when the stored weights w are float32, to be read in place; else (alt,
    False). The choice is made when the kernel compiles, by w's type, so a path that
    reads w in place (Winograd's direct U) is compiled on alt's type instead of on fp16
    or bf16 bits, and the tiles it calls keep the specialisations they already have."""
    raise TypeError("floats_or runs inside compiled kernels only")


@overload(floats_or, inline="always")
def _floats_or(w, alt):
    if isinstance(w.dtype, types.Float):
        return lambda w, alt: (w, True)
    return lambda w, alt: (alt, False)


@njit(inline="always")
def valid_cols(shift, stride, width, n_out):
    """Output columns [lo, hi) whose input column ``ox * stride + shift`` is inside [0, width)."""
    if stride == 1:  # no division: a runtime-divisor idiv costs ~25 ns
        return max(0, -shift), max(0, min(n_out, width - shift))
    lo = 0 if shift >= 0 else (-shift + stride - 1) // stride
    hi = (width - 1 - shift) // stride + 1 if width - 1 - shift >= 0 else 0
    return lo, min(hi, n_out)


@njit(inline="always")
def _dw_row3(out, x, w, c, oy, i, iy, sw, pl, wd, ow, lo, hi):
    """One kernel row of a 3-wide depthwise tap set: out[c, oy, :] += w[c, 0, i, :] * x.

    The three column taps are summed in one pass where all are inside the image (one
    read-modify-write of the output instead of three; at stride 2 LLVM turns the three
    neighbouring loads into one gather plus shuffles instead of three gathers, 3x).
    [lo, hi) are the columns whose three taps are all inside (the caller computes them
    once: an integer division per row cost more than the row). Border columns take the
    checked path.
    """
    w0 = np.float32(w[c, 0, i, 0])
    w1 = np.float32(w[c, 0, i, 1])
    w2 = np.float32(w[c, 0, i, 2])
    if sw == 1:
        for k in range(lo, hi):
            bx = k - pl
            out[c, oy, np.uintp(k)] += (
                w0 * x[c, iy, np.uintp(bx)]
                + w1 * x[c, iy, np.uintp(bx + 1)]
                + w2 * x[c, iy, np.uintp(bx + 2)]
            )
    elif sw == 2:
        for k in range(lo, hi):
            bx = 2 * k - pl
            out[c, oy, np.uintp(k)] += (
                w0 * x[c, iy, np.uintp(bx)]
                + w1 * x[c, iy, np.uintp(bx + 1)]
                + w2 * x[c, iy, np.uintp(bx + 2)]
            )
    else:
        for k in range(lo, hi):
            bx = k * sw - pl
            out[c, oy, np.uintp(k)] += (
                w0 * x[c, iy, np.uintp(bx)]
                + w1 * x[c, iy, np.uintp(bx + 1)]
                + w2 * x[c, iy, np.uintp(bx + 2)]
            )
    for kb in range(ow - (hi - lo)):  # border columns: at most a couple on each side
        k = kb if kb < lo else kb + (hi - lo)
        acc = np.float32(0)
        for j in range(3):
            ix = k * sw - pl + j
            if ix >= 0 and ix < wd:
                acc += np.float32(w[c, 0, i, j]) * x[c, iy, ix]
        out[c, oy, k] += acc


@njit(inline="always")
def _dw_row3x3(out, x, w, c, oy, iy0, sw, pl, wd, ow, lo, hi):
    """One output row of a 3x3 depthwise conv whose three input rows are all inside:
    nine taps per output in one pass (no zeroing, one store per output)."""
    w00, w01, w02 = np.float32(w[c, 0, 0, 0]), np.float32(w[c, 0, 0, 1]), np.float32(w[c, 0, 0, 2])
    w10, w11, w12 = np.float32(w[c, 0, 1, 0]), np.float32(w[c, 0, 1, 1]), np.float32(w[c, 0, 1, 2])
    w20, w21, w22 = np.float32(w[c, 0, 2, 0]), np.float32(w[c, 0, 2, 1]), np.float32(w[c, 0, 2, 2])
    r0, r1, r2 = iy0, iy0 + 1, iy0 + 2
    if sw == 1:
        for k in range(lo, hi):
            b0 = np.uintp(k - pl)
            b1, b2 = b0 + np.uintp(1), b0 + np.uintp(2)
            out[c, oy, np.uintp(k)] = (
                (w00 * x[c, r0, b0] + w01 * x[c, r0, b1] + w02 * x[c, r0, b2])
                + (w10 * x[c, r1, b0] + w11 * x[c, r1, b1] + w12 * x[c, r1, b2])
                + (w20 * x[c, r2, b0] + w21 * x[c, r2, b1] + w22 * x[c, r2, b2])
            )
    else:
        for k in range(lo, hi):
            b0 = np.uintp(k * sw - pl)
            b1, b2 = b0 + np.uintp(1), b0 + np.uintp(2)
            out[c, oy, np.uintp(k)] = (
                (w00 * x[c, r0, b0] + w01 * x[c, r0, b1] + w02 * x[c, r0, b2])
                + (w10 * x[c, r1, b0] + w11 * x[c, r1, b1] + w12 * x[c, r1, b2])
                + (w20 * x[c, r2, b0] + w21 * x[c, r2, b1] + w22 * x[c, r2, b2])
            )
    for kb in range(ow - (hi - lo)):  # border columns, checked
        k = kb if kb < lo else kb + (hi - lo)
        acc = np.float32(0)
        for i in range(3):
            for j in range(3):
                ix = k * sw - pl + j
                if ix >= 0 and ix < wd:
                    acc += np.float32(w[c, 0, i, j]) * x[c, iy0 + i, ix]
        out[c, oy, k] = acc


@njit(parallel=True, cache=True)
def dwconv(x, w, bias, scale, res, out, sh, sw, pt, pl, dh, dw, flags, act, a, b):
    """Depthwise conv, one image: x[C,H,W], w[C,1,kh,kw] (float32 or int8), out[C,oh,ow].

    Accumulates whole output rows per tap over the valid column range (computed once
    per tap), so the inner loop has no bounds test. Column indices are unsigned
    (``np.uintp``): numba then emits no negative-index wraparound, and LLVM vectorises
    (11x on a strided micro-test; views would do the same but cost ~20 ns each to make).
    """
    c_, h, wd = x.shape
    kh, kw = w.shape[2], w.shape[3]
    oh, ow = out.shape[1], out.shape[2]
    has_res = (flags & HAS_RES) != 0
    rstep = 1 if has_res else 0  # the dummy residual is 1x1x1
    rn = oh * ow if has_res else 1
    lo3, hi3 = valid_cols(-pl, sw, wd - 2, ow)  # columns whose taps 0..2 are all inside
    hi3 = max(hi3, lo3)
    k3 = kh == 3 and kw == 3 and dh == 1 and dw == 1
    for c in prange(c_):
        for oy in range(oh):
            iy0 = oy * sh - pt
            if k3 and iy0 >= 0 and iy0 + 2 < h:
                _dw_row3x3(out, x, w, c, oy, iy0, sw, pl, wd, ow, lo3, hi3)
                continue
            for ox in range(ow):
                out[c, oy, ox] = 0.0
            for i in range(kh):
                iy = oy * sh - pt + i * dh
                if iy < 0 or iy >= h:
                    continue
                if kw == 3 and dw == 1:
                    _dw_row3(out, x, w, c, oy, i, iy, sw, pl, wd, ow, lo3, hi3)
                    continue
                for j in range(kw):
                    wv = np.float32(w[c, 0, i, j])
                    shift = j * dw - pl
                    lo, hi = valid_cols(shift, sw, wd, ow)
                    if sw == 1:
                        for k in range(lo, hi):
                            out[c, oy, np.uintp(k)] += wv * x[c, iy, np.uintp(k + shift)]
                    else:
                        for k in range(lo, hi):
                            out[c, oy, np.uintp(k)] += wv * x[c, iy, np.uintp(k * sw + shift)]
        s = scale[c] if flags & HAS_SCALE else np.float32(1)
        bb = bias[c] if flags & HAS_BIAS else np.float32(0)
        epilogue_row(out[c].reshape(oh * ow), s, bb, res[c * rstep].reshape(rn), has_res, act, a, b)


@njit(parallel=True, cache=True)
def dwconv3_flat(x, w, bias, scale, res, out, planes, flags, act, a, b):
    """3x3 depthwise conv, stride 1, pads 1, one image, for small images.

    Rows of 7 or 14 outputs leave the row-wise kernel mostly in loop overhead and
    checked border columns. Here each channel is copied into a zero-bordered plane
    (``planes[slot, 0]``, width wp = W + 2) and one vectorised 9-tap loop runs over the
    flat range of oh * wp "wide" outputs (``planes[slot, 1]``; the 2 extra columns per
    row are discarded), then the rows are copied out and the epilogue applied.
    """
    c_, h, wd = x.shape
    oh, ow = out.shape[1], out.shape[2]
    wp = wd + 2
    n = oh * wp
    has_res = (flags & HAS_RES) != 0
    rstep = 1 if has_res else 0  # the dummy residual is 1x1x1
    rn = oh * ow if has_res else 1
    slots = planes.shape[0]
    for sl in prange(slots):
        for c in range(sl, c_, slots):
            for p in range(planes.shape[2]):
                planes[sl, 0, np.uintp(p)] = 0.0
            for iy in range(h):
                o = (iy + 1) * wp + 1
                for ix in range(wd):
                    planes[sl, 0, np.uintp(o + ix)] = x[c, iy, np.uintp(ix)]
            w00, w01, w02 = (
                np.float32(w[c, 0, 0, 0]),
                np.float32(w[c, 0, 0, 1]),
                np.float32(w[c, 0, 0, 2]),
            )
            w10, w11, w12 = (
                np.float32(w[c, 0, 1, 0]),
                np.float32(w[c, 0, 1, 1]),
                np.float32(w[c, 0, 1, 2]),
            )
            w20, w21, w22 = (
                np.float32(w[c, 0, 2, 0]),
                np.float32(w[c, 0, 2, 1]),
                np.float32(w[c, 0, 2, 2]),
            )
            for p in range(n):
                q0 = np.uintp(p)
                q1 = q0 + np.uintp(wp)
                q2 = q1 + np.uintp(wp)
                one, two = np.uintp(1), np.uintp(2)
                planes[sl, 1, q0] = (
                    (
                        w00 * planes[sl, 0, q0]
                        + w01 * planes[sl, 0, q0 + one]
                        + w02 * planes[sl, 0, q0 + two]
                    )
                    + (
                        w10 * planes[sl, 0, q1]
                        + w11 * planes[sl, 0, q1 + one]
                        + w12 * planes[sl, 0, q1 + two]
                    )
                    + (
                        w20 * planes[sl, 0, q2]
                        + w21 * planes[sl, 0, q2 + one]
                        + w22 * planes[sl, 0, q2 + two]
                    )
                )
            for oy in range(oh):
                for ox in range(ow):
                    out[c, oy, np.uintp(ox)] = planes[sl, 1, np.uintp(oy * wp + ox)]
            s = scale[c] if flags & HAS_SCALE else np.float32(1)
            bb = bias[c] if flags & HAS_BIAS else np.float32(0)
            epilogue_row(
                out[c].reshape(oh * ow), s, bb, res[c * rstep].reshape(rn), has_res, act, a, b
            )


@njit(parallel=True, cache=True)
def dwconv3_s2(x, w, bias, scale, res, out, planes, flags, act, a, b):
    """3x3 depthwise conv, stride 2, pads 1, one image.

    At stride 2 the taps of neighbouring outputs are two columns apart, so the
    row-wise kernel gathers. Here each padded input row is first split once into its
    even and odd columns (``planes[slot, 0]`` / ``planes[slot, 1]``, rows of ne = ow + 1);
    output column ox then reads even[ox], odd[ox], even[ox + 1]: unit stride.
    """
    c_, h, wd = x.shape
    oh, ow = out.shape[1], out.shape[2]
    ne = ow + 1
    hp = 2 * oh + 1  # padded rows the outputs read
    has_res = (flags & HAS_RES) != 0
    rstep = 1 if has_res else 0  # the dummy residual is 1x1x1
    rn = oh * ow if has_res else 1
    slots = planes.shape[0]
    for sl in prange(slots):
        for c in range(sl, c_, slots):
            for r in range(hp):  # padded column q = 2u (even) or 2u + 1 (odd); x col = q - 1
                base = r * ne
                for u in range(ne):
                    planes[sl, 0, np.uintp(base + u)] = 0.0
                    planes[sl, 1, np.uintp(base + u)] = 0.0
                iy = r - 1
                if iy < 0 or iy >= h:
                    continue
                # even q = 2u holds x col 2u - 1, odd q = 2u + 1 holds x col 2u; read as
                # pairs (2u - 1, 2u) so LLVM loads them interleaved, not as gathers
                planes[sl, 1, np.uintp(base)] = x[c, iy, 0]
                for u in range(1, min(ne, (wd + 1) // 2)):
                    v0 = x[c, iy, np.uintp(2 * u - 1)]
                    v1 = x[c, iy, np.uintp(2 * u)]
                    planes[sl, 0, np.uintp(base + u)] = v0
                    planes[sl, 1, np.uintp(base + u)] = v1
                if wd % 2 == 0 and wd // 2 < ne:  # the last column has no pair
                    planes[sl, 0, np.uintp(base + wd // 2)] = x[c, iy, wd - 1]
            w00, w01, w02 = (
                np.float32(w[c, 0, 0, 0]),
                np.float32(w[c, 0, 0, 1]),
                np.float32(w[c, 0, 0, 2]),
            )
            w10, w11, w12 = (
                np.float32(w[c, 0, 1, 0]),
                np.float32(w[c, 0, 1, 1]),
                np.float32(w[c, 0, 1, 2]),
            )
            w20, w21, w22 = (
                np.float32(w[c, 0, 2, 0]),
                np.float32(w[c, 0, 2, 1]),
                np.float32(w[c, 0, 2, 2]),
            )
            for oy in range(oh):
                e0 = np.uintp(2 * oy * ne)
                e1 = e0 + np.uintp(ne)
                e2 = e1 + np.uintp(ne)
                for ox in range(ow):
                    q = np.uintp(ox)
                    q1 = q + np.uintp(1)
                    out[c, oy, q] = (
                        (
                            w00 * planes[sl, 0, e0 + q]
                            + w01 * planes[sl, 1, e0 + q]
                            + w02 * planes[sl, 0, e0 + q1]
                        )
                        + (
                            w10 * planes[sl, 0, e1 + q]
                            + w11 * planes[sl, 1, e1 + q]
                            + w12 * planes[sl, 0, e1 + q1]
                        )
                        + (
                            w20 * planes[sl, 0, e2 + q]
                            + w21 * planes[sl, 1, e2 + q]
                            + w22 * planes[sl, 0, e2 + q1]
                        )
                    )
            s = scale[c] if flags & HAS_SCALE else np.float32(1)
            bb = bias[c] if flags & HAS_BIAS else np.float32(0)
            epilogue_row(
                out[c].reshape(oh * ow), s, bb, res[c * rstep].reshape(rn), has_res, act, a, b
            )


@njit(parallel=True, cache=True)
def maxpool(x, out, kh, kw, sh, sw, pt, pl, dh, dw):
    """x[C,H,W] -> out[C,oh,ow]; padding never wins (it is -inf in ONNX semantics).

    Row-wise like dwconv: per tap the valid output columns are found once per call,
    and the inner loops run over unsigned indices with no bounds test. A 3-wide window
    takes its three columns in one pass where all are inside (one gather plus shuffles
    at stride 2 instead of three gathers).
    """
    c_, h, wd = x.shape
    oh, ow = out.shape[1], out.shape[2]
    lo3, hi3 = valid_cols(-pl, sw, wd - 2 * dw, ow)  # columns whose 3 taps are inside
    hi3 = max(hi3, lo3)
    w3 = kw == 3
    for c in prange(c_):
        for oy in range(oh):
            for ox in range(ow):
                out[c, oy, ox] = -np.inf
            for i in range(kh):
                iy = oy * sh - pt + i * dh
                if iy < 0 or iy >= h:
                    continue
                if w3:
                    for k in range(lo3, hi3):
                        b0 = k * sw - pl
                        v0 = x[c, iy, np.uintp(b0)]
                        v1 = x[c, iy, np.uintp(b0 + dw)]
                        v2 = x[c, iy, np.uintp(b0 + 2 * dw)]
                        m = out[c, oy, np.uintp(k)]  # NaN, once seen, stays
                        m = v0 if v0 > m or v0 != v0 else m
                        m = v1 if v1 > m or v1 != v1 else m
                        out[c, oy, np.uintp(k)] = v2 if v2 > m or v2 != v2 else m
                    for kb in range(ow - (hi3 - lo3)):  # border columns, checked
                        k = kb if kb < lo3 else kb + (hi3 - lo3)
                        for j in range(3):
                            ix = k * sw - pl + j * dw
                            if ix >= 0 and ix < wd:
                                v = x[c, iy, ix]
                                if v > out[c, oy, k] or v != v:
                                    out[c, oy, k] = v
                    continue
                for j in range(kw):
                    shift = j * dw - pl
                    lo, hi = valid_cols(shift, sw, wd, ow)
                    for k in range(lo, hi):
                        v = x[c, iy, np.uintp(k * sw + shift)]
                        cur = out[c, oy, np.uintp(k)]
                        out[c, oy, np.uintp(k)] = v if v > cur or v != v else cur


@njit(parallel=True, cache=True)
def avgpool(x, out, kh, kw, sh, sw, pt, pl, pb, pr, include_pad):
    """x[C,H,W] -> out[C,oh,ow]. With include_pad, explicit pads count in the divisor
    but the ceil_mode overhang never does (ONNX Runtime's rule)."""
    c_, h, wd = x.shape
    oh, ow = out.shape[1], out.shape[2]
    for c in prange(c_):
        for oy in range(oh):
            for ox in range(ow):
                s = np.float32(0)
                n = 0
                for i in range(kh):
                    iy = oy * sh - pt + i
                    inside_pad_y = iy >= -pt and iy < h + pb
                    for j in range(kw):
                        ix = ox * sw - pl + j
                        if iy >= 0 and iy < h and ix >= 0 and ix < wd:
                            s += x[c, iy, ix]
                            n += 1
                        elif include_pad and inside_pad_y and ix >= -pl and ix < wd + pr:
                            n += 1
                out[c, oy, ox] = s / n if n > 0 else np.float32(0)


@njit(parallel=True, cache=True)
def global_avgpool(x, out):
    """x[R, P] -> out[R]: mean over the spatial positions of each (n, c) row."""
    r_, p_ = x.shape
    for r in prange(r_):
        s = np.float32(0)
        for p in range(p_):
            s += x[r, p]
        out[r] = s / p_


@njit(parallel=True, cache=True)
def channel_affine(x, scale, shift, out, act, a, b):
    """x[N, C, P] -> out: x * scale[c] + shift[c], then activation."""
    n_, c_, p_ = x.shape
    for nc in prange(n_ * c_):
        n = nc // c_
        c = nc % c_
        s = scale[c]
        t = shift[c]
        for p in range(p_):
            out[n, c, p] = act_scalar(x[n, c, p] * s + t, act, a, b)


@njit(parallel=True, cache=True)
def softmax3(x, out, log):
    """Softmax over axis 1 of x[outer, L, inner]; with ``log`` the log-softmax,
    (x - max) - log(sum(exp(x - max))) with the sum in float64 (no exp of a large
    logit overflows, no log of an underflow)."""
    o_, l_, i_ = x.shape
    for oi in prange(o_ * i_):
        o = oi // i_
        i = oi % i_
        m = -np.inf
        for k in range(l_):
            if x[o, k, i] > m:
                m = x[o, k, i]
        if log:
            s = 0.0
            for k in range(l_):
                s += np.exp(np.float64(x[o, k, i]) - m)
            ls = np.log(s)
            for k in range(l_):
                out[o, k, i] = np.float64(x[o, k, i]) - m - ls
            continue
        s32 = np.float32(0)
        for k in range(l_):
            e = np.exp(x[o, k, i] - m)
            out[o, k, i] = e
            s32 += e
        inv = np.float32(1) / s32
        for k in range(l_):
            out[o, k, i] *= inv



@njit(inline="always")
def _vcombo(a, ao, src, so, stride, n, lanes):
    """sum over t < n of a[ao + t] * src[so + t * stride : + lanes] (a vector of 8, the
    first ``lanes`` lanes): four partial sums, since one fma chain waits on its latency."""
    a0, a1, a2, a3 = _vzero(), _vzero(), _vzero(), _vzero()
    t = 0
    while t + 4 <= n:
        o = so + t * stride
        a0 = _vfma(_vsplat(a[ao + t]), _vload_n(src, o, lanes), a0)
        a1 = _vfma(_vsplat(a[ao + t + 1]), _vload_n(src, o + stride, lanes), a1)
        a2 = _vfma(_vsplat(a[ao + t + 2]), _vload_n(src, o + 2 * stride, lanes), a2)
        a3 = _vfma(_vsplat(a[ao + t + 3]), _vload_n(src, o + 3 * stride, lanes), a3)
        t += 4
    for u in range(t, n):
        a0 = _vfma(_vsplat(a[ao + u]), _vload_n(src, so + u * stride, lanes), a0)
    return _vadd(_vadd(a0, a1), _vadd(a2, a3))


@njit(parallel=True, cache=True)
def sdpa4(q, k, v, mask, out, s, scale, k_t, has_mask, nan_zero):
    """softmax(scale * q k^T + mask) v for q [B, H, Sq, D], k [B, H, Sk, D] (``k_t``:
    K^T [B, H, D, Sk]), v [B, H, Sk, Dv], mask a [B, H, Sq, Sk] view (broadcast: zero
    strides), out [B, H, Sq, Dv]; s [B * H, Sk] one row of scores a (b, h) pair. One call
    for the six steps an exporter's attention had been (two batched matmuls, scalar
    muls, the mask's add, the softmax), each row of scores staying in L1. The two
    products in vectors of 8 with the sums in registers (q[c] times K^T's rows; p[j]
    times v's rows), four partial sums each (one fma chain waits on its latency): as
    plain loops, storing to the output each step, with a branch for the max, MiniLM's
    4 x 12 x 32 x 32 took 1.1 ms, 0.3 so. Sums in float32, the max's
    NaN as softmax3, exp the vectorising exp_f32. ``nan_zero``: a NaN probability
    counts as 0 (torch's export guards fully masked rows with IsNaN and Where)."""
    nb, nh, sq, d = q.shape
    sk, dv = v.shape[2], v.shape[3]
    qf, kf, vf, of = q.reshape(q.size), k.reshape(k.size), v.reshape(v.size), out.reshape(out.size)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        row = s[bh]
        kb, vb = bh * sk * d, bh * sk * dv
        for i in range(sq):
            qo, oo = (bh * sq + i) * d, (bh * sq + i) * dv
            if k_t:  # K^T rows: q[c] broadcast against them
                for j0 in range(0, sk, 8):
                    _vstore_n(row, j0, _vcombo(qf, qo, kf, kb + j0, sk, d, sk - j0), sk - j0)
            else:
                for j in range(sk):
                    t = np.float32(0)
                    for c in range(d):
                        t += qf[qo + c] * kf[kb + j * d + c]
                    row[j] = t
            for j in range(sk):
                row[j] *= scale
            if has_mask:
                for j in range(sk):
                    row[j] += mask[b, h, i, j]
            m = np.float32(-np.inf)
            for j in range(sk):  # a select, not a branch: a mispredicted branch an
                r = row[j]  # element had taken 40% of MiniLM's attention
                m = r if r > m else m
            for j in range(sk):  # apart from the serial sum, so that it vectorises
                row[j] = exp_f32(row[j] - m)
            tot = np.float32(0)
            for j in range(sk):
                tot += row[j]
            inv = np.float32(1) / tot
            for j in range(sk):
                p = row[j] * inv
                row[j] = np.float32(0) if nan_zero and p != p else p
            for c0 in range(0, dv, 8):
                _vstore_n(of, oo + c0, _vcombo(row, 0, vf, vb + c0, dv, sk, dv - c0), dv - c0)


@njit(parallel=True, cache=True)
def conv_transpose(x, w, bias, y, sh, sw, pt, pl, dh, dw, group, has_bias):
    """ConvTranspose as a gather (no two threads write one output): y[n, o, oy, ox]
    sums x[n, c, iy, ix] * w[c, o', ky, kx] over the taps with iy * sh + ky * dh =
    oy + pt (likewise x), c in o's group; float64 sums."""
    n_, c_, h_, w_ = x.shape
    cog, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    co_, oh, ow = y.shape[1], y.shape[2], y.shape[3]
    cig = c_ // group
    for no in prange(n_ * co_):
        n = no // co_
        o = no % co_
        gi = o // cog
        oc = o - gi * cog
        for oy in range(oh):
            for ox in range(ow):
                s = np.float64(bias[o]) if has_bias else 0.0
                for ky in range(kh):
                    ty = oy + pt - ky * dh
                    if ty < 0 or ty % sh:
                        continue
                    iy = ty // sh
                    if iy >= h_:
                        continue
                    for kx in range(kw):
                        tx = ox + pl - kx * dw
                        if tx < 0 or tx % sw:
                            continue
                        ix = tx // sw
                        if ix >= w_:
                            continue
                        for ci in range(gi * cig, (gi + 1) * cig):
                            s += np.float64(x[n, ci, iy, ix]) * w[ci, oc, ky, kx]
                y[n, o, oy, ox] = s


@njit(parallel=True, cache=True)
def resample3(x, idx, w, y):
    """y[a, o, b] = sum_t w[o, t] * x[a, idx[o, t], b] (float64 sums): one axis of a
    Resize, x and y as [outer, axis, inner]."""
    o_, n_, i_ = y.shape
    taps = idx.shape[1]
    for ao in prange(o_ * n_):
        a = ao // n_
        o = ao % n_
        for b in range(i_):
            s = 0.0
            for t in range(taps):
                s += np.float64(w[o, t]) * x[a, idx[o, t], b]
            y[a, o, b] = s


@njit(parallel=True, cache=True)
def decode_i8(src, dst):
    """int8 weights -> float32 scratch (flat arrays); the scale is applied later."""
    for i in prange(src.size):
        dst[i] = np.float32(src[i])


# Halves a parallel task of decode_f16 widens: large enough that a task's start costs
# nothing against it, small enough to split a conv's weights between the threads.
DECODE_CHUNK = 1 << 16
_V16 = Ops(16)
_wload16, _wload16_n, _store16, _store16_n = _V16.vloadw, _V16.vloadw_n, _V16.vstore, _V16.vstore_n


@njit(parallel=True, cache=True)
def decode_f16(src, dst):
    """IEEE half (as uint16 bits) -> float32, flat arrays, 16 at a time with the
    hardware conversion (simd ``vloadw``: vcvtph2ps, fcvtl on aarch64; exact for every
    half, subnormals, infinities and NaNs included). numba has no CPU float16 type, and
    NumPy's casting copy goes through a 32 KB buffer on every call. The bit-rebuilding
    loop this replaces did not vectorise (a branch per value): ResNet-18's 11.7 M
    weights took 9.3 ms a call at 1 thread."""
    n = src.size
    for c in prange((n + DECODE_CHUNK - 1) // DECODE_CHUNK):
        lo = c * DECODE_CHUNK
        hi = min(n, lo + DECODE_CHUNK)
        i = lo
        while i + 16 <= hi:
            _store16(dst, i, _wload16(src, i))
            i += 16
        if i < hi:
            _store16_n(dst, i, _wload16_n(src, i, hi - i), hi - i)


@njit(parallel=True, cache=True)
def decode_bf16(src, dst):
    """bfloat16 (as uint16 bits) -> float32 (as uint32 bits): the top half of the word."""
    for i in prange(src.size):
        dst[i] = np.uint32(src[i]) << np.uint32(16)


# 2**(e - 25) for a half's exponent field e (e = 0: subnormal, the same step as e = 1)
_HALF_STEP = np.array([2.0 ** (max(e, 1) - 25) for e in range(32)], np.float32)


@njit(inline="always")
def half_to_f32(h):
    """One IEEE half (its uint16 bits) as float32, exactly (int4 group scales). A table
    of powers, not 2.0 ** e: a pow call per group held the int4 GEMV to 3 GB/s."""
    h = np.int64(h)
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        v = np.float32(m + (1024 if e else 0)) * _HALF_STEP[e]
    return -v if h & 0x8000 else v


@njit(parallel=True, cache=True)
def decode_q4(src, scale, dst, rows, cols):
    """int4 weights (wtypes.py: packed [N, Kp/2], fp16 scales [N, Kp/G] as uint16) ->
    float32 at dst[rows[n] + cols[k]] for k < K = cols.size (layout.weight_offsets: the
    node's own layout, so panels and OIHW come out of the same loop)."""
    n_, half = src.shape
    k_ = cols.size
    group = half * 2 // scale.shape[1]
    for n in prange(n_):
        r = rows[n]
        for run in range((k_ + 31) // 32):
            s = half_to_f32(scale[n, run * 32 // group])
            b0 = run * 16
            k0 = run * 32
            for j in range(16):
                byte = np.int64(src[n, b0 + j])
                if k0 + j < k_:
                    dst[r + cols[k0 + j]] = np.float32((byte & 15) - 8) * s
                if k0 + 16 + j < k_:
                    dst[r + cols[k0 + 16 + j]] = np.float32((byte >> 4) - 8) * s


@njit(inline="always")
def _ieee_div(x, y):
    """x / y as IEEE (and NumPy, ONNX Runtime) give it: a zero divisor gives a signed
    infinity, or NaN for 0 / 0. Serial numba builds (what one thread and the AOT
    executables run) follow Python and raise ZeroDivisionError instead; parallel ones
    do not, so the answer had depended on the thread count (LpNormalization of a zero
    vector crashed one build of the conformance test)."""
    if y != 0:
        return x / y
    if x != x or x == 0:
        return np.float32(np.nan)
    return np.float32(math.copysign(np.inf, x) * math.copysign(1.0, y))


@njit(inline="always")
def _binop(x, y, kind):
    """kinds: ops.BINARY_KINDS' order. max/min propagate NaN (x + y is NaN when either
    is), as ONNX Runtime's Max/Min and NumPy's maximum/minimum do."""
    if kind == 0:
        return x + y
    if kind == 1:
        return x - y
    if kind == 2:
        return x * y
    if kind == 3:
        return _ieee_div(x, y)
    if kind == 4:
        return x + y if x != x or y != y else max(x, y)
    if kind == 5:
        return x + y if x != x or y != y else min(x, y)
    return x**y


@njit(parallel=True, cache=True)
def binary4(x, y, out, kind, act, a, b):
    """out = act(x (op) y) over 4-D views; x and y are broadcast views (zero strides)
    of out's shape. Elementwise at equal indices, so out may alias x or y (in place)."""
    d0, d1, d2, d3 = out.shape
    for ij in prange(d0 * d1):
        i = ij // d1
        j = ij % d1
        for k in range(d2):
            for m in range(d3):
                out[i, j, k, m] = act_scalar(_binop(x[i, j, k, m], y[i, j, k, m], kind), act, a, b)


@njit(inline="always")
def _rows_kind(x, z, out, kind, rev):
    """out = x (op) z for one kind, z [R or 1, C or 1] indexed in place (a row view a
    row, with the kind tested inside the row loop, had cost 35 ns a row: an SE block's
    channel scale of 1152 x 8 floats took 42 us, 3 us so)."""
    zr, zc = z.shape
    for r in range(out.shape[0]):
        i = r if zr > 1 else 0
        if zc > 1:
            for c in range(out.shape[1]):
                u, v = x[r, c], z[i, c]
                out[r, c] = _binop(v, u, kind) if rev else _binop(u, v, kind)
        else:
            s = z[i, 0]
            for c in range(out.shape[1]):
                out[r, c] = _binop(s, x[r, c], kind) if rev else _binop(x[r, c], s, kind)


@njit(inline="always")
def _vbinop(u, v, kind):
    if kind == 0:
        return _vadd(u, v)
    if kind == 1:
        return _vsub(u, v)
    if kind == 2:
        return _vmul(u, v)
    return _vdiv(u, v)


@njit(inline="always")
def _rows_kind_v(x, z, out, kind, rev):
    """_rows_kind for add, sub, mul and div in explicit vectors of 8. LLVM's own vector
    loop checks at run time that out and x do not overlap, and in place (the usual
    case: the input dies there) fell to its scalar loop: an SE gate of 192 x 200
    took 30 us in place against 3.9 out of place."""
    rows, cols = out.shape
    zr, zc = z.shape
    xf, zf, of = x.reshape(x.size), z.reshape(z.size), out.reshape(out.size)
    whole = cols - cols % 8
    for r in range(rows):
        o = r * cols
        zo = (r if zr > 1 else 0) * zc
        s = _vsplat(zf[zo])
        for c in range(0, whole, 8):
            u = _vload(xf, o + c)
            v = _vload(zf, zo + c) if zc > 1 else s
            _vstore(of, o + c, _vbinop(v, u, kind) if rev else _vbinop(u, v, kind))
        if whole < cols:  # a masked load and store for the last columns
            n = cols - whole
            u = _vload_n(xf, o + whole, n)
            v = _vload_n(zf, zo + whole, n) if zc > 1 else s
            _vstore_n(of, o + whole, _vbinop(v, u, kind) if rev else _vbinop(u, v, kind), n)


@njit(cache=True)
def binary_rows(x, z, out, kind, rev, act, a, b):
    """out = act(x (op) z) over rows: x and out [R, C], z [R or 1, C or 1] (a per-row or
    per-column operand: a channel vector in either layout, a row, a scalar). Equal
    indices only, so out may be x (in place). One loop nest per kind, so the common
    ones vectorise (_binop's branches do not)."""
    if kind == 0:
        _rows_kind_v(x, z, out, 0, 0)
    elif kind == 2:
        _rows_kind_v(x, z, out, 2, 0)
    elif kind == 1:
        _rows_kind_v(x, z, out, 1, rev)
    elif kind == 3:
        _rows_kind_v(x, z, out, 3, rev)
    else:
        _rows_kind(x, z, out, kind, rev)
    if act != 0:
        for r in range(out.shape[0]):
            act_row(out[r], act, a, b)


@njit(inline="always")
def _input_gates(x, w, b, gx, wt, hid, lbr):
    """gx[row] = x[row] W^T + W's bias + R's (but the h gate's with linear_before_reset,
    added inside the reset), W transposed into wt once a call."""
    g_, ni = w.shape
    for g in range(g_):
        for i in range(ni):
            wt[i, g] = w[g, i]
    for row in range(gx.shape[0]):
        for g in range(g_):
            gx[row, g] = b[g] + (np.float32(0) if lbr and g >= 2 * hid else b[g_ + g])
        for i in range(ni):
            xi = x[row, i]
            for g in range(g_):
                gx[row, g] += wt[i, g] * xi


@njit(inline="always")
def _gates_rt(rt, h, bb, g0, g1, out):
    """out[bb, g0:g1] += h[bb] R^T over those gate columns, rt = R^T [H, G]: one
    broadcast of h[k] against a contiguous row of rt a k, a loop LLVM vectorises (a dot
    per gate, a serial float reduction, had been 90% of an LSTM tagger's run)."""
    for k in range(rt.shape[0]):
        hk = h[bb, k]
        for g in range(g0, g1):
            out[bb, g] += rt[k, g] * hk


@njit(cache=True)
def rnn_recur(x, w, b, gx, r, rbh, h0, c0, y, gates, c, tmp, hb, rt, wt, cell, reverse, lbr,
              emit_c, states, inputs):  # fmt: skip
    """The recurrence of an ``rnn`` node (kernels/recurrent.py has the plan and the
    NumPy form): gx [S, B, G*H] the input's part of the gates with the biases, r
    [G*H, H], transposed into the scratch rt [H, G*H] once a run (r may be an input);
    each step h R^T and the gate math per batch row, h kept in hb, c the LSTM cell.
    cell 0 lstm (gates i o f c), 1 gru (z r h; rbh the recurrent h-gate bias with
    linear_before_reset), 2 rnn; emit_c 0: y holds each step's h, 1: its cell state, 2:
    h, then the final cell state in y[S]. ``states``: bit 0 h0 given, bit 1 c0 (zeros
    otherwise). With ``inputs`` the kernel makes gx itself from x [S*B, I], w [G*H, I]
    (through wt [I, G*H]) and b [2*G*H], rank-1 updates that vectorise (the
    ``in_loop`` variant, for weights that stay in cache: three NumPy calls around the
    recurrence took 60% of a small tagger's LSTM); otherwise the caller did, by GEMM.
    Sigmoid and tanh are the vectorising float32 forms of the activations. One call a
    run: the NumPy form's twelve ufunc calls a step took 2.8 ms for a 20-step
    bidirectional 2-layer tagger."""
    steps, nb, g_ = gx.shape
    hid = r.shape[1]
    for g in range(g_):
        for k in range(hid):
            rt[k, g] = r[g, k]
    if inputs:
        _input_gates(x, w, b, gx.reshape((steps * nb, g_)), wt, hid, lbr)
    for bb in range(nb):
        for k in range(hid):
            c[bb, k] = c0[bb, k] if states & 2 else np.float32(0)
            hb[bb, k] = h0[bb, k] if states & 1 else np.float32(0)
    for s in range(steps):
        t = steps - 1 - s if reverse else s
        for bb in range(nb):
            if cell == 1 and not lbr:  # the h gate's recurrent part waits for r
                for g in range(2 * hid):
                    gates[bb, g] = gx[t, bb, g]
                _gates_rt(rt, hb, bb, 0, 2 * hid, gates)
            else:
                for g in range(g_):
                    gates[bb, g] = gx[t, bb, g] if cell != 1 else np.float32(0)
                _gates_rt(rt, hb, bb, 0, g_, gates)
            if cell == 2:
                for k in range(hid):
                    hb[bb, k] = tanh_f32(gates[bb, k])
            elif cell == 0:
                for k in range(hid):
                    i = sigmoid_f32(gates[bb, k])
                    o = sigmoid_f32(gates[bb, hid + k])
                    f = sigmoid_f32(gates[bb, 2 * hid + k])
                    c[bb, k] = f * c[bb, k] + i * tanh_f32(gates[bb, 3 * hid + k])
                    hb[bb, k] = o * tanh_f32(c[bb, k])
            else:
                if lbr:  # gates hold h R^T alone: z, r from gx + it; h~ from r * (. + Rb_h)
                    for k in range(2 * hid):
                        gates[bb, k] = sigmoid_f32(gx[t, bb, k] + gates[bb, k])
                    for k in range(hid):
                        gh = gates[bb, 2 * hid + k] + rbh[k]
                        tmp[bb, k] = tanh_f32(gx[t, bb, 2 * hid + k] + gates[bb, hid + k] * gh)
                else:  # (r * h) R_h^T
                    for k in range(2 * hid):
                        gates[bb, k] = sigmoid_f32(gates[bb, k])
                    for k in range(hid):
                        tmp[bb, k] = gates[bb, hid + k] * hb[bb, k]
                    for k in range(hid):
                        gates[bb, 2 * hid + k] = gx[t, bb, 2 * hid + k]
                    _gates_rt(rt, tmp, bb, 2 * hid, g_, gates)
                    for k in range(hid):
                        tmp[bb, k] = tanh_f32(gates[bb, 2 * hid + k])
                for k in range(hid):
                    z = gates[bb, k]
                    hb[bb, k] = tmp[bb, k] + z * (hb[bb, k] - tmp[bb, k])
            for k in range(hid):
                y[t, bb, k] = c[bb, k] if emit_c == 1 else hb[bb, k]
    if emit_c == 2:  # "hc": the final cell state after the steps
        for bb in range(nb):
            for k in range(hid):
                y[steps, bb, k] = c[bb, k]


# Winograd's working planes are channels-last (gemm_tiles.wino_conv_*): a
# tile element is then a contiguous run of channels, one vector load, where the planar
# layout made it a gather (the tap-gather transforms took 2/3 of a ResNet-18 Winograd
# layer). These two rows convert between the layouts, one channel at a time: the
# planar side is read or written contiguously, the channels-last side at a stride of a
# few cache lines, which measured faster than 16-channel blocks.


@njit(cache=True)
def nhwc_row(x, xt, iy, pt, pl):
    """Row iy of xt[Hp, Wp, Cp] from x[C, H, W] shifted by the pads (pt, pl): image
    pixels where they fall, zeros elsewhere; channels past C are left as they are."""
    c_, h, wd = x.shape
    wp = xt.shape[1]
    y = iy - pt
    if y < 0 or y >= h:
        for ix in range(wp):
            for c in range(c_):
                xt[iy, ix, np.uintp(c)] = 0.0
        return
    n = min(wd, wp - pl)
    for ix in range(wp):
        if ix < pl or ix >= pl + n:
            for c in range(c_):
                xt[iy, ix, np.uintp(c)] = 0.0
    for c in range(c_):
        for ix in range(n):
            xt[iy, ix + pl, np.uintp(c)] = x[c, y, np.uintp(ix)]


@njit(cache=True)
def nhwc_row_out(yt, y, oy, row0, bias, scale, res, flags, act, a, b):
    """y[c, oy, :] = act(scale[c] * yt[oy - row0, :W, c] + bias[c] [+ res[c, oy, :]])
    for every channel c of y (yt: a band of rows from row0; flags as in epilogue_rows)."""
    c_, _, ow = y.shape
    has_res = (flags & HAS_RES) != 0
    r = oy - row0
    for c in range(c_):
        for ox in range(ow):
            y[c, oy, np.uintp(ox)] = yt[r, ox, np.uintp(c)]
        s = scale[c] if flags & HAS_SCALE else np.float32(1)
        bb = bias[c] if flags & HAS_BIAS else np.float32(0)
        rr = res[c, oy] if has_res else res[0, 0]
        epilogue_row(y[c, oy], s, bb, rr, has_res, act, a, b)


# The same two rows for channels-last activations (packager/layout.py): whole runs of
# channels on both sides.


@njit(cache=True)
def nhwc_fill_row(x, xt, iy, pt, pl):
    """Row iy of xt[Hp, Wp, Cp] from channels-last x[H, W, C] shifted by the pads, as
    nhwc_row does from a planar x: one contiguous run of C channels per pixel."""
    h, wd, c_ = x.shape
    wp, cp = xt.shape[1], xt.shape[2]
    xf, tf = x.reshape(-1), xt.reshape(-1)
    y = iy - pt
    n = min(wd, wp - pl) if 0 <= y < h else 0
    row = iy * wp * cp
    for ix in range(wp):
        if ix < pl or ix >= pl + n:
            o = row + ix * cp
            for c in range(c_):
                tf[np.uintp(o + c)] = 0.0
    for ix in range(n):
        o = row + (ix + pl) * cp
        src = (y * wd + ix) * c_
        for c in range(c_):
            tf[np.uintp(o + c)] = xf[np.uintp(src + c)]


@njit(cache=True)
def nhwc_out_row(yt, y, oy, row0, bias, scale, res, flags, act, a, b):
    """y[oy, :, c] = act(scale[c] * yt[oy - row0, :W, c] + bias[c] [+ res[oy, :, c]])
    for channels-last y[OH, OW, C]: the row is copied, then each epilogue term is one
    vectorisable pass over it (a test per element kept LLVM from vectorising)."""
    _, ow, c_ = y.shape
    ywp, cp = yt.shape[1], yt.shape[2]
    tf, yf = yt.reshape(-1), y.reshape(-1)
    r = oy - row0
    row = oy * ow * c_
    for ox in range(ow):
        src = (r * ywp + ox) * cp
        dst = row + ox * c_
        for c in range(c_):
            yf[np.uintp(dst + c)] = tf[np.uintp(src + c)]
    if flags & HAS_SCALE:
        for ox in range(ow):
            dst = row + ox * c_
            for c in range(c_):
                yf[np.uintp(dst + c)] = yf[np.uintp(dst + c)] * scale[np.uintp(c)]
    if flags & HAS_BIAS:
        for ox in range(ow):
            dst = row + ox * c_
            for c in range(c_):
                yf[np.uintp(dst + c)] = yf[np.uintp(dst + c)] + bias[np.uintp(c)]
    if flags & HAS_RES:
        rf = res.reshape(-1)
        for i in range(row, row + ow * c_):
            yf[np.uintp(i)] = yf[np.uintp(i)] + rf[np.uintp(i)]
    act_row(yf[row : row + ow * c_], act, a, b)


@njit(parallel=True, cache=True)
def to_channels_last(x, y):
    """y[h, w, c] = x[c, h, w] (one image): a row of each plane at a time, so both sides
    stream (NumPy's strided copy of a 3x224x224 input took 0.3 ms)."""
    c_, h, wd = x.shape
    for iy in prange(h):
        for c in range(c_):
            for ix in range(wd):
                y[iy, ix, np.uintp(c)] = x[c, iy, np.uintp(ix)]


@njit(parallel=True, cache=True)
def swap_axes(x, y):
    """y[a, c, b, :] = x[a, b, c, :] for x [A, B, C, D], y [A, C, B, D]: every transpose
    whose axes merge into that form (attention's heads (0, 2, 1, 3), a matrix's (1, 0),
    a sequence's (1, 0, 2)). NumPy's strided copy cost 1.5-2 us a call on a ViT's
    1 x 17 x 4 x 16 heads, most of it the call; this, 0.4."""
    na, nb, nc, nd = x.shape
    for ac in prange(na * nc):
        a, c = ac // nc, ac % nc
        for b in range(nb):
            for t in range(nd):
                y[a, c, b, t] = x[a, b, c, t]


@njit(parallel=True, cache=True)
def to_channels_first(x, y):
    """y[c, h, w] = x[h, w, c] (one image)."""
    h, wd, c_ = x.shape
    for iy in prange(h):
        for c in range(c_):
            for ix in range(wd):
                y[c, iy, np.uintp(ix)] = x[iy, ix, np.uintp(c)]
