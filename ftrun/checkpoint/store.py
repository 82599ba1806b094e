"""Persistent checkpoints with torch.distributed.checkpoint (DCP): save, find the latest complete, restore, prune.

Layout: `root/step-{n:08d}/` holds DCP's files (`__0_0.distcp`, `.metadata`), the loader_state snapshot
(`loader_state.bin`, the ledger after n committed steps) and, written last and atomically through the
Storage seam, `manifest.json` with every file's size and CRC32. A folder without a manifest, or whose
files do not match it, is not a checkpoint: `latest_complete` skips it with a warning naming the file
and falls back to the previous complete one.

Trust: with `key` (the trainer passes `checkpoint_key(job token)`), `save` signs the manifest (HMAC over
every file's SHA-256, see manifest.py) and readers accept only a checkpoint whose MAC and files verify,
checked before DCP reads (unpickles) anything. Without a key a checkpoint folder is trusted like code.
Forks: `save` refuses (CheckpointFork) to replace a complete checkpoint of another lineage at the same
step, or to write below a complete checkpoint at a higher step.

DCP use: `dcp.save(state_dict, storage_writer=FileSystemWriter(dir), no_dist=True)` and `dcp.load(...,
storage_reader=FileSystemReader(dir), no_dist=True)` in one process (no process group), on the
canonical state dicts of `torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`
(FQN-keyed optimizer state, loaded back with `set_state_dict`). `FileSystemWriter(sync_files=True)`
fsyncs the data files before the manifest is written.

Threading: one writer per root at a time (the quorum's chosen replica); readers may run concurrently.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ftrun.checkpoint import manifest as mf
from ftrun.checkpoint.policy import parse_step_dir, prune_plan, step_dir
from ftrun.data import loader_state as ls
from ftrun.storage import FileStorage

log = logging.getLogger("ftrun.checkpoint")

LOADER_STATE_FILE = "loader_state.bin"


class CheckpointError(Exception):
    """Base of the checkpoint package's errors."""


class NoCheckpoint(CheckpointError):
    """No complete checkpoint under the root."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint that passed its manifest check but could not be loaded."""


class CheckpointFork(CheckpointError):
    """A write that would replace a complete checkpoint of another lineage (a stale or forked writer)."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    manifest: mf.Manifest


@dataclass(frozen=True)
class CheckpointStatus:
    step: int
    path: Path
    problems: tuple[str, ...]  # () = complete and verified

    @property
    def complete(self) -> bool:
        return not self.problems


@contextlib.contextmanager
def _single_process():
    """DCP warns on every single-process call that it assumes one process; that is what we ask for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save(root: str | os.PathLike, *, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         loader_state: ls.LoaderState, keep: int = 3, key: bytes | None = None) -> CheckpointInfo:
    """Write the checkpoint of the state after `step` committed steps, commit its manifest, prune to `keep`.

    key: sign the manifest (see the module docstring). Raises ValueError if `loader_state` is not at
    `step`, CheckpointFork if a complete checkpoint of another lineage is at `step` or any complete one
    above it. A crash anywhere before the manifest is written leaves a folder that readers ignore (and
    a later prune removes).
    """
    if loader_state.step != step:
        raise ValueError(f"loader_state is at step {loader_state.step}, the checkpoint is of step {step}")
    root, name = Path(root), step_dir(step)
    storage, path = FileStorage(root), root / name
    _refuse_fork(root, step, loader_state.lineage, key)
    _discard(path)  # a torn write of this step, or a complete one of the same lineage: never current
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _single_process():
        dcp.save({"model": model_sd, "optim": optim_sd},
                 storage_writer=dcp.FileSystemWriter(path, sync_files=True), no_dist=True)
    storage.write_atomic(f"{name}/{LOADER_STATE_FILE}", ls.encode(loader_state))
    files = tuple(
        mf.FileEntry(p.name, p.stat().st_size, *mf.file_digests(p))
        for p in sorted(path.iterdir()) if p.is_file() and p.name != mf.MANIFEST and ".tmp" not in p.name
    )
    manifest = mf.Manifest(step, files, LOADER_STATE_FILE, loader_state.lineage)
    if key is not None:
        manifest = mf.sign(manifest, key)
    storage.write_atomic(f"{name}/{mf.MANIFEST}", mf.encode(manifest))  # last: now it is current
    log.info("checkpoint of step %d written to %s (%d files)", step, path, len(files))
    prune(root, keep=keep)
    return CheckpointInfo(step, path, manifest)


def _refuse_fork(root: Path, step: int, lineage: str, key: bytes | None) -> None:
    """Raise CheckpointFork if a complete checkpoint at `step` has another lineage or one above `step` exists.
    Only folders at or above `step` are verified: in a healthy job there are none."""
    for other, path in _step_dirs(root):
        if other < step:
            return
        manifest, problems = verify(path, key=key)
        if manifest is None or problems or (other == step and manifest.lineage == lineage):
            continue  # torn, corrupt or untrusted (replaceable), or this very state
        what = f"lineage {manifest.lineage}" if other == step else f"a newer step ({other})"
        raise CheckpointFork(f"refusing to write the checkpoint of step {step} (lineage {lineage}): {path} holds "
                             f"a complete checkpoint of {what}; this writer is stale or forked")


