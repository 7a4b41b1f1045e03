"""Device target files: the shipped ones load, bad ones fail with the file and field named."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env
from edgepack.targets import (
    BACKENDS,
    Target,
    TargetError,
    _parse,
    list_targets,
    llvm_features,
    load_target,
    target_names,
)

TARGETS_DIR = Path(__file__).resolve().parents[1] / "targets"
EXPECTED = {"linux-x86_64", "rpi4", "rpi5", "jetson-orin-nano", "jetson-xavier-nx"}


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string for the plain text used here
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def dump_toml(d: dict) -> str:
    """Enough TOML for a target: scalars and arrays, then sub-tables and arrays of them."""

    def tables(v) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)

    lines = [
        f"{k} = {_toml_value(v)}" for k, v in d.items() if not isinstance(v, dict) and not tables(v)
    ]
    for k, v in d.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]"] + [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items()]
        elif tables(v):
            for t in v:
                lines += ["", f"[[{k}]]"] + [f"{kk} = {_toml_value(vv)}" for kk, vv in t.items()]
    return "\n".join(lines) + "\n"


def valid(name: str = "board") -> dict:
    return {
        "name": name,
        "description": "a test board",
        "arch": "aarch64",
        "cpu": "cortex-a76",
        "cpu_features": ["neon", "dotprod", "fp16"],
        "min_glibc": "2.31",
        "python_abi": "cp311",
        "memory_budget_mb": 1000,
        "default_quant": "int8",
        "default_threads": 4,
        "backends": ["cpu", "ref"],
    }


def write(tmp_path: Path, d: dict, stem: str = "board") -> Path:
    p = tmp_path / f"{stem}.toml"
    p.write_text(dump_toml(d))
    return p


# ---- shipped targets ----------------------------------------------------------------


def test_shipped_targets_are_the_files():
    files = {p.stem for p in TARGETS_DIR.glob("*.toml")}
    assert EXPECTED <= files
    assert set(target_names()) == files
    assert [t.name for t in list_targets()] == sorted(files)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_target_loads_by_name_and_path(name):
    t = load_target(name)
    assert isinstance(t, Target) and t.name == name
    assert Path(t.source).name == f"{name}.toml"
    assert load_target(str(TARGETS_DIR / f"{name}.toml")) == t
    # The TOML round-trips through as_dict (what `edgepack targets --json` prints).
    assert _parse(t.as_dict(), "x", name) == t
    assert t.backends[-1] == "ref"
    assert (t.cuda is not None) == ("cuda" in t.backends)


def test_shipped_figures():
    x86, rpi4, rpi5 = load_target("linux-x86_64"), load_target("rpi4"), load_target("rpi5")
    orin, xavier = load_target("jetson-orin-nano"), load_target("jetson-xavier-nx")
    assert (x86.arch, x86.cpu, x86.llvm_features) == ("x86_64", "x86-64-v3", "+avx2,+fma,+f16c")
    assert (rpi4.cpu, rpi4.llvm_features, rpi4.default_quant) == ("cortex-a72", "+neon", "int8")
    # LLVM spells AArch64 half-precision arithmetic "fullfp16".
    assert rpi5.llvm_features == "+neon,+dotprod,+fullfp16"
    assert rpi5.glibc_tuple == (2, 36)
    assert xavier.glibc_tuple == (2, 31) and "dotprod" not in xavier.cpu_features
    assert orin.cuda is not None and orin.cuda.arch == "sm_87" and orin.cuda.unified_memory
    assert xavier.cuda is not None and xavier.cuda.arch == "sm_72"
    assert orin.backends == ("cuda", "cpu", "ref")
    assert rpi4.memory_budget_mb < rpi5.memory_budget_mb < x86.memory_budget_mb


def test_kernel_registry_backends_are_accepted():
    from edgepack.kernels.registry import BACKENDS as KERNEL_BACKENDS

    assert set(KERNEL_BACKENDS) <= set(BACKENDS)


def test_llvm_knows_every_cpu_and_feature():
    # LLVM only warns on stderr ("not a recognized processor ... ignoring") and compiles
    # generic code, so compile a trivial function per target and look for the warning.
    # A subprocess, because the warning is written by C++ straight to fd 2.
    code = """
