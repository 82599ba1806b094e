"""Persistent checkpoints with torch.distributed.checkpoint (DCP): save, find the latest complete, restore, prune.

Layout: `root/step-{n:08d}/` holds DCP's files (`__{rank}_{n}.distcp` per rank, `.metadata`), the loader_state snapshot
(`loader_state.bin`, the ledger after n committed steps) and, written last and atomically through the
Storage seam, `manifest.json` with every file's size, CRC32 and SHA-256. A folder without a manifest, or whose
files do not match it, is not a checkpoint: `latest_complete` skips it with a warning naming the file
and falls back to the previous complete one.

Trust: with `key` (the trainer passes `checkpoint_key(job token)`), `save` signs the manifest (HMAC over
every file's SHA-256, see manifest.py) and readers accept only a checkpoint whose MAC and files verify,
checked before DCP reads (unpickles) anything. Without a key a checkpoint folder is trusted like code.
Forks: `save` refuses (CheckpointFork) to replace a complete checkpoint of another lineage at the same
step, or to write below a complete checkpoint at a higher step.

DCP use: `dcp.save(state_dict, storage_writer=FileSystemWriter(dir))` and `dcp.load(...,
storage_reader=FileSystemReader(dir))` on the canonical state dicts of
`torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)` (FQN-keyed optimizer state,
DTensor shards under FSDP2, loaded back with `set_state_dict`) plus the user's registered state as
"user.<name>" entries. `FileSystemWriter(sync_files=True)` fsyncs the data files before the manifest.

Sharded replicas. `save` and `restore` are collective over the writer's (or restoring) replica, given
its ReplicaComm (the control path of check-in and the commit vote); a one-rank replica runs DCP without
a process group (`no_dist`). Every rank writes its own shards (`__{rank}_{n}.distcp`) through DCP over
the replica's default process group (its FSDP group, ftrun.train.shard), rank 0 also `.metadata` and
the loader_state; each rank hashes its own files and sends the entries to the leader (`gather_bytes`,
JSON, the vote); the leader commits the one manifest over all of them only if every rank wrote, then
broadcasts the outcome, so every rank raises or none does. A rank that dies mid-write leaves no
manifest: the previous checkpoint stays the latest complete one. `restore` loads into the restoring
replica's own sharding, whatever the writer's number of ranks was (DCP reshards). The leader picks
and fully verifies it; every other rank checks the manifest, `.metadata` and the ledger before DCP
unpickles anything and each data file before DCP reads from it, so it hashes only the files its
shards come from.

Asynchronous saves: `stage` does the part that must happen at the step boundary (the leader's checks
and discard, agreed over the replica's control comm, and a host-memory copy of the state) and `write`
the rest (DCP, the vote, the manifest, pruning) on whatever channel it is given, e.g. in a background
task over a group of its own (ftrun.train.checkpointer). `save` is the two in one, without the copy.

Threading: one writer per root at a time (the quorum's chosen replica); readers may run concurrently.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import stat
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from ftrun.checkpoint import manifest as mf
from ftrun.checkpoint.policy import parse_step_dir, prune_plan, step_dir
from ftrun.data import loader_state as ls
from ftrun.replica.comm import LocalComm, ReplicaComm
from ftrun.storage import FileStorage

log = logging.getLogger("ftrun.checkpoint")

LOADER_STATE_FILE = "loader_state.bin"
USER_PREFIX = "user."  # a registered user state `name` is the checkpoint entry "user.<name>"


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
         loader_state: ls.LoaderState, keep: int = 3, key: bytes | None = None,
         extra: Mapping[str, Stateful] | None = None, comm: ReplicaComm | None = None) -> CheckpointInfo | None:
    """Write the checkpoint of the state after `step` committed steps, commit its manifest, prune to `keep`.

    Collective over the writer replica: every rank of `comm` (default: a one-rank replica) calls it with
    the same arguments and writes its own shards (see "Sharded replicas" in the module docstring).
    extra: user state saved as "user.<name>" entries. key: sign the manifest (module docstring).
    Raises ValueError if `loader_state` is not at `step`, CheckpointFork if a complete checkpoint of
    another lineage is at `step` or any complete one above it, CheckpointError if any rank's write
    failed; every rank raises alike. Returns the checkpoint on the leader, None on the other ranks.
    A crash anywhere before the manifest is written leaves a folder that readers ignore (and a later
    prune removes).
    """
    comm = comm or LocalComm()
    _prepare_write(root, step, loader_state, key, comm)
    return write(Staged(Path(root), step, loader_state, keep, key, _state_dict(model, optimizer, extra)), comm=comm)


@dataclass(frozen=True)
class Staged:
    """What `write` writes: where, the ledger, and the state dict (a host-memory copy when `stage` made it)."""

    root: Path
    step: int
    loader_state: ls.LoaderState
    keep: int
    key: bytes | None
    state_dict: dict[str, Any]


def stage(root: str | os.PathLike, *, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          loader_state: ls.LoaderState, keep: int = 3, key: bytes | None = None,
          extra: Mapping[str, Stateful] | None = None, comm: ReplicaComm | None = None) -> Staged:
    """The part of an asynchronous save that blocks the step, collective over `comm` like `save` (same
    arguments and errors): the leader's checks and the discard of the step's folder, agreed by every rank,
    then a copy of the state in host memory (DCP's BlockingAsyncStager; the user's registered state
    through its state_dict, deep-copied), which the optimizer can no longer change. Then
    `write(staged, comm=...)`, e.g. in a background task, writes and commits it."""
    comm = comm or LocalComm()
    _prepare_write(root, step, loader_state, key, comm)
    live = _state_dict(model, optimizer, {n: copy.deepcopy(obj.state_dict()) for n, obj in (extra or {}).items()})
    staged = BlockingAsyncStager(cache_staged_state_dict=False).stage(live)
    return Staged(Path(root), step, loader_state, keep, key, staged)


def _prepare_write(root: str | os.PathLike, step: int, loader_state: ls.LoaderState, key: bytes | None,
                   comm: ReplicaComm) -> None:
    """The leader's fork check and discard of the step's folder, agreed by every rank of `comm`."""
    if loader_state.step != step:
        raise ValueError(f"loader_state is at step {loader_state.step}, the checkpoint is of step {step}")
    root = Path(root)
    _agree(comm, lambda: _prepare(root, root / step_dir(step), step, loader_state.lineage, key)
           if comm.rank == 0 else None)


def write(target: Staged, *, comm: ReplicaComm | None = None, process_group: Any = None) -> CheckpointInfo | None:
    """Write `target`'s state dict into its checkpoint folder (prepared by `save` or `stage`), commit the
    manifest once every rank wrote, prune. Collective over `comm` and, for DCP's own collectives,
    `process_group` (None: the default group); a background write passes a group of its own, so that
    it never interleaves with the step's collectives. Raises CheckpointError if any rank's write
    failed; every rank raises alike."""
    comm = comm or LocalComm()
    root, step, loader_state, key, leader = target.root, target.step, target.loader_state, target.key, comm.rank == 0
    name = step_dir(step)
    path = root / name
    try:
        with _single_process():
            dcp.save(target.state_dict, storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                     process_group=process_group, no_dist=comm.world_size == 1)
        if leader:
            FileStorage(root).write_atomic(f"{name}/{LOADER_STATE_FILE}", ls.encode(loader_state))
        report = mf.encode_report(comm.rank, files=_own_files(path, comm.rank))
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        report = mf.encode_report(comm.rank, error=f"rank {comm.rank}: {type(e).__name__}: {str(e)[:300]}")
    reports = comm.gather_bytes(report)  # the vote: every rank's shards are written
    manifest = None

    def commit() -> None:
        nonlocal manifest
        manifest = _commit(root, path, step, loader_state.lineage, key, reports or [], comm.world_size)
        log.info("checkpoint of step %d written to %s (%d files, %d ranks)", step, path, len(manifest.files),
                 comm.world_size)
        try:
            prune(root, keep=target.keep)
        except OSError as e:  # the checkpoint is committed; old ones stay until the next prune
            log.warning("pruning %s after the checkpoint of step %d failed: %s", root, step, e)

    _agree(comm, commit if leader else lambda: None)
    return CheckpointInfo(step, path, manifest) if manifest is not None else None


def _agree(comm: ReplicaComm, act: Callable[[], None]) -> None:
    """Run `act` (a no-op except on the leader), then share its outcome: every rank raises the leader's
    error (as CheckpointError on the others) or none does. Keeps the ranks' collectives in step."""
    error: BaseException | None = None
    try:
        act()
    except (Exception, CheckpointException) as e:
        error = e
    verdict = comm.broadcast_bytes(
        (f"{type(error).__name__}: {error}" if error is not None else "").encode() if comm.rank == 0 else None)
    if error is not None:
        if isinstance(error, CheckpointException):
            raise CheckpointError(str(error)[:500]) from error
        raise error
    if verdict:
        raise CheckpointError(f"the replica's leader: {verdict.decode(errors='replace')}")


