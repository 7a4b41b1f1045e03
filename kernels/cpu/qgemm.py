"""int8 x int8 GEMM for convs and linears: u8 activations times s8 weights into int32.

The scheme (docs/quantization.md, "int8 activations"): activations are quantized per
tensor, unsigned and asymmetric (``q = clamp(rint(x / s) + z, 0, 255)``, scale and zero
point from pack-time calibration, as ONNX Runtime's QDQ models carry them), weights
per output channel, signed and symmetric (``w = q * sw[n]``, kernels/wtypes.py's int8
row). A product is

    y[m, n] = s * sw[n] * (sum_k q[m, k] * w[k, n] - z * sum_k w[k, n]) + bias[n]

with the integer part exact in int32 (|q * w| <= 255 * 128, K * 32640 < 2**31 for K up
to 65793). ``zw[n] = -z * sum_k w[k, n]`` is a pack-time constant, added to the sums
before they turn float; ``scale[n] = s * sw[n]`` likewise. Every CPU computes the same
integers, so every CPU gives the same bits.

How the integers are made (``_dot4``, from the features of the code being compiled, as
qdot.py): ``vpdpbusd`` (AVX-512 VNNI: 64 byte products into 16 int32 lanes per
instruction; AVX-VNNI / AVX-512VL on 256-bit vectors), otherwise the bytes widened to
16 bits and ``vpmaddwd``-style pair sums. The 16-bit route is where ONNX Runtime's
``reduce_range`` comes from: its AVX2 kernels multiply u8 by s8 with ``vpmaddubsw``,
whose 16-bit pair sums saturate past 32767 (255 * 127 * 2 = 64770), so it keeps weights
to 7 bits on such CPUs. Widening first cannot saturate and keeps all 8 bits, at half
``vpmaddubsw``'s products per instruction.

Weights are panels like the float GEMM's (kernels/layout.py), regrouped for the dot
instructions: ``[ceil(N/64), K4, 64, 4]`` int8, K4 = K/4 rounded up, zero past N and
past K. Lane c of a 64-byte vector holds four consecutive reduction steps of output
channel c, which is what one ``vpdpbusd`` lane sums against a broadcast of four
activation bytes. A conv's reduction is ``nky`` kernel rows of ``run`` taps
(``kw * C``, channels fastest), each run padded to a multiple of 4 with zero weights:
the activation bytes read past a run (the next pixel's, or the slack after the image)
are multiplied by zero.

The activation operand is read in place, as gemmp reads its float rows: row m of the
product is output pixel m's window, starting at byte ``rtab[m]`` of the quantized
(padded) image, kernel row ky a further ``ky * wrow`` bytes on.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..flags import HAS_BIAS, HAS_RES
from ..layout import PANEL
from .abi import QGEMM_MR, QGEMM_SLACK, qgemm_scratch_int64s
from .jit import njit
from .kernels import act_row, panel_share
from .qdot import _call, _consts, _features, _vec, dot_isa
from .simd import F32, I32, F32Vec, Ops, _elem_ptr

MR = QGEMM_MR  # rows (output pixels) per micro-tile
K4 = 4  # reduction steps per int32 lane
TILE = MR * PANEL  # int32 sums per micro-tile (its scratch)
SLACK = QGEMM_SLACK  # bytes a quantized image needs after its end (padded runs read them)
assert qgemm_scratch_int64s() == MR + TILE // 2

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I64 = ir.IntType(64)

# Per instruction family: (int32 lanes of an accumulator, columns it sums, accumulators
# across a chunk of columns). AVX-512 takes a panel's 64 columns as 4 zmm (24
# accumulators + 4 weights + 1 broadcast of 32 registers), AVX-VNNI 2 ymm at a time
# (12 + 2 + 1 of 16). AVX2 keeps two partial sums a column (``vpmaddwd``'s pairs) and
# adds them once per tile: adding them every step or shuffling products into place ran
# at 23 GMAC/s against 75-80 (AVX2 dots JIT-compiled on an AVX-512 EPYC). Other CPUs
# (SSE, NEON without a mixed-sign dot) take the same pairs from plain IR: 10 GMAC/s on
# SSE4.2, a quarter of the float GEMM there.
_SHAPES = {"vnni512": (16, 16, 4), "vnni256": (8, 8, 2), "avx2": (8, 4, 2),
           "sdot": (8, 4, 2), "generic": (8, 4, 2)}  # fmt: skip


def _dot4(builder, isa: str, acc, u, s, lanes: int):
    """acc plus the products of u (unsigned bytes) and s (signed bytes), 4 bytes a
    column: acc[l] + sum_{j<4} u[4l+j] * s[4l+j] where an accumulator lane is a column;
    for the pair families lane l holds products 2l, 2l+1 (two lanes a column)."""
    vi = _vec(I32, lanes)
    if isa in ("vnni512", "vnni256"):
        name = f"llvm.x86.avx512.vpdpbusd.{32 * lanes}"
        return _call(builder, name, vi, [acc, builder.bitcast(u, vi), builder.bitcast(s, vi)])
    if isa == "avx2":  # bytes widened to 16 bits: vpmaddwd's pair sums cannot saturate
        n = 2 * lanes
        a16, b16 = builder.zext(u, _vec(_I16, n)), builder.sext(s, _vec(_I16, n))
        return builder.add(acc, _call(builder, "llvm.x86.avx2.pmadd.wd", vi, [a16, b16]))
    wide = _vec(I32, 2 * lanes)  # the same pair sums in plain IR
    p = builder.mul(builder.zext(u, wide), builder.sext(s, wide))
    und = ir.Constant(wide, ir.Undefined)
    for j in range(2):
        part = builder.shuffle_vector(p, und, _consts(I32, range(j, 2 * lanes, 2)))
        acc = builder.add(acc, part)
    return acc


def _column_sums(builder, acc, lanes: int, cols: int):
    """An accumulator's per-column sums: itself, or its lane pairs added (``avx2``)."""
    if cols == lanes:
        return acc
    und = ir.Constant(acc.type, ir.Undefined)
    even = builder.shuffle_vector(acc, und, _consts(I32, range(0, lanes, 2)))
    odd = builder.shuffle_vector(acc, und, _consts(I32, range(1, lanes, 2)))
    return builder.add(even, odd)


