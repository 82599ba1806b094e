"""The checkpoint manifest: what a complete checkpoint contains, committed last. Pure apart from `file_digests`.

A checkpoint folder is current only once its `manifest.json` exists, and that file is written
atomically after every other file is durable. The manifest lists each file with its size, CRC32 and
SHA-256, and names the loader_state snapshot file, so a reader can tell a complete checkpoint from a
torn, truncated or bit-rotten one without trusting anything but the manifest.

Verified, not trusted: DCP's `.metadata` (and non-tensor values in its data files) are pickles, so a
crafted checkpoint folder would run code on restore. A manifest written with the job key carries
`mac`, an HMAC-SHA256 (key: `checkpoint_key(job token)`) over its canonical encoding, which covers every
file's SHA-256. A reader holding the key checks the MAC, then each file's size and SHA-256, before
anything else reads a byte of the folder. `decode` treats the bytes as untrusted: anything malformed
raises ManifestError.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import zlib
from dataclasses import dataclass, replace
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
    sha256: str = ""  # hex; "" in manifests written before it was added


@dataclass(frozen=True)
class Manifest:
    step: int
    files: tuple[FileEntry, ...]
    loader_state: str  # name of the loader_state snapshot, one of `files`
    lineage: str = ""  # the loader_state's lineage hash (for humans and for cross-checks)
    mac: str = ""  # hex HMAC-SHA256 of encode(self without mac) under the job's checkpoint key; "" = unsigned

    def entry(self, name: str) -> FileEntry | None:
        return next((f for f in self.files if f.name == name), None)


def encode(manifest: Manifest) -> bytes:
    doc = {
        "format": FORMAT,
        "step": manifest.step,
        "lineage": manifest.lineage,
        "loader_state": manifest.loader_state,
        "files": [{"name": f.name, "size": f.size, "crc32": f.crc32, **({"sha256": f.sha256} if f.sha256 else {})}
                  for f in manifest.files],
    }
    if manifest.mac:
        doc["mac"] = manifest.mac
    return json.dumps(doc, indent=1).encode()


def checkpoint_key(token: str | bytes) -> bytes:
    """The key checkpoint manifests are signed with, derived from the job token (never the token itself)."""
    secret = token.encode() if isinstance(token, str) else bytes(token)
    if not secret:
        raise ValueError("the checkpoint key needs a non-empty job token")
    return hmac.new(secret, b"ftrun checkpoint manifest v1", hashlib.sha256).digest()


def _mac(manifest: Manifest, key: bytes) -> str:
    return hmac.new(key, encode(replace(manifest, mac="")), hashlib.sha256).hexdigest()


def sign(manifest: Manifest, key: bytes) -> Manifest:
    """`manifest` with its MAC. Raises ValueError if a file has no SHA-256 (the MAC would not cover it)."""
    if any(not f.sha256 for f in manifest.files):
        raise ValueError("sign a manifest whose every file has its SHA-256")
    return replace(manifest, mac=_mac(manifest, key))


def check_mac(manifest: Manifest, key: bytes) -> str | None:
    """None if `manifest` is signed under `key` and every file has its SHA-256; else the problem."""
    if not manifest.mac:
        return "unsigned (written without the job key): not trusted, DCP would unpickle it"
    if not hmac.compare_digest(manifest.mac, _mac(manifest, key)):
        return "its MAC does not verify under the job key (written by another job, or altered)"
    if any(not f.sha256 for f in manifest.files):
        return "a file has no SHA-256"
    return None


MAX_NAME_BYTES = 255  # a file name in a checkpoint folder: one path component (NAME_MAX on Linux)
MAX_INT = 2**63 - 1  # steps, sizes: what an int64 holds


def decode(data: bytes) -> Manifest:
    """Parse and check manifest bytes. Raises ManifestError for anything malformed (never another error)."""
    try:
        raw = json.loads(data)
    except RecursionError:
        raise ManifestError("malformed manifest: nested too deeply") from None
    except (ValueError, TypeError) as e:  # UnicodeDecodeError is a ValueError
        raise ManifestError(f"malformed manifest: {e!r}") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"malformed manifest: a JSON {type(raw).__name__}, not an object")
    if raw.get("format") != FORMAT:
        raise ManifestError(f"format {str(raw.get('format'))[:64]!r}, expected {FORMAT!r}")
    files = raw.get("files")
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        raise ManifestError("malformed manifest: 'files' must be a list of objects")
    m = Manifest(_int(raw, "step"), tuple(_file(f) for f in files), _name(raw.get("loader_state"), "loader_state"),
                 _str(raw.get("lineage", ""), "lineage"), _hex(raw.get("mac", ""), "mac"))
    if m.entry(m.loader_state) is None:
        raise ManifestError(f"loader_state file {m.loader_state!r} is not among the listed files")
    if len({f.name for f in m.files}) != len(m.files):
        raise ManifestError("a file is listed twice")
    return m


def _int(raw: dict, key: str, hi: int = MAX_INT) -> int:
    value = raw.get(key)
    if type(value) is not int or not 0 <= value <= hi:
        raise ManifestError(f"malformed manifest: {key} = {str(value)[:64]} is not an int in [0, {hi}]")
    return value


def _str(value: object, what: str, max_len: int = 256) -> str:
    if not isinstance(value, str) or len(value) > max_len:
        raise ManifestError(f"malformed manifest: {what} is not a string of at most {max_len} characters")
    return value


def _name(value: object, what: str) -> str:
    """A plain file name inside the checkpoint folder."""
    name = _str(value, what)
    if (not name or name in (".", "..", MANIFEST) or "/" in name or "\0" in name
            or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES):
        raise ManifestError(f"file name {name[:64]!r} is not a plain name inside the checkpoint folder "
                            f"(1-{MAX_NAME_BYTES} bytes, no '/', NUL, '.', '..' or {MANIFEST})")
    return name


def _hex(value: object, what: str) -> str:
    text = _str(value, what, 64)
    if text and (len(text) != 64 or text.strip("0123456789abcdef")):
        raise ManifestError(f"malformed manifest: {what} is not 64 lowercase hex digits")
    return text


def _file(raw: dict) -> FileEntry:
    return FileEntry(_name(raw.get("name"), "file name"), _int(raw, "size"), _int(raw, "crc32", 0xFFFFFFFF),
                     _hex(raw.get("sha256", ""), "sha256"))


def file_digests(path: Path, *, chunk: int = 1 << 22, sha256: bool = True) -> tuple[int, str]:
    """(CRC32, hex SHA-256 or "") of a file's bytes, in one pass."""
    crc, sha = 0, hashlib.sha256() if sha256 else None
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
            if sha is not None:
                sha.update(block)
    return crc, sha.hexdigest() if sha is not None else ""


