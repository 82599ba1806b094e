"""Exactly-once data under failures: a pure job driver, hypothesis-chosen failure sequences, and the audit.

The driver runs the step protocol of `ftrun.data.progress` for a few replicas with the real ledger,
loader_state store, audit records and checkpoint writer choice; only the model is a stand-in: the tuple
of batch ids the replica's weights have trained (the ground truth the audit must reconstruct). Replicas
die at any phase of a step, restart from the latest complete checkpoint and heal from a healthy peer
(taking its ledger, or the loader_state file when it is of the same step and lineage), attempts abort
for everyone or commit on some replicas only (a death or a 'no' vote after the all-reduce completed),
and the newest checkpoint may be corrupt. After every sequence the audit of the records must show
each batch trained exactly once on the final lineage, and list exactly the batches the model trained.
Each replica incarnation opens the loader_state store when it starts, as a process does; a writer the
store refuses as stale or forked (LoaderStateFork) stops, as a real replica does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings, strategies as st

from ftrun.quorum.decide import Participant as P  # a participant: (replica_id, step)
from ftrun.storage import MemoryStorage
from ftrun.checkpoint.policy import CheckpointConfig, checkpoint_writer, should_checkpoint
from ftrun.data.audit import (
    Attempt, AuditLog, Commit, FileAuditSink, audit, decode_record, encode_record, read_log,
)
from ftrun.data.loader_state import (
    GENESIS, LoaderState, LoaderStateFork, LoaderStateStore, contributors, next_lineage,
)
from ftrun.data.progress import DataProgress
from ftrun.data.sampler import DataLayout, Sampler

PHASES = ("before_quorum", "heal", "checkpoint", "before_attempt", "after_attempt", "all_gather",
          "after_commit", "after_audit", "after_loader_state")



@dataclass(frozen=True)
class RoundPlan:
    kills: tuple[tuple[int, str], ...] = ()  # (replica index, phase at which it dies)
    restarts: frozenset[int] = frozenset()  # dead replicas restarted before the quorum
    transient_abort: bool = False  # an error every participant sees: nobody commits
    vote_no: frozenset[int] = frozenset()  # replicas that fail after the all-reduce completed
    heal_from_file: bool = False
    corrupt_newest_checkpoint: bool = False


@dataclass
class Rep:
    rid: str
    index: int
    alive: bool = True
    progress: DataProgress | None = None
    model: tuple[int, ...] = ()
    local: int = 0  # naive policy only: batches it committed itself (its own file: survives restarts)
    store: LoaderStateStore | None = None  # opened when this incarnation started


@dataclass
class Job:
    num_replicas: int
    every_steps: int
    naive: bool = False  # the buggy policy: position = batches a replica committed itself
    records: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layout = DataLayout(dataset_size=23, num_replicas=self.num_replicas, ranks_per_replica=2,
                                 batch_size_per_rank=1, seed=5)
        self.sampler = Sampler(self.layout)
        self.ids = tuple(f"r{i}" for i in range(self.num_replicas))
        self.storage = MemoryStorage()
        self.store = LoaderStateStore(storage=self.storage)  # the job-level reader (heal_from_file)
        self.refused = 0  # loader_state writes refused as forks
        self.config = CheckpointConfig(every_steps=self.every_steps, keep=2)
        self.checkpoints: dict[int, tuple[LoaderState, tuple[int, ...]]] = {}
        self.corrupt: set[int] = set()
        self.log = AuditLog(lambda b: self.records.append(decode_record(b)))
        self.reps = [Rep(rid, i) for i, rid in enumerate(self.ids)]
        for rep in self.reps:
            self._restart(rep)

    # -- lifecycle ---------------------------------------------------------------------------------
    def _restart(self, rep: Rep) -> None:
        good = [s for s in self.checkpoints if s not in self.corrupt]
        state, model = self.checkpoints[max(good)] if good else (LoaderState.initial(self.layout, self.ids), ())
        rep.alive, rep.progress, rep.model = True, DataProgress(replica_id=rep.rid, state=state), model
        rep.store = LoaderStateStore(storage=self.storage)

    @staticmethod
    def _kill(rep: Rep) -> None:
        rep.alive, rep.progress, rep.model = False, None, ()

    def _checkpoint(self, rep: Rep) -> None:
        state = rep.progress.state
        self.checkpoints[state.step] = (state, rep.model)
        self.corrupt.discard(state.step)
        for old in sorted(self.checkpoints)[:-self.config.keep]:
            del self.checkpoints[old]

    # -- one quorum round --------------------------------------------------------------------------
    def run_round(self, plan: RoundPlan) -> None:
        if plan.corrupt_newest_checkpoint and self.checkpoints:
            self.corrupt.add(max(self.checkpoints))
        for i in plan.restarts:
            if not self.reps[i].alive:
                self._restart(self.reps[i])
        kills = dict(plan.kills)

        def dies(rep: Rep, phase: str) -> bool:
            if rep.alive and kills.get(rep.index) == phase:
                self._kill(rep)
                return True
            return not rep.alive

        members = [r for r in self.reps if not dies(r, "before_quorum")]
        if not members:
            return
        quorum = [P(r.rid, r.progress.state.step) for r in members]
        step = max(p.step for p in quorum)
        healthy = [r for r in members if r.progress.state.step == step]
        assert len({(r.progress.state.lineage, r.model) for r in healthy}) == 1, "healthy replicas diverged"
        broken = self._heal(members, healthy[0], step, plan, dies)
        broken |= self._maybe_checkpoint(quorum, step, dies)
        attempts, broken = self._attempts(members, quorum, step, dies, broken)
        committers = []
        if not (broken or plan.transient_abort):
            committers = [r for r in members if not dies(r, "all_gather") and r.index not in plan.vote_no]
        trained = tuple(attempts[rid].batch_id for rid in contributors(quorum, step)) if committers else ()
        self._commit(members, committers, trained, checkpoint_writer(quorum), dies)

    def _heal(self, members, source: Rep, step: int, plan: RoundPlan, dies) -> bool:
        broken = False
        for rep in members:
            if rep.progress.state.step == step:
                continue
            if dies(rep, "heal"):
                broken = True  # a participant is gone: the all-reduce cannot complete
                continue
            ledger = source.progress.state
            stored = self.store.load() if plan.heal_from_file else None
            if stored is not None and stored.step == step and stored.lineage == ledger.lineage:
                assert stored == ledger
                ledger = stored  # same step, same lineage: the file is as good as the peer's ledger
            rep.progress.heal(ledger)
            rep.model = source.model
        return broken

    def _maybe_checkpoint(self, quorum, step: int, dies) -> bool:
        writer = self.reps[self.ids.index(checkpoint_writer(quorum))]
        have = self.checkpoints.get(step)
        if not should_checkpoint(step, self.config) or not writer.alive or (
                have is not None and step not in self.corrupt and have[0] == writer.progress.state):
            return False
        if dies(writer, "checkpoint"):
            self.checkpoints.pop(step, None)  # the rewrite discarded the old folder, the new one is torn
            return True
        self._checkpoint(writer)
        return False

    def _attempts(self, members, quorum, step: int, dies, broken: bool):
        attempts = {}
        for rep in members:
            if dies(rep, "before_attempt"):
                broken = True
                continue
            attempt = rep.progress.start(step=step, participants=quorum)
            if attempt is not None:
                if self.naive:
                    attempt = replace(attempt, position=rep.local,
                                      batch_id=self.sampler.batch_id(rep.index, rep.local))
                self.log.append(attempt)
                attempts[rep.rid] = attempt
            if dies(rep, "after_attempt"):
                broken = True
        return attempts, broken

    def _commit(self, members, committers, trained, ls_writer: str, dies) -> None:
        for rep in committers:
            rep.model = rep.model + trained
            was_contributor = rep.progress.trains
            commit = rep.progress.commit(writer=rep.rid)
            if dies(rep, "after_commit"):
                continue
            rep.local += was_contributor
            self.log.append(commit)
            if dies(rep, "after_audit"):
                continue
            if rep.rid == ls_writer:
                try:
                    rep.store.save(rep.progress.state)
                except LoaderStateFork:  # it trained on a branch the job had left: it stops
                    self.refused += 1
                    self._kill(rep)
                    continue
            dies(rep, "after_loader_state")
        for rep in members:
            if rep.alive and rep not in committers:
                rep.progress.abort()

    def final(self) -> Rep:
        alive = [r for r in self.reps if r.alive]
        if not alive:
            self._restart(self.reps[0])
            alive = [self.reps[0]]
        return max(alive, key=lambda r: r.progress.state.step)


def check_exactly_once(job: Job) -> None:
    tip = job.final()
    report = audit(job.records, final=tip.progress.state)
    assert report.ok, report.summary()
    assert tuple(t.batch_id for t in report.trained) == tip.model  # the audit reconstructs the model's data
    assert report.num_steps == tip.progress.state.step


def plans(num_replicas: int):
    idx = st.integers(0, num_replicas - 1)
    rare = st.sampled_from([False] * 7 + [True])
    return st.builds(
        RoundPlan,
        kills=st.just(()) | st.lists(st.tuples(idx, st.sampled_from(PHASES)), max_size=2).map(tuple),
        restarts=st.frozensets(idx),
        transient_abort=rare,
        vote_no=st.frozensets(idx, max_size=1) | st.just(frozenset()),
        heal_from_file=st.booleans(),
        corrupt_newest_checkpoint=rare,
    )


@st.composite
def jobs(draw):
    num_replicas = draw(st.integers(1, 4))
    return num_replicas, draw(st.integers(1, 4)), draw(st.lists(plans(num_replicas), min_size=10, max_size=60))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(jobs())
def test_every_batch_is_trained_exactly_once_under_random_failures(case):
    num_replicas, every_steps, rounds = case
    job = Job(num_replicas, every_steps)
    for plan in rounds:
        job.run_round(plan)
    check_exactly_once(job)


def test_a_failure_free_run_trains_every_replica_every_step():
    job = Job(3, 2)
    for _ in range(10):
        job.run_round(RoundPlan())
    check_exactly_once(job)
    assert job.final().progress.state.committed_batches == (10, 10, 10)


def test_partial_commit_counts_the_failed_replicas_batch():
    """r1 dies after the all-reduce while r0 commits: r1's batch 0 was trained; r1 resumes at position 1."""
    job = Job(2, 100)
    job.run_round(RoundPlan(kills=((1, "all_gather"),)))
    job.run_round(RoundPlan(restarts=frozenset({1})))  # r1 restarts at step 0, heals from r0, sends zeros
    job.run_round(RoundPlan())
    check_exactly_once(job)
    assert job.final().progress.state.committed_batches == (3, 2)


