"""csrc/ compiles with nvcc (when present) and its launchers reject bad arguments with readable
errors. No GPU needed: argument checks run before anything touches CUDA."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ftrun.ftar import cuda_kernels
from ftrun.ftar.kernels import DType, KernelError

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> cuda_kernels.FtarLibrary:
    """The in-tree library if it is newer than every source, else a fresh build in a temp dir."""
    built = cuda_kernels.default_library_path()
    sources = [p for p in CSRC.iterdir() if p.suffix in {".cu", ".h", ".cuh", ".sh"}]
    if built.exists() and all(built.stat().st_mtime >= p.stat().st_mtime for p in sources):
        return cuda_kernels.load_library(built)
    out = tmp_path_factory.mktemp("ftar_build")
    proc = subprocess.run(["bash", str(CSRC / "build.sh"), str(out)], capture_output=True, text=True,
                          timeout=240, env=os.environ | {"NVCC": NVCC})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cuda_kernels.load_library(out / "libftar_kernels.so")


def test_library_exports_the_abi(library):
    assert library.error_string(0) == "ok"
    assert "dtype" in library.error_string(1)
    assert "unknown" in library.error_string(999)
    assert library.error_string(1000 + 2)  # a CUDA error: CUDA's own text, no GPU needed


@pytest.mark.parametrize("call, code", [
    (lambda lib: lib.reduce(16, 32, 4, 99, None, 2, 512, 0), 1),  # unknown dtype
    (lambda lib: lib.reduce_copy(16, 32, 48, 4, 3, None, 2, 512, 0), 1),  # bytes cannot be reduced
    (lambda lib: lib.copy(16, 32, 4, 7, None, 2, 512, 0), 1),
    (lambda lib: lib.reduce(16, 32, 4, int(DType.FLOAT32), None, 0, 512, 0), 3),  # no blocks
    (lambda lib: lib.copy(16, 32, 4, int(DType.FLOAT16), None, 2, 2048, 0), 3),  # too many threads
    (lambda lib: lib.reduce(16, 32, -1, int(DType.FLOAT32), None, 2, 512, 0), 2),  # negative count
    (lambda lib: lib.reduce(0, 32, 4, int(DType.BFLOAT16), None, 2, 512, 0), 2),  # NULL dst
    (lambda lib: lib.reduce_copy(16, 32, 0, 4, int(DType.FLOAT32), None, 2, 512, 0), 2),  # NULL out
    (lambda lib: lib.reduce(18, 32, 4, int(DType.FLOAT32), None, 2, 512, 0), 2),  # misaligned float32
    (lambda lib: lib.wait_flag(0, 1, 10, 64, 0), 2),
    (lambda lib: lib.wait_flag(64, 1, -1, 64, 0), 2),
])
def test_launchers_reject_bad_arguments_with_a_message(library, call, code):
    with pytest.raises(KernelError) as info:
        call(library)
    assert info.value.code == code
    assert library.error_string(code) in str(info.value)


def test_empty_ranges_launch_nothing(library):
    library.reduce(0, 0, 0, int(DType.FLOAT32), None, 2, 512, 0)
    library.copy(0, 0, 0, 3, None, 2, 512, 0)