def _prepare(root: Path, path: Path, step: int, lineage: str, key: bytes | None) -> None:
    _refuse_fork(root, step, lineage, key)
    _discard(path)  # a torn write of this step, or a complete one of the same lineage: never current


def _own_files(path: Path, rank: int) -> list[mf.FileEntry]:
    """The files rank `rank` wrote into the folder, with their digests: its DCP data files (DCP names
    them `__{rank}_{n}.distcp`) and, on rank 0, DCP's `.metadata` and the loader_state snapshot."""
    mine = sorted(path.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine += [path / ".metadata", path / LOADER_STATE_FILE]
    return [mf.FileEntry(p.name, p.stat().st_size, *mf.file_digests(p)) for p in mine]


def _commit(root: Path, path: Path, step: int, lineage: str, key: bytes | None, reports: list[bytes],
            world_size: int) -> mf.Manifest:
    """The leader, once every rank reported: the manifest over every rank's files, written last."""
    on_disk = {p.name for p in path.iterdir() if p.is_file() and p.name != mf.MANIFEST and ".tmp" not in p.name}
    vote = mf.shard_vote(reports, on_disk, world_size)
    if not vote.commit:
        raise CheckpointError(f"checkpoint of step {step} not committed: {vote.reason}")
    manifest = mf.Manifest(step, vote.files, LOADER_STATE_FILE, lineage)
    if key is not None:
        manifest = mf.sign(manifest, key)
    FileStorage(root).write_atomic(f"{path.name}/{mf.MANIFEST}", mf.encode(manifest))  # last: now it is current
    return manifest


def _state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                extra: Mapping[str, Stateful] | None) -> dict[str, Any]:
    """What a checkpoint holds: the canonical (FQN-keyed; DTensor shards under FSDP2) model and
    optimizer state dicts, and each user state as "user.<name>" (DCP calls its state_dict/load_state_dict)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, **{f"{USER_PREFIX}{n}": obj for n, obj in (extra or {}).items()}}


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


def verify(path: str | os.PathLike, *, key: bytes | None = None,
           only: set[str] | None = None) -> tuple[mf.Manifest | None, list[str]]:
    """(manifest, problems) of one checkpoint folder; problems name the file and what is wrong with it.
    key: also require the manifest's MAC under it, and every file's SHA-256 (checked before any file is read).
    only: check just these of the manifest's files (the rest: `check_files_of`, before they are read)."""
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
    return manifest, check_files_of(path, manifest, manifest.files if only is None else only, signed=key is not None)