def test_full_restart_from_checkpoint_drops_the_abandoned_steps():
    job = Job(2, 2)
    for _ in range(5):
        job.run_round(RoundPlan())
    job.run_round(RoundPlan(kills=((0, "before_quorum"), (1, "before_quorum"))))
    job.run_round(RoundPlan(restarts=frozenset({0, 1})))  # both resume from the step-4 checkpoint
    assert job.final().progress.state.step == 5
    check_exactly_once(job)
    assert len([r for r in job.records if isinstance(r, Commit) and r.step == 4]) == 4  # two branches


def test_the_audit_catches_the_naive_per_replica_counter():
    """Counting only the batches a replica committed itself retrains a batch after a partial commit."""
    job = Job(2, 100, naive=True)
    job.run_round(RoundPlan(kills=((1, "all_gather"),)))
    job.run_round(RoundPlan(restarts=frozenset({1})))
    job.run_round(RoundPlan())
    report = audit(job.records, final=job.final().progress.state)
    assert not report.ok
    assert report.duplicates == ((job.sampler.batch_id(1, 0), (0, 2)),)
    assert "ledger says r1 trained position 1, it trained 0" in report.summary()


# -- the checker on hand-written logs --------------------------------------------------------------
def commit(step, parent, pairs, writer="r0"):
    ids, positions = zip(*pairs) if pairs else ((), ())
    return Commit(writer, step, parent, next_lineage(parent, step, pairs), tuple(ids), tuple(positions))


