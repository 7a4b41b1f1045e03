"""The folders show the architecture: plan (packager/), run (runtime/ core, kernels/ by
backend), serve (runtime/serve/); these tests keep the imports that way.

Imports are read from the source (``ast``), function-level ones included: a lazy
import still ties two modules together."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {
    "edgepack": "edgepack",
    "runtime": "edgepack.runtime",
    "packager": "edgepack.packager",
    "kernels": "edgepack.kernels",
    "targets": "edgepack.targets",
}


def _modules() -> dict[str, Path]:
    out = {}
    for top, pkg in PACKAGES.items():
        for p in (REPO / top).rglob("*.py"):
            if "__pycache__" in p.parts:
                continue
            rest = list(p.relative_to(REPO / top).with_suffix("").parts)
            if rest[-1] == "__init__":
                rest = rest[:-1]
            out[".".join([pkg, *rest])] = p
    return out


def _imports() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom):
                if n.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                    target = ".".join(base + ([n.module] if n.module else []))
                else:
                    target = n.module or ""
                for c in [target, *(f"{target}.{a.name}" for a in n.names)]:
                    if c in mods and c != m:
                        edges[m].add(c)
            elif isinstance(n, ast.Import):
                edges[m].update(a.name for a in n.names if a.name in mods)
    return edges


EDGES = _imports()


def _under(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def test_the_import_graph_has_no_cycles() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(EDGES[m]):
            if state.get(n) == 1:
                cycle = path[path.index(n) :] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(EDGES):
        if m not in state:
            visit(m)


def _violations(src_pkg: str, dst_pkg: str, allowed: tuple[str, ...] = ()) -> list[str]:
    return sorted(
        f"{m} -> {n}"
        for m, ns in EDGES.items()
        if _under(m, src_pkg) and m not in allowed
        for n in ns
        if _under(n, dst_pkg)
    )


def test_device_code_never_imports_the_packager() -> None:
    for pkg in ("edgepack.runtime", "edgepack.kernels", "edgepack.targets"):
        assert not _violations(pkg, "edgepack.packager"), pkg


def _direct(mods, dst_pkg: str) -> list[str]:
    return sorted(f"{m} -> {n}" for m in mods for n in EDGES[m] if _under(n, dst_pkg))


def test_the_runtime_core_does_not_import_serve() -> None:
    serve = "edgepack.runtime.serve"
    core = [m for m in EDGES if _under(m, "edgepack.runtime") and not _under(m, serve)]
    # only the command table registers the `serve` command (argparse only at import)
    assert _direct(core, serve) == ["edgepack.runtime.cli -> edgepack.runtime.serve.cli"]
    assert not _violations(serve, "edgepack.runtime.cli")


BACKENDS = ("edgepack.kernels.ref", "edgepack.kernels.cpu", "edgepack.kernels.cuda")


def test_backends_do_not_know_each_other() -> None:
    for a in BACKENDS:
        for b in BACKENDS:
            if a != b:
                assert not _violations(a, b), (a, b)
    # the shared kernel modules (tables, layouts, the decode wrapper) import no backend;
    # the registry loads them from its table of module names
    shared = [
        m
        for m in EDGES
        if _under(m, "edgepack.kernels") and not any(_under(m, b) for b in BACKENDS)
    ]
    for b in BACKENDS:
        assert not _direct(shared, b), b


def test_no_backend_names_another_backend() -> None:
    # Imports are not the only way to know another backend: a registry lookup under its
    # name ("sized for what cuda needs") ties the two just as well. No string in a
    # backend's modules is another backend's name.
    from edgepack.kernels.registry import BACKEND_TABLE

    mods = _modules()
    for b in BACKENDS:
        me = b.rsplit(".", 1)[1]
        others = set(BACKEND_TABLE) - {me}
        for m, p in mods.items():
            if not _under(m, b):
                continue
            named = {
                n.value
                for n in ast.walk(ast.parse(p.read_text()))
                if isinstance(n, ast.Constant) and n.value in others
            }
            assert not named, f"{m} names backend(s) {sorted(named)}"
