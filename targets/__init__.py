"""Device targets: one TOML file per device, loaded and validated into a ``Target``.

The schema is documented in docs/targets.md. This module is imported by the packager
and may be imported by the device runtime, so it uses only the standard library
(plus ``tomli`` on Python 3.10, where ``tomllib`` does not exist yet) and the weight-type
table (kernels/wtypes.py, numpy only) for the quantization modes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ..kernels.registry import BACKEND_TABLE, BACKENDS
from ..kernels.wtypes import QUANT_MODES

__all__ = [
    "ARCHES",
    "BACKENDS",
    "QUANTS",
    "CPU_FEATURES",
    "CPUINFO_FLAGS",
    "CudaInfo",
    "KernelBuild",
    "Target",
    "TargetError",
    "load_target",
    "list_targets",
    "target_names",
]

ARCHES = ("x86_64", "aarch64")
# A target's ``backends``: rows of kernels/registry.py's BACKEND_TABLE. The packager
# falls back along the list when a host backend lacks a kernel; a device backend
# ("cuda") comes first or not at all, and its nodes record their host fallback
# (docs/cuda.md).
QUANTS = QUANT_MODES  # the weight-type table's --quant modes (kernels/wtypes.py)

# Feature names a target may list, per arch, and their LLVM spelling. A closed list so
# that a typo fails here instead of LLVM printing "not a recognized feature (ignoring
# feature)" and quietly compiling slower code. Only "fp16" differs: LLVM calls AArch64
# half-precision arithmetic "fullfp16" (its "fp16" is not a feature name).
CPU_FEATURES: dict[str, dict[str, str]] = {
    "x86_64": {
        f: f
        for f in (
            "sse4.2",
            "avx",
            "avx2",
            "fma",
            "f16c",
            "bmi2",
            "avxvnni",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512vnni",
            "avx512bf16",
            "avx512fp16",
        )
    },
    "aarch64": {
        "neon": "neon",
        "fp16": "fullfp16",
        "fp16fml": "fp16fml",
        "dotprod": "dotprod",
        "i8mm": "i8mm",
        "bf16": "bf16",
        "sve": "sve",
        "sve2": "sve2",
        "crc": "crc",
        "lse": "lse",
        "rcpc": "rcpc",
    },
}

# The same features as Linux spells them in /proc/cpuinfo ("flags" on x86, "Features"
# on aarch64): what an executable checks at start to pick its kernel build.
CPUINFO_FLAGS: dict[str, dict[str, str]] = {
    "x86_64": {
        **{f: f for f in CPU_FEATURES["x86_64"]},
        "sse4.2": "sse4_2",
        "avxvnni": "avx_vnni",
        "avx512vnni": "avx512_vnni",
        "avx512bf16": "avx512_bf16",
        "avx512fp16": "avx512_fp16",
    },
    "aarch64": {
        "neon": "asimd",
        "fp16": "asimdhp",
        "fp16fml": "asimdfhm",
        "dotprod": "asimddp",
        "i8mm": "i8mm",
        "bf16": "bf16",
        "sve": "sve",
        "sve2": "sve2",
        "crc": "crc32",
        "lse": "atomics",
        "rcpc": "lrcpc",
    },
}

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # becomes part of file names
_CPU_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")  # LLVM CPU names: x86-64-v3, cortex-a72
_GLIBC_RE = re.compile(r"(\d+)\.(\d+)")
_ABI_RE = re.compile(r"cp3(\d+)")
_SM_RE = re.compile(r"sm_\d+")
_VERSION_RE = re.compile(r"\d+(\.\d+)+")
_MIN_PYTHON_MINOR = 10  # edgepack's requires-python floor


class TargetError(ValueError):
    """A target file is missing, unreadable or does not follow the schema."""


@dataclass(frozen=True)
class CudaInfo:
    arch: str  # compute capability as nvcc/PTX spell it, e.g. "sm_87"
    cuda_version: str  # CUDA toolkit on the device, e.g. "12.2"
    unified_memory: bool  # CPU and GPU share one physical memory (all Jetsons)
    jetpack: str | None = None  # JetPack release for Jetson boards, e.g. "6.0"


@dataclass(frozen=True)
class KernelBuild:
    """One more CPU the executable's kernels are compiled for (``extra_builds``)."""

    cpu: str  # LLVM CPU name
    cpu_features: tuple[str, ...]