def crc32_file(path: Path, *, chunk: int = 1 << 22) -> int:
    return file_digests(path, chunk=chunk, sha256=False)[0]


def check_files(manifest: Manifest, size_of: Callable[[str], int | None],
                digests_of: Callable[[str], tuple[int, str]], *, sha256: bool = False) -> list[str]:
    """Problems with the files against the manifest ([] = complete). `size_of` returns None for a missing
    file; `digests_of` gives (CRC32, SHA-256 hex). sha256: also compare SHA-256 (a signed manifest)."""
    problems = []
    for f in manifest.files:
        size = size_of(f.name)
        if size is None:
            problems.append(f"{f.name}: missing (or not a regular file)")
        elif size != f.size:
            problems.append(f"{f.name}: truncated or resized ({size} bytes, manifest says {f.size})")
        else:
            crc, sha = digests_of(f.name)
            if crc != f.crc32:
                problems.append(f"{f.name}: CRC32 {crc:#010x} does not match the manifest's {f.crc32:#010x}")
            elif sha256 and not hmac.compare_digest(sha, f.sha256):
                problems.append(f"{f.name}: SHA-256 does not match the signed manifest")
    return problems


# -- the writer replica's vote ---------------------------------------------------------------------
def encode_report(rank: int, files: list[FileEntry] | None = None, error: str | None = None) -> bytes:
    """One rank's part of a sharded checkpoint, sent to the leader: the files it wrote, or its error."""
    doc = {"rank": rank, "error": error} if error is not None else \
        {"rank": rank, "files": [[f.name, f.size, f.crc32, f.sha256] for f in files or []]}
    return json.dumps(doc).encode()


@dataclass(frozen=True)
class ShardVote:
    files: tuple[FileEntry, ...]  # every rank's files, by name; () unless committed
    reason: str  # one line: why the manifest may or may not be committed

    @property
    def commit(self) -> bool:
        return bool(self.files)


def shard_vote(reports: list[bytes], on_disk: set[str], world_size: int) -> ShardVote:
    """Whether the leader may commit the manifest over the ranks' reports (rank order): only if every one
    of `world_size` ranks reported its files, no name is claimed twice, and every file in the folder
    (`on_disk`, less the manifest and temporaries) is claimed by some rank."""
    files, errors = [], []
    for i, raw in enumerate(reports):
        try:
            doc = json.loads(raw)
            if "error" in doc:
                errors.append(str(doc["error"])[:300])
                continue
            if doc["rank"] != i:
                raise ValueError(f"it says rank {doc['rank']}")
            files += [_file({"name": n, "size": size, "crc32": crc, "sha256": sha})
                      for n, size, crc, sha in doc["files"]]
        except (ValueError, TypeError, KeyError, RecursionError) as e:  # ManifestError is a ValueError
            errors.append(f"rank {i}: unreadable report: {str(e)[:100]}")
    names = [f.name for f in files]
    if errors:
        return ShardVote((), "a rank failed its write: " + "; ".join(errors))
    if len(reports) != world_size:
        return ShardVote((), f"{len(reports)} of {world_size} ranks reported")
    if len(set(names)) != len(names):
        return ShardVote((), f"a file is claimed twice: {sorted(n for n in set(names) if names.count(n) > 1)[:3]}")
    if not files:
        return ShardVote((), "no rank wrote a file")
    if missing := sorted(on_disk - set(names)):
        return ShardVote((), f"files in the folder that no rank reported: {missing[:3]}")
    return ShardVote(tuple(sorted(files, key=lambda f: f.name)), f"all {world_size} ranks wrote {len(files)} files")