def chain(*steps):
    """Records of a clean history; steps: list of [(replica, position), ...] per step."""
    records, parent = [], GENESIS
    for n, pairs in enumerate(steps):
        records += [Attempt(r, n, parent, p, p * 2 + int(r[1])) for r, p in pairs]
        c = commit(n, parent, pairs)
        records.append(c)
        parent = c.lineage
    return records, parent


def test_checker_accepts_a_clean_history_and_lists_what_was_trained():
    records, _ = chain([("r0", 0), ("r1", 0)], [("r0", 1)], [("r0", 2), ("r1", 1)])
    report = audit(records)
    assert report.ok and report.num_steps == 3 and len(report.trained) == 5
    assert report.summary() == "exactly once: 5 batches over 3 committed steps"


def test_checker_reports_a_duplicate():
    records, _ = chain([("r0", 0)], [("r0", 0)])
    report = audit(records)
    assert report.duplicates == ((0, (0, 1)),) and not report.ok


def test_checker_reports_a_gap():
    records, _ = chain([("r0", 0)], [("r0", 2)])
    assert audit(records).gaps == (("r0", 1),)


LAYOUT2 = DataLayout(dataset_size=4, num_replicas=2, ranks_per_replica=1, batch_size_per_rank=1)


def test_checker_reports_batches_the_final_ledger_does_not_account_for():
    records, tip = chain([("r0", 0), ("r1", 0)])
    final = LoaderState(LAYOUT2, ("r0", "r1"), (1, 2), step=1, lineage=tip)
    assert audit(records, final=final).gaps == (("r1", 1),)