def check_files_of(path: Path, manifest: mf.Manifest, names: Iterable[str] | Iterable[mf.FileEntry], *,
                   signed: bool) -> list[str]:
    """Problems of some of a checkpoint's files against its (already trusted) manifest; a name the
    manifest does not list is one. signed: compare SHA-256 too."""
    wanted = {n.name if isinstance(n, mf.FileEntry) else n for n in names}
    problems = [f"{n}: not listed in the manifest" for n in sorted(wanted - {f.name for f in manifest.files})]

    def size_of(name: str) -> int | None:
        try:
            st = (path / name).lstat()
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None  # a folder, link or device is not a file

    subset = replace(manifest, files=tuple(f for f in manifest.files if f.name in wanted))
    try:
        return problems + mf.check_files(subset, size_of, lambda name: mf.file_digests(path / name, sha256=signed),
                                         sha256=signed)
    except OSError as e:  # e.g. replaced by a folder between the size and the CRC check
        return problems + [f"{e.filename}: cannot be read: {e.strerror or e}"]


class _CheckingReader(dcp.FileSystemReader):
    """DCP's reader that checks each data file against the trusted manifest before reading from it:
    a rank of a sharded replica verifies the files its own shards come from, not the whole checkpoint."""

    def __init__(self, path: Path, manifest: mf.Manifest, *, signed: bool, checked: set[str]) -> None:
        super().__init__(path)
        self._manifest, self._signed, self._checked = manifest, signed, set(checked)

    def read_data(self, plan, planner):
        names = {self.storage_data[item.storage_index].relative_path for item in plan.items} - self._checked
        if problems := check_files_of(Path(self.path), self._manifest, names, signed=self._signed):
            raise CheckpointCorrupt(f"{self.path}: " + "; ".join(problems))
        self._checked |= names
        return super().read_data(plan, planner)


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
            key: bytes | None = None, extra: Mapping[str, Stateful] | None = None,
            comm: ReplicaComm | None = None) -> tuple[int, ls.LoaderState]:
    """Load the latest complete checkpoint into `model`, `optimizer` and `extra` (in place).

    Collective over a replica: every rank of `comm` (default: a one-rank replica) calls it. The leader
    picks the checkpoint (verifying every file); each other rank checks the manifest's MAC under `key`
    and the SHA-256 of `.metadata` and the ledger before DCP unpickles anything, and of each data file
    before DCP reads from it (only the files its own shards come from), and loads the shards its
    parameters need, whatever the saving replica's number of ranks was (DCP reshards).
    Returns (step, loader_state): the number of committed steps it holds and the ledger at that step.
    Raises NoCheckpoint if there is none, CheckpointCorrupt if a rank cannot verify or load it; every
    rank raises alike.
    """
    comm = comm or LocalComm()
    info = latest_complete(root, key=key) if comm.rank == 0 else None
    chosen = comm.broadcast_bytes((info.path.name if info is not None else "").encode() if comm.rank == 0 else None)
    if not chosen:
        raise NoCheckpoint(f"no complete checkpoint under {root}")
    path = Path(root) / chosen.decode()
    problem = ""
    if info is None:  # not the leader: verify it here too, this process is about to unpickle its files
        manifest, problems = verify(path, key=key, only={".metadata", LOADER_STATE_FILE})
        info = CheckpointInfo(manifest.step, path, manifest) if manifest is not None and not problems else None
        problem = "; ".join(problems)
    if max(comm.all_reduce_int([int(info is None)], "max")) or info is None:
        raise CheckpointCorrupt(f"{path}: a rank of the replica could not verify it: {problem or 'see its log'}")
    checked = {f.name for f in info.manifest.files} if comm.rank == 0 else {".metadata", LOADER_STATE_FILE}
    return info.step, _load(Path(root), info, model, optimizer, extra, comm,
                            _CheckingReader(info.path, info.manifest, signed=key is not None, checked=checked))


def _load(root: Path, info: CheckpointInfo, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          extra: Mapping[str, Stateful] | None, comm: ReplicaComm, reader: dcp.FileSystemReader) -> ls.LoaderState:
    key = f"{info.path.name}/{info.manifest.loader_state}"
    try:
        state = ls.decode(FileStorage(root).read(key) or b"", key=key)
    except ls.LoaderStateCorrupt as e:
        raise CheckpointCorrupt(str(e)) from e
    if state.step != info.step:
        raise CheckpointCorrupt(f"{key} is at step {state.step}, the checkpoint is of step {info.step}")
    sd = _state_dict(model, optimizer, extra)
    try:
        _add_saved_group_keys(sd["optim"], reader)
        with _single_process():
            dcp.load(sd, storage_reader=reader, no_dist=comm.world_size == 1)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointCorrupt(f"{info.path}: DCP load failed: {str(e)[:500]}") from e
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    log.info("restored step %d from %s (rank %d of %d)", info.step, info.path, comm.rank, comm.world_size)
    return state


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
