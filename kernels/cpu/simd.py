"""Explicit SIMD vectors for numba CPU kernels.

numba has no vector type, and LLVM's auto-vectoriser does not keep a GEMM tile's
accumulators in registers across the reduction loop; a plain numba GEMM ran at
~20 GFLOP/s against OpenBLAS's ~90. Here a numba type ``f32xN`` lowers to LLVM's
``<N x float>``; the intrinsics below load, broadcast, multiply-add and store whole
vectors. LLVM maps them onto the target's registers (AVX-512 zmm, AVX2 ymm, NEON q),
and a micro-kernel built from them (gemm_tiles.py) runs at 140-165 GFLOP/s in L1 on an
AVX-512 core. Loads and stores take an array plus a flat element offset from its data
pointer: no bounds or negative-index checks, which numba would otherwise put in the
inner loop (they halved the micro-kernel's speed). Callers own the bounds.

Lanes come per CPU from ``lanes_for``: the vector width of the ISA (16 for AVX-512,
8 for AVX2, 4 for NEON/SSE), and the tile shape from the register count.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

I32 = ir.IntType(32)
F32 = ir.FloatType()


class F32Vec(types.Type):
    """A vector of ``lanes`` float32 values held in registers."""

    def __init__(self, lanes: int):
        self.lanes = lanes
        super().__init__(name=f"f32x{lanes}")


@register_model(F32Vec)
class _F32VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.VectorType(F32, fe_type.lanes))


def _elem_ptr(context, builder, arrty, arr, idx, idxty):
    data = context.make_array(arrty)(context, builder, value=arr).data
    return builder.gep(data, [context.cast(builder, idx, idxty, types.intp)])


def _splat(builder, scalar, lanes: int):
    vty = ir.VectorType(F32, lanes)
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(
        v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(I32, lanes), [0] * lanes)
    )


def _widen(builder, v, dtype, lanes: int):
    """A vector of stored weights as float32, exactly: float32 as it is, int8 by value,
    uint16 as IEEE half bits (vcvtph2ps / fcvtl), int16 as bfloat16 bits (the upper half
    of a float32: a shift)."""
    lvt = ir.VectorType(F32, lanes)
    if isinstance(dtype, types.Float):
        return v
    if dtype == types.uint16:
        return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), lanes)), lvt)
    if dtype == types.int16:
        vi = ir.VectorType(I32, lanes)
        wide = builder.shl(builder.zext(v, vi), ir.Constant(vi, [16] * lanes))
        return builder.bitcast(wide, lvt)
    if dtype == types.int8:
        return builder.sitofp(v, lvt)
    raise TypeError(f"no weight widening from {dtype}")


def _to_f32(builder, value, dtype):
    if isinstance(dtype, types.Float):
        return value if dtype.bitwidth == 32 else builder.fptrunc(value, F32)
    if isinstance(dtype, types.Integer):
        return builder.sitofp(value, F32) if dtype.signed else builder.uitofp(value, F32)
    raise TypeError(f"no float32 conversion from {dtype}")


class Ops:
    """The intrinsics for one vector width, as numba-callable attributes."""

    def __init__(self, lanes: int):
        self.lanes = lanes
        vt = F32Vec(lanes)
        lvt = ir.VectorType(F32, lanes)

        @intrinsic
        def vload(typingctx, arr, idx):
            """arr's elements idx .. idx+lanes-1 (float32 array)."""

            def codegen(context, builder, sig, args):
                p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                return builder.load(builder.bitcast(p, lvt.as_pointer()), align=4)

            return vt(arr, idx), codegen

        @intrinsic
        def vstore(typingctx, arr, idx, v):
            def codegen(context, builder, sig, args):
                p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                builder.store(args[2], builder.bitcast(p, lvt.as_pointer()), align=4)
                return context.get_dummy_value()

            return types.void(arr, idx, v), codegen

        ids = ir.Constant(ir.VectorType(I32, lanes), list(range(lanes)))

        def first_n(context, builder, n, nty):
            """<lanes x i1>: lane < n."""
            n32 = builder.trunc(context.cast(builder, n, nty, types.intp), I32)
            vi = ir.VectorType(I32, lanes)
            v = builder.insert_element(ir.Constant(vi, ir.Undefined), n32, ir.Constant(I32, 0))
            splat = builder.shuffle_vector(
                v, ir.Constant(vi, ir.Undefined), ir.Constant(vi, [0] * lanes)
            )
            return builder.icmp_signed("<", ids, splat)

        # A partial vector (a tile's last columns) as one masked load or store
        # (vmaskmovps on AVX2, a mask register on AVX-512): lane-by-lane loops there
        # doubled the tiles' compile time, which every cold numba cache pays.
        @intrinsic
        def vload_n(typingctx, arr, idx, n):
            """arr's elements idx .. idx+n-1 in the first n lanes, zeros after; nothing
            past them is read (n >= lanes: a whole vector; n <= 0: zeros, nothing read)."""

            def codegen(context, builder, sig, args):
                p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                m = first_n(context, builder, args[2], sig.args[2])
                fnty = ir.FunctionType(lvt, [p.type, I32, m.type, lvt])
                name = f"llvm.masked.load.v{lanes}f32.p0"
                fn = cgutils.get_or_insert_function(builder.module, fnty, name)
                zeros = ir.Constant(lvt, [0.0] * lanes)
                return builder.call(fn, [p, ir.Constant(I32, 4), m, zeros])

            return vt(arr, idx, n), codegen

        @intrinsic
        def vstore_n(typingctx, arr, idx, v, n):
            """The first n lanes of v into arr[idx .. idx+n-1]; nothing past them is
            written (n >= lanes: the whole vector; n <= 0: nothing)."""

            def codegen(context, builder, sig, args):
                p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                m = first_n(context, builder, args[3], sig.args[3])
                fnty = ir.FunctionType(ir.VoidType(), [lvt, p.type, I32, m.type])
                name = f"llvm.masked.store.v{lanes}f32.p0"
                fn = cgutils.get_or_insert_function(builder.module, fnty, name)
                builder.call(fn, [args[2], p, ir.Constant(I32, 4), m])
                return context.get_dummy_value()

            return types.void(arr, idx, v, n), codegen

        @intrinsic
        def vloadw_n(typingctx, arr, idx, n):
            """vload_n from stored weights, widened to float32 (``_widen``: float32, int8,
            fp16 bits as uint16, bf16 bits as int16)."""

            def codegen(context, builder, sig, args):
                p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                m = first_n(context, builder, args[2], sig.args[2])
                dt = sig.args[0].dtype
                floats = isinstance(dt, types.Float)
                ety = F32 if floats else ir.IntType(dt.bitwidth)
                vty = ir.VectorType(ety, lanes)
                fnty = ir.FunctionType(vty, [p.type, I32, m.type, vty])
                suffix = "f32" if floats else f"i{dt.bitwidth}"
                name = f"llvm.masked.load.v{lanes}{suffix}.p0"
                fn = cgutils.get_or_insert_function(builder.module, fnty, name)
                zeros = ir.Constant(vty, [0.0 if floats else 0] * lanes)
                align = ir.Constant(I32, 4 if floats else dt.bitwidth // 8)
                v = builder.call(fn, [p, align, m, zeros])
                return _widen(builder, v, dt, lanes)

            return vt(arr, idx, n), codegen

        i8v = ir.VectorType(ir.IntType(8), lanes)

        @intrinsic
        def vloadw(typingctx, arr, idx):
            """arr's stored weights idx .. idx+lanes-1 widened to float32 (``_widen``:
            int8 one vpmovsxbd + vcvtdq2ps, fp16 one vcvtph2ps, bf16 a shift). A masked
            int8 or int16 load has no AVX2 form and LLVM splits it lane by lane, so whole
            vectors take this plain load."""

            def codegen(context, builder, sig, args):
                dt = sig.args[0].dtype
                p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                ety = F32 if isinstance(dt, types.Float) else ir.IntType(dt.bitwidth)
                vty = ir.VectorType(ety, lanes)
                raw = builder.load(builder.bitcast(p, vty.as_pointer()), align=dt.bitwidth // 8)
                return _widen(builder, raw, dt, lanes)

            return vt(arr, idx), codegen

        self.vloadw = vloadw

        def nibbles(shift: bool):
            @intrinsic
            def vnib(typingctx, arr, idx):
                """The low (vnib_lo) or high (vnib_hi) nibbles of arr's bytes idx ..
                idx+lanes-1 as float32 values 0..15 (int4 weights, wtypes.py): one byte
                load feeds two vectors of consecutive weights."""

                def codegen(context, builder, sig, args):
                    p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                    raw = builder.load(builder.bitcast(p, i8v.as_pointer()), align=1)
                    if shift:
                        q = builder.lshr(raw, ir.Constant(i8v, [4] * lanes))
                    else:
                        q = builder.and_(raw, ir.Constant(i8v, [15] * lanes))
                    return builder.uitofp(q, lvt)

                return vt(arr, idx), codegen

            return vnib

        @intrinsic
        def vsum(typingctx, v):
            """The lanes of v added up in lane order (the same result at every width
            only when the lanes hold the same partial sums: callers reduce once, last)."""

            def codegen(context, builder, sig, args):
                acc = builder.extract_element(args[0], ir.Constant(I32, 0))
                for i in range(1, lanes):
                    acc = builder.fadd(acc, builder.extract_element(args[0], ir.Constant(I32, i)))
                return acc

            return types.float32(vt), codegen

        @intrinsic
        def vsum_tree(typingctx, v):
            """The lanes of v added up pairwise: upper half onto lower half until one lane
            is left (log2(lanes) dependent adds instead of lanes - 1; the order is fixed,
            so the result is the same on every CPU for the same lane count)."""

            def codegen(context, builder, sig, args):
                acc, n = args[0], lanes
                while n > 1:
                    h = n // 2
                    und = ir.Constant(ir.VectorType(F32, n), ir.Undefined)
                    lo = builder.shuffle_vector(acc, und, ir.Constant(ir.VectorType(I32, h),
                                                                      list(range(h))))
                    hi = builder.shuffle_vector(acc, und, ir.Constant(ir.VectorType(I32, h),
                                                                      list(range(h, n))))
                    acc, n = builder.fadd(lo, hi), h
                return builder.extract_element(acc, ir.Constant(I32, 0))

            return types.float32(vt), codegen

        self.vnib_lo, self.vnib_hi, self.vsum = nibbles(False), nibbles(True), vsum
        self.vsum_tree = vsum_tree

        @intrinsic
        def vbload(typingctx, arr, idx):
            """arr[idx] widened to float32 (float or int8 weights) in every lane."""

            def codegen(context, builder, sig, args):
                p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                s = _to_f32(builder, builder.load(p), sig.args[0].dtype)
                return _splat(builder, s, lanes)

            return vt(arr, idx), codegen

        @intrinsic
        def vsplat(typingctx, x):
            def codegen(context, builder, sig, args):
                return _splat(builder, _to_f32(builder, args[0], sig.args[0]), lanes)

            return vt(x), codegen

        @intrinsic
        def vzero(typingctx):
            def codegen(context, builder, sig, args):
                return ir.Constant(lvt, [0.0] * lanes)

            return vt(), codegen

        @intrinsic
        def vfma(typingctx, a, b, c):
            """a * b + c, rounded once (the same result at every vector width)."""

            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(lvt, [lvt, lvt, lvt])
                fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.fma.v{lanes}f32")
                return builder.call(fn, args)

            return vt(vt, vt, vt), codegen

        def _binary(emit):
            @intrinsic
            def op(typingctx, a, b):
                def codegen(context, builder, sig, args):
                    return emit(builder, args[0], args[1])

                return vt(vt, vt), codegen

            return op

        @intrinsic
        def sload(typingctx, arr, idx):
            """arr's element idx counted flat from its data pointer (any dimensions)."""

            def codegen(context, builder, sig, args):
                p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                return builder.load(p)

            return arr.dtype(arr, idx), codegen

        @intrinsic
        def sstore(typingctx, arr, idx, x):
            def codegen(context, builder, sig, args):
                p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                val = context.cast(builder, args[2], sig.args[2], sig.args[0].dtype)
                builder.store(val, p)
                return context.get_dummy_value()

            return types.void(arr, idx, x), codegen

        @intrinsic
        def vloadh(typingctx, arr, idx):
            """arr's halves idx .. idx+lanes-1 (uint16 bits) widened to float32: one
            vcvtph2ps with F16C, fcvtl on aarch64 (the same caveat as half_bits_to_f32)."""

            def codegen(context, builder, sig, args):
                p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                raw = builder.load(builder.bitcast(p, ir.VectorType(ir.IntType(16), lanes)
                                                   .as_pointer()), align=2)  # fmt: skip
                return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), lanes)), lvt)

            return vt(arr, idx), codegen

        @intrinsic
        def vstoreh(typingctx, arr, idx, v):
            """v rounded to halves (to nearest, ties to even; NaN stays NaN) into arr's
            uint16 elements idx .. idx+lanes-1: one vcvtps2ph with F16C, fcvtn on aarch64
            (the same caveat as half_bits_to_f32). Finite values and infinities give the
            bits of the portable f32_bits_to_half; a NaN keeps the top of its payload."""

            def codegen(context, builder, sig, args):
                p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                h = builder.fptrunc(args[2], ir.VectorType(ir.HalfType(), lanes))
                i16 = ir.VectorType(ir.IntType(16), lanes)
                builder.store(builder.bitcast(h, i16), builder.bitcast(p, i16.as_pointer()),
                              align=2)  # fmt: skip
                return context.get_dummy_value()

            return types.void(arr, idx, v), codegen

        self.vloadh, self.vstoreh = vloadh, vstoreh

        @intrinsic
        def vrint(typingctx, v):
            """Each lane rounded to the nearest integer, ties to even (vroundps)."""

            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(lvt, [lvt])
                name = f"llvm.rint.v{lanes}f32"
                return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name),
                                    args)  # fmt: skip

            return vt(vt), codegen

        @intrinsic
        def vpow2i(typingctx, n):
            """2**n for lanes holding integers in -126 .. 127, built from the exponent bits."""

            def codegen(context, builder, sig, args):
                vi = ir.VectorType(I32, lanes)
                e = builder.add(builder.fptosi(args[0], vi), ir.Constant(vi, [127] * lanes))
                return builder.bitcast(builder.shl(e, ir.Constant(vi, [23] * lanes)), lvt)

            return vt(vt), codegen

        @intrinsic
        def vkeep_n(typingctx, v, n):
            """v's first n lanes, zeros after."""

            def codegen(context, builder, sig, args):
                m = first_n(context, builder, args[1], sig.args[1])
                return builder.select(m, args[0], ir.Constant(lvt, [0.0] * lanes))

            return vt(vt, n), codegen

        self.vrint, self.vpow2i, self.vkeep_n = vrint, vpow2i, vkeep_n
        self.sload, self.sstore = sload, sstore
        self.vload, self.vstore, self.vbload, self.vsplat = vload, vstore, vbload, vsplat
        self.vload_n, self.vstore_n, self.vloadw_n = vload_n, vstore_n, vloadw_n
        self.vzero, self.vfma = vzero, vfma
        self.vadd = _binary(lambda bl, a, b: bl.fadd(a, b))
        self.vsub = _binary(lambda bl, a, b: bl.fsub(a, b))
        self.vmul = _binary(lambda bl, a, b: bl.fmul(a, b))
        self.vdiv = _binary(lambda bl, a, b: bl.fdiv(a, b))  # IEEE: x / 0 is inf or NaN
        # max / min as compare + select that keep a NaN of either operand (a + b is NaN
        # then), as the scalar epilogue (act_scalar) and ONNX Runtime's Relu and Clip:
        # relu is vmax(0, v), clip vmin(vmax(v, lo), hi)
        self.vmax = _binary(lambda bl, a, b: _keep_nan(bl, a, b, ">"))
        self.vmin = _binary(lambda bl, a, b: _keep_nan(bl, a, b, "<"))


