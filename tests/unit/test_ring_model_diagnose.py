"""Analytic FTAR rings under diagnose (harness.run.ring_model): the telemetry a modeled all-reduce records and
how summarize reads it, the per-call latch that runs a ring chunk by chunk at a fault, the close watch that
reads no frame, and the diagnose bench's chunk positions per fault kind."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ftrun.diagnose.summary import DONE, FAILED, RUNNING, summarize
from ftrun.diagnose.telemetry import Ev, Recorder
from ftrun.env.base import NetTimeout, PeerClosed
from harness.diagbench import Scenario, Shape, chunk_positions
from harness.engine.world import EmulatedWorld
from harness.profile import NetworkConfig, apply_overrides, load_profile
from harness.run import EmulatedJob, JobOptions
from harness.run.ring_model import RingBoard, rank_cost, step_summary
from ftrun.ftar.schedule import schedule
from tests.manual_clock import ManualClock

pytestmark = pytest.mark.timeout(120)


# -- telemetry of a modeled all-reduce -----------------------------------------------------------------
def test_a_modeled_all_reduce_reads_as_moving_until_its_end_then_done_with_its_totals():
    clock, big = ManualClock(100.0), 5 * (1 << 32) + 123  # bytes sent past the u4 nbytes field: W48
    rec = Recorder(clock, capacity=64)
    rec.ftar_enter(7, 1 << 33, 4, 2, 70)
    clock.t = 101.0  # the last member arrived: modeled from 101 to 103
    rec.ftar_model(101.0, 103.0, 70, 60, big, 1.5)
    s, h = summarize(rec.records(), 100.5)  # before the modeled start: entered, nothing moved
    assert s["f_state"][0] == RUNNING and s["f_steps"][0] == 0 and s["f_last"][0] == 101.0
    s, h = summarize(rec.records(), 102.0)  # half way
    assert s["f_state"][0] == RUNNING and s["f_last"][0] == 102.0 and s["f_total"][0] == 70
    assert s["f_steps"][0] == 35 and s["f_sent"][0] == s["f_recvd"][0] == s["f_used"][0] == s["f_sends"][0] == 30
    assert (h["cid"] < 0).all()  # nothing completed yet
    s, _ = summarize(rec.records(), 110.0)  # past the end without DONE (a frozen rank): its age counts from the end
    assert s["f_state"][0] == RUNNING and s["f_last"][0] == 103.0
    clock.t = 103.0
    rec.ftar_end(True)
    s, h = summarize(rec.records(), 104.0)
    assert s["f_state"][0] == DONE and s["f_steps"][0] == 70 and s["f_sent"][0] == 60 and s["f_last"][0] == 103.0
    row = h[-1]
    assert (row["qid"], row["cid"], row["enter"], row["done"]) == (7, 0, 100.0, 103.0)
    assert row["busy"] == pytest.approx(1.5, abs=1e-9) and row["sent_bytes"] == big


def test_a_failed_modeled_all_reduce_names_the_side_that_closed():
    clock = ManualClock(100.0)
    rec = Recorder(clock, capacity=64)
    rec.ftar_enter(3, 4096, 4, 1, 14)
    rec.ftar_model(100.0, 102.0, 14, 12, 3000, 0.0)
    clock.t = 101.0
    rec.ftar_end(False, 2)
    s, h = summarize(rec.records(), 105.0)
    assert s["f_state"][0] == FAILED and s["f_fail_peer"][0] == 2 and s["f_last"][0] == 101.0
    assert s["f_sent"][0] == 6 and (h["cid"] < 0).all()


@pytest.mark.parametrize("args,why", [((101.0, 100.0, 1, 1, 1, 0.0), "end >= start"),
                                      ((0.0, 1.0, 1, 1, -1, 0.0), "sent_bytes"),
                                      ((0.0, 1.0, 1, 1, 1 << 48, 0.0), "sent_bytes"),
                                      ((0.0, 1.0, 1, 1, 1, 1e6), "busy_s")])
def test_ftar_model_refuses_values_it_cannot_record(args, why):
    rec = Recorder(ManualClock(100.0), capacity=16)
    with pytest.raises(ValueError, match=why):
        rec.ftar_model(*args)
    assert rec.written == 0


def test_rank_cost_busy_is_the_nic_time_when_the_nic_is_the_bottleneck_else_the_burst():
    summary = step_summary(schedule(4, 1, 4 * 2 * 1024, elem_size=4, chunk_bytes=1024, num_chunks=2))
    sends = sum(c for _, c in summary[2])
    assert sends == 2 * (2 * 4 - 2) and {nb for nb, _ in summary[2]} == {1024}
    cost = rank_cost(summary, seconds=2.0, nic_rate=1024.0, share=3, sndbuf_s=0.5)
    assert cost.nic_s == pytest.approx(sends * 3.0) and cost.burst_s == pytest.approx(sends * 1.5)
    assert cost.busy(ring_s=sends * 3.0) == pytest.approx(sends * 3.0 - 0.5)  # NIC-bound: less one buffer
    assert cost.busy(ring_s=sends * 10.0) == pytest.approx(sends * 1.5)  # mean place in the burst (2 x 1 s) - 0.5
    assert rank_cost(summary, seconds=1.0, nic_rate=1024.0, share=1, sndbuf_s=4.0).busy(100.0) == 0.0  # absorbed
    with pytest.raises(ValueError, match="nic_rate"):
        rank_cost(summary, seconds=1.0, nic_rate=0.0, share=1, sndbuf_s=0.0)


def test_the_analytic_cost_sees_a_slowed_link_while_it_lasts():
    job = EmulatedJob(load_profile("ci-small"), JobOptions(steps=1, ftar_model="analytic"))
    job.kernels = lambda: SimpleNamespace(launch_s=1e-5, reduce_bw=1e12)  # loaded by run(); not what is tested
    hosts = job.topology.training_hosts
    a = hosts[0]
    b = next(h for h in hosts[1:] if job.topology.location(h).zone == job.topology.location(a).zone)  # NIC-bound
    cost = job.ring_cost(a)
    summary = step_summary(schedule(4, 1, 64 << 20, elem_size=2, chunk_bytes=1 << 20, num_chunks=2))
    healthy = cost(summary, f"{b}:7")
    job.world.fabric.slow_link(a, b, 4.0)
    slowed = cost(summary, f"{b}:7")
    assert slowed.nic_s == pytest.approx(4 * healthy.nic_s) and slowed.seconds > 2 * healthy.seconds
    assert slowed.busy(slowed.seconds) > 3 * healthy.busy(healthy.seconds) > 0  # what the slow-link test compares
    job.world.fabric.slow_link(a, b, 1.0)
    assert cost(summary, f"{b}:7") == healthy


def test_an_all_reduce_refused_for_an_aborted_epoch_is_recorded_as_entered_and_failed_as_by_the_chunk_engine():
    from ftrun.ftar.cpu_kernels import CpuKernels
    from ftrun.ftar.engine import FtarConfig
    from ftrun.ftar.ring import RecoverableError
    from harness.run.ring_model import AnalyticFtarEngine

    env = EmulatedWorld(seed=0).host_env("host-0")  # its connections have the wait_closed the link watch uses

    def body():
        engs = [AnalyticFtarEngine(board=RingBoard(), cost=None, env=env, kernels=CpuKernels(), token="job",
                                   config=FtarConfig(chunk_bytes=4096, num_chunks=2, timeout_s=20.0,
                                                     transport="socket"))
                for _ in range(2)]
        try:
            rec = engs[0].telemetry = Recorder(env.clock, capacity=64)
            ring = [e.addr for e in engs]
            tasks = [env.spawn(lambda e=e, i=i: e.reconfigure(epoch=4, ring=ring, index=i), name="build")
                     for i, e in enumerate(engs)]
            assert all(t.join(20.0) and t.exception is None for t in tasks)
            assert engs[0].abort(4)
            with pytest.raises(RecoverableError, match="aborted"):
                engs[0].all_reduce(np.ones(100, np.float32))
            s, _ = summarize(rec.records(), env.clock.now())
            assert (s["f_qid"][0], s["f_cid"][0], s["f_state"][0], s["f_ring"][0]) == (4, 0, FAILED, 2)
        finally:
            for e in engs:
                e.close()

    env.run(body)


# -- the per-call latch ----------------------------------------------------------------------------------
def test_the_first_arrival_latches_a_calls_mode_for_every_member():
    board = RingBoard()
    board.chunk_positions = frozenset({1})
    a, b = (5, ("x", "y", "z"), 1), (5, ("x", "y", "z"), 2)
    assert board.chunked(a, 3, 1)
    board.chunk_positions = frozenset()  # cleared while the call runs: its other members still chunk
    assert board.chunked(a, 3, 1) and board.chunked(a, 3, 1)
    assert not board.chunked(b, 3, 1)  # the next call: latched by its own first arrival
    board.chunk_positions = frozenset({1})
    assert not board.chunked(b, 3, 1) and not board.chunked(b, 3, 1)
    assert board.num_chunked == 1 and not board._modes  # every member asked: nothing kept


# -- the close watch reads no frame ----------------------------------------------------------------------
def test_wait_closed_reads_no_frame_and_ends_on_the_peers_fin_or_a_local_close():
    w = EmulatedWorld(0, cpu_charging=False, network=NetworkConfig(base_latency_us=10.0, frame_overhead_bytes=0))
    a, b = w.host_env("a"), w.host_env("b")
    seen: dict = {}

    def watch(name, conn):
        try:
            conn.wait_closed(timeout=None)
        except PeerClosed as e:
            seen[name] = (str(e), conn.peer_addr)

    def main():
        ln = a.net.listen("127.0.0.1:0")
        client = b.net.connect(ln.addr, timeout=1.0)
        server = ln.accept(timeout=1.0)
        watchers = [a.spawn(watch, "server", server, name="w1"), b.spawn(watch, "client", client, name="w2")]
        with pytest.raises(NetTimeout):
            server.wait_closed(timeout=0.01)
        for i in range(3):
            client.send({"i": i})
        client.send_bytes(b"abcd")
        got = [server.recv(timeout=1.0)["i"] for _ in range(3)]
        buf = bytearray(4)
        server.recv_into(buf, timeout=1.0)
        assert got == [0, 1, 2] and bytes(buf) == b"abcd" and not seen  # every frame reached the reader
        client.close()
        for t in watchers:
            assert t.join(1.0)

    w.run_on("b", main)
    assert "closed locally" in seen["client"][0] and "closed the connection" in seen["server"][0]


# -- jobs ----------------------------------------------------------------------------------------------
NARROW = ["network.host_nic_gbps=0.1", "ftar.engine.chunk_bytes=16384", "network.send_buffer_kib=16"]


def _hist(model: str, positions: frozenset[int] = frozenset()) -> tuple[EmulatedJob, dict]:
    prof = apply_overrides(load_profile("ci-small"), NARROW)  # bandwidth-bound: sends wait on the wire
    job = EmulatedJob(prof, JobOptions(steps=4, diagnose=True, trace=False, ftar_model=model, ftar_detail="full",
                                       chunks_at_faults=True))  # type: ignore[arg-type]
    if job.ring_board is not None:
        job.ring_board.chunk_positions = positions
    job.run()
    out = {}
    for key, rec in job.diagnosis.recorders.items():
        s, h = summarize(rec.records(), job.world.now)
        out[key] = (s, h[h["cid"] >= 0])
    return job, out


def test_analytic_summaries_match_a_chunk_runs_for_healthy_all_reduces():
    _, chunks = _hist("chunks")
    job, model = _hist("analytic")
    assert job.ring_board.num_rings > 0 and job.ring_board.num_chunked == 0
    assert sorted(chunks) == sorted(model) and len(chunks) == 32
    busy_c, busy_m = [], []
    for key in chunks:
        (sc, hc), (sm, hm) = chunks[key], model[key]
        assert sm["f_state"][0] == sc["f_state"][0] == DONE and sm["f_total"][0] == sc["f_total"][0], key
        assert len(hm) == len(hc) >= 4 and (hm["sent_bytes"] == hc["sent_bytes"]).all(), key
        dur_c, dur_m = hc["done"] - hc["enter"], hm["done"] - hm["enter"]
        # the modeled duration (ring_seconds, every step at the slowest resource's pace) is within 1.6x here
        assert (dur_m >= 0.8 * dur_c).all() and (dur_m <= 1.6 * dur_c).all(), (key, dur_c, dur_m)
        busy_c.append(float(np.median(hc["busy"])))
        busy_m.append(float(np.median(hm["busy"])))
    busy_c, busy_m = np.array(busy_c), np.array(busy_m)
    assert (busy_c > 0).all() and (busy_m > 0).all()
    assert 1 / 1.5 <= np.median(busy_m) / np.median(busy_c) <= 1.5  # the comparable links' median
    assert ((busy_m / busy_c <= 3.0) & (busy_c / busy_m <= 3.0)).all()  # and every link within 3x


def test_chunk_positions_run_the_real_engine_on_the_analytic_rings_connections():
    job, model = _hist("analytic", positions=frozenset({0, 5}))  # LinkWatch sits beside the chunk frames
    board = job.ring_board
    assert board.num_chunked > 0 and board.num_rings > 0 and not job.recorder.errors
    assert job.max_step >= 4
    steps = {key: int(s["f_total"][0]) for key, (s, _) in model.items()}
    for key, (s, h) in model.items():
        assert s["f_state"][0] == DONE and len(h) >= 4, key
    chunked = [k for k in model if k.endswith("/0") or k.endswith("/5")]
    assert chunked and all(steps[k] == steps["r0/1"] for k in chunked)  # the same schedule either way


def test_chunks_at_faults_is_for_diagnose_and_lets_it_use_analytic_rings():
    assert JobOptions(steps=1, diagnose=True).needs_chunk_rings
    assert not JobOptions(steps=1, diagnose=True, chunks_at_faults=True).needs_chunk_rings
    with pytest.raises(ValueError, match="chunks_at_faults"):
        JobOptions(steps=1, chunks_at_faults=True)
    with pytest.raises(ValueError, match="ftar_model=analytic"):
        JobOptions(steps=1, diagnose=True, ftar_model="analytic")
    assert EmulatedJob(load_profile("crusoe-300"), JobOptions(steps=1, diagnose=True)).ring_board is None
    assert EmulatedJob(load_profile("crusoe-300"),
                       JobOptions(steps=1, diagnose=True, chunks_at_faults=True)).ring_board is not None


# -- the bench's chunk positions --------------------------------------------------------------------------
SHAPE = Shape(replicas=4, ranks_per_replica=20, gpus_per_host=8, buildings=2, max_slow_factor=5.0)


@pytest.mark.parametrize("sc,want", [
    (Scenario(0, "hang_rank", 0.5, replica=2, rank=13), {13}),
    (Scenario(0, "hang_host", 0.5, host=3 + 1), set(range(8, 16))),  # replica 1's second host
    (Scenario(0, "hang_host", 0.5, host=2 * 3 + 2), set(range(16, 20))),  # a last host with 4 ranks
    (Scenario(0, "cut_building", 0.5, building=1), set(range(20))),
    (Scenario(0, "kill_rank", 0.5, replica=1, rank=3), set()),
    (Scenario(0, "slow_host", 0.5, host=1, factor=3.0), set()),
    (Scenario(0, "slow_link", 0.5, host=1, host_b=4, factor=5.0), set()),
])
def test_chunk_positions_per_fault_kind(sc, want):
    assert SHAPE.hosts_per_replica == 3
    assert chunk_positions(sc, SHAPE) == frozenset(want)
