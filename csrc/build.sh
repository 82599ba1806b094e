#!/usr/bin/env bash
# Builds the FTAR CUDA kernels into <out_dir>/libftar_kernels.so (default: csrc/build).
# Usage: [FTAR_NVCC_FLAGS=-DFTAR_UNROLL_LOADS=8] bash csrc/build.sh [out_dir]
# Needs nvcc (PATH, $NVCC, or /usr/local/cuda/bin); no GPU and no torch. cudart is linked statically,
# so the library loads on machines without a CUDA toolkit (it needs the driver only to run kernels).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out_dir="${1:-$here/build}"
nvcc="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
if [ ! -x "$nvcc" ]; then
  echo "csrc/build.sh: nvcc not found (set NVCC or put it on PATH)" >&2
  exit 2
fi
mkdir -p "$out_dir"
tmp="$out_dir/libftar_kernels.so.tmp.$$"
trap 'rm -f "$tmp"' EXIT
# sm_90 (H100/H200) and sm_80 (A100) machine code.
"$nvcc" -O3 -std=c++17 -Xcompiler -fPIC -shared ${FTAR_NVCC_FLAGS:-} \
  -gencode arch=compute_90,code=sm_90 \
  -gencode arch=compute_80,code=sm_80 \
  -o "$tmp" "$here/ftar_kernels.cu"
mv -f "$tmp" "$out_dir/libftar_kernels.so"  # atomic: a concurrent loader never sees half a file
echo "csrc/build.sh: built $out_dir/libftar_kernels.so"