def llvm_features(arch: str, features: tuple[str, ...]) -> str:
    """Target feature names as an LLVM/numba feature string, e.g. ``"+neon,+dotprod"``."""
    return ",".join(f"+{CPU_FEATURES[arch][f]}" for f in features)


def cpuinfo_flags(arch: str, features: tuple[str, ...]) -> list[str]:
    """Target feature names as /proc/cpuinfo lists them."""
    return [CPUINFO_FLAGS[arch][f] for f in features]


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    arch: str
    cpu: str
    cpu_features: tuple[str, ...]
    min_glibc: str
    python_abi: str
    memory_budget_mb: int
    default_quant: str
    default_threads: int
    backends: tuple[str, ...]
    cuda: CudaInfo | None = None
    # more CPUs the kernels are built for, first preferred (the executable runs the first
    # whose features the CPU has, else the target's own build)
    extra_builds: tuple[KernelBuild, ...] = ()
    # Where the target was read from; for messages only, so equality ignores it.
    source: str = field(default="", compare=False, repr=False)

    @property
    def glibc_tuple(self) -> tuple[int, int]:
        major, minor = self.min_glibc.split(".")
        return int(major), int(minor)

    @property
    def llvm_feature_names(self) -> tuple[str, ...]:
        """The features under LLVM's names, e.g. ``("neon", "dotprod")``."""
        names = CPU_FEATURES[self.arch]
        return tuple(names[f] for f in self.cpu_features)

    @property
    def llvm_features(self) -> str:
        """The features as an LLVM/numba feature string, e.g. ``"+neon,+dotprod"``."""
        return llvm_features(self.arch, self.cpu_features)

    @property
    def kernel_builds(self) -> tuple[KernelBuild, ...]:
        """Every CPU the kernels are compiled for, first preferred, the target's last."""
        return (*self.extra_builds, KernelBuild(self.cpu, self.cpu_features))

    def as_dict(self) -> dict[str, Any]:
        """The target as its TOML fields (lists for arrays; no ``cuda`` key when absent)."""
        d: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "arch": self.arch,
            "cpu": self.cpu,
            "cpu_features": list(self.cpu_features),
            "min_glibc": self.min_glibc,
            "python_abi": self.python_abi,
            "memory_budget_mb": self.memory_budget_mb,
            "default_quant": self.default_quant,
            "default_threads": self.default_threads,
            "backends": list(self.backends),
        }
        if self.extra_builds:
            d["extra_builds"] = [
                {"cpu": b.cpu, "cpu_features": list(b.cpu_features)} for b in self.extra_builds
            ]
        if self.cuda is not None:
            d["cuda"] = {
                "arch": self.cuda.arch,
                "cuda_version": self.cuda.cuda_version,
                "unified_memory": self.cuda.unified_memory,
            }
            if self.cuda.jetpack is not None:
                d["cuda"]["jetpack"] = self.cuda.jetpack
        return d


# field -> (type, required). bool is checked apart from int because bool subclasses int.
_FIELDS: dict[str, tuple[type, bool]] = {
    "name": (str, True),
    "description": (str, True),
    "arch": (str, True),
    "cpu": (str, True),
    "cpu_features": (list, True),
    "min_glibc": (str, True),
    "python_abi": (str, True),
    "memory_budget_mb": (int, True),
    "default_quant": (str, True),
    "default_threads": (int, True),
    "backends": (list, True),
    "cuda": (dict, False),
    "extra_builds": (list, False),
}
_BUILD_FIELDS: dict[str, tuple[type, bool]] = {"cpu": (str, True), "cpu_features": (list, True)}
_CUDA_FIELDS: dict[str, tuple[type, bool]] = {
    "arch": (str, True),
    "cuda_version": (str, True),
    "unified_memory": (bool, True),
    "jetpack": (str, False),
}
_TOML_TYPE = {
    str: "a string",
    int: "an integer",
    bool: "a boolean",
    list: "an array",
    dict: "a table",
}