def _keep_nan(bl, a, b, cmp: str):
    """b if b (cmp) a else a, or a + b (NaN) when either is NaN."""
    pick = bl.select(bl.fcmp_ordered(cmp, b, a), b, a)
    return bl.select(bl.fcmp_unordered("uno", a, b), bl.fadd(a, b), pick)


@intrinsic
def prefetch(typingctx, arr, idx):
    """Ask the cache for the line holding arr's element idx (flat from its data pointer)
    without waiting for it: the GEMM streams its next weight slab into L2 while the
    current one is in use. A hint only: an address past the array is not an error."""

    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # read, locality 2 (x86 prefetcht1: into L2; L1 is left to the tile in use), data
        consts = [ir.Constant(I32, v) for v in (0, 2, 1)]
        builder.call(fn, [builder.bitcast(p, i8p), *consts])
        return context.get_dummy_value()

    return types.void(arr, idx), codegen


@intrinsic
def pow2i_f32(typingctx, n):
    """2**n as float32 for a float32 holding an integer in -126 .. 127, from the exponent
    bits: the scalar twin of Ops.vpow2i, for loops LLVM vectorises itself."""

    def codegen(context, builder, sig, args):
        e = builder.add(builder.fptosi(args[0], I32), ir.Constant(I32, 127))
        return builder.bitcast(builder.shl(e, ir.Constant(I32, 23)), F32)

    return types.float32(types.float32), codegen