def _discard(path: Path) -> None:
    try:
        (path / mf.MANIFEST).unlink()  # first, so the folder stops being a checkpoint at once
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def verify(path: str | os.PathLike, *, key: bytes | None = None) -> tuple[mf.Manifest | None, list[str]]:
    """(manifest, problems) of one checkpoint folder; problems name the file and what is wrong with it.
    key: also require the manifest's MAC under it, and every file's SHA-256 (checked before any file is read)."""
    path = Path(path)
    try:
        data = (path / mf.MANIFEST).read_bytes()
    except FileNotFoundError:
        return None, [f"{mf.MANIFEST}: missing (the write did not finish)"]
    except OSError as e:
        return None, [f"{mf.MANIFEST}: cannot be read: {e.strerror or e}"]
    try:
        manifest = mf.decode(data)
    except mf.ManifestError as e:
        return None, [f"{mf.MANIFEST}: {e}"]
    if parse_step_dir(path.name) not in (None, manifest.step):
        return manifest, [f"{mf.MANIFEST}: says step {manifest.step}, the folder is {path.name}"]
    if key is not None and (untrusted := mf.check_mac(manifest, key)) is not None:
        return manifest, [f"{mf.MANIFEST}: {untrusted}"]

    signed = key is not None

    def size_of(name: str) -> int | None:
        try:
            st = (path / name).lstat()
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None  # a folder, link or device is not a file

    try:
        return manifest, mf.check_files(manifest, size_of, lambda name: mf.file_digests(path / name, sha256=signed),
                                        sha256=signed)
    except OSError as e:  # e.g. replaced by a folder between the size and the CRC check
        return manifest, [f"{e.filename}: cannot be read: {e.strerror or e}"]


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(parse_step_dir(p.name), p) for p in root.iterdir() if p.is_dir()]
    return sorted(((s, p) for s, p in found if s is not None), reverse=True)


def scan(root: str | os.PathLike, *, key: bytes | None = None) -> list[CheckpointStatus]:
    """Every checkpoint folder under `root`, newest first, fully verified (reads every file)."""
    return [CheckpointStatus(s, p, tuple(verify(p, key=key)[1])) for s, p in _step_dirs(Path(root))]


def latest_complete(root: str | os.PathLike, *, key: bytes | None = None) -> CheckpointInfo | None:
    """The newest checkpoint whose files match its manifest (signed under `key`, if given); skipped ones
    are logged with the reason."""
    for step, path in _step_dirs(Path(root)):
        manifest, problems = verify(path, key=key)
        if manifest is not None and not problems:
            return CheckpointInfo(step, path, manifest)
        log.warning("checkpoint %s skipped, falling back to an older one: %s", path, "; ".join(problems))
    return None


def restore(root: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
            key: bytes | None = None) -> tuple[int, ls.LoaderState]:
    """Load the latest complete checkpoint into `model` and `optimizer` (in place).

    key: accept only checkpoints signed under it, verified before DCP unpickles anything.
    Returns (step, loader_state): the number of committed steps it holds and the ledger at that step.
    Raises NoCheckpoint if there is none, CheckpointCorrupt if DCP or the loader_state fails to load.
    """
    info = latest_complete(root, key=key)
    if info is None:
        raise NoCheckpoint(f"no complete checkpoint under {root}")
    key = f"{info.path.name}/{info.manifest.loader_state}"
    try:
        state = ls.decode(FileStorage(Path(root)).read(key) or b"", key=key)
    except ls.LoaderStateCorrupt as e:
        raise CheckpointCorrupt(str(e)) from e
    if state.step != info.step:
        raise CheckpointCorrupt(f"{key} is at step {state.step}, the checkpoint is of step {info.step}")
    reader = dcp.FileSystemReader(info.path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    try:
        _add_saved_group_keys(optim_sd, reader)
        with _single_process():
            dcp.load(sd, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointCorrupt(f"{info.path}: DCP load failed: {str(e)[:500]}") from e
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    log.info("restored step %d from %s", info.step, info.path)
    return info.step, state


def _add_saved_group_keys(optim_sd: dict, reader: dcp.FileSystemReader) -> None:
    """DCP loads only the keys the template has: add param-group keys the checkpoint holds beyond a fresh
    optimizer's (e.g. the LR helper's base LR, a scheduler's initial_lr) so they are restored too."""
    paths = getattr(reader.read_metadata(), "planner_data", None) or {}
    groups = optim_sd.get("param_groups", [])
    for path in paths.values():
        if len(path) == 4 and path[:2] == ("optim", "param_groups"):
            index, name = int(path[2]), path[3]
            if index < len(groups):
                groups[index].setdefault(name, None)


def prune(root: str | os.PathLike, *, keep: int) -> list[Path]:
    """Delete checkpoints beyond the newest `keep` complete ones (by manifest presence) and stale torn ones."""
    dirs = _step_dirs(Path(root))
    complete = [s for s, p in dirs if (p / mf.MANIFEST).exists()]
    incomplete = [s for s, p in dirs if not (p / mf.MANIFEST).exists()]
    removed = []
    by_step = dict(dirs)
    for step in prune_plan(complete, incomplete, keep):
        _discard(by_step[step])
        removed.append(by_step[step])
    return removed