def test_checker_follows_the_final_lineage_and_ignores_abandoned_branches():
    records, tip = chain([("r0", 0)], [("r0", 1)])
    fork = records[1].lineage  # after step 0, a second commit of step 1 that was later abandoned
    records += [Attempt("r1", 1, fork, 0, 1), commit(1, fork, [("r0", 1), ("r1", 0)], writer="r1")]
    ambiguous = audit(records)
    assert not ambiguous.ok and "competing commits" in ambiguous.summary()
    report = audit(records, final=LoaderState(LAYOUT2, ("r0", "r1"), (2, 0), step=2, lineage=tip))
    assert report.ok and [t.batch_id for t in report.trained] == [0, 2]


@pytest.mark.parametrize(("mutate", "problem"), [
    (lambda rs: [r for r in rs if not (isinstance(r, Attempt) and r.step == 1)], "has no attempt record"),
    (lambda rs: [r for r in rs if not (isinstance(r, Commit) and r.step == 0)], "no commit record for lineage"),
    (lambda rs: rs + [Attempt("r0", 1, rs[1].lineage, 1, 99)], "read different batches"),
    (lambda rs: rs + [replace(rs[1], writer="r9", lineage="feedbeeffeedbeef")], "does not hash its content"),
])
def test_checker_reports_broken_logs(mutate, problem):
    records, _ = chain([("r0", 0)], [("r0", 1)])
    report = audit(mutate(records))
    assert any(problem in p for p in report.problems), report.problems


def test_log_round_trip_and_torn_tail(tmp_path):
    records, _ = chain([("r0", 0), ("r1", 0)], [("r1", 1)])
    sink = FileAuditSink(tmp_path / "audit.jsonl")
    log = AuditLog(sink)
    for r in records:
        log.append(r)
    sink.close()
    data = (tmp_path / "audit.jsonl").read_bytes()
    assert read_log(data) == (records, [])
    torn, problems = read_log(data + encode_record(records[0])[:9], name="audit.jsonl")
    assert torn == records and problems == ["audit.jsonl: ignored a torn last line (9 bytes)"]


def test_a_replica_left_alone_on_an_abandoned_step_cannot_overwrite_the_job_s_loader_state():
    """r1 votes no on step 8 while r0 commits it and writes step 9; r0 dies; r1 retrains step 8 alone on
    another lineage. Its loader_state write of step 9 is refused (it would fork the job) and it stops."""
    job = Job(2, 100)
    for _ in range(8):
        job.run_round(RoundPlan())
    job.run_round(RoundPlan(vote_no=frozenset({1})))
    stored = job.store.load()
    job.run_round(RoundPlan(kills=((0, "before_quorum"),)))
    assert job.refused == 1 and not any(r.alive for r in job.reps)
    assert job.store.load() == stored  # r0's step 9 is still what the store holds
