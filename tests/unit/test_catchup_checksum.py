"""The catch-up CRC32 gives zlib.crc32's values for every buffer shape the snapshot and client hand it."""

from __future__ import annotations

import mmap
import random
import zlib

import numpy as np
import pytest
import torch

from ftrun.catchup.checksum import IMPLEMENTATION, crc32


@pytest.mark.parametrize("n", [0, 1, 7, 64, 4095, 65536 + 3, 1 << 20])
def test_crc32_matches_zlib(n):
    data = random.Random(n).randbytes(n)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(memoryview(data)[n // 3:], 12345) == zlib.crc32(data[n // 3:], 12345)
    half = n // 2
    assert crc32(data[half:], crc32(data[:half])) == zlib.crc32(data)  # running checksum


def test_crc32_of_numpy_torch_and_mmap_buffers():
    t = torch.arange(1000, dtype=torch.float32)
    raw = t.numpy().tobytes()
    assert crc32(t.numpy()) == zlib.crc32(raw)
    assert crc32(memoryview(t.numpy())) == zlib.crc32(raw)  # a typed (format "f") view
    assert crc32(memoryview(t.view(torch.uint8).numpy())[8:40]) == zlib.crc32(raw[8:40])
    m = mmap.mmap(-1, 4096)
    m[:5] = b"hello"
    assert crc32(memoryview(m)[:5]) == zlib.crc32(b"hello")
    m.close()
    assert crc32(np.zeros((3, 4), np.int16)) == zlib.crc32(bytes(24))


def test_isal_is_in_use():
    assert IMPLEMENTATION == "isal"  # a pinned dependency: falling back to zlib would be a silent slowdown
