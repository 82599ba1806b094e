"""The per-rank telemetry ring buffer and its pure summary."""

from __future__ import annotations

import numpy as np
import pytest

from ftrun.diagnose.summary import DONE, FAILED, HIST_LEN, RUNNING, summarize
from ftrun.diagnose.telemetry import DEFAULT_CAPACITY, MAX_BYTES, RECORD, Ev, Op, Recorder
from tests.manual_clock import ManualClock


def ring_op(rec: Recorder, clock: ManualClock, epoch: int, *, n: int = 3, chunks: int = 2, ok: bool | None = True,
            stop_after: int | None = None, send_s: float = 0.0) -> None:
    """One all-reduce as the engine records it: (2n-1) hops x `chunks` chunk steps; sends after each
    step but the last hop's."""
    steps = [(h, c) for h in range(2 * n - 1) for c in range(chunks)]
    rec.ftar_enter(epoch, 4096, n, 1, len(steps))
    for i, (hop, _) in enumerate(steps):
        if stop_after is not None and i == stop_after:
            return
        clock.t += 0.01
        if hop > 0:
            rec.ftar_recv(1024)
        rec.ftar_step(0, hop, 1024)
        if hop < 2 * n - 2:
            clock.t += send_s
            rec.ftar_sent(2, 1024)
    if ok is not None:
        rec.ftar_end(ok)


def test_buffer_is_at_most_one_megabyte_and_records_are_40_bytes():
    rec = Recorder(ManualClock(100.0))
    assert RECORD.itemsize == 40
    assert rec.nbytes == DEFAULT_CAPACITY * 40 <= MAX_BYTES == 1_000_000


@pytest.mark.parametrize("capacity", [0, 15, DEFAULT_CAPACITY + 1])
def test_bad_capacity_is_refused(capacity):
    with pytest.raises(ValueError, match="capacity"):
        Recorder(ManualClock(100.0), capacity)


def test_ring_buffer_keeps_the_newest_records_oldest_first():
    clock = ManualClock(100.0)
    rec = Recorder(clock, capacity=16)
    for i in range(40):
        clock.t = float(i)
        rec.quorum_ask(i)
    got = rec.records()
    assert len(got) == 16 and rec.written == 40
    assert list(got["cid"]) == list(range(24, 40))
    assert list(got["t"]) == [float(i) for i in range(24, 40)]
    assert set(got["op"]) == {Op.QUORUM} and set(got["ev"]) == {Ev.ENTER}


def test_records_carry_collective_ids_peers_and_step():
    clock = ManualClock(100.0)
    rec = Recorder(clock)
    rec.quorum_got(7, quorum_id=3)
    rec.ftar_enter(3, 1 << 20, 4, 2, 10)
    rec.ftar_step(1, 0, 512)
    rec.ftar_sent(3, 512)
    r = rec.records()
    assert list(r["op"]) == [Op.QUORUM, Op.FTAR, Op.FTAR, Op.FTAR]
    assert list(r["step"]) == [7, 7, 7, 7]  # the step the quorum gave, on every later record
    enter, step, sent = r[1], r[2], r[3]
    assert (enter["qid"], enter["cid"], enter["aux"], enter["peer"], enter["seq"]) == (3, 0, 4, 2, 10)
    assert (step["peer"], step["part"], step["seq"], step["aux"]) == (1, 1, 1, 0)  # from ring index 1, hop 0
    assert (sent["peer"], sent["nbytes"]) == (3, 512)
    rec.ftar_enter(3, 1, 4, 2, 10)
    rec.ftar_enter(4, 1, 4, 2, 10)
    assert list(rec.records()["cid"][-2:]) == [1, 0]  # numbered within the epoch


