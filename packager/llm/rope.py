"""RoPE tables: cos/sin [positions, rotated dims / 2] for the ``rope`` op, computed at
pack time with the model's frequency scaling applied (the runtime only indexes them).

As transformers does: inverse frequencies 1 / theta^(2i / dim), rescaled per
``rope_type`` (``linear``: / factor; ``llama3``: long wavelengths / factor, a smooth
blend in between; ``factors``: each rotated pair's own factor divides it, then
``factor`` if given, as ggml's rope does with llama.cpp's ``rope_freqs`` tensor,
``theta / freq_factor``), then angle = float32(pos) * inv_freq rounded to float32 (HF
forms the product in float32), then cos and sin. The frequencies themselves are
computed in float64 and rounded once.
"""

from __future__ import annotations

import math

import numpy as np

from ..ir import PackError
from .arch import DecoderSpec


def inv_freq(spec: DecoderSpec) -> np.ndarray:
    p = spec.rope
    dim = int(spec.head_dim * float(p.get("partial_rotary_factor", 1.0)))
    inv = 1.0 / spec.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    kind = p["rope_type"]
    if kind == "linear":
        inv = inv / float(p["factor"])
    elif kind == "llama3":
        try:
            factor, lo_f, hi_f = (
                float(p["factor"]),
                float(p["low_freq_factor"]),
                float(p["high_freq_factor"]),
            )
            old = float(p["original_max_position_embeddings"])
        except KeyError as e:
            raise PackError(f"config.json: llama3 RoPE scaling lacks {e.args[0]!r}") from None
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo_f, inv / factor, inv)
        smooth = (old / wavelen - lo_f) / (hi_f - lo_f)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi_f) & (wavelen <= old / lo_f)
        inv = np.where(medium, blended, scaled)
    elif kind == "factors":  # a GGUF's rope_freqs (gguf_file.py), one per rotated pair
        factors = np.asarray(p.get("factors", ()), dtype=np.float64).reshape(-1)
        if factors.shape != inv.shape or not np.all(factors > 0):
            raise PackError(
                f"RoPE frequency factors: {factors.size} given for {inv.size} rotated pairs "
                "(each must be positive)"
            )
        inv = inv / factors / float(p.get("factor", 1.0))
    return inv.astype(np.float32)


def tables(spec: DecoderSpec, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each float32 [positions, rotated dims / 2]."""
    ang = np.arange(positions, dtype=np.float32)[:, None] * inv_freq(spec)[None, :]
    a = ang.astype(np.float64)  # the float32 angles, exactly
    return np.cos(a).astype(np.float32), np.sin(a).astype(np.float32)
