"""Rank folding under diagnose: two lead hosts per replica (the first, where the bench's faults go, and the
reference host the ranks not run mirror), and the mirrored ranks' telemetry served as their reference lead's
rows under their own names (harness.run.diag_mirror)."""

from __future__ import annotations

import numpy as np
import pytest

from ftrun.diagnose.collect import summarize_recorder
from ftrun.diagnose.summary import HIST, SUMMARY
from ftrun.diagnose.telemetry import Recorder
from harness.diagbench import kill_phase
from harness.engine import EmulatedWorld
from harness.profile import apply_overrides, load_profile
from harness.run import EmulatedJob, JobOptions
from harness.run.diag_mirror import SummaryCache, mirrored_hosts
from harness.run.fold import Mirror, lead_of

BIG = ["ranks_per_replica=512", "topology.racks_per_zone=128"]  # above FOLD_RANKS_ABOVE, 2 GPUs per host


@pytest.mark.parametrize("rank, leads, reference, want", [
    (0, 8, 0, 0), (7, 8, 0, 7), (8, 8, 0, 0), (13, 8, 0, 5),  # one lead host: rank % num_leads
    (3, 16, 8, 3), (12, 16, 8, 12), (16, 16, 8, 8), (21, 16, 8, 13), (8191, 16, 8, 15),  # reference host 8..15
])
def test_lead_of_follows_the_reference_host(rank, leads, reference, want):
    assert lead_of(rank, leads, reference) == want


@pytest.mark.parametrize("rank, leads, reference, what", [(1, 4, 4, "reference"), (1, 4, -1, "reference"),
                                                            (-1, 4, 0, "rank")])
def test_lead_of_rejects_bad_input(rank, leads, reference, what):
    with pytest.raises(ValueError, match=what):
        lead_of(rank, leads, reference)
    if what == "reference":
        with pytest.raises(ValueError, match="reference"):
            Mirror(None, leads, reference)


def test_mirrored_hosts_serve_every_rank_not_run_from_its_reference_lead():
    got = mirrored_hosts(16, 4, run=(0, 1, 2, 3, 4, 5, 6, 7, 13), num_leads=8, reference=4)
    assert got == [(2, ((8, 4), (9, 5), (10, 6), (11, 7))), (3, ((12, 4), (14, 6), (15, 7)))]
    assert mirrored_hosts(8, 4, run=range(8), num_leads=8, reference=4) == []  # every rank runs
    assert mirrored_hosts(10, 4, run=range(4), num_leads=4, reference=0)[-1] == (2, ((8, 0), (9, 1)))  # short host
    with pytest.raises(ValueError, match="every lead"):
        mirrored_hosts(16, 4, run=(0, 1, 2), num_leads=4, reference=0)
    with pytest.raises(ValueError, match="gpus_per_host"):
        mirrored_hosts(16, 0, run=(0,), num_leads=1, reference=0)


def _recorder(world: EmulatedWorld) -> Recorder:
    rec = Recorder(world.clock, capacity=64)
    rec.ftar_enter(epoch=1, nbytes=1024, ring_size=4, index=2, num_steps=6)
    rec.ftar_step(part=0, hop=1, nbytes=256)
    return rec


def test_summary_cache_is_summarize_with_its_now_and_recomputes_on_new_records():
    world = EmulatedWorld(0, cpu_charging=False)
    rec = _recorder(world)
    cache = SummaryCache()
    for now in (5.0, 7.5):
        s, h = cache(rec, now)
        want_s, want_h = summarize_recorder(rec, now)
        assert s.dtype == SUMMARY and h.dtype == HIST
        assert s.tobytes() == want_s.tobytes() and h.tobytes() == want_h.tobytes()
    assert (cache.computed, cache.served) == (1, 2)
    rec.ftar_end(True)
    s, _ = cache(rec, 9.0)
    assert cache.computed == 2 and s.tobytes() == summarize_recorder(rec, 9.0)[0].tobytes()
    assert int(s["f_state"][0]) == 2  # DONE


def _job(overrides: list[str], steps: int = 4, **options) -> EmulatedJob:
    profile = apply_overrides(load_profile("ci-small"), overrides)
    return EmulatedJob(profile, JobOptions(steps=steps, **options))


def test_represented_ranks_under_diagnose_are_the_two_lead_hosts():
    job = _job(BIG, diagnose=True, ftar_detail="folded", trace=False)
    assert job.ranks == (0, 1, 2, 3) and job._num_leads == 4 and job._mirror_reference() == 2
    assert "the first two hosts'" in job.folding()["folding"]
    plain = _job(BIG, ftar_detail="folded")  # without diagnose: one lead host, as before
    assert plain.ranks == (0, 1) and plain._num_leads == 2 and plain._mirror_reference() == 0
    small = _job([], diagnose=True, ftar_detail="folded")  # at or below FOLD_RANKS_ABOVE nothing changes
    assert small.ranks == tuple(range(8)) and small._num_leads == 2 and small._mirror_reference() == 0
    forced = _job([], diagnose=True, ftar_detail="folded", fold_ranks="on")  # unless asked (design-4k)
    assert forced.ranks == (0, 1, 2, 3) and forced._num_leads == 4 and forced._mirror_reference() == 2
    one_host = _job(["ranks_per_replica=2", "topology.racks_per_zone=1"], diagnose=True, ftar_detail="folded",
                    fold_ranks="on")  # a replica of one host has no reference host: every rank runs
    assert one_host.ranks == (0, 1) and one_host._num_leads == 2


