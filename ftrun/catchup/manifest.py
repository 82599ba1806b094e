"""The snapshot's layout and manifest: pure, no I/O.

A published state is one flat byte buffer. Every tensor (sorted by name, so every replica builds the same
layout from the same state) starts at a multiple of ALIGN; the padding between tensors is zero. Shards
are contiguous byte ranges that cover the buffer exactly: small tensors are packed together up to
max_shard_bytes, a tensor larger than that is split into near-equal byte ranges of its own. The
manifest (JSON) lists tensors (name, dtype, shape, offset, nbytes), shards (offset, nbytes, the tensors
they hold, CRC32) and small JSON metadata. The client decodes it with `decode_manifest`, which treats
it as untrusted input: anything malformed raises CatchupPeerError. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ftrun.catchup.config import ALIGN
from ftrun.catchup.errors import CatchupPeerError

FORMAT = "ftrun-catchup/1"
CHECKSUM = "crc32"  # zlib.crc32 of each shard's bytes

_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32", "int16",
    "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
)
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) is not dtype:
        raise ValueError(f"dtype {dtype} cannot be carried in a catch-up snapshot")
    return name


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # in the flat buffer
    nbytes: int


@dataclass(frozen=True)
class ShardSpec:
    index: int
    offset: int
    nbytes: int
    names: tuple[str, ...]  # tensors with bytes in this shard


@dataclass(frozen=True)
class Layout:
    tensors: tuple[TensorSpec, ...]
    shards: tuple[ShardSpec, ...]
    total_bytes: int

    @property
    def key(self) -> tuple:
        """What decides whether a buffer laid out for one state can hold another."""
        return tuple((t.name, t.dtype, t.shape) for t in self.tensors), self.total_bytes

    def gaps(self) -> list[tuple[int, int]]:
        """(start, end) of the padding bytes between tensors."""
        out, pos = [], 0
        for t in self.tensors:
            if t.nbytes and t.offset > pos:
                out.append((pos, t.offset))
            pos = max(pos, t.offset + t.nbytes)
        if pos < self.total_bytes:
            out.append((pos, self.total_bytes))
        return out


def layout_for(entries: Sequence[tuple[str, str, tuple[int, ...]]], max_shard_bytes: int) -> Layout:
    """Lay out (name, dtype name, shape) entries in a flat buffer and cut it into shards."""
    tensors, offset = [], 0
    for name, dtype, shape in sorted(entries):
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        offset = align_up(offset) if nbytes else offset
        tensors.append(TensorSpec(name, dtype, tuple(shape), offset, nbytes))
        offset += nbytes
    return Layout(tuple(tensors), _cut_shards(tensors, offset, max_shard_bytes), offset)


def _cut_shards(tensors: list[TensorSpec], total: int, max_bytes: int) -> tuple[ShardSpec, ...]:
    shards: list[ShardSpec] = []
    start, names = 0, []

    def close(end: int, holding: list[str]) -> None:
        nonlocal start
        shards.append(ShardSpec(len(shards), start, end - start, tuple(holding)))
        start = end

    for t in tensors:
        if not t.nbytes:
            continue
        end = t.offset + t.nbytes
        if t.nbytes > max_bytes:
            if names:
                close(t.offset, names)
                names = []
            piece = align_up(ceil_div(t.nbytes, ceil_div(t.nbytes, max_bytes)))  # <= max_bytes
            for cut in range(t.offset + piece, end, piece):
                close(cut, [t.name])
            close(end, [t.name])
            continue
        if names and end - start > max_bytes:
            close(t.offset, names)
            names = []
        names.append(t.name)
    if start < total:
        close(total, names)
    return tuple(shards)


@dataclass(frozen=True)
class Manifest:
    step: int
    layout: Layout
    crcs: tuple[int, ...]  # one per shard
    metadata: dict[str, Any] = field(default_factory=dict)
    checksum: str = CHECKSUM


def encode_manifest(m: Manifest) -> bytes:
    doc = {
        "format": FORMAT, "step": m.step, "checksum": m.checksum, "total_bytes": m.layout.total_bytes,
        "metadata": m.metadata,
        "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset,
                     "nbytes": t.nbytes} for t in m.layout.tensors],
        "shards": [{"index": s.index, "offset": s.offset, "nbytes": s.nbytes, "tensors": list(s.names),
                    "crc32": crc} for s, crc in zip(m.layout.shards, m.crcs)],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_manifest(body: bytes | bytearray | memoryview, *, step: int) -> Manifest:
    """Parse and validate a manifest from a source. Raises CatchupPeerError for anything malformed."""
    try:
        doc = json.loads(bytes(body))
        return _validated(doc, step)
    except CatchupPeerError:
        raise
    except RecursionError:
        raise CatchupPeerError("malformed manifest: nested too deeply") from None
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError) as e:
        raise CatchupPeerError(f"malformed manifest: {type(e).__name__}: {str(e)[:200]}") from None


def _int(v: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    if type(v) is not int or v < lo or (hi is not None and v > hi):
        raise CatchupPeerError(f"manifest field {what[:64]} = {str(v)[:64]} is not an int in [{lo}, {hi}]")
    return v


def _validated(doc: dict, step: int) -> Manifest:
    if doc.get("format") != FORMAT or doc.get("checksum") != CHECKSUM:
        raise CatchupPeerError(f"unsupported manifest format {doc.get('format')!r}/{doc.get('checksum')!r}")
    if _int(doc["step"], "step") != step:
        raise CatchupPeerError(f"asked for the manifest of step {step}, got step {doc['step']}")
    total = _int(doc["total_bytes"], "total_bytes")
    if not isinstance(doc["metadata"], dict):
        raise CatchupPeerError("manifest metadata is not a JSON object")
    tensors = tuple(_tensor(t, total) for t in doc["tensors"])
    if len({t.name for t in tensors}) != len(tensors):
        raise CatchupPeerError("manifest names a tensor twice")
    shards, crcs, pos = [], [], 0
    for i, s in enumerate(doc["shards"]):
        if _int(s["index"], "index") != i or _int(s["offset"], "offset") != pos:
            raise CatchupPeerError(f"manifest shard {i} is out of order or not contiguous")
        nbytes = _int(s["nbytes"], "nbytes", 1, total - pos)
        shards.append(ShardSpec(i, pos, nbytes, tuple(str(n) for n in s["tensors"])))
        crcs.append(_int(s["crc32"], "crc32", 0, 0xFFFFFFFF))
        pos += nbytes
    if pos != total:
        raise CatchupPeerError(f"manifest shards cover {pos} of {total} bytes")
    return Manifest(step, Layout(tensors, tuple(shards), total), tuple(crcs), doc["metadata"])


def _tensor(t: dict, total: int) -> TensorSpec:
    name, dtype = t["name"], t["dtype"]
    if not isinstance(name, str) or not name or dtype not in DTYPES:
        raise CatchupPeerError(f"manifest tensor {name!r} has a bad name or dtype {dtype!r}")
    shape = tuple(_int(d, f"{name}.shape") for d in t["shape"])
    itemsize = DTYPES[dtype].itemsize
    offset, nbytes = _int(t["offset"], f"{name}.offset"), _int(t["nbytes"], f"{name}.nbytes")
    if nbytes != math.prod(shape) * itemsize or offset % itemsize or offset + nbytes > total:
        raise CatchupPeerError(f"manifest tensor {name!r} does not fit the buffer (offset {offset}, {nbytes} bytes)")
    return TensorSpec(name, dtype, shape, offset, nbytes)
