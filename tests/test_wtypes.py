"""The weight-type table (kernels/wtypes.py): its rows' references, pinned block
layouts, and that everything else derives from it."""

from __future__ import annotations

import numpy as np
import pytest
from edgepack.kernels import registry, wtypes
from edgepack.packager import quantize
from edgepack.targets import QUANTS


@pytest.mark.parametrize("name", list(wtypes.WTYPES))
def test_quantize_dequantize_round_trip_within_the_rows_error(name: str) -> None:
    rng = np.random.default_rng(0)
    for shape in [(8, 96), (6, 5, 3, 3), (3, 40)]:  # K = 96, 45, 40: partial groups too
        w = rng.standard_normal(shape).astype(np.float32)
        stored, scale = wtypes.QUANTIZE[name](w, wtypes.DEFAULT_GROUP)
        row = wtypes.get(name)
        assert stored.dtype == row.storage
        assert (scale is None) == (row.scale == "none")
        if scale is not None:
            assert scale.dtype == row.scale_dtype
        back = wtypes.DEQUANTIZE[name](stored, scale, shape)
        assert back.shape == shape and back.dtype == np.float32
        rel = np.linalg.norm(back - w) / np.linalg.norm(w)
        assert rel <= row.max_rel_error, (name, shape, rel)


def test_bf16_rounds_to_nearest_even() -> None:
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, np.inf, 3e38, 1e-40], np.float32)
    bits, _ = wtypes.QUANTIZE["bf16"](x, 0)
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: to even (1); 1 + 3*2^-8 to 1 + 2^-6
    assert list(bits[:5]) == [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x7F80]
    back = wtypes.bf16_to_f32(bits)
    assert np.isclose(back[5], 3e38, rtol=2**-8) and back[6] != 0  # range and subnormals
    nan, _ = wtypes.QUANTIZE["bf16"](np.array([np.nan], np.float32), 0)
    assert np.isnan(wtypes.bf16_to_f32(nan))[0]


def test_int4_layout_golden_bytes() -> None:
    """Codes q + 8, byte j of a 32-weight run holding weight j (low) and j + 16 (high);
    the group's scale is its largest-magnitude weight over -8, in fp16."""
    w = np.zeros((1, 32), np.float32)
    w[0, :16] = np.arange(16) - 8  # weights 0..15: -8 .. 7
    w[0, 16:] = 7 - np.arange(16)  # weights 16..31: 7 .. -8
    packed, scale = wtypes.QUANTIZE["i4"](w, 32)
    assert scale.tolist() == [[1.0]] and scale.dtype == np.float16
    assert packed.tobytes().hex() == "f0e1d2c3b4a5968778695a4b3c2d1e0f"
    assert np.array_equal(wtypes.DEQUANTIZE["i4"](packed, scale, w.shape), w)


def test_int4_pads_k_to_whole_groups_and_records_its_group() -> None:
    w = np.random.default_rng(1).standard_normal((5, 70)).astype(np.float32)
    for group in wtypes.GROUP_SIZES:
        packed, scale = wtypes.QUANTIZE["i4"](w, group)
        kp = -(-70 // group) * group
        assert packed.shape == (5, kp // 2) and scale.shape == (5, kp // group)
        assert wtypes.q4_group(packed.shape, scale.shape) == group
        assert wtypes.check_scale("i4", packed.shape, scale.shape) is None
    assert "group size" in wtypes.check_scale("i4", (5, 48), (5, 2))  # K = 96: groups of 48
    assert "do not match" in wtypes.check_scale("i4", (5, 48), (4, 3))
    assert "need their group scales" in wtypes.check_scale("i4", (5, 48), None)
    assert "multiple of 32" in wtypes.check_stored("i4", [5, 9])
    with pytest.raises(ValueError, match="group size 16"):
        wtypes.QUANTIZE["i4"](w, 16)


def test_unknown_types_are_errors_everywhere() -> None:
    with pytest.raises(KeyError, match="unknown weight type 'q3'.*f32, f16, bf16, i8, i4"):
        wtypes.get("q3")
    with pytest.raises(ValueError, match="--quant 'int3'; choose from fp32, fp16, bf16, int8"):
        wtypes.by_quant("int3")
    with pytest.raises(ValueError, match="cannot be stored"):
        wtypes.of_array(np.zeros(2, np.complex64))
    assert wtypes.check_stored("q3", [4]) == "unknown weight type 'q3'"


def test_everything_derives_from_the_table() -> None:
    modes = tuple(r.quant for r in wtypes.ROWS if r.quant)
    assert quantize.MODES == modes and QUANTS == modes
    assert set(registry.DTYPES) == set(wtypes.WTYPES)
    registry._load_backends()
    # every row has a kernel for each op it stores, on every backend that can meet the op
    # (an op a graph pass makes only meets the backends that ask for the pass: qconv)
    made_by = {op: p for p, ops in registry.PASS_OPS.items() for op in ops}
    for row in wtypes.ROWS:
        for op in row.ops:
            for backend in registry.BACKENDS:
                pass_made = op in made_by and backend != "ref"
                if pass_made and not registry.wants((backend,), made_by[op]):
                    continue
                assert (op, row.name, backend) in registry.KERNELS, (op, row.name, backend)