@pytest.mark.timeout(120)
def test_a_mirrored_hosts_rows_are_its_reference_leads_rows_relabeled():
    job = _job(BIG, steps=40, diagnose=True, ftar_detail="folded", trace=False)
    seen: dict = {}

    def driver(j: EmulatedJob) -> None:
        clock = j.world.clock
        while j.max_step < 4:
            clock.sleep(0.1)
        seen["verdict"] = j.diagnosis.diagnose()
        seen["input"] = j.diagnosis.collector.last_input
        seen["keys"] = sorted(j.diagnosis.collector._known)
        j.finish()

    job.driver = driver
    job.run()
    assert seen["verdict"]["kind"] == "no_hang" and seen["verdict"]["num_ranks"] == 4 * 512
    assert seen["verdict"]["num_answered"] == 4 * 512
    snap, layout = seen["input"]
    row = {(int(r), int(g)): i for i, (r, g) in enumerate(zip(layout.replica, layout.group))}
    host = layout.host_names
    for replica in range(4):
        for rank in (4, 5, 100, 511):
            ref = lead_of(rank, 4, 2)
            a, b = snap.summary[row[replica, rank]], snap.summary[row[replica, ref]]
            for f in SUMMARY.names:
                if SUMMARY[f].kind == "f":  # times: mapped by each reply's own offset (its network latency)
                    assert a[f] == pytest.approx(b[f], abs=1e-3), f
                else:
                    assert a[f] == b[f], f
            assert np.array_equal(snap.hist[row[replica, rank]]["cid"], snap.hist[row[replica, ref]]["cid"])
            assert layout.ring_pos[row[replica, rank]] == layout.ring_pos[row[replica, ref]]
            assert host[layout.host[row[replica, rank]]] == job.topology.replica_hosts(replica)[rank // 2]
    diag = job.diagnosis
    for server in diag.mirrors.servers:  # each mirrored rank: its own name and host, its reference lead's recorder
        for info, rec in server.ranks.items():
            rid = job.replica_id(info.replica)
            assert info.key == f"{rid}/{info.rank}" and info.rank >= 4
            assert rec is diag.recorders[f"{rid}/{lead_of(info.rank, 4, 2)}"]
            assert info.host == job.topology.replica_hosts(info.replica)[info.rank // 2]
    assert len(seen["keys"]) == 4 * 512 and f"{job.replica_id(3)}/511" in seen["keys"]
    figures = job.diagnosis.telemetry()
    assert figures["telemetry_ranks"] == 16 and figures["telemetry_mirrored_ranks_per_replica"] == 508
    assert figures["telemetry_mirror_servers"] == 4 * 254 and figures["telemetry_mirror_register_failures"] == 0


@pytest.mark.parametrize("phase, detect, entry, period, want", [
    (0.3, 0.5, 0.4, 0.5, 0.3), (0.3, 1.0, 0.4, 0.5, 0.3),  # a step no longer than the detection: unchanged
    (0.0, 5.0, 21.0, 20.0, 17.0 / 20), (0.5, 5.0, 21.0, 20.0, 18.5 / 20), (1.0, 5.0, 21.0, 20.0, 20.0 / 20),
    (0.0, 5.0, 2.0, 20.0, 0.0), (0.2, 0.0, 21.0, 20.0, 21.0 / 20),
])
def test_a_rank_kill_lands_within_crash_detection_before_the_next_all_reduce(phase, detect, entry, period, want):
    assert kill_phase(phase, detect, entry, period) == pytest.approx(want)


@pytest.mark.parametrize("args", [(-0.1, 5.0, 1.0, 20.0), (1.1, 5.0, 1.0, 20.0), (0.5, -1.0, 1.0, 20.0),
                                  (0.5, 5.0, -1.0, 20.0), (0.5, 5.0, 1.0, 0.0)])
def test_kill_phase_rejects_bad_input(args):
    with pytest.raises(ValueError, match="kill_phase"):
        kill_phase(*args)


@pytest.mark.timeout(120)
def test_a_restarted_replicas_old_mirror_servers_and_cached_rows_are_dropped():
    """A killed incarnation's lead recorders (1 MB each) must not stay alive in the mirror servers' list or
    the summary cache: only each replica's latest incarnation is served."""
    from harness.run import parse_inject, split_faults

    kills, faults = split_faults([parse_inject("kill replica=1 step=3")])
    job = _job(["ranks_per_replica=32", "topology.racks_per_zone=8"], steps=30, diagnose=True,
               ftar_detail="folded", fold_ranks="on", trace=False, kills=kills, faults=faults)
    seen: dict = {}

    def driver(j: EmulatedJob) -> None:
        clock = j.world.clock
        while j._num_starts[1] < 2 or j.max_step < 8:
            clock.sleep(0.1)
        seen["verdict"] = j.diagnosis.diagnose()
        j.finish()

    job.driver = driver
    job.run()
    m, live = job.diagnosis.mirrors, job.diagnosis.recorders
    assert seen["verdict"]["num_answered"] == seen["verdict"]["num_ranks"] == 4 * 32
    assert m.servers_started == 5 * len(m.hosts) and len(m.servers) == 4 * len(m.hosts)  # r1 started twice
    assert {info.incarnation for s in m.servers for info in s.ranks if info.replica == 1} == {1}
    assert all(rec is live[info.key.rsplit("/", 1)[0] + f"/{lead_of(info.rank, 4, 2)}"]
               for s in m.servers for info, rec in s.ranks.items())
    assert m.cache._rows and set(m.cache._rows) <= {id(r) for r in live.values()}


def test_summary_cache_forgets_recorders():
    world = EmulatedWorld(0, cpu_charging=False)
    a, b, cache = _recorder(world), _recorder(world), SummaryCache()
    cache(a, 1.0), cache(b, 1.0)
    cache.forget([a])
    assert set(cache._rows) == {id(b)}
    cache(a, 2.0)
    assert cache.computed == 3
