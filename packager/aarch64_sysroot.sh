#!/usr/bin/env bash
# Build (once) a Debian bookworm arm64 sysroot in which edgepack's numba kernels run on
# an x86_64 host under user-mode qemu:
#
#     bash scripts/aarch64_sysroot.sh [SYSROOT]
#     qemu-aarch64-static -L SYSROOT SYSROOT/usr/bin/python3.11 -c 'import numba'
#
# SYSROOT defaults to $EDGEPACK_AARCH64_ROOT, else aarch64-sysroot in edgepack's cache
# ($EDGEPACK_CACHE_DIR, else $XDG_CACHE_HOME/edgepack, else ~/.cache/edgepack).
# Beside it, SYSROOT.cross gets Debian's x86_64 -> aarch64 cross compiler (gcc and g++
# 12, binutils, the arm64 glibc and libstdc++ headers), unpacked the same way: the
# packager cross-compiles the kernels for aarch64 stubs with it (packager/aot_cross.py).
# And SYSROOT.board holds only what an aarch64 stub takes from the board's OS (glibc,
# libgcc_s, libstdc++, libexpat: packager/stub_cross.py): qemu runs stubs on it
# (QEMU_LD_PREFIX), so a library the stub should carry and does not fails here too.
#
# No debootstrap: the arm64 .debs of python3.11 and the shared libraries it and the
# numpy / numba / llvmlite wheels load are fetched with `apt-get download` and unpacked
# with `dpkg -x` (no maintainer scripts run, nothing is installed on the host). The
# aarch64 wheels of numpy, numba and llvmlite, pinned to the host's versions, are
# unpacked into SYSROOT/usr/local/lib/python3.11/dist-packages, which Debian's python
# has on sys.path; so are the pure-Python wheels the kernel check imports (pytest and
# its dependencies, threadpoolctl).
#
# Idempotent: a finished sysroot carries a stamp listing what went into it; a second
# run with the same host versions only re-checks it. Anything else is rebuilt in
# SYSROOT.partial and swapped in. Needs root (or sudo) only to add the arm64 dpkg
# architecture and to install qemu-user-static when they are missing. There is no
# binfmt_misc on the machines this was written for: aarch64 programs must be started
# explicitly through qemu-aarch64-static.
set -euo pipefail

CACHE="${EDGEPACK_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/edgepack}"
ROOT="${1:-${EDGEPACK_AARCH64_ROOT:-$CACHE/aarch64-sysroot}}"
ROOT="$(realpath -m "$ROOT")"
HOST_PY="${PYTHON:-$(command -v python || command -v python3)}"
QEMU="${QEMU:-qemu-aarch64-static}"
DOWNLOADS="${ROOT}.downloads"   # .debs and wheels, kept so that a rebuild is offline
SITE_REL="usr/local/lib/python3.11/dist-packages"

log() { printf '[aarch64-sysroot] %s\n' "$*" >&2; }

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

# The arm64 packages python3.11 needs (its Depends/Pre-Depends closure minus dpkg, perl,
# tar and mime-support, which a sysroot that never runs dpkg does not need), plus
# libgomp1 (numba's OpenMP threading layer) and libstdc++6 (llvmlite).
DEBS=(
  libc6 gcc-12-base libgcc-s1 libstdc++6 libgomp1
  zlib1g libexpat1 libssl3 libffi8 libbz2-1.0 liblzma5 libzstd1 libsqlite3-0 libuuid1
  libncursesw6 libtinfo6 libreadline8 libcrypt1 libdb5.3
  libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3
  libkrb5support0 libcom-err2 libkeyutils1
  libpython3.11-minimal python3.11-minimal libpython3.11-stdlib python3.11
  libpython3.11 libpython3.11-dev
)
# The cross compiler (host packages; the -arm64-cross ones are Architecture: all): pycc
# compiles its C helpers and numba's runtime (C++) and links the kernels' extension.
CROSS_DEBS=(
  binutils-aarch64-linux-gnu cpp-12-aarch64-linux-gnu gcc-12-aarch64-linux-gnu-base
  gcc-12-aarch64-linux-gnu g++-12-aarch64-linux-gnu
  libc6-arm64-cross libc6-dev-arm64-cross linux-libc-dev-arm64-cross
  libgcc-s1-arm64-cross libgcc-12-dev-arm64-cross libatomic1-arm64-cross
  libgomp1-arm64-cross libstdc++6-arm64-cross libstdc++-12-dev-arm64-cross
)
CROSS="${ROOT}.cross"
BOARD="${ROOT}.board"
BOARD_DEBS=(libc6 libgcc-s1 libstdc++6 libexpat1 gcc-12-base)
DEBS_ALL=(readline-common libtirpc-common media-types)  # Architecture: all

# --- host tools ------------------------------------------------------------------------

