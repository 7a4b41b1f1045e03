"""``edgepack build MODEL --target T``: bundle + runtime stub -> dist/<model>-<target>.

Refuses, before writing anything, what the target cannot run: a stub of another
architecture, a stub needing newer glibc symbols than the target has, a model
whose arena + weights exceed the target's memory budget, an op with no kernel on
the target's backends.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from ..targets import Target
from .aot import host_arch
from .build import BuildResult, build
from .executable import assemble
from .ir import PackError
from .stub import (
    build_stub,
    cached_stub,
    check_stub,
    read_stub,
    runtime_sources_digest,
)


def find_stub(
    target: Target, stub: str | Path | None, log: Callable[[str], None] = print
) -> Path:
    """The stub named by --stub, else the cached one for ``target``. A cache without a
    stub made from these runtime sources gets one, made here: frozen for this machine's
    architecture (about a minute when the install made the kernel builds), assembled
    for another (aarch64 on x86_64, packager/stub_cross.py: ~7 minutes the first time,
    the kernels' cross build); the error names what is missing when it cannot be."""
    if stub is not None:
        p = Path(stub)
        if not p.is_file():
            raise PackError(f"--stub {p}: no such file")
        return p
    p = cached_stub(target)
    why = "none" if not p.is_file() else None
    if why is None and read_stub(p)[0].get("sources") != runtime_sources_digest():
        why = "one frozen from other edgepack runtime sources"
    if why is None:
        return p
    verb = "freezing" if host_arch() == target.arch else f"assembling an {target.arch}"
    log(f"      the stub cache has {why} for target {target.name}: {verb} one ({p.parent})")
    return build_stub(target, log=log)


def memory_parts(result: BuildResult, target: Target) -> dict[str, int]:
    """The bytes the target's memory budget has to hold, by part."""
    arena, weights = result.plan.arena_bytes, result.weight_bytes
    if target.cuda is not None and target.cuda.unified_memory and "cuda" in target.backends:
        # Tegra: CPU and GPU share one physical memory, so the device arena and the
        # uploaded weight copy come out of the same budget as the mmap'd weights and the
        # host arena (the cpu fallback's, and what the runtime maps before uploading).
        # Counted as uploaded (the default); --gpu-weights map would save one copy.
        return {
            "host arena": arena,
            "device arena": arena,
            "weights": weights,
            "device weights": weights,
        }
    return {"arena": arena, "weights": weights}


def check_budget(result: BuildResult, target: Target) -> None:
    parts = memory_parts(result, target)
    need = sum(parts.values())
    budget = target.memory_budget_mb * 2**20
    if need > budget:
        shared = " (CPU and GPU share it)" if len(parts) > 2 else ""
        detail = " + ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in parts.items())
        raise PackError(
            f"the model needs {need / 2**20:.0f} MiB ({detail}), over target {target.name}'s "
            f"memory budget of {target.memory_budget_mb} MiB{shared}: quantize further "
            "(--quant int8), use a smaller input shape or batch, or pick a target with more "
            "memory"
        )


def build_for_target(
    model: str | Path,
    target: Target,
    out: str | Path | None = None,
    quant: str | None = None,
    stub: str | Path | None = None,
    private_key: bytes | None = None,
    embed_pubkey: bytes | None = None,
    log: Callable[[str], None] = print,
    builder: Callable[..., BuildResult] = build,
    **build_kw,
) -> Path:
    """``builder``: ``build`` (ONNX models) or ``llm.build.build_llm`` (language models:
    the same stub runs their bundle; the KV cache counts in the arena's budget)."""
    stub_path = find_stub(target, stub, log)
    meta = check_stub(stub_path, target)
    out = Path(out) if out else Path("dist") / f"{Path(model).stem}-{target.name}"
    with tempfile.TemporaryDirectory(prefix="edgepack-") as tmp:
        bundle = Path(tmp) / "model.epk"
        result = builder(
            model,
            bundle,
            quant=quant or target.default_quant,
            backends=target.backends,
            log=log,
            extra_manifest={
                "target": {"name": target.name, "arch": target.arch, "stub": meta["stub_id"]}
            },
            **build_kw,
        )
        check_budget(result, target)
        assemble(stub_path, bundle, out, private_key, embed_pubkey)
    size = out.stat().st_size
    log(
        f"      {out}: {size / 1e6:.1f} MB executable for {target.name} (stub "
        f"{stub_path.stat().st_size / 1e6:.1f} MB + bundle {result.bundle_bytes / 1e6:.1f} MB)"
        + (", signed" if private_key else "")
    )
    return out
