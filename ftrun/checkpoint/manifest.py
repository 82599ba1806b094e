"""The checkpoint manifest: what a complete checkpoint contains, committed last. Pure apart from `crc32_file`.

A checkpoint folder is current only once its `manifest.json` exists, and that file is written
atomically after every other file is durable. The manifest lists each file with its size and CRC32,
and names the loader_state snapshot file, so a reader can tell a complete checkpoint from a torn,
truncated or bit-rotten one without trusting anything but the manifest.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

FORMAT = "ftrun.checkpoint/1"
MANIFEST = "manifest.json"


class ManifestError(ValueError):
    """Manifest bytes that do not parse as a manifest."""


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    crc32: int


@dataclass(frozen=True)
class Manifest:
    step: int
    files: tuple[FileEntry, ...]
    loader_state: str  # name of the loader_state snapshot, one of `files`
    lineage: str = ""  # the loader_state's lineage hash (for humans and for cross-checks)

    def entry(self, name: str) -> FileEntry | None:
        return next((f for f in self.files if f.name == name), None)


def encode(manifest: Manifest) -> bytes:
    return json.dumps({
        "format": FORMAT,
        "step": manifest.step,
        "lineage": manifest.lineage,
        "loader_state": manifest.loader_state,
        "files": [{"name": f.name, "size": f.size, "crc32": f.crc32} for f in manifest.files],
    }, indent=1).encode()


def decode(data: bytes) -> Manifest:
    try:
        raw = json.loads(data)
        if raw.get("format") != FORMAT:
            raise ManifestError(f"format {raw.get('format')!r}, expected {FORMAT!r}")
        files = tuple(FileEntry(str(f["name"]), int(f["size"]), int(f["crc32"])) for f in raw["files"])
        m = Manifest(int(raw["step"]), files, str(raw["loader_state"]), str(raw.get("lineage", "")))
    except ManifestError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ManifestError(f"malformed manifest: {e!r}") from e
    if m.entry(m.loader_state) is None:
        raise ManifestError(f"loader_state file {m.loader_state!r} is not among the listed files")
    if any("/" in f.name or f.name in ("", ".", "..", MANIFEST) for f in m.files):
        raise ManifestError("file names must be plain names inside the checkpoint folder")
    return m


def crc32_file(path: Path, *, chunk: int = 1 << 22) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def check_files(manifest: Manifest, size_of: Callable[[str], int | None],
                crc_of: Callable[[str], int]) -> list[str]:
    """Problems with the files against the manifest ([] = complete). `size_of` returns None for a missing file."""
    problems = []
    for f in manifest.files:
        size = size_of(f.name)
        if size is None:
            problems.append(f"{f.name}: missing")
        elif size != f.size:
            problems.append(f"{f.name}: truncated or resized ({size} bytes, manifest says {f.size})")
        else:
            crc = crc_of(f.name)
            if crc != f.crc32:
                problems.append(f"{f.name}: CRC32 {crc:#010x} does not match the manifest's {f.crc32:#010x}")
    return problems
