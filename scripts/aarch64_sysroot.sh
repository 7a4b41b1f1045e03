#!/usr/bin/env bash
# The arm64 sysroot, aarch64 cross compiler and bare board root for ARM stubs: the
# script itself ships inside the package (packager/aarch64_sysroot.sh), so that
# `edgepack stub` / `edgepack build --target rpi5` run it from a wheel install too.
exec bash "$(dirname "${BASH_SOURCE[0]}")/../packager/aarch64_sysroot.sh" "$@"
