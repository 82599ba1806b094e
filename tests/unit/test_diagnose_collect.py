"""The pure parts of collection: parsing a reply, assembling the analysis input, the CLI's token and text."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from ftrun.diagnose.analysis import HANG, analyze
from ftrun.diagnose.cli import format_verdict, job_token
from ftrun.diagnose.collect import (MAX_INDEX, RankInfo, _Known, assemble, parse_rank, parse_register, reply_fields,
                                   verdict_dict)
from ftrun.diagnose.summary import HIST_LEN, RUNNING, empty_hist, empty_summary
from tests.manual_clock import ManualClock


def known(replica, rank, *, qid=2, index=None, host=None, last=10.0):
    s = empty_summary()
    s["f_qid"], s["f_index"], s["f_state"], s["f_last"], s["f_ring"] = qid, replica if index is None else index, \
        RUNNING, last, 3
    return _Known(RankInfo(f"r{replica}/{rank}", replica, rank, host or f"h{replica}"), "addr", s, empty_hist())


def test_parse_rank_takes_only_the_fixed_dtypes():
    k = known(0, 0)
    key, s, h = parse_rank({"key": "r0/0", "summary": k.summary.tobytes(), "hist": k.hist.tobytes()})
    assert key == "r0/0" and s["f_qid"][0] == 2 and len(h) == HIST_LEN
    with pytest.raises(ValueError, match="expected"):
        parse_rank({"key": "r0/0", "summary": b"x" * 3, "hist": k.hist.tobytes()})
    with pytest.raises(ValueError, match="str key and bytes"):
        parse_rank({"key": 5, "summary": k.summary.tobytes(), "hist": k.hist.tobytes()})


def test_assemble_places_ranks_in_the_newest_ring_and_marks_who_answered():
    ks = [known(0, 0), known(1, 0), known(2, 0, qid=1), known(0, 1, host="h0")]
    snap, layout = assemble(ks, {"r0/0", "r1/0", "r2/0"}, now=12.0)
    assert list(layout.ring_pos) == [0, 1, -1, 0]  # r2 answers from an older epoch: outside the ring
    assert list(layout.group) == [0, 0, 0, 1] and list(layout.replica) == [0, 1, 2, 0]
    assert list(layout.host) == [0, 1, 2, 0] and layout.host_names == ("h0", "h1", "h2")
    assert list(snap.answered) == [True, True, True, False] and snap.now == 12.0
    assert snap.hist.shape == (4, HIST_LEN)


def test_silent_ranks_last_seen_in_an_older_epoch_keep_their_replicas_place():
    # r0/1 is silent and last seen in an older epoch: its replica r0 holds position 0, so does it
    ks = [known(0, 0), known(1, 0), known(2, 0), known(0, 1, qid=1, index=2)]
    assert list(assemble(ks, {"r0/0", "r1/0", "r2/0"}, now=12.0)[1].ring_pos) == [0, 1, 2, 0]
    # replica 2 went silent before any pull in the newest epoch, the only free position of a ring of 3 is 2
    ks = [known(0, 0), known(1, 0), known(2, 0, qid=1, index=0), known(2, 1, qid=-1)]
    assert list(assemble(ks, {"r0/0", "r1/0"}, now=12.0)[1].ring_pos) == [0, 1, 2, 2]
    # two silent replicas for one free position: no guess
    ks = [known(0, 0), known(1, 0), known(2, 0, qid=1), known(3, 0, qid=1)]
    assert list(assemble(ks, {"r0/0", "r1/0"}, now=12.0)[1].ring_pos) == [0, 1, -1, -1]
    # a ring of 4 with two silent replicas whose last indices are the two free positions (a building cut)
    ks = [known(0, 0), known(1, 0), known(2, 0, qid=1), known(3, 0, qid=1)]
    for k in ks:
        k.summary["f_ring"] = 4
    snap, layout = assemble(ks, {"r0/0", "r1/0"}, now=12.0)
    assert list(layout.ring_pos) == [0, 1, 2, 3] and layout.ring_table.shape == (1, 4)
    ks[3].summary["f_index"] = 1  # its last index is not a free one: no guess, the ring keeps its holes
    snap, layout = assemble(ks, {"r0/0", "r1/0"}, now=12.0)
    assert list(layout.ring_pos) == [0, 1, -1, -1] and layout.ring_table.shape == (1, 4)


def test_a_ring_position_nobody_holds_is_reported_not_named():
    ks = [known(0, 0, index=0, last=1.0), known(1, 0, index=1, last=1.0)]  # ring of 3: position 2 unknown
    ks[0].summary["f_ring"] = ks[1].summary["f_ring"] = 3
    snap, layout = assemble(ks, {"r0/0", "r1/0"}, now=12.0)
    layout = type(layout)(layout.replica, layout.group, layout.host, np.array([0, 2]), layout.host_names)
    v = analyze(snap, layout)
    assert v.kind == HANG and v.ranks == () and "no known rank holds it" in v.reason, v


def test_verdict_text_and_dict():
    ks = [known(0, 0), known(1, 0)]
    for k in ks:
        k.summary["f_ring"] = 2  # a ring of two
    snap, layout = assemble(ks, {"r0/0"}, now=30.0)
    v = analyze(snap, layout)
    d = verdict_dict(v, layout, [k.info.key for k in ks])
    assert d["kind"] == HANG and d["ranks"] == ["r1/0"] and d["hosts"] == ["h1"]
    text = format_verdict({**d, "eviction": {"replicas": [1], "reason": "confirmed"}, "num_ranks": 2,
                           "num_answered": 1})
    assert text.splitlines()[0] == "verdict: hang (1 of 2 ranks answered)"
    assert "ranks: rank 0 of replica 1 (h1)" in text and "eviction: [1]: confirmed" in text


def test_job_token_from_environment_or_private_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FTRUN_TOKEN", "from-env")
    assert job_token(None) == "from-env"
    f = tmp_path / "token"
    f.write_text("from-file\n")
    os.chmod(f, 0o600)
    assert job_token(str(f)) == "from-file"
    os.chmod(f, 0o644)
    with pytest.raises(SystemExit, match="owner only"):
        job_token(str(f))
    monkeypatch.delenv("FTRUN_TOKEN")
    with pytest.raises(SystemExit, match="no job token"):
        job_token(None)


def test_nothing_registered_or_nobody_in_a_ring_is_no_hang():
    snap, layout = assemble([], set(), now=1.0)
    assert analyze(snap, layout).kind == "no_hang"
    snap, layout = assemble([known(0, 0, qid=-1), known(1, 0, qid=-1)], {"r0/0", "r1/0"}, now=1.0)
    assert list(layout.ring_pos) == [-1, -1] and analyze(snap, layout).kind == "no_hang"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("first_tail", [16, 256])
def test_summarize_recorder_reads_the_newest_records_and_equals_summarize_of_the_buffer(seed, first_tail,
                                                                                       monkeypatch):
    """summarize_recorder widens its tail until it holds what summarize reads: the same rows as the whole
    buffer's, through wraps, failed and running all-reduces, chunk runs longer than the tail, and old records
    of an op the tail lacks (a catch-up long ago)."""
    import random

    from ftrun.diagnose import collect
    from ftrun.diagnose.summary import summarize
    from ftrun.diagnose.telemetry import Op, Recorder

    monkeypatch.setattr(collect, "SUMMARY_TAIL", first_tail)
    rng, clock = random.Random(seed), ManualClock()
    rec = Recorder(clock, capacity=rng.choice([64, 300, 2000]))
    widened = 0
    for step in range(400):
        clock.t += 1.0
        if rng.random() < 0.02:
            rec.catchup_start(step, 2)
            rec.catchup_end(step, 100, rng.random() < 0.5)
        rec.quorum_ask(step)
        rec.quorum_got(step, step // 50)
        rec.tree_enter(step)
        for _ in range(rng.choice([1, 2, 3])):
            rec.ftar_enter(step // 50, 1 << 20, 4, 1, 6)
            if rng.random() < 0.1:  # chunk by chunk, sometimes longer than the first tail
                for seq in range(rng.choice([3, 40, 200])):
                    rec.ftar_step(0, seq % 6, 512)
                    rec.ftar_sent(2, 512)
            else:
                rec.ftar_model(clock.t, clock.t + 0.5, 6, 4, 2048, 0.01)
            if rng.random() < 0.9:
                rec.ftar_end(rng.random() < 0.85)
        rec.tree_done(step)
        if step % 7 == 0:
            want = summarize(rec.records(), clock.t + 0.25)
            got = collect.summarize_recorder(rec, clock.t + 0.25)
            assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()
            widened += collect.summary_start(rec.records(last=collect.SUMMARY_TAIL), rec.holds(Op.FTAR)) is None
    assert widened  # the widening ran (else the test shows nothing about it)


GOOD = {"key": "r0/0", "replica": 0, "rank": 0, "host": "h0"}


def test_parse_register_reads_every_rank():
    msg = {"type": "register", "addr": "10.0.0.1:7", "ranks": [GOOD, {**GOOD, "key": "r1/3", "replica": 1, "rank": 3,
                                                                      "incarnation": 2}]}
    assert parse_register(msg) == ("10.0.0.1:7", [RankInfo("r0/0", 0, 0, "h0"), RankInfo("r1/3", 1, 3, "h0", 2)])


@pytest.mark.parametrize("change, says", [
    ({"addr": 7}, "address in 'addr', got 7"),
    ({"ranks": {"r0/0": GOOD}}, "a list in 'ranks', got dict"),
    ({"ranks": [GOOD, ["r1/0"]]}, "ranks[1] needs a non-empty string 'key'"),
    ({"ranks": [GOOD, {**GOOD, "key": ""}]}, "ranks[1] needs a non-empty string 'key'"),
    ({"ranks": [GOOD, {**GOOD, "replica": float("inf")}]}, "ranks[1] needs an integer in [0, 1048576) in 'replica', "
                                                           "got inf"),
    ({"ranks": [GOOD, {**GOOD, "replica": MAX_INDEX}]}, "in 'replica', got 1048576"),
    ({"ranks": [{**GOOD, "rank": -1}]}, "ranks[0] needs an integer in [0, 1048576) in 'rank', got -1"),
    ({"ranks": [{**GOOD, "rank": True}]}, "in 'rank', got True"),
    ({"ranks": [{**GOOD, "incarnation": "2"}]}, "in 'incarnation', got '2'")])
def test_parse_register_names_the_malformed_field(change, says):
    """A register the collector refuses whole: an index out of range made every later diagnosis fail (a MemoryError
    for a huge replica index, an IndexError for a negative one) and a float one left the request unanswered."""
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_register({"type": "register", "addr": "10.0.0.1:7", "ranks": [GOOD], **change})


def test_reply_fields_of_a_pull_reply():
    rows = [{"key": "r0/0", "written": 3}, {"key": "r0/1"}]
    assert reply_fields({"now": 5, "serve_s": 0.25, "ranks": rows}) == (5, 0.25, 3, rows)
    assert reply_fields({"now": 1.5}) == (1.5, 0.0, 0, [])
    for bad, says in (({"serve_s": 1.0}, "'now' must be a finite number, got None"),
                      ({"now": float("inf")}, "'now' must be a finite number, got inf"),
                      ({"now": 1, "serve_s": "x"}, "'serve_s' must be a finite number"),
                      ({"now": 1, "ranks": {}}, "'ranks' must be a list, got dict"),
                      ({"now": 1, "ranks": [{"written": -1}]}, "'written' counts must be non-negative integers")):
        with pytest.raises(ValueError, match=re.escape(says)):
            reply_fields(bad)