def _data(context, builder, arrty, arr, elem):
    data = context.make_array(arrty)(context, builder, value=arr).data
    return builder.bitcast(data, elem.as_pointer())


@intrinsic
def q8_tile(typingctx, x, xo, w, wo, nky, run4, wrow, acc, cols, zw, zo):
    """acc[r * 64 + c] = zw[zo + c] + sum_{ky < nky, j < run4} dot4(x bytes at xo[r] +
    ky * wrow + 4j, w bytes at wo + ((ky * run4 + j) * 64 + c) * 4), for r < MR and the
    columns c of the accumulator vectors that hold c < cols: one micro-tile of MR rows by
    one weight panel. The zero-point terms start the sums (one load a column vector for
    all MR rows, where the epilogue loaded and added them per row and vector: a K = 16
    expansion of 40x40 pixels to 96 channels 0.036 -> 0.033 ms into float32, 0.042 ->
    0.036 into codes), or, where a column's sum is two lanes (the pair families), join
    it as it is stored. Vectors wholly past cols are neither computed nor
    stored: MobileNetV2's projections to 24 and 32 channels filled a 64-column panel
    (0.19 ms for 56x56x96 -> 24, against 0.07 for ONNX Runtime)."""

    def codegen(context, builder, sig, args):
        isa = dot_isa(_features(context))
        lanes, cpa, nv = _SHAPES[isa]
        px = _data(context, builder, sig.args[0], args[0], _I8)
        pxo = _data(context, builder, sig.args[1], args[1], _I64)
        pw = _data(context, builder, sig.args[2], args[2], _I8)
        pacc = _data(context, builder, sig.args[7], args[7], I32)
        pzw = _data(context, builder, sig.args[9], args[9], I32)
        cast = [context.cast(builder, args[i], sig.args[i], types.int64)
                for i in (3, 4, 5, 6, 8, 10)]  # fmt: skip
        wo_, nky_, run4_, wrow_, cols_, zo_ = cast
        rows = [builder.load(builder.gep(pxo, [ir.Constant(_I64, r)])) for r in range(MR)]
        vi, vb = _vec(I32, lanes), _vec(_I8, 4 * cpa)
        vs = _vec(I32, cpa)
        step = ir.Constant(_I64, 4 * PANEL)  # weight bytes per reduction step of 4

        def chunk(col0: int, nvec: int) -> None:
            """Columns col0 .. col0 + nvec * cpa over the whole reduction, stored."""
            zws = []
            for v in range(nvec):
                off = builder.add(zo_, ir.Constant(_I64, col0 + v * cpa))
                p = builder.bitcast(builder.gep(pzw, [off]), vs.as_pointer())
                zws.append(builder.load(p, align=4))
            start = zws if cpa == lanes else [ir.Constant(vi, [0] * lanes)] * nvec
            slots = [[cgutils.alloca_once(builder, vi) for _ in range(nvec)] for _ in range(MR)]
            for r in range(MR):
                for v in range(nvec):
                    builder.store(start[v], slots[r][v])
            with cgutils.for_range(builder, nky_) as ky_loop:
                ky = ky_loop.index
                xk = builder.mul(ky, wrow_)
                wk = builder.add(wo_, builder.mul(builder.mul(ky, run4_), step))
                with cgutils.for_range(builder, run4_) as j_loop:
                    j = j_loop.index
                    wj = builder.add(wk, builder.mul(j, step))
                    ws = []
                    for v in range(nvec):
                        off = builder.add(wj, ir.Constant(_I64, 4 * (col0 + v * cpa)))
                        p = builder.bitcast(builder.gep(pw, [off]), vb.as_pointer())
                        ws.append(builder.load(p, align=1))
                    xj = builder.add(xk, builder.mul(j, ir.Constant(_I64, 4)))
                    for r in range(MR):
                        p = builder.gep(px, [builder.add(rows[r], xj)])
                        four = builder.load(builder.bitcast(p, I32.as_pointer()), align=1)
                        splat = builder.insert_element(
                            ir.Constant(vs, ir.Undefined), four, ir.Constant(I32, 0)
                        )
                        splat = builder.shuffle_vector(
                            splat, ir.Constant(vs, ir.Undefined), _consts(I32, [0] * cpa)
                        )
                        u = builder.bitcast(splat, vb)
                        for v in range(nvec):
                            a = builder.load(slots[r][v])
                            builder.store(_dot4(builder, isa, a, u, ws[v], lanes), slots[r][v])
            for r in range(MR):
                for v in range(nvec):
                    off = ir.Constant(_I64, r * PANEL + col0 + v * cpa)
                    p = builder.bitcast(builder.gep(pacc, [off]), vs.as_pointer())
                    sums = _column_sums(builder, builder.load(slots[r][v]), lanes, cpa)
                    if cpa != lanes:
                        sums = builder.add(sums, zws[v])
                    builder.store(sums, p, align=4)

        def some(col0: int, nvec: int) -> None:
            """As many of the nvec vectors from col0 as hold columns below cols."""
            if nvec == 0:
                return
            more = builder.icmp_signed(">", cols_, ir.Constant(_I64, col0 + (nvec - 1) * cpa))
            with builder.if_else(more) as (all_, fewer):
                with all_:
                    chunk(col0, nvec)
                with fewer:
                    some(col0, nvec - 1)

        for c in range(PANEL // (cpa * nv)):
            some(c * cpa * nv, nv)
        return context.get_dummy_value()

    return types.void(x, xo, w, wo, nky, run4, wrow, acc, cols, zw, zo), codegen


LANES = 16  # the epilogue's float vectors (LLVM splits them on narrower CPUs)
_V = Ops(LANES)
vload_n, vstore_n, vmul, vadd = _V.vload_n, _V.vstore_n, _V.vmul, _V.vadd
vmax, vmin, vsplat, vzero = _V.vmax, _V.vmin, _V.vsplat, _V.vzero
_VB = _vec(_I8, LANES)
_VF = _vec(F32, LANES)


def _lanes_below(builder, n):
    """<LANES x i1>: lane < n (n an int64)."""
    vi = _vec(I32, LANES)
    n32 = builder.trunc(n, I32)
    v = builder.insert_element(ir.Constant(vi, ir.Undefined), n32, ir.Constant(I32, 0))
    splat = builder.shuffle_vector(v, ir.Constant(vi, ir.Undefined), _consts(I32, [0] * LANES))
    return builder.icmp_signed("<", _consts(I32, range(LANES)), splat)


def _store_bytes(builder, p, n, value) -> None:
    """Store the first n of ``value``'s LANES bytes at p (i8*): a plain store when
    n >= LANES, else a masked one. Whole vectors stay plain: AVX2 has no byte mask and
    LLVM splits a masked byte store lane by lane."""
    full = builder.icmp_signed(">=", n, ir.Constant(_I64, LANES))
    with builder.if_else(full) as (whole, part):
        with whole:
            builder.store(value, builder.bitcast(p, _VB.as_pointer()), align=1)
        with part:
            m = _lanes_below(builder, n)
            fnty = ir.FunctionType(ir.VoidType(), [_VB, p.type, I32, m.type])
            name = f"llvm.masked.store.v{LANES}i8.p0"
            fn = cgutils.get_or_insert_function(builder.module, fnty, name)
            builder.call(fn, [value, p, ir.Constant(I32, 1), m])


def _splat_f32(builder, x):
    v = builder.insert_element(ir.Constant(_VF, ir.Undefined), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(_VF, ir.Undefined), _consts(I32, [0] * LANES))


@intrinsic
def vstore_out(typingctx, arr, idx, v, n, inv, zf, qlo, qhi):
    """The first n lanes of v into arr[idx ..]: float32 arrays as they are (vstore_n),
    u8 arrays requantized, ``clamp(rint(v * inv) + zf, qlo, qhi)`` with NaN as zf
    (module doc: the next int8 op's codes, written once instead of float32 its
    quantizing re-reads). qlo, qhi: 0 and 255, or narrower with the producer's relu or
    clip folded in (``code_bounds``)."""
    codes = arr.dtype == types.uint8

    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        n = context.cast(builder, args[3], sig.args[3], types.int64)
        if not codes:
            m = _lanes_below(builder, n)
            fnty = ir.FunctionType(ir.VoidType(), [_VF, p.type, I32, m.type])
            name = f"llvm.masked.store.v{LANES}f32.p0"
            fn = cgutils.get_or_insert_function(builder.module, fnty, name)
            builder.call(fn, [args[2], p, ir.Constant(I32, 4), m])
            return context.get_dummy_value()
        zs = _splat_f32(builder, args[5])
        rint = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VF, [_VF]), f"llvm.rint.v{LANES}f32"
        )
        scaled = builder.fmul(args[2], _splat_f32(builder, args[4]))
        q = builder.fadd(builder.call(rint, [scaled]), zs)
        lo, hi = _splat_f32(builder, args[6]), _splat_f32(builder, args[7])
        q = builder.select(builder.fcmp_ordered(">", q, lo), q, lo)
        q = builder.select(builder.fcmp_ordered("<", q, hi), q, hi)
        q = builder.select(builder.fcmp_ordered("ord", scaled, scaled), q, zs)
        b = builder.trunc(builder.fptosi(q, _vec(I32, LANES)), _VB)
        _store_bytes(builder, p, n, b)
        return context.get_dummy_value()

    if codes or arr.dtype == types.float32:
        f4 = types.float32
        return types.void(arr, idx, v, n, f4, f4, f4, f4), codegen
    return None