@intrinsic
def half_bits_to_f32(typingctx, h):
    """A uint16 holding an IEEE half, as float32: one vcvtph2ps with F16C (every AVX2
    CPU), one fcvt on aarch64. CPUs without either (SSE-only x86) must not call it:
    LLVM would call a runtime helper numba does not link (cpu_numba.half_to_f32 is the
    portable form). A per-group table lookup held the int4 GEMV at 3 GB/s."""

    def codegen(context, builder, sig, args):
        bits = builder.trunc(args[0], ir.IntType(16)) if sig.args[0].bitwidth > 16 else args[0]
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), F32)

    return types.float32(h), codegen


def lanes_for(features: set[str] | frozenset[str], arch: str = "x86_64") -> tuple[int, int]:
    """(lanes, vectors per tile row) for a CPU: the widest float32 vector, and as many
    vectors across as leave registers for MR=6 rows of accumulators plus operands."""
    if arch == "x86_64":
        if "avx512f" in features:
            return 16, 4  # 32 zmm: 24 accumulators + 4 loads + 1 broadcast
        if "avx2" in features or "avx" in features:
            return 8, 2  # 16 ymm: 12 accumulators + 2 loads + 1 broadcast
        return 4, 2  # SSE: 16 xmm
    return 4, 4  # aarch64 NEON: 32 q registers


def host_features() -> set[str]:
    import llvmlite.binding as llvm

    raw = llvm.get_host_cpu_features().flatten()
    return {f[1:] for f in raw.split(",") if f.startswith("+")}
