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
from .build import BuildResult, build
from .executable import assemble
from .ir import PackError
from .stub import cached_stub, check_stub, how_to_build


def find_stub(target: Target, stub: str | Path | None) -> Path:
    if stub is not None:
        p = Path(stub)
        if not p.is_file():
            raise PackError(f"--stub {p}: no such file")
        return p
    p = cached_stub(target)
    if not p.is_file():
        raise PackError(
            f"no runtime stub for target {target.name} in the stub cache; {how_to_build(target)}"
        )
    return p


def check_budget(result: BuildResult, target: Target) -> None:
    arena = result.plan.arena_bytes
    need = arena + result.weight_bytes
    budget = target.memory_budget_mb * 2**20
    if need > budget:
        raise PackError(
            f"the model needs {need / 2**20:.0f} MiB (arena {arena / 2**20:.0f} MiB + weights "
            f"{result.weight_bytes / 2**20:.0f} MiB), over target {target.name}'s memory budget "
            f"of {target.memory_budget_mb} MiB: quantize further (--quant int8), use a smaller "
            "input shape or batch, or pick a target with more memory"
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
    **build_kw,
) -> Path:
    stub_path = find_stub(target, stub)
    meta = check_stub(stub_path, target)
    out = Path(out) if out else Path("dist") / f"{Path(model).stem}-{target.name}"
    with tempfile.TemporaryDirectory(prefix="edgepack-") as tmp:
        bundle = Path(tmp) / "model.epk"
        result = build(
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
