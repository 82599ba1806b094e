"""Audit log of trained batches, and the checker that proves each batch was trained exactly once.

Two kinds of append-only records, both written by replica leaders:
- `Attempt(replica, step, parent, position, batch_id)`: before its gradient enters the all-reduce, a
  replica says which batch it trains as `step` on top of lineage `parent`. Written for every attempt,
  committed or not (a retry writes the same batch again).
- `Commit(writer, step, parent, lineage, contributors, positions)`: after its optimizer step, each
  replica that committed says which replicas' batches (and, per its ledger, which positions) the
  update contained and the lineage hash of the new state.

`audit(records, final=...)` follows the chain of commits from the final state's lineage back to the
genesis (commits of abandoned branches, e.g. after a full restart from an older checkpoint, are not on
it), takes each contributor's batch from that contributor's own Attempt record on the same parent
(evidence independent of the ledger), and lists duplicates (a batch id trained at two steps), gaps
(positions of a replica never trained below its last trained one or its final ledger position) and
problems (missing or conflicting records, ledger and attempt disagreeing). Pure.

Restarts into another layout. A job restarted with another replica count (or replica batch) starts
a new era (LoaderState.resharded): the final ledger lists the finished eras, and the chain crosses
each restart through its reshard lineage, which the audit recomputes. Then the checks above run per
era (batch ids and positions belong to an era), and one more over the global order, the order that
does not depend on the replica count: the global offsets of every trained batch must be disjoint
(overlaps are duplicates), each era's origin must be exactly what the era before left untrained, and
the trained offsets plus what the final era has not trained yet must cover the global order up to
its untrained tail without a hole.

I/O: `AuditLog` appends JSON lines to a sink (`append(bytes)`): `FileAuditSink` (one O_APPEND write
per record, so concurrent writers do not interleave) or a list in tests and the emulator.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Union

from ftrun.data.loader_state import GENESIS, DataError, Era, LoaderState, next_lineage, reshard_lineage
from ftrun.data.sampler import Sampler, merge_ranges, remaining


class AuditLogError(DataError):
    """An audit log line that cannot be parsed."""


@dataclass(frozen=True)
class Attempt:
    replica: str
    step: int
    parent: str
    position: int
    batch_id: int


@dataclass(frozen=True)
class Commit:
    writer: str
    step: int
    parent: str
    lineage: str
    contributors: tuple[str, ...]
    positions: tuple[int, ...]  # the writer's ledger positions of the contributors, same order

    def content(self) -> tuple:
        return (self.step, self.parent, self.contributors, self.positions)


Record = Union[Attempt, Commit]


# -- log I/O ---------------------------------------------------------------------------------------
def encode_record(record: Record) -> bytes:
    kind = "attempt" if isinstance(record, Attempt) else "commit"
    return (json.dumps({"kind": kind, **asdict(record)}, separators=(",", ":")) + "\n").encode()


MAX_FIELD = 2**63 - 1  # steps, positions, batch ids: int64
_ATTEMPT = {"replica": str, "step": int, "parent": str, "position": int, "batch_id": int}
_COMMIT = {"writer": str, "step": int, "parent": str, "lineage": str, "contributors": list, "positions": list}


def decode_record(line: bytes | str) -> Record:
    """One JSON-lines record. Raises AuditLogError for anything that is not exactly a record."""
    try:
        raw = json.loads(line)
    except RecursionError:
        raise AuditLogError(f"bad audit record ({len(line)} bytes): nested too deeply") from None
    except (ValueError, TypeError) as e:
        raise AuditLogError(f"bad audit record {_clip(line)}: {e}") from None
    kind = raw.get("kind") if isinstance(raw, dict) else None
    schema = {"attempt": _ATTEMPT, "commit": _COMMIT}.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise AuditLogError(f"unknown audit record kind in {_clip(line)}")
    fields_ = {k: v for k, v in raw.items() if k != "kind"}
    if set(fields_) != set(schema) or not all(_fits(fields_[k], t) for k, t in schema.items()):
        raise AuditLogError(f"bad audit record {_clip(line)}: fields must be exactly {sorted(schema)} "
                            f"with their types")
    if kind == "attempt":
        return Attempt(**fields_)
    contributors, positions = tuple(fields_["contributors"]), tuple(fields_["positions"])
    if not (all(_fits(c, str) for c in contributors) and all(_fits(p, int) for p in positions)
            and len(contributors) == len(positions)):
        raise AuditLogError(f"bad audit record {_clip(line)}: contributors must be strings, positions ints, "
                            f"as many of each")
    return Commit(**{**fields_, "contributors": contributors, "positions": positions})


def _fits(value: object, kind: type) -> bool:
    if kind is int:
        return type(value) is int and 0 <= value <= MAX_FIELD
    return isinstance(value, kind)


def _clip(line: bytes | str) -> str:
    return repr(line[:120]) + ("..." if len(line) > 120 else "")


def read_log(data: bytes, *, name: str = "<audit log>") -> tuple[list[Record], list[str]]:
    """Records of a JSON-lines log, plus problems. A torn last line (a crash mid-append) is a problem, not an error."""
    lines = data.split(b"\n")
    records, problems = [], []
    tail = lines.pop()  # after the last newline: empty unless the final append was torn
    if tail:
        problems.append(f"{name}: ignored a torn last line ({len(tail)} bytes)")
    for number, line in enumerate(lines, 1):
        if line:
            try:
                records.append(decode_record(line))
            except AuditLogError as e:
                raise AuditLogError(f"{name}:{number}: {e}") from e
    return records, problems


class FileAuditSink:
    """Appends to a file with one write(2) per record under O_APPEND; many processes may share it."""

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False) -> None:
        self.path, self._fsync = path, fsync
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, data: bytes) -> None:
        os.write(self._fd, data)
        if self._fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


class AuditLog:
    """Encodes records and hands each to `sink` (e.g. FileAuditSink, or `list.append` in tests)."""

    def __init__(self, sink: Callable[[bytes], None]) -> None:
        self._sink = sink

    def append(self, record: Record) -> None:
        self._sink(encode_record(record))


# -- checker ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trained:
    step: int
    replica: str
    position: int
    batch_id: int
    era: int = 0  # index into the final ledger's eras (its current era last); 0 for a job never resharded


@dataclass(frozen=True)
class AuditReport:
    trained: tuple[Trained, ...]  # along the final lineage, in step order
    duplicates: tuple[tuple[int, tuple[int, ...]], ...]  # (batch_id, steps that trained it)
    gaps: tuple[tuple[str, int], ...]  # (replica, position never trained)
    problems: tuple[str, ...] = field(default=())
    num_steps: int = 0

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.gaps or self.problems)

    def summary(self) -> str:
        head = f"{len(self.trained)} batches over {self.num_steps} committed steps"
        if self.ok:
            return f"exactly once: {head}"
        parts = [f"{len(self.duplicates)} duplicated", f"{len(self.gaps)} skipped", f"{len(self.problems)} problems"]
        details = [f"batch {b} trained at steps {list(s)}" for b, s in self.duplicates[:5]]
        details += [f"{r} position {p} never trained" for r, p in self.gaps[:5]] + list(self.problems[:5])
        return f"NOT exactly once ({head}): {', '.join(parts)}; " + "; ".join(details)


def audit(records: Iterable[Record], *, final: LoaderState | None = None) -> AuditReport:
    """Check that the final lineage trained every batch exactly once (see the module docstring).

    final: the job's final ledger; its lineage is the chain's tip and its positions the expected
    counts. Without it the tip is the highest-step commit (a tie between lineages is a problem).
    """
    commits: dict[str, Commit] = {}
    attempts: dict[tuple[str, int, str], set[tuple[int, int]]] = defaultdict(set)
    problems: list[str] = []
    for rec in records:
        if isinstance(rec, Attempt):
            attempts[(rec.replica, rec.step, rec.parent)].add((rec.position, rec.batch_id))
        else:
            _add_commit(commits, rec, problems)
    tip = final.lineage if final is not None else _pick_tip(commits, problems)
    eras = _eras(final)
    links = _reshard_links(eras, problems)
    chain = _chain(commits, tip, problems, links)
    trained = [t for c in chain for t in _trained_in(c, attempts, problems, _era_of(eras, c.step))]
    if final is None:
        duplicates, gaps = _duplicates_and_gaps(trained, None, problems)
    else:
        duplicates, gaps = (), ()
        for k, era in enumerate(eras):
            d, g = _duplicates_and_gaps([t for t in trained if t.era == k],
                                        dict(zip(era.replica_ids, era.committed_batches)), problems)
            duplicates, gaps = duplicates + d, gaps + g
        if len(eras) > 1:
            duplicates += _global_order(trained, eras, problems)
    return AuditReport(tuple(trained), duplicates, gaps, tuple(problems), len(chain))


def _eras(final: LoaderState | None) -> list[Era]:
    """Every era of the final ledger, its current one last (as an Era ending at the final step)."""
    if final is None:
        return []
    return list(final.eras) + [Era(final.layout, final.replica_ids, final.committed_batches, final.origin,
                                   final.era_start, final.step, final.lineage)]


def _era_of(eras: list[Era], step: int) -> int:
    for k, era in enumerate(eras[:-1]):
        if step < era.end_step:
            return k
    return max(len(eras) - 1, 0)


def _reshard_links(eras: list[Era], problems: list[str]) -> dict[str, str]:
    """Lineage that began era k+1 -> lineage at the end of era k; checks that each era's stream is what
    the one before left untrained."""
    links = {}
    for old, new in zip(eras, eras[1:]):
        if new.origin != remaining(old.layout, old.origin, old.committed_batches):
            problems.append(f"the era from step {new.start_step} does not read what the era before left untrained")
        links[reshard_lineage(old.lineage, old.end_step, new.layout, new.replica_ids, new.origin)] = old.lineage
    return links


def _global_order(trained: list[Trained], eras: list[Era], problems: list[str]) -> tuple:
    """Duplicates (overlapping global offsets) and problems (holes) over the global order across eras."""
    samplers = [Sampler(e.layout, e.origin) for e in eras]
    spans = sorted((a, b, t) for t in trained if t.replica in eras[t.era].replica_ids  # others: a problem already
                   for a, b in samplers[t.era].global_ranges(eras[t.era].replica_ids.index(t.replica), t.position))
    duplicates, end, last = [], 0, None
    for a, b, t in spans:
        if last is not None and a < end:
            duplicates.append((t.batch_id, (last.step, t.step)))
            problems.append(f"global offsets [{a}, {min(b, end)}) trained at steps {last.step} and {t.step}")
        if b > end:
            end, last = b, t
    left = remaining(eras[-1].layout, eras[-1].origin, eras[-1].committed_batches)
    covered = merge_ranges([(a, b) for a, b, _ in spans] + list(left.prefix) + [(left.tail, left.tail + 1)])
    if covered != [(0, left.tail + 1)]:
        holes = [(b, a) for (_, b), (a, _) in zip(covered, covered[1:])]
        if covered and covered[0][0] > 0:
            holes.insert(0, (0, covered[0][0]))
        problems.append(f"global offsets never trained nor left for later: {holes[:5]}")
    return tuple(duplicates)


def _add_commit(commits: dict[str, Commit], rec: Commit, problems: list[str]) -> None:
    pairs = list(zip(rec.contributors, rec.positions))
    if next_lineage(rec.parent, rec.step, pairs) != rec.lineage:
        problems.append(f"step {rec.step}: commit by {rec.writer} has lineage {rec.lineage} that does not "
                        f"hash its content")
        return
    seen = commits.setdefault(rec.lineage, rec)
    if seen.content() != rec.content():
        problems.append(f"lineage {rec.lineage}: {seen.writer} and {rec.writer} recorded different commits")


def _pick_tip(commits: dict[str, Commit], problems: list[str]) -> str:
    if not commits:
        return GENESIS
    top = max(c.step for c in commits.values())
    heads = sorted(c.lineage for c in commits.values() if c.step == top)
    if len(heads) > 1:
        problems.append(f"step {top} has {len(heads)} competing commits ({', '.join(heads)}); pass final=")
    return heads[0]


def _chain(commits: dict[str, Commit], tip: str, problems: list[str],
           links: dict[str, str] | None = None) -> list[Commit]:
    chain, lineage = [], tip
    while lineage != GENESIS:
        if lineage in (links or {}) and lineage not in commits:
            lineage = links[lineage]  # a restart into another layout: no commit, the chain goes on
            continue
        c = commits.get(lineage)
        if c is None:
            problems.append(f"no commit record for lineage {lineage} (the chain breaks after "
                            f"{len(chain)} steps back from the tip)")
            break
        if chain and c.step != chain[-1].step - 1:
            problems.append(f"lineage {lineage} is step {c.step}, its child is step {chain[-1].step}")
            break
        chain.append(c)
        lineage = c.parent
    chain.reverse()
    if chain and chain[0].parent == GENESIS and chain[0].step != 0:
        problems.append(f"the chain starts at step {chain[0].step}, not 0")
    return chain


def _trained_in(c: Commit, attempts: dict, problems: list[str], era: int = 0) -> list[Trained]:
    out = []
    for rid, claimed in zip(c.contributors, c.positions):
        seen = attempts.get((rid, c.step, c.parent), set())
        if not seen:
            problems.append(f"step {c.step}: contributor {rid} has no attempt record on lineage {c.parent}")
            continue
        if len(seen) > 1:
            problems.append(f"step {c.step}: {rid} read different batches on the same lineage: {sorted(seen)}")
        position, batch_id = min(seen)
        if position != claimed:
            problems.append(f"step {c.step}: ledger says {rid} trained position {claimed}, it trained {position}")
        out.append(Trained(c.step, rid, position, batch_id, era))
    return out


def _duplicates_and_gaps(trained: list[Trained], expected: dict[str, int] | None, problems: list[str]):
    steps_of: dict[int, list[int]] = defaultdict(list)
    positions: dict[str, set[int]] = defaultdict(set)
    for t in trained:
        steps_of[t.batch_id].append(t.step)
        positions[t.replica].add(t.position)
    duplicates = tuple((b, tuple(s)) for b, s in sorted(steps_of.items()) if len(s) > 1)
    gaps = []
    for rid in sorted(set(positions) | set(expected or ())):
        have = positions.get(rid, set())
        end = expected[rid] if expected is not None and rid in expected else max(have, default=-1) + 1
        gaps += [(rid, p) for p in range(end) if p not in have]
        beyond = sorted(p for p in have if p >= end)
        if beyond:
            problems.append(f"{rid} trained positions {beyond} beyond its final ledger position {end}")
    if expected is not None:
        unknown = sorted(set(positions) - set(expected))
        if unknown:
            problems.append(f"replicas {unknown} trained but are not in the final ledger")
    return duplicates, tuple(gaps)