import json, sys
import llvmlite.binding as llvm
llvm.initialize_all_targets()
llvm.initialize_all_asmprinters()
for t in json.loads(sys.argv[1]):
    triple = t["arch"] + "-unknown-linux-gnu"
    mod = llvm.parse_assembly("define i32 @f(i32 %x) {\\n  ret i32 %x\\n}")
    mod.triple = triple
    tm = llvm.Target.from_triple(triple).create_target_machine(
        cpu=t["cpu"], features=t["features"]
    )
    tm.emit_assembly(mod)
    print(t["name"], "ok", flush=True)
"""
    ts = [
        {"name": t.name, "arch": t.arch, "cpu": b.cpu,
         "features": llvm_features(t.arch, b.cpu_features)}  # fmt: skip
        for t in list_targets()
        for b in t.kernel_builds
    ]
    r = subprocess.run(
        [sys.executable, "-c", code, json.dumps(ts)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "not a recognized" not in r.stderr, r.stderr
    assert r.stdout.count(" ok") == len(ts)


# ---- custom targets -----------------------------------------------------------------


def test_custom_target_loads_by_path(tmp_path):
    d = valid("my-board")
    d["cuda"] = {"arch": "sm_87", "cuda_version": "12.6", "unified_memory": False}
    d["backends"] = ["cuda", "cpu", "ref"]
    p = write(tmp_path, d, "my-board")
    t = load_target(str(p))
    assert t.name == "my-board" and t.source == str(p)
    assert t.cuda is not None and t.cuda.jetpack is None and not t.cuda.unified_memory
    assert load_target(p) == t  # a Path works too


def test_unknown_name_lists_shipped_targets():
    with pytest.raises(TargetError, match=r"unknown target 'rpi3'.*rpi4.*\.toml"):
        load_target("rpi3")


def test_missing_file_names_it(tmp_path):
    p = tmp_path / "nope.toml"
    with pytest.raises(TargetError, match=re.escape(f"{p}: cannot read target file")):
        load_target(str(p))


# ---- validation errors --------------------------------------------------------------


def _drop(key):
    def f(d):
        del d[key]

    return f


def _set(key, value):
    def f(d):
        d[key] = value

    return f


def _cuda(**kw):
    def f(d):
        d["backends"] = ["cuda", "cpu", "ref"]
        d["cuda"] = {"arch": "sm_87", "cuda_version": "12.2", "unified_memory": True, **kw}

    return f


def _cuda_without(key):
    def f(d):
        _cuda()(d)
        del d["cuda"][key]

    return f


BAD = {
    "missing field": (_drop("cpu"), r"missing required field 'cpu'"),
    "typo key": (
        _set("memory_budget", 100),
        r"unknown field\(s\) memory_budget \(allowed: name, ",
    ),
    "int as string": (
        _set("memory_budget_mb", "1200"),
        r"field 'memory_budget_mb' must be an integer, got str '1200'",
    ),
    "bool as int": (_set("default_threads", True), r"'default_threads' must be an integer"),
    "string not array": (_set("backends", "cpu"), r"'backends' must be an array"),
    "array of ints": (_set("cpu_features", [1]), r"'cpu_features' must be an array of strings"),
    "glibc as float": (_set("min_glibc", 2.31), r"'min_glibc' must be a string, got float"),
    "glibc three parts": (_set("min_glibc", "2.31.1"), r"'min_glibc' is '2.31.1'; expected"),
    "glibc prefix": (_set("min_glibc", "glibc-2.31"), r"'min_glibc' is 'glibc-2.31'"),
    "unknown arch": (_set("arch", "riscv64"), r"'arch' is 'riscv64'; expected one of x86_64"),
    "unknown backend": (
        _set("backends", ["tpu", "ref"]),
        r"'backends' is 'tpu'; expected one of cpu, ref, cuda",
    ),
    "empty backends": (_set("backends", []), r"'backends' is empty"),
    "duplicate backend": (_set("backends", ["cpu", "cpu", "ref"]), r"lists cpu more than once"),
    "bad quant": (_set("default_quant", "int3"), r"'default_quant' is 'int3'; expected one of"),
    "unknown feature": (
        _set("cpu_features", ["neon", "dotprd"]),
        r"unknown aarch64 feature 'dotprd'",
    ),
    "x86 feature on arm": (_set("cpu_features", ["avx2"]), r"unknown aarch64 feature 'avx2'"),
    "llvm spelling": (_set("cpu_features", ["fullfp16"]), r"feature 'fullfp16' \(known: .*fp16"),
    "old python": (_set("python_abi", "cp38"), r"'python_abi' is 'cp38'"),
    "not an abi": (_set("python_abi", "3.11"), r"'python_abi' is '3.11'"),
    "zero threads": (_set("default_threads", 0), r"'default_threads' must be >= 1, got 0"),
    "zero budget": (_set("memory_budget_mb", 0), r"'memory_budget_mb' must be >= 1"),
    "bad cpu": (_set("cpu", "Cortex A76"), r"'cpu' 'Cortex A76' is not an LLVM CPU name"),
    "cuda backend, no table": (
        _set("backends", ["cuda", "cpu", "ref"]),
        r"no \[cuda\] table",
    ),
    "table, no cuda backend": (
        _set("cuda", {"arch": "sm_87", "cuda_version": "12.2", "unified_memory": True}),
        r"\[cuda\] table but backends lack \"cuda\"",
    ),
    "device backend not first": (
        lambda d: (_cuda()(d), d.update(backends=["cpu", "cuda", "ref"])),
        r"backend 'cuda' runs on a device and must come first in 'backends'",
    ),
    "cuda typo key": (_cuda(jetpak="6.0"), r"unknown field\(s\) cuda.jetpak"),
    "cuda missing": (_cuda_without("arch"), r"missing required field 'cuda.arch'"),
    "cuda arch": (_cuda(arch="87"), r"'cuda.arch' is '87'; expected like \"sm_87\""),
    "cuda version": (_cuda(cuda_version="12"), r"'cuda.cuda_version' is '12'"),
    "jetpack version": (_cuda(jetpack="six"), r"'cuda.jetpack' is 'six'"),
    "unified not bool": (_cuda(unified_memory=1), r"'cuda.unified_memory' must be a boolean"),
    "cuda not table": (_set("cuda", "sm_87"), r"'cuda' must be a table"),
    "extra build lacks a base feature": (
        _set("extra_builds", [{"cpu": "cortex-a78", "cpu_features": ["neon", "fp16"]}]),
        r"'extra_builds\[0\].cpu_features' lacks dotprod: an extra build is for CPUs with at",
    ),
    "extra build unknown feature": (
        _set("extra_builds", [{"cpu": "neoverse-v1",
                               "cpu_features": ["neon", "dotprod", "fp16", "sve3"]}]),
        r"'extra_builds\[0\].cpu_features' has unknown aarch64 feature 'sve3'",
    ),
    "extra build typo key": (
        _set("extra_builds", [{"cpu": "cortex-a78", "features": ["neon"]}]),
        r"unknown field\(s\) extra_builds\[0\].features",
    ),
    "extra builds not tables": (_set("extra_builds", ["x86-64-v4"]), r"array of tables"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_validation_error_names_file_and_field(tmp_path, case):
    mutate, message = BAD[case]
    d = valid()
    mutate(d)
    p = write(tmp_path, d)
    with pytest.raises(TargetError, match=message) as e:
        load_target(str(p))
    assert str(e.value).startswith(f"{p}: ")


def test_all_missing_fields_named(tmp_path):
    p = tmp_path / "board.toml"
    p.write_text('name = "board"\narch = "x86_64"\n')
    with pytest.raises(TargetError, match=r"missing required fields 'description', 'cpu', "):
        load_target(str(p))


def test_name_must_match_file(tmp_path):
    p = write(tmp_path, valid("rpi4"), "board")
    with pytest.raises(TargetError, match=r"'name' is 'rpi4' but the file is board\.toml"):
        load_target(str(p))


def test_not_toml(tmp_path):
    p = tmp_path / "board.toml"
    p.write_text('name = "board"\narch = \n')
    with pytest.raises(TargetError, match=re.escape(f"{p}: not valid TOML")):
        load_target(str(p))


def test_target_error_is_a_value_error():
    # The CLI reports ValueErrors as "edgepack: error: ..." with exit status 1.
    assert issubclass(TargetError, ValueError)


# ---- the CLI ------------------------------------------------------------------------


def ep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edgepack.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
    )


def test_cli_lists_every_target():
    r = ep("targets")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["name", "arch", "cpu", "glibc"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == set(target_names())
    assert rows["jetson-orin-nano"][-1] == "sm_87" and rows["rpi4"][-1] == "-"
    assert "cortex-a72" in rows["rpi4"] and "1200" in rows["rpi4"]


def test_cli_json(tmp_path):
    r = ep("targets", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [d["name"] for d in data] == target_names()
    assert data == [t.as_dict() for t in list_targets()]
    custom = write(tmp_path, valid())
    r = ep("targets", "rpi5", custom, "--json")
    assert [d["name"] for d in json.loads(r.stdout)] == ["rpi5", "board"]


def test_cli_reports_bad_target(tmp_path):
    d = valid()
    d["arch"] = "mips"
    r = ep("targets", write(tmp_path, d))
    assert r.returncode == 1
    assert r.stderr.startswith("edgepack: error: ") and "'arch' is 'mips'" in r.stderr


def test_extra_builds_come_first_and_round_trip(tmp_path):
    """A target's extra kernel builds are preferred in their order, its own build last;
    the stub names their modules after the plain one."""
    from edgepack.packager.aot import kernel_modules

    d = valid()
    d["extra_builds"] = [
        {"cpu": "neoverse-v1", "cpu_features": ["neon", "dotprod", "fp16", "i8mm", "sve"]},
        {"cpu": "cortex-a78", "cpu_features": ["neon", "dotprod", "fp16", "i8mm"]},
    ]
    t = load_target(str(write(tmp_path, d)))
    assert [b.cpu for b in t.kernel_builds] == ["neoverse-v1", "cortex-a78", "cortex-a76"]
    assert t.as_dict() == d
    assert [m for _, m in kernel_modules(t)] == [
        "edgepack_kernels_1", "edgepack_kernels_2", "edgepack_kernels"
    ]
    x86 = load_target("linux-x86_64")
    assert [b.cpu for b in x86.kernel_builds] == ["x86-64-v4", "x86-64-v3"]


def test_the_executable_takes_the_first_build_its_cpu_can_run(monkeypatch):
    from edgepack.kernels.cpu.native import UnsupportedCPU, aot_module

    builds = [
        {"module": "k_1", "cpu": "x86-64-v4", "flags": ["avx2", "fma", "avx512f", "avx512_vnni"]},
        {"module": "k", "cpu": "x86-64-v3", "flags": ["avx2", "fma"]},
    ]
    monkeypatch.delenv("EDGEPACK_KERNEL_CPU", raising=False)
    assert aot_module(builds, {"avx2", "fma", "avx512f", "avx512_vnni", "sse2"}) == "k_1"
    assert aot_module(builds, {"avx2", "fma", "avx512f"}) == "k"  # AVX-512 without VNNI
    from edgepack.kernels.cpu import native

    with monkeypatch.context() as m:  # /proc/cpuinfo unreadable: the target's floor
        m.setattr(native, "host_cpu_flags", lambda: None)
        assert aot_module(builds) == "k"
    with pytest.raises(UnsupportedCPU, match=r"lacks avx2, fma, which .* \(built for x86-64-v3\)"):
        aot_module(builds, {"sse2", "sse4_2"})
    monkeypatch.setenv("EDGEPACK_KERNEL_CPU", "x86-64-v3")
    assert aot_module(builds, {"avx2", "fma", "avx512f", "avx512_vnni"}) == "k"
    monkeypatch.setenv("EDGEPACK_KERNEL_CPU", "znver9")
    with pytest.raises(UnsupportedCPU, match="has kernels for x86-64-v4, x86-64-v3"):
        aot_module(builds, {"avx2", "fma"})