def code_bounds(out, act, a, b, yinv, yz):
    """(act, qlo, qhi) for an int8 op writing ``out``: into u8 codes a relu or clip is
    applied to the codes instead (act 0, qlo / qhi the codes of its bounds, within 0 and
    255), the same codes as clamping the floats first since rounding to codes keeps
    order; two instructions less per vector (K = 16 expansion into codes, 1 thread:
    0.048 -> 0.040 ms without the float clamp). Float32 outputs: as they are."""


@njit(inline="always")
def _code(v, inv, zf):
    """v's u8 code as vstore_out computes it, saturated (v a float32 bound)."""
    q = np.rint(np.float32(v) * inv) + zf
    return min(max(q, np.float32(0)), np.float32(255))


@overload(code_bounds, inline="always")
def _code_bounds(out, act, a, b, yinv, yz):
    if out.dtype != types.uint8:
        return lambda out, act, a, b, yinv, yz: (act, np.float32(0), np.float32(255))

    def impl(out, act, a, b, yinv, yz):
        inv, zf = np.float32(yinv), np.float32(yz)
        if act == 1:
            return 0, _code(0.0, inv, zf), np.float32(255)
        if act == 3:
            return 0, _code(a, inv, zf), _code(b, inv, zf)
        return act, np.float32(0), np.float32(255)

    return impl