def _check_keys(
    raw: dict[str, Any], spec: dict[str, tuple[type, bool]], where: str, prefix: str
) -> None:
    unknown = sorted(set(raw) - set(spec))
    if unknown:
        raise TargetError(
            f"{where}: unknown field(s) {', '.join(prefix + k for k in unknown)} "
            f"(allowed: {', '.join(prefix + k for k in spec)})"
        )
    # All missing fields at once, so a new file is fixed in one pass.
    missing = [f"'{prefix}{k}'" for k, (_, required) in spec.items() if required and k not in raw]
    if missing:
        s = "s" if len(missing) > 1 else ""
        raise TargetError(f"{where}: missing required field{s} {', '.join(missing)}")
    for key, (typ, _) in spec.items():
        if key not in raw:
            continue
        value = raw[key]
        ok = isinstance(value, typ) and (typ is bool or not isinstance(value, bool))
        if not ok:
            raise TargetError(
                f"{where}: field '{prefix}{key}' must be {_TOML_TYPE[typ]}, "
                f"got {type(value).__name__} {value!r}"
            )


def _str_list(raw: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    items = raw[key]
    bad = [x for x in items if not isinstance(x, str)]
    if bad:
        raise TargetError(f"{where}: field '{key}' must be an array of strings, got {bad[0]!r}")
    dupes = sorted({x for x in items if items.count(x) > 1})
    if dupes:
        raise TargetError(f"{where}: field '{key}' lists {', '.join(dupes)} more than once")
    return tuple(items)


def _one_of(value: str, allowed: tuple[str, ...] | list[str], key: str, where: str) -> None:
    if value not in allowed:
        raise TargetError(
            f"{where}: field '{key}' is {value!r}; expected one of {', '.join(allowed)}"
        )


def _parse(raw: dict[str, Any], where: str, stem: str) -> Target:
    """Validate a parsed TOML document; ``where`` names the file in every message."""
    _check_keys(raw, _FIELDS, where, "")

    name = raw["name"]
    if name != stem:
        raise TargetError(
            f"{where}: field 'name' is {name!r} but the file is {stem}.toml; "
            "they must match so a target is found by its name"
        )
    if not _NAME_RE.fullmatch(name):
        raise TargetError(
            f"{where}: field 'name' {name!r} must be letters, digits, '.', '_' or '-'"
        )
    arch = raw["arch"]
    _one_of(arch, ARCHES, "arch", where)
    features = _cpu_and_features(raw, arch, where, "")
    extra = []
    for i, b in enumerate(raw.get("extra_builds", [])):
        prefix = f"extra_builds[{i}]."
        if not isinstance(b, dict):
            raise TargetError(f"{where}: 'extra_builds' must be an array of tables")
        _check_keys(b, _BUILD_FIELDS, where, prefix)
        more = _cpu_and_features(b, arch, where, prefix)
        lacking = [f for f in features if f not in more]
        if lacking:
            raise TargetError(
                f"{where}: field '{prefix}cpu_features' lacks {', '.join(lacking)}: an extra "
                "build is for CPUs with at least the target's features"
            )
        extra.append(KernelBuild(b["cpu"], more))

    if not _GLIBC_RE.fullmatch(raw["min_glibc"]):
        raise TargetError(
            f"{where}: field 'min_glibc' is {raw['min_glibc']!r}; expected MAJOR.MINOR "
            'like "2.31"'
        )
    abi = _ABI_RE.fullmatch(raw["python_abi"])
    if not abi or int(abi.group(1)) < _MIN_PYTHON_MINOR:
        raise TargetError(
            f"{where}: field 'python_abi' is {raw['python_abi']!r}; expected a CPython ABI "
            f'tag for Python 3.{_MIN_PYTHON_MINOR} or later, like "cp311"'
        )
    for key in ("memory_budget_mb", "default_threads"):
        if raw[key] < 1:
            raise TargetError(f"{where}: field '{key}' must be >= 1, got {raw[key]}")
    _one_of(raw["default_quant"], QUANTS, "default_quant", where)

    backends = _str_list(raw, "backends", where)
    if not backends:
        raise TargetError(f"{where}: field 'backends' is empty")
    for b in backends:
        _one_of(b, BACKENDS, "backends", where)
    late = [b for b in backends[1:] if not BACKEND_TABLE[b].host]
    if late:
        raise TargetError(
            f"{where}: backend {late[0]!r} runs on a device and must come first in "
            "'backends' (a graph runs wholly on the device or on the host; the host "
            "backends after it are its fallback)"
        )
    # No rule that "ref" comes last: a target may leave out the slow reference kernels,
    # and `edgepack build --target` then refuses a node no listed backend can run.

    cuda = None
    if "cuda" in raw:
        c = raw["cuda"]
        _check_keys(c, _CUDA_FIELDS, where, "cuda.")
        if not _SM_RE.fullmatch(c["arch"]):
            raise TargetError(
                f"{where}: field 'cuda.arch' is {c['arch']!r}; expected like \"sm_87\""
            )
        for key in ("cuda_version", "jetpack"):
            if key in c and not _VERSION_RE.fullmatch(c[key]):
                raise TargetError(
                    f"{where}: field 'cuda.{key}' is {c[key]!r}; expected a version like \"12.2\""
                )
        cuda = CudaInfo(
            arch=c["arch"],
            cuda_version=c["cuda_version"],
            unified_memory=c["unified_memory"],
            jetpack=c.get("jetpack"),
        )
    # Both directions, so a forgotten table or a stale one is caught.
    if "cuda" in backends and cuda is None:
        raise TargetError(f'{where}: backends include "cuda" but there is no [cuda] table')
    if cuda is not None and "cuda" not in backends:
        raise TargetError(f'{where}: there is a [cuda] table but backends lack "cuda"')

    return Target(
        name=name,
        description=raw["description"],
        arch=arch,
        cpu=raw["cpu"],
        cpu_features=features,
        min_glibc=raw["min_glibc"],
        python_abi=raw["python_abi"],
        memory_budget_mb=raw["memory_budget_mb"],
        default_quant=raw["default_quant"],
        default_threads=raw["default_threads"],
        backends=backends,
        cuda=cuda,
        extra_builds=tuple(extra),
        source=where,
    )


def _cpu_and_features(raw: dict[str, Any], arch: str, where: str, prefix: str) -> tuple[str, ...]:
    """Check a ``cpu`` name and its ``cpu_features``; the features."""
    if not _CPU_RE.fullmatch(raw["cpu"]):
        raise TargetError(
            f"{where}: field '{prefix}cpu' {raw['cpu']!r} is not an LLVM CPU name "
            "(lower case, e.g. x86-64-v3, cortex-a72)"
        )
    raw_f = {"cpu_features": raw["cpu_features"]}
    features = _str_list(raw_f, "cpu_features", where)
    known = CPU_FEATURES[arch]
    for f in features:
        if f not in known:
            raise TargetError(
                f"{where}: field '{prefix}cpu_features' has unknown {arch} feature {f!r} "
                f"(known: {', '.join(known)})"
            )
    return features


def _load_bytes(data: bytes, where: str, stem: str) -> Target:
    try:
        raw = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise TargetError(f"{where}: not UTF-8 text ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise TargetError(f"{where}: not valid TOML: {e}") from None
    return _parse(raw, where, stem)


def _shipped() -> dict[str, Any]:
    # importlib.resources rather than __file__ so shipped targets are found wherever the
    # package lives (site-packages, an editable install, a zip).
    folder = resources.files(__name__)
    return {
        p.name[: -len(".toml")]: p
        for p in folder.iterdir()
        if p.name.endswith(".toml") and p.is_file()
    }


def target_names() -> list[str]:
    """Names of the shipped targets, sorted."""
    return sorted(_shipped())


def load_target(name_or_path: str | os.PathLike[str]) -> Target:
    """Load a shipped target by name (``"rpi5"``) or any target file by path (``*.toml``)."""
    s = os.fspath(name_or_path)
    if s.endswith(".toml"):
        path = Path(s)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise TargetError(f"{s}: cannot read target file ({e.strerror or e})") from None
        return _load_bytes(data, s, path.stem)
    shipped = _shipped()
    if s not in shipped:
        raise TargetError(
            f"unknown target {s!r}; shipped targets: {', '.join(sorted(shipped))} "
            "(or give the path of a .toml file)"
        )
    res = shipped[s]
    return _load_bytes(res.read_bytes(), str(res), s)


def list_targets() -> list[Target]:
    """Every shipped target, sorted by name."""
    return [load_target(n) for n in target_names()]
