#!/usr/bin/env bash
# Compiles csrc/ with nvcc when nvcc is present (CI has nvcc but no GPU), and the kernels' per-thread
# bodies for the CPU with a host compiler (tests/unit/test_csrc_host_kernels.py runs those on every CI run).
set -euo pipefail
cd "$(dirname "$0")/.."
cxx="$(command -v g++ || command -v c++ || true)"
if [ -n "$cxx" ]; then
  mkdir -p csrc/build
  "$cxx" -O2 -std=c++17 -Wall -Wextra -Werror -fPIC -shared -o csrc/build/libftar_host.so csrc/host/ftar_host.cpp
  echo "build_kernels: built csrc/build/libftar_host.so (host build of the kernel bodies)"
else
  echo "build_kernels: no host C++ compiler, skipping the host build of the kernel bodies"
fi
if ! command -v nvcc >/dev/null 2>&1; then
  echo "build_kernels: nvcc not found, skipping CUDA build"
  exit 0
fi
bash csrc/build.sh