@intrinsic
def vsums(typingctx, acc, ao):
    """float32(acc[ao:ao+16]): a tile's int32 sums (their zero-point terms included)."""

    def codegen(context, builder, sig, args):
        vi = _vec(I32, LANES)
        a = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        va = builder.load(builder.bitcast(a, vi.as_pointer()), align=4)
        return builder.sitofp(va, _vec(F32, LANES))

    return F32Vec(LANES)(acc, ao), codegen


# inline: as a call of its own per micro-tile (some 80 scalar arguments) it cost 11% of
# a K = 16 expansion (MobileNetV2's 112x112 16 -> 96: 0.037 -> 0.033 ms a 40x40 tile)
@njit(inline="always")
def _epilogue(acc, c, m0, rows, c_n, cols, bias, scale, res, flags, act, a, b, yinv, yz,
              qlo, qhi):  # fmt: skip
    """c[m0:m0+rows, c_n:c_n+cols] = scale * acc + bias [+ res] (acc: the sums with their
    zero-point terms), then relu or clip in registers (other activations: act_row after,
    float32 outputs only), then stored as it is or requantized to u8 codes within
    qlo..qhi (``vstore_out``; the caller folds relu or clip into those,
    ``code_bounds``). A column block's scale and bias are loaded once for the tile's
    rows."""
    zero = vzero()
    lo = vsplat(a)
    hi = vsplat(b)
    for v in range(0, cols, LANES):
        n = cols - v
        sv = vload_n(scale, c_n + v, n)
        bv = vload_n(bias, c_n + v, n) if flags & HAS_BIAS else zero
        for r in range(rows):
            y = vmul(vsums(acc, r * PANEL + v), sv)
            if flags & HAS_BIAS:
                y = vadd(y, bv)
            if flags & HAS_RES:
                y = vadd(y, vload_n(res[m0 + r], c_n + v, n))
            if act == 1:
                y = vmax(zero, y)
            elif act == 3:
                y = vmin(vmax(y, lo), hi)
            vstore_out(c[m0 + r], c_n + v, y, n, yinv, yz, qlo, qhi)