apt_updated=0
apt_update() {
  if [ "$apt_updated" -eq 0 ]; then
    log "apt-get update"
    $SUDO apt-get update -qq
    apt_updated=1
  fi
}

if ! command -v "$QEMU" >/dev/null 2>&1; then
  log "installing qemu-user-static"
  apt_update
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static >/dev/null
fi

# --- versions to match -----------------------------------------------------------------

# The host's numpy / numba / llvmlite versions (the ones the kernels are tested with)
# and the pure-Python packages the check imports.
mapfile -t PINS < <("$HOST_PY" - <<'EOF'
from importlib.metadata import version
for name in ("numpy", "numba", "llvmlite"):
    print(f"{name}=={version(name)}")
for name in ("pytest", "pluggy", "iniconfig", "packaging", "pygments", "threadpoolctl"):
    try:
        print(f"{name}=={version(name)}")
    except Exception:
        print(name)
EOF
)
STAMP_TEXT="edgepack aarch64 sysroot v2
debs: ${DEBS[*]}
wheels: ${PINS[*]}"
CROSS_STAMP="edgepack aarch64 cross compiler v1
debs: ${CROSS_DEBS[*]}"

run_py() {  # run the sysroot's python under qemu
  "$QEMU" -L "$ROOT" "$ROOT/usr/bin/python3.11" "$@"
}

report() {
  log "sysroot: $ROOT"
  run_py - <<'EOF'
import platform, sys
import llvmlite, numba, numpy
print(f"python {platform.python_version()} on {platform.machine()} under qemu "
      f"(numpy {numpy.__version__}, numba {numba.__version__}, llvmlite {llvmlite.__version__})")
EOF
}

cross() {  # the cross compiler in $CROSS (see the top), unless it is there already
  if [ -f "$CROSS/.edgepack-cross" ] && [ "$(cat "$CROSS/.edgepack-cross")" = "$CROSS_STAMP" ]; then
    return
  fi
  mkdir -p "$DOWNLOADS/cross"
  mapfile -t files < <(apt-get download --print-uris "${CROSS_DEBS[@]}" | awk '{print $2}')
  if [ "${#files[@]}" -ne "${#CROSS_DEBS[@]}" ]; then
    apt_update
    mapfile -t files < <(apt-get download --print-uris "${CROSS_DEBS[@]}" | awk '{print $2}')
  fi
  [ "${#files[@]}" -eq "${#CROSS_DEBS[@]}" ] || { log "apt knows ${#files[@]} of the cross packages"; exit 1; }
  local need=()
  for f in "${files[@]}"; do [ -f "$DOWNLOADS/cross/$f" ] || need+=("${f%%_*}"); done
  if [ "${#need[@]}" -gt 0 ]; then
    log "apt-get download ${#need[@]} cross-compiler packages"
    (cd "$DOWNLOADS/cross" && apt-get download -qq "${need[@]}" 2>&1 | grep -v "unsandboxed" >&2 || true)
  fi
  rm -rf "$CROSS.partial" && mkdir -p "$CROSS.partial"
  for f in "${files[@]}"; do
    [ -f "$DOWNLOADS/cross/$f" ] || { log "missing $DOWNLOADS/cross/$f (download failed?)"; exit 1; }
    dpkg -x "$DOWNLOADS/cross/$f" "$CROSS.partial"
  done
  printf '%s\n' "$CROSS_STAMP" > "$CROSS.partial/.edgepack-cross"
  rm -rf "$CROSS" && mv "$CROSS.partial" "$CROSS"
  log "cross compiler: $CROSS/usr/bin/aarch64-linux-gnu-gcc-12"
}

board() {  # $BOARD from the sysroot's own downloads (they are there once it is)
  local stamp="edgepack aarch64 bare board v1: ${BOARD_DEBS[*]}"
  if [ -f "$BOARD/.edgepack-board" ] && [ "$(cat "$BOARD/.edgepack-board")" = "$stamp" ]; then
    return
  fi
  rm -rf "$BOARD.partial" && mkdir -p "$BOARD.partial"
  for p in "${BOARD_DEBS[@]}"; do
    local f
    f=$(ls "$DOWNLOADS/debs/${p}_"*_arm64.deb 2>/dev/null | head -n 1)
    [ -n "$f" ] || { log "no $p .deb in $DOWNLOADS/debs"; exit 1; }
    dpkg -x "$f" "$BOARD.partial"
  done
  for d in bin lib sbin; do [ -e "$BOARD.partial/$d" ] || ln -s "usr/$d" "$BOARD.partial/$d"; done
  printf '%s\n' "$stamp" > "$BOARD.partial/.edgepack-board"
  rm -rf "$BOARD" && mv "$BOARD.partial" "$BOARD"
  log "bare board root: $BOARD"
}

if [ -f "$ROOT/.edgepack-sysroot" ] && [ "$(cat "$ROOT/.edgepack-sysroot")" = "$STAMP_TEXT" ]; then
  log "up to date (remove $ROOT to rebuild)"
  cross
  board
  report
  exit 0