def test_summary_of_completed_running_and_failed_all_reduces():
    clock = ManualClock(100.0)
    rec = Recorder(clock)
    for _ in range(3):
        ring_op(rec, clock, 1, send_s=0.002)
    rec.tree_enter(5)
    ring_op(rec, clock, 1, ok=None, stop_after=5)
    s, h = summarize(rec.records(), clock.t)
    assert s["f_state"][0] == RUNNING and s["f_cid"][0] == 3 and s["f_total"][0] == 10
    assert (s["f_steps"][0], s["f_recvd"][0], s["f_used"][0], s["f_sends"][0], s["f_sent"][0]) == (5, 3, 3, 5, 5)
    assert s["t_cid"][0] == 5 and s["t_ev"][0] == Ev.ENTER
    assert list(h["cid"][-3:]) == [0, 1, 2] and (h["cid"][:-3] == -1).all() and len(h) == HIST_LEN
    assert np.allclose(h["busy"][-3:], 8 * 0.002)  # 8 sends, each 2 ms on the wire
    assert (h["sent_bytes"][-3:] == 8 * 1024).all() and (h["done"][-3:] > h["enter"][-3:]).all()
    ring_op(rec, clock, 2, ok=False)
    s, _ = summarize(rec.records(), clock.t)
    assert s["f_state"][0] == FAILED and s["f_qid"][0] == 2
    ring_op(rec, clock, 2)
    assert summarize(rec.records(), clock.t)[0]["f_state"][0] == DONE


def test_summary_refuses_other_arrays():
    with pytest.raises(ValueError, match="RECORD"):
        summarize(np.zeros(3), 0.0)


def test_attach_sets_one_recorder_on_every_hooked_component():
    from ftrun.diagnose.attach import attach
    from ftrun.ftar.engine import FtarEngine
    from ftrun.quorum.client import LighthouseClient
    from ftrun.replica.tree_comm import TreeComm

    parts = [object.__new__(cls) for cls in (FtarEngine, TreeComm, LighthouseClient)]  # hooks only, no I/O
    rec = attach(ManualClock(100.0), engine=parts[0], comm=parts[1], lighthouse=parts[2], capacity=64)
    assert all(p.telemetry is rec for p in parts) and rec.capacity == 64
    assert FtarEngine.telemetry is None  # the class default stays off
    with pytest.raises(TypeError, match="has no telemetry hook"):
        attach(ManualClock(100.0), engine=object())


@pytest.mark.parametrize("written", [0, 5, 16, 23, 40])
def test_records_last_are_the_newest_oldest_first(written):
    clock = ManualClock(100.0)
    rec = Recorder(clock, capacity=16)
    for i in range(written):
        rec.quorum_ask(i)
    assert rec.held == min(written, 16)
    assert list(rec.records()["cid"]) == list(range(max(0, written - 16), written))
    for last in (0, 1, 7, 16, 100):
        got = rec.records(last=last)
        assert list(got["cid"]) == list(range(written - min(last, rec.held), written))
        got["cid"] = -5  # a copy: the buffer is untouched
    assert list(rec.records()["cid"]) == list(range(max(0, written - 16), written))
    assert rec.holds(Op.QUORUM) == (written > 0) and not rec.holds(Op.FTAR)


def test_holds_says_whether_an_op_is_still_in_the_buffer():
    rec = Recorder(ManualClock(100.0), capacity=16)
    assert not any(rec.holds(op) for op in Op)
    rec.catchup_start(3, 2)
    rec.ftar_enter(1, 64, 4, 0, 6)
    assert rec.holds(Op.CATCHUP) and rec.holds(Op.FTAR) and not rec.holds(Op.TREE)
    for i in range(15):
        rec.quorum_ask(i)
    assert not rec.holds(Op.CATCHUP) and rec.holds(Op.FTAR)  # the catch-up record was overwritten
    rec.quorum_ask(15)
    assert not rec.holds(Op.FTAR) and rec.holds(Op.QUORUM)


def test_last_record_is_the_newest_of_its_op_while_held():
    clock = ManualClock(100.0)
    rec = Recorder(clock, capacity=16)
    assert rec.last_record(Op.CATCHUP) is None
    rec.catchup_start(3, 2)
    rec.catchup_end(3, 100, True)
    for i in range(14):
        rec.quorum_ask(i)
    got = rec.last_record(Op.CATCHUP)
    assert got.dtype == RECORD and len(got) == 1 and (got["ev"][0], got["cid"][0]) == (Ev.DONE, 3)
    assert rec.last_record(Op.QUORUM)["cid"][0] == 13
    rec.quorum_ask(14)  # overwrites the catch-up's first record
    assert rec.last_record(Op.CATCHUP)["ev"][0] == Ev.DONE
    rec.quorum_ask(15)  # and its last
    assert rec.last_record(Op.CATCHUP) is None