# inline: q8_tile picks its instructions when it is compiled, from the features of the
# build in hand (qdot.BUILD_FEATURES). As a cached function of its own, an AOT build
# for x86-64-v3 linked the JIT's cached AVX-512 copy of it, and LLVM stopped on
# vpdpbusd.512; inlined, it is compiled inside each kernel that calls it.
@njit(inline="always")
def _q8_block(x, rtab, run4, nky, wrow, wq, zw, c, bias, scale, res, flags, act, a, b,
              yinv, yz, t_lo, t_hi, m_lo, m_hi, xo, acc):  # fmt: skip
    n_ = c.shape[1]
    act, qlo, qhi = code_bounds(c, act, a, b, yinv, yz)
    ps = nky * run4 * K4 * PANEL  # bytes per panel
    for t in range(t_lo, t_hi):
        c_n = t * PANEL
        cols = min(PANEL, n_ - c_n)
        for m0 in range(m_lo, m_hi, MR):
            rows = min(MR, m_hi - m0)
            for r in range(MR):
                xo[r] = rtab[m0 + min(r, rows - 1)]
            q8_tile(x, xo, wq, t * ps, nky, run4, wrow, acc, cols, zw, c_n)
            _epilogue(acc, c, m0, rows, c_n, cols, bias, scale, res, flags, act, a, b,
                      yinv, yz, qlo, qhi)
            if act != 0 and act != 1 and act != 3:  # other activations: on the stored rows
                for r in range(rows):
                    float_act_row(c[m0 + r, c_n : c_n + cols], act, a, b)


