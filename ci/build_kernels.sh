#!/usr/bin/env bash
# Compiles csrc/ with nvcc when nvcc is present (CI has nvcc but no GPU); a no-op otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then
  echo "build_kernels: nvcc not found, skipping CUDA build"
  exit 0
fi
if [ -f csrc/build.sh ]; then bash csrc/build.sh; else echo "build_kernels: no csrc/build.sh yet"; fi
