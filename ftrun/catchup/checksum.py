"""The catch-up checksum: CRC32 (zlib's polynomial and values), computed with ISA-L when it is installed.

    crc = crc32(buf)            # any contiguous buffer: bytes, memoryview, numpy array, mmap slice
    crc = crc32(more, crc)      # continue a running checksum

`isal.isal_zlib.crc32` gives exactly zlib.crc32's values (the manifest format "crc32" is unchanged, so
sources and joiners on either implementation agree) at several times its speed, and releases the GIL
for large buffers, so a source checksumming its snapshot does not hold up its training loop. Without
isal the module falls back to zlib.crc32 (`IMPLEMENTATION` says which one is in use).
"""

from __future__ import annotations

import zlib
from typing import Any

try:
    from isal import isal_zlib as _impl

    IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover - isal is a pinned dependency; zlib keeps a bare install working
    _impl = zlib
    IMPLEMENTATION = "zlib"

_crc32 = _impl.crc32


def crc32(buf: Any, value: int = 0) -> int:
    """CRC32 of `buf` (any object with the buffer protocol), continuing from `value`."""
    if isinstance(buf, memoryview) and (buf.format != "B" or buf.ndim != 1):
        buf = buf.cast("B") if buf.c_contiguous else buf.tobytes()
    return _crc32(buf, value)