@njit(parallel=True, cache=True)
def gemm_u8s8(x, rtab, run4, nky, wrow, wq, zw, c, bias, scale, res, flags, act, a, b,
              yinv, yz, scratch):  # fmt: skip
    """c[M, N] = act(scale * (sum of u8 x s8 products + zw) + bias [+ res]) (module doc):
    x the quantized image (flat bytes), rtab[M] each row's first byte in it, nky kernel
    rows of run4 * 4 bytes wrow bytes apart, wq the weight panels (flat bytes), zw the
    int32 zero-point terms per column (padded to whole panels), bias and scale per
    column. c float32, or u8 codes of scale 1 / yinv and zero point yz (relu and clip
    only: the packager gives no other activation a u8 output). scratch: one row of
    int64 [workers, MR + TILE / 2] per worker (its row offsets and its tile's int32
    sums); as many workers as it has rows, sharing the work as gemmp does
    (kernels.panel_share)."""
    m_ = c.shape[0]
    workers = scratch.shape[0]
    for sl in prange(workers):
        t_lo, t_hi, m_lo, m_hi = panel_share(m_, c.shape[1], workers, sl, MR, wq.size,
                                              x.size + c.size * c.itemsize)
        if m_lo < m_hi:
            xo = scratch[sl, :MR]
            acc = scratch[sl, MR:].view(np.int32)
            _q8_block(x, rtab, run4, nky, wrow, wq, zw, c, bias, scale, res, flags, act, a, b,
                      yinv, yz, t_lo, t_hi, m_lo, m_hi, xo, acc)  # fmt: skip


def float_act_row(row, act, a, b):
    """act_row on a float32 row; nothing on u8 codes (their producer clamps)."""


@overload(float_act_row)
def _float_act_row(row, act, a, b):
    if row.dtype == types.uint8:
        return lambda row, act, a, b: None
    return lambda row, act, a, b: act_row(row, act, a, b)


@njit(inline="always")
def _quantize(v, s, zf):
    """ONNX QuantizeLinear to u8 (NaN as the zero point), branch-free so LLVM
    vectorises the loops that call it."""
    q = np.rint(v / s) + zf
    q = q if q == q else zf
    q = q if q > 0 else np.float32(0)
    q = q if q < 255 else np.float32(255)
    return np.uint8(q)


def to_code(v, s, zf):
    """v's u8 code: ``_quantize`` for a float, v itself for a code already (an int8
    op's u8 output, padded or gathered for the next one)."""


@overload(to_code, inline="always")
def _to_code(v, s, zf):
    if v == types.uint8:
        return lambda v, s, zf: v
    return lambda v, s, zf: _quantize(v, s, zf)


@njit(cache=True)
def _quantize_run(x, xo, xq, qo, n, s, zf):
    """xq[qo:qo+n] = the u8 codes of x[xo:xo+n], through slices: indexed by offset + i,
    numba's negative-index check stayed in the loop and kept LLVM from vectorising it
    (ResNet-18's 56x56x64 input: 264 us against 27)."""
    src, dst = x[xo : xo + n], xq[qo : qo + n]
    for i in range(n):
        dst[i] = to_code(src[i], s, zf)


@njit(parallel=True, cache=True)
def quantize_pad_nhwc(x, xq, hp, wp, pt, pl, sy, sx, s, z):
    """x[H, W, C] float32 quantized to u8 (``_quantize``; u8 codes copied as they are)
    into xq, the flat [hp, wp, C] image the windows read: position (r, c) holds x's
    pixel (r * sy - pt, c * sx - pl), or the zero point z outside x (a padded tap is
    the real 0). Steps above 1 gather a
    strided 1x1 conv's pixels only, so it quantizes a quarter of its input at stride 2."""
    h, wd, c_ = x.shape
    flat = x.reshape(h * wd * c_)
    zb = np.uint8(z)
    zf = np.float32(z)
    x_lo = min(wp, (pl + sx - 1) // sx)  # first column whose pixel is in x
    x_hi = max(x_lo, min(wp, (wd - 1 + pl) // sx + 1))  # one past the last
    for yy in prange(hp):
        iy = yy * sy - pt
        base = yy * wp * c_
        if iy < 0 or iy >= h:
            for i in range(wp * c_):
                xq[base + i] = zb
            continue
        for i in range(x_lo * c_):
            xq[base + i] = zb
        for i in range(x_hi * c_, wp * c_):
            xq[base + i] = zb
        if sx == 1:  # the row's pixels are contiguous: one flat run
            _quantize_run(flat, (iy * wd + x_lo - pl) * c_, xq, base + x_lo * c_,
                          (x_hi - x_lo) * c_, s, zf)  # fmt: skip
        else:
            for xx in range(x_lo, x_hi):
                ix = xx * sx - pl
                o = base + xx * c_
                for ch in range(c_):
                    xq[o + ch] = to_code(x[iy, ix, ch], s, zf)