fi
if [ -e "$ROOT" ] && [ ! -f "$ROOT/.edgepack-sysroot" ] && [ -n "$(ls -A "$ROOT")" ]; then
  log "refusing to replace $ROOT: it exists and was not made by this script"
  exit 1
fi

# --- arm64 .debs -----------------------------------------------------------------------

# the package lists must be read again after the architecture is added, even when an
# update already ran for qemu above (on a fresh machine it had, and no arm64 package
# was known)
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  log "dpkg --add-architecture arm64"
  $SUDO dpkg --add-architecture arm64
  apt_updated=0
fi
if ! apt-cache show libc6:arm64 >/dev/null 2>&1; then
  apt_updated=0
  apt_update
fi

mkdir -p "$DOWNLOADS/debs" "$DOWNLOADS/wheels"
PKGS=("${DEBS_ALL[@]}")
for p in "${DEBS[@]}"; do PKGS+=("$p:arm64"); done
# The candidate versions' file names; only those not in DOWNLOADS yet are fetched.
mapfile -t FILES < <(apt-get download --print-uris "${PKGS[@]}" | awk '{print $2}')
if [ "${#FILES[@]}" -ne "${#PKGS[@]}" ]; then
  log "apt knows ${#FILES[@]} of the ${#PKGS[@]} packages (is the arm64 architecture enabled?)"
  exit 1
fi
need=()
for f in "${FILES[@]}"; do  # name_version_arch.deb -> name:arm64 (or name, for _all)
  if [ ! -f "$DOWNLOADS/debs/$f" ]; then
    case "$f" in *_all.deb) need+=("${f%%_*}") ;; *) need+=("${f%%_*}:arm64") ;; esac
  fi
done
if [ "${#need[@]}" -gt 0 ]; then
  log "apt-get download ${#need[@]} packages"
  # apt drops to the _apt user for downloads; a root-owned folder makes it warn (harmless).
  (cd "$DOWNLOADS/debs" && apt-get download -qq "${need[@]}" 2>&1 | grep -v "unsandboxed" >&2 || true)
fi

PART="$ROOT.partial"
rm -rf "$PART"
mkdir -p "$PART"
log "dpkg -x ${#FILES[@]} packages"
for f in "${FILES[@]}"; do
  [ -f "$DOWNLOADS/debs/$f" ] || { log "missing $DOWNLOADS/debs/$f (download failed?)"; exit 1; }
  dpkg -x "$DOWNLOADS/debs/$f" "$PART"
done
# bookworm is merged-/usr: /lib and /bin are links into /usr. dpkg -x extracts the
# files where each package ships them, so add the links the base-files package makes.
for d in bin lib sbin; do
  if [ ! -e "$PART/$d" ]; then ln -s "usr/$d" "$PART/$d"; fi
done
# (the dynamic loader is /lib/ld-linux-aarch64.so.1, found through the lib link)
[ -e "$PART/lib/ld-linux-aarch64.so.1" ] || { log "no aarch64 dynamic loader in the sysroot"; exit 1; }

# --- aarch64 wheels --------------------------------------------------------------------

log "pip download ${PINS[*]}"
"$HOST_PY" -m pip download -q --dest "$DOWNLOADS/wheels" \
  --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 \
  --platform manylinux_2_28_aarch64 --only-binary=:all: --python-version 3.11 \
  --implementation cp --no-deps "${PINS[@]}"

log "unpacking wheels into /$SITE_REL"
mkdir -p "$PART/$SITE_REL"
"$HOST_PY" - "$DOWNLOADS/wheels" "$PART/$SITE_REL" "${PINS[@]}" <<'EOF'
"""Unpack one wheel per pin (a wheel is a zip) the way pip would lay out its files."""
import re
import sys
from pathlib import Path

from edgepack.packager.stub_cross import unpack_wheel

wheels, site, pins = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
for pin in pins:
    name, _, ver = pin.partition("==")
    norm = re.sub(r"[-_.]+", "_", name).lower()
    found = sorted(
        w for w in wheels.glob("*.whl")
        if w.name.split("-")[0].lower().replace(".", "_") == norm
        and (not ver or w.name.split("-")[1] == ver)
        and ("aarch64" in w.name or w.name.endswith("-none-any.whl"))
    )
    if not found:
        sys.exit(f"no aarch64/pure wheel for {pin} in {wheels}")
    whl = found[-1]
    unpack_wheel(whl, site)  # as the ARM stubs' wheels are
    print(f"  {whl.name}")
EOF

printf '%s\n' "$STAMP_TEXT" > "$PART/.edgepack-sysroot"
if [ -e "$ROOT" ]; then rm -rf "$ROOT"; fi
mv "$PART" "$ROOT"
cross
board
report
