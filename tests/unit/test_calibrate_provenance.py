"""`ftrun calibrate`'s pure parts: figures -> profile keys with provenance, the TOML writer, the profile's
check of a [calibration] table, and the emulator reading the calibrated keys."""

from __future__ import annotations

import math
import tomllib

import pytest

from harness.calibrate.measure import Figure, linear_fit
from harness.calibrate.provenance import ONE_MACHINE, calibrated_document, profile_keys, to_toml
from harness.profile import _to_dict, apply_overrides, load_profile, profile_from_dict, profile_value
from tests.manual_clock import ManualClock

AT = "2026-11-26T10:00:00Z"


def fig(name: str, value: float, unit: str = "s") -> Figure:
    return Figure(name, value, unit, f"measured {name} somehow", 3)


def two_replica_figures(*, ranks: int) -> list[Figure]:
    """A 10 ms step on 2 effective cores, 30 ms with 2 replicas, `ranks` ranks per replica."""
    return [fig("step_s", 0.010), fig("script_step_period_s", 0.010), fig("cpu_cores_effective", 2.0, "cores"),
            fig("script_step_2_replicas_s", 0.030), fig("script_ranks", ranks, "ranks")]


def recorded_keys(figures: dict[str, Figure]) -> set[str]:
    """The keys the calibrated document of `figures` records."""
    doc = calibrated_document({"name": "x"}, figures, measured_at=AT, host="h", command="c", quick=False)
    return {v["key"] for v in doc["calibration"]["values"]}


FIGURES = {f.name: f for f in [
    fig("step_s", 0.0006), fig("tcp_one_way_us", 40.0, "us"), fig("tcp_gb_s", 3.0, "GB/s"),
    fig("unix_one_way_us", 7.0, "us"), fig("unix_gb_s", 6.0, "GB/s"), fig("shm_gb_s", 6.0, "GB/s"),
    fig("catchup_per_fetch_s", 0.002), fig("catchup_ns_per_byte", 0.8, "ns/B"),
    fig("ftar_reduce_gb_s", 14.0, "GB/s"), fig("ftar_copy_gb_s", 20.0, "GB/s"),
    fig("zygote_start_s", 0.009), fig("crash_detect_s", 0.0035), fig("peer_reset_s", 0.0002),
    fig("storage_write_s", 0.004),
]}


def document() -> dict:
    return calibrated_document(_to_dict(load_profile("ci-small")), FIGURES, measured_at=AT, host="box",
                               command="ftrun calibrate --out x.toml", quick=True)


def test_profile_keys_map_figures_with_units():
    keys = profile_keys(FIGURES)
    assert keys["train.step_compute_s"][0] == 0.0006
    assert keys["network.base_latency_us"][0] == 40.0
    assert keys["network.host_nic_gbps"][:2] == (24.0, "Gbit/s")
    assert keys["ftar.kernel_reduce_gb_s"][0] == 14.0 and keys["ftar.kernel_copy_gb_s"][0] == 20.0
    assert keys["scheduler.crash_detect_s"][0] == 0.0035
    assert keys["network.crash_fin_delay_s"][0] == 0.0002
    assert keys["storage.local_write_latency_s"][0] == 0.004
    assert keys["scheduler.process_start_s"][0] == 0.009
    # per fetch minus the 2 round trips (4 one-way latencies) the modeled network already charges
    assert math.isclose(keys["train.catchup_fetch_extra_s"][0], 0.002 - 4 * 40e-6)
    for key in ONE_MACHINE:
        assert keys[key][0] == 1.0 and "derived" in keys[key][2]


def test_catchup_extra_floors_at_zero_and_missing_figures_set_nothing():
    keys = profile_keys({"catchup_per_fetch_s": fig("catchup_per_fetch_s", 1e-5),
                         "tcp_one_way_us": fig("tcp_one_way_us", 40.0, "us")})
    assert keys["train.catchup_fetch_extra_s"][0] == 0.0
    assert profile_keys({}) == {}


def test_document_round_trips_through_toml_and_loads_as_a_profile(tmp_path):
    doc = document()
    text = to_toml(doc, "header line\nsecond")
    assert text.startswith("# header line\n# second\n")
    assert tomllib.loads(text) == doc
    path = tmp_path / "calibrated.toml"
    path.write_text(text)
    p = load_profile(path)
    assert p.name == "ci-small-calibrated" and p.replicas == 4 and p.ranks_per_replica == 8
    assert p.train.step_compute_s == 0.0006 and p.ftar.kernel_reduce_gb_s == 14.0
    assert p.scheduler.crash_detect_s == 0.0035 and p.failures.events  # the base's events are kept
    cal = p.calibration
    assert cal is not None and cal.measured_at == AT and cal.host == "box" and cal.quick
    by_key = {v.key: v for v in cal.values}
    # every profile key that was set says how and when; every other figure is kept as measured.NAME
    for key in profile_keys(FIGURES):
        v = by_key[key]
        assert v.value == profile_value(p, key) and v.method and v.measured_at == AT
    assert {"measured.unix_one_way_us", "measured.shm_gb_s", "measured.catchup_ns_per_byte",
            "measured.tcp_gb_s"} <= set(by_key)
    assert "measured.step_s" not in by_key  # recorded under train.step_compute_s only


def test_a_calibrated_value_that_disagrees_with_the_profile_is_rejected():
    doc = document()
    doc["train"]["step_compute_s"] = 0.5
    with pytest.raises(ValueError, match=r"calibration\] train.step_compute_s"):
        profile_from_dict(doc)
    doc = document()
    doc["calibration"]["values"].append({"key": "train.nope", "value": 1.0, "unit": "s", "method": "m",
                                         "measured_at": AT})
    with pytest.raises(ValueError, match="unknown profile key 'train.nope'"):
        profile_from_dict(doc)
    doc = document()
    doc["calibration"]["values"][0]["method"] = ""
    with pytest.raises(ValueError, match="method"):
        profile_from_dict(doc)


def test_overriding_a_calibrated_key_drops_its_provenance():
    p = profile_from_dict(document())
    q = apply_overrides(p, ["train.step_compute_s=2", "train.steps=4"])
    assert q.train.step_compute_s == 2.0
    keys = {v.key for v in q.calibration.values}
    assert "train.step_compute_s" not in keys and "ftar.kernel_reduce_gb_s" in keys


def test_new_keys_validate():
    with pytest.raises(ValueError, match="kernel_reduce_gb_s"):
        apply_overrides(load_profile("ci-small"), ["ftar.kernel_reduce_gb_s=-1"])
    with pytest.raises(ValueError, match="crash_detect_s"):
        apply_overrides(load_profile("ci-small"), ["scheduler.crash_detect_s=-0.1"])
    with pytest.raises(ValueError, match="catchup_fetch_extra_s"):
        apply_overrides(load_profile("ci-small"), ["train.catchup_fetch_extra_s=-1"])


def test_to_toml_rejects_what_toml_cannot_hold():
    with pytest.raises(ValueError, match="x.y"):
        to_toml({"x": {"y": float("nan")}})
    with pytest.raises(ValueError, match="NoneType"):
        to_toml({"x": None})
    assert tomllib.loads(to_toml({"a b": {"c.d": [1, 2]}, "s": 'q"\n'})) == {"a b": {"c.d": [1, 2]}, "s": 'q"\n'}


def test_linear_fit():
    a, b = linear_fit([0.0, 1.0, 2.0, 3.0], [1.0, 3.0, 5.0, 7.0])
    assert math.isclose(a, 1.0) and math.isclose(b, 2.0)
    with pytest.raises(ValueError):
        linear_fit([1.0, 1.0], [2.0, 3.0])


# -- the emulator reads the calibrated keys ------------------------------------------------------------

class _Env:
    def __init__(self) -> None:
        self.clock = ManualClock()


def test_timed_catchup_charges_the_per_fetch_extra():
    from harness.run.seams import TimedCatchup

    env = _Env()
    spans = []

    class Service:
        url = "u"

        def fetch(self, step, sources):
            env.clock.sleep(0.01)  # the modeled transfer
            return "ok"

    c = TimedCatchup(Service(), env, on_fetch=lambda a, b: spans.append(b - a), extra_s=0.002)
    assert c.fetch(3, ["x"]) == "ok"
    assert spans == [pytest.approx(0.012)]


def test_emulated_kernels_charge_the_calibrated_throughput():
    import mocks.ftar_kernels
    from harness.run import EmulatedJob, JobOptions

    p = apply_overrides(load_profile("ci-small"), ["ftar.kernel_reduce_gb_s=10", "ftar.kernel_copy_gb_s=20"])
    job = EmulatedJob(p, JobOptions(steps=1))
    job._cuda_kernels = mocks.ftar_kernels
    k = job.kernels()
    assert k.reduce_bw == 10e9 and k.copy_bw == 20e9 and k.reduce_copy_bw == 7.5e9
    default = EmulatedJob(load_profile("ci-small"), JobOptions(steps=1))
    default._cuda_kernels = mocks.ftar_kernels
    assert default.kernels().reduce_bw != 10e9  # 0: the modeled GPU kernels


def test_a_crashed_hosts_connections_reset_after_the_calibrated_teardown():
    from ftrun.env.base import PeerClosed
    from harness.engine import EmulatedWorld
    from harness.profile import NetworkConfig

    net = NetworkConfig(base_latency_us=10.0, crash_fin_delay_s=0.05)
    w = EmulatedWorld(seed=0, network=net, cpu_charging=False)
    victim, survivor = w.host_env("victim"), w.host_env("survivor")

    def body():
        listener = victim.net.listen("127.0.0.1:0")
        client = survivor.net.connect(listener.addr, timeout=1.0)
        listener.accept(timeout=1.0)
        t_kill = survivor.clock.now()
        w.kill_host(victim.host)
        with pytest.raises(PeerClosed):
            client.recv(timeout=10.0)
        return survivor.clock.now() - t_kill

    seen_after = survivor.run(body)
    assert 0.05 < seen_after < 0.05 + 1e-3


# -- bad input: exit 2 naming what was wrong, before measuring anything ----------------------------------

@pytest.mark.parametrize("argv, message", [
    (["calibrate", "--out", "x.json"], "must name a .toml file"),
    (["calibrate", "--out", "/no/such/dir/x.toml"], "no such directory"),
    (["calibrate", "no_such_script.py", "--out", "x.toml"], "is not a file"),
    (["calibrate", "--profile", "nope", "--out", "x.toml"], "--profile 'nope'"),
    (["calibrate", "-m", "--out", "x.toml"], "-m needs a module name"),
    (["fidelity", "--replicas", "1"], "--replicas must be >= 2"),
    (["fidelity", "--kill-step", "90", "--steps", "80"], "--kill-step"),
    (["fidelity", "--profile", "/no/such.toml"], "is not a file"),
    (["fidelity", "--repeat", "0"], "--repeat must be >= 1"),
    (["fidelity", "--emulated-seeds", "0"], "--emulated-seeds must be >= 1"),
])
def test_bad_input_exits_2_naming_it(argv, message, capsys, tmp_path, monkeypatch):
    from ftrun.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_quorum_to_commit_spans_of_a_real_event_stream():
    from harness.calibrate import quorum_to_commit_s

    ev = [{"event": "quorum", "t": 1.0, "step": 0, "replica_id": "r0", "rank": 0},
          {"event": "commit", "t": 1.5, "step": 1, "replica_id": "r0", "rank": 0},
          {"event": "commit", "t": 1.6, "step": 1, "replica_id": "r0", "rank": 1},
          {"event": "quorum", "t": 1.7, "step": 1, "replica_id": "r0", "rank": 0},
          {"event": "commit", "t": 2.0, "step": 2, "replica_id": "r0", "rank": 0},
          {"event": "commit", "t": 3.0, "step": 9, "replica_id": "r0", "rank": 0}]
    assert quorum_to_commit_s(ev) == [pytest.approx(0.5), pytest.approx(0.3)]


def test_commit_to_quorum_spans_of_a_real_event_stream():
    from harness.calibrate import commit_to_quorum_s

    events = [{"event": "commit", "t": 1.0, "step": 1, "replica_id": "r0"},
              {"event": "quorum", "t": 1.02, "step": 1, "replica_id": "r0"},
              {"event": "commit", "t": 1.1, "step": 2, "replica_id": "r0"},
              {"event": "quorum", "t": 1.13, "step": 2, "replica_id": "r0", "rank": 1},  # not rank 0
              {"event": "quorum", "t": 1.15, "step": 2, "replica_id": "r0"}]
    assert commit_to_quorum_s(events) == pytest.approx([0.02, 0.05])


def test_bookkeeping_hop_overhead_and_cores_are_derived_from_their_figures():
    keys = profile_keys({f.name: f for f in (
        fig("script_commit_to_quorum_s", 0.030), fig("storage_write_s", 0.016), fig("storage_append_s", 1e-6),
        fig("tcp_one_way_us", 10.0, "us"), fig("ftar_sync_overhead_s", 0.004), fig("cpu_cores_effective", 1.6, "cores"))})
    assert keys["train.step_bookkeeping_s"][0] == pytest.approx(0.030 - 0.016 - 1e-6 - 20e-6)
    assert keys["ftar.sync_overhead_s"][0] == 0.004 and keys["train.shared_cpu_cores"][0] == 1.6
    assert keys["storage.local_append_latency_s"][0] == 1e-6
    keys = profile_keys({f.name: f for f in (fig("script_commit_to_quorum_s", 0.01), fig("storage_write_s", 0.016),
                                             fig("tcp_one_way_us", 10.0, "us"))})
    assert keys["train.step_bookkeeping_s"][0] == 0.0  # floored


def test_fetch_costs_take_the_small_fetch_and_the_slope():
    from harness.calibrate.measure import fetch_costs

    xs = [1e3, 1e3, 1e3, 1e6, 1e6, 2e6]
    ys = [0.05, 0.04, 0.06, 0.2, 0.2, 0.3]
    per_fetch, per_byte = fetch_costs(xs, ys)
    assert per_byte == pytest.approx(linear_fit(xs, ys)[1])
    assert per_fetch == pytest.approx(0.05 - 1e3 * per_byte)


def test_a_timed_scripts_start_sets_the_process_start():
    keys = profile_keys({f.name: f for f in (fig("zygote_start_s", 0.02), fig("script_start_s", 0.5))})
    assert keys["scheduler.process_start_s"][0] == 0.5
    assert profile_keys({"zygote_start_s": fig("zygote_start_s", 0.02)})["scheduler.process_start_s"][0] == 0.02


def test_the_crash_teardown_is_the_peers_reset_not_the_scripts_notice():
    """A survivor's notice of a mid-step kill (script_crash_detect_s) includes its own way to the next all-reduce,
    which the emulator models itself; the FINs' delay is the OS's teardown: the peer's reset."""
    keys = profile_keys({f.name: f for f in (fig("script_crash_detect_s", 0.1), fig("tcp_one_way_us", 10.0, "us"),
                                             fig("peer_reset_s", 0.003))})
    assert keys["network.crash_fin_delay_s"][0] == 0.003
    assert "network.crash_fin_delay_s" not in profile_keys({"script_crash_detect_s": fig("script_crash_detect_s", 0.1)})


def test_the_crash_teardown_is_the_scripts_own_killed_rank_where_timed():
    """A killed training rank's teardown under its job's load (the lighthouse's loss of its connection:
    script_peer_reset_s) sets the FINs' delay over an idle child's (peer_reset_s), which is then recorded as
    measured."""
    figures = {f.name: f for f in (fig("peer_reset_s", 0.008), fig("script_peer_reset_s", 0.02))}
    assert profile_keys(figures)["network.crash_fin_delay_s"][0] == 0.02
    doc = calibrated_document({"name": "ci-small"}, figures, measured_at="now", host="h", command="c", quick=False)
    recorded = {v["key"]: v["value"] for v in doc["calibration"]["values"]}
    assert recorded["network.crash_fin_delay_s"] == 0.02 and recorded["measured.peer_reset_s"] == 0.008
    assert "measured.script_peer_reset_s" not in recorded


def test_crash_detection_is_per_kill_the_survivors_first_notice():
    from harness.calibrate import crash_detections

    ev = [{"event": "kill", "t": 1.0, "replica_id": "r1"}, {"event": "abort", "t": 1.02, "replica_id": "r0"},
          {"event": "abort", "t": 1.05, "replica_id": "r0"}, {"event": "error", "t": 1.01, "replica_id": "r1"},
          {"event": "kill", "t": 2.0, "replica_id": "r1"}, {"event": "error", "t": 2.04, "replica_id": "r0"},
          {"event": "kill", "t": 3.0, "replica_id": "r1"}]  # the last kill goes unnoticed: left out
    assert crash_detections(ev) == pytest.approx([0.02, 0.04])
    assert crash_detections([]) == []


def test_the_scripts_step_and_overhead_leave_out_the_contention_the_emulator_charges_itself():
    base = (fig("step_s", 0.010), fig("script_step_period_s", 0.010), fig("cpu_cores_effective", 2.0, "cores"),
            fig("script_step_2_replicas_s", 0.030))
    # 2 ranks computing all the time (u = 1) on 2 cores: no contention in the 1-replica step; the 2-replica
    # step of 4 ranks is 2 x a step under contention, so 0.01 s of its 0.03 s is the all-reduce's overhead
    keys = profile_keys({f.name: f for f in (*base, fig("script_ranks", 2, "ranks"))})
    assert keys["train.step_compute_s"][0] == pytest.approx(0.010)
    assert keys["ftar.sync_overhead_s"][0] == pytest.approx(0.030 - 0.020)
    # 4 ranks on 2 cores: the 1-replica step met 2x contention already
    keys = profile_keys({f.name: f for f in (*base, fig("script_ranks", 4, "ranks"))})
    assert keys["train.step_compute_s"][0] == pytest.approx(0.005)
    assert keys["ftar.sync_overhead_s"][0] == pytest.approx(0.030 - 0.005 * 4)
    assert "K = 4 ranks" in keys["train.step_compute_s"][2]
    # without the ranks (a profile from before) the figures set the keys as they are
    keys = profile_keys({f.name: f for f in base})
    assert keys["train.step_compute_s"][0] == 0.010 and "ftar.sync_overhead_s" not in keys


def test_the_bookkeeping_comes_from_the_2_replica_run_where_timed():
    figures = (fig("script_commit_to_quorum_s", 0.030), fig("script_commit_to_quorum_2_replicas_s", 0.020),
               fig("storage_write_s", 0.005), fig("tcp_one_way_us", 10.0, "us"))
    keys = profile_keys({f.name: f for f in figures})
    assert keys["train.step_bookkeeping_s"][0] == pytest.approx(0.020 - 0.005 - 20e-6)
    assert "script_commit_to_quorum_2_replicas_s" in keys["train.step_bookkeeping_s"][2]


def test_commit_to_quorum_of_quorums_of_so_many_replicas():
    from harness.calibrate import commit_to_quorum_s

    ev = [{"event": "commit", "t": 1.0, "step": 1, "replica_id": "r0"},
          {"event": "quorum", "t": 1.01, "step": 1, "replica_id": "r0", "participants": ["r0", "r1"]},
          {"event": "commit", "t": 2.0, "step": 2, "replica_id": "r0"},
          {"event": "quorum", "t": 2.05, "step": 2, "replica_id": "r0", "participants": ["r0"]}]
    assert commit_to_quorum_s(ev) == pytest.approx([0.01, 0.05])
    assert commit_to_quorum_s(ev, participants=2) == pytest.approx([0.01])


def test_a_timed_loop_runs_its_reps_or_longer_until_its_minimum_time():
    """The contention probe's processes step for a minimum time, so that N of them overlap (a fixed count of
    millisecond steps let each finish before the next started, and 4 processes on 2 cores measured ~3 cores)."""
    import time

    from harness.calibrate.measure import _median_time

    calls = []
    t, n = _median_time(lambda: calls.append(time.sleep(0.002)), reps=3)
    assert n == len(calls) == 3 and t >= 0.002
    calls.clear()
    start = time.perf_counter()
    t, n = _median_time(lambda: calls.append(time.sleep(0.002)), reps=3, min_seconds=0.05)
    assert time.perf_counter() - start >= 0.05 and n == len(calls) >= 10


def test_the_write_the_scripts_runs_met_sets_the_write_and_the_bookkeeping():
    """The script's commit-to-quorum holds the writer's write as the disk was during those runs (slower under
    the job's own load than alone): the bookkeeping leaves out that write, not an idle disk's."""
    figures = {f.name: f for f in (fig("script_commit_to_quorum_2_replicas_s", 0.020), fig("storage_write_s", 0.001),
                                   fig("script_write_s", 0.008), fig("tcp_one_way_us", 10.0, "us"))}
    keys = profile_keys(figures)
    assert keys["train.step_bookkeeping_s"][0] == pytest.approx(0.020 - 0.008 - 20e-6)
    assert "script_write_s" in keys["train.step_bookkeeping_s"][2]
    assert keys["storage.local_write_latency_s"][0] == 0.008
    doc = calibrated_document(_to_dict(load_profile("ci-small")), figures, measured_at=AT, host="box",
                              command="ftrun calibrate --out x.toml", quick=True)
    recorded = {v["key"]: v["value"] for v in doc["calibration"]["values"]}
    assert recorded["measured.storage_write_s"] == 0.001 and "measured.script_write_s" not in recorded
    assert profile_keys({k: v for k, v in figures.items() if k != "script_write_s"})[
        "storage.local_write_latency_s"][0] == 0.001


def _phase(rid: str, rank: int, phase: str, step: int, t: float) -> dict:
    return {"event": "phase", "replica_id": rid, "incarnation": 0, "rank": rank, "phase": phase, "step": step, "t": t}


# One replica of 2 ranks: step 0 committed (the commit event names step 1); step 1 aborted once, then committed.
PHASED = [
    _phase("r0", 0, "started", 0, 1.000), _phase("r0", 1, "started", 0, 1.002),
    _phase("r0", 0, "forward", 0, 1.001), _phase("r0", 1, "forward", 0, 1.003),
    _phase("r0", 0, "exchange", 0, 1.011), _phase("r0", 1, "exchange", 0, 1.015),
    _phase("r0", 0, "before_commit", 0, 1.020), _phase("r0", 1, "before_commit", 0, 1.024),
    {"event": "commit", "replica_id": "r0", "incarnation": 0, "step": 1, "t": 1.028},
    _phase("r0", 0, "started", 1, 2.000), _phase("r0", 1, "started", 1, 2.001),
    _phase("r0", 0, "forward", 1, 2.001), _phase("r0", 1, "forward", 1, 2.002),
    _phase("r0", 0, "before_commit", 1, 2.030), _phase("r0", 1, "before_commit", 1, 2.031),  # its exchange failed
    {"event": "abort", "replica_id": "r0", "incarnation": 0, "step": 1, "t": 2.033},
    _phase("r0", 0, "started", 1, 3.000), _phase("r0", 1, "started", 1, 3.003),
    _phase("r0", 0, "forward", 1, 3.001), _phase("r0", 1, "forward", 1, 3.004),
    _phase("r0", 0, "exchange", 1, 3.021), _phase("r0", 1, "exchange", 1, 3.024),
    _phase("r0", 0, "before_commit", 1, 3.030), _phase("r0", 1, "before_commit", 1, 3.032),
    {"event": "commit", "replica_id": "r0", "incarnation": 0, "step": 2, "t": 3.038},
]


def test_phase_spans_votes_and_broadcasts_of_every_ranks_phase_events():
    from harness.calibrate import commit_votes, decision_broadcasts, phase_spans

    # forward -> exchange per attempt; the aborted attempt's forward has no exchange: left out
    assert sorted(phase_spans(PHASED, "forward", "exchange")) == pytest.approx([0.010, 0.012, 0.020, 0.020])
    # from the last rank's before_commit of the committed attempt to the leader's commit
    assert commit_votes(PHASED) == pytest.approx([0.004, 0.006])
    assert decision_broadcasts(PHASED) == pytest.approx([0.002, 0.003])
    one_rank = [e for e in PHASED if e.get("rank", 0) == 0]  # a replica of one rank has no vote over a comm
    assert commit_votes(one_rank) == [] and decision_broadcasts(one_rank) == []


def test_the_vote_sets_the_collective_pass_and_leaves_the_step_and_overhead():
    from harness.calibrate.provenance import STEP_PASSES, collective_pass_s

    assert collective_pass_s(0.004, 10.0) == pytest.approx((0.004 - 20e-6) / 2)
    assert collective_pass_s(10e-6, 10.0) == 0.0
    base = [fig("step_s", 0.016), fig("script_step_period_s", 0.016), fig("cpu_cores_effective", 2.0, "cores"),
            fig("script_step_2_replicas_s", 0.036), fig("script_ranks", 2, "ranks"), fig("tcp_one_way_us", 0.0, "us")]
    votes = [fig("script_commit_vote_s", 0.004), fig("script_commit_vote_2_replicas_s", 0.002)]
    keys = profile_keys({f.name: f for f in [*base, *votes]})
    assert keys["network.replica_collective_pass_s"][0] == pytest.approx(0.001)  # the 2-replica run's vote
    # each run's own collectives out of its step: 3 x 2 ms of the 1-replica step, 3 x 1 ms of the 2-replica one
    assert keys["train.step_compute_s"][0] == pytest.approx(0.016 - STEP_PASSES * 0.002)
    assert keys["ftar.sync_overhead_s"][0] == pytest.approx(0.036 - STEP_PASSES * 0.001 - 2 * 0.010)
    assert "network.replica_collective_pass_s" not in profile_keys({f.name: f for f in base})


def test_the_2_replica_steps_rise_goes_to_the_compute_as_far_as_the_compute_phase_rose():
    base = two_replica_figures(ranks=1)
    # 1 rank computing all the time (u = 1) on 2 cores: no modeled contention at 1 or 2 ranks; the rise is 20 ms
    keys = profile_keys({f.name: f for f in [*base, fig("script_compute_s", 0.008),
                                             fig("script_compute_2_replicas_s", 0.015)]})
    assert keys["train.replica_compute_extra_s"][0] == pytest.approx(0.007)
    assert keys["ftar.sync_overhead_s"][0] == pytest.approx(0.020 - 0.007)
    # a compute phase that rose by more than the step: all of the step's rise, none left for the all-reduce
    keys = profile_keys({f.name: f for f in [*base, fig("script_compute_s", 0.008),
                                             fig("script_compute_2_replicas_s", 0.040)]})
    assert keys["train.replica_compute_extra_s"][0] == pytest.approx(0.020)
    assert keys["ftar.sync_overhead_s"][0] == pytest.approx(0.0)
    # one that fell: nothing
    keys = profile_keys({f.name: f for f in [*base, fig("script_compute_s", 0.008),
                                             fig("script_compute_2_replicas_s", 0.006)]})
    assert keys["train.replica_compute_extra_s"][0] == 0.0 and keys["ftar.sync_overhead_s"][0] == pytest.approx(0.020)
    assert "train.replica_compute_extra_s" not in profile_keys({f.name: f for f in base})  # without the phases


def test_the_contention_probe_times_a_throughput_where_time_sharing_shows():
    """A step shorter than a scheduler time slice mostly runs unpreempted: the median of a process's steps left
    the time sharing out (4 processes on a 2-core box stepped at the 1-process median: 3.0-3.4 cores). The mean
    (wall time over the steps) counts a step's wait for the CPU."""
    import time

    from harness.calibrate.measure import _median_time

    delays = iter([0.001] * 9 + [0.05])
    t, n = _median_time(lambda: time.sleep(next(delays)), reps=10)
    assert n == 10 and t < 0.01
    delays = iter([0.001] * 9 + [0.05])
    t, n = _median_time(lambda: time.sleep(next(delays)), reps=10, mean=True)
    assert n == 10 and t >= (9 * 0.001 + 0.05) / 10


def test_effective_cores_fits_the_slowdown_through_zero():
    from harness.calibrate.measure import effective_cores

    assert effective_cores([0.001, 0.001, 0.0015, 0.002]) == pytest.approx(2.0)  # 2 cores, time shared fairly
    assert effective_cores([0.002, 0.002, 0.002, 0.002]) == pytest.approx(29 / 9)  # what the medians saw
    with pytest.raises(ValueError, match="effective_cores"):
        effective_cores([0.001])


def test_start_skews_pair_every_rank_of_a_step_that_all_started():
    from harness.calibrate import start_skews

    ev = [_phase("r0", 0, "started", 1, 1.000), _phase("r0", 1, "started", 1, 1.002), _phase("r1", 0, "started", 1, 1.005),
          _phase("r0", 0, "started", 2, 2.000), _phase("r1", 0, "started", 2, 2.004),  # r0 rank 1 missing: left out
          _phase("r0", 0, "started", 1, 1.500)]  # a retry of step 1: its first start counts
    assert sorted(start_skews(ev)) == pytest.approx([0.002, 0.003, 0.005])
    assert start_skews([_phase("r0", 0, "started", 1, 1.0)]) == []  # one rank: no pair


def test_the_writer_write_is_the_writers_after_commit_to_ask_less_the_others():
    from harness.calibrate import writer_writes

    quorum = lambda rid, step, t: {"event": "quorum", "replica_id": rid, "rank": 0, "step": step, "t": t,
                                   "participants": ["r1", "r0", "r2"]}
    ev = [quorum("r0", 5, 0.9), _phase("r0", 0, "after_commit", 5, 1.000), _phase("r0", 0, "quorum", 6, 1.006),
          _phase("r1", 0, "after_commit", 5, 1.000), _phase("r1", 0, "quorum", 6, 1.001),
          _phase("r2", 0, "after_commit", 5, 1.001), _phase("r2", 0, "quorum", 6, 1.003),
          _phase("r0", 1, "after_commit", 5, 1.000), _phase("r0", 1, "quorum", 6, 1.050)]  # not a leader: left out
    assert writer_writes(ev) == pytest.approx([0.006 - 0.0015])  # r0 (lowest id) less the median of 1 and 2 ms
    assert writer_writes(ev[1:]) == []  # no quorum: no writer known


def test_the_start_skew_sets_its_key_and_leaves_the_latest_ranks_wait_out_of_the_step_and_overhead():
    from harness.calibrate.provenance import median_max_exp

    assert median_max_exp(1) == pytest.approx(math.log(2))
    assert median_max_exp(2) < median_max_exp(4) < median_max_exp(8)
    with pytest.raises(ValueError, match="n >= 1"):
        median_max_exp(0)
    base = two_replica_figures(ranks=2)
    plain = profile_keys({f.name: f for f in base})
    keys = profile_keys({f.name: f for f in (*base, fig("script_start_skew_s", 0.001))})
    assert keys["train.rank_start_skew_s"][0] == 0.001
    # a step waits for the latest of its ranks beyond its leader's own late start (before its quorum event)
    assert keys["train.step_compute_s"][0] == pytest.approx(0.010 - 0.001 * (median_max_exp(2) - math.log(2)))
    assert keys["ftar.sync_overhead_s"][0] == pytest.approx(
        0.030 - 0.001 * (median_max_exp(4) - math.log(2)) - 2 * keys["train.step_compute_s"][0])
    assert keys["ftar.sync_overhead_s"][0] != plain["ftar.sync_overhead_s"][0]
    assert "late starts" in keys["train.step_compute_s"][2]
    recorded = recorded_keys({f.name: f for f in (*base, fig("script_start_skew_s", 0.001))})
    assert "train.rank_start_skew_s" in recorded and "measured.script_start_skew_s" not in recorded
    # the leader's own late start lies between its commit and its quorum event: not bookkeeping
    after = [fig("script_commit_to_quorum_2_replicas_s", 0.010), fig("storage_write_s", 0.002),
             fig("tcp_one_way_us", 10.0, "us")]
    plain = profile_keys({f.name: f for f in after})
    keys = profile_keys({f.name: f for f in (*after, fig("script_start_skew_s", 0.001))})
    assert plain["train.step_bookkeeping_s"][0] - keys["train.step_bookkeeping_s"][0] == pytest.approx(0.001 * math.log(2))


def test_the_write_prefers_the_scripts_own_writer_and_records_the_others_as_measured():
    from harness.calibrate.provenance import write_figure

    figures = {f.name: f for f in (fig("storage_write_s", 0.001), fig("script_write_s", 0.006),
                                   fig("script_writer_write_s", 0.003), fig("tcp_one_way_us", 10.0, "us"),
                                   fig("script_commit_to_quorum_2_replicas_s", 0.010))}
    assert write_figure(figures).name == "script_writer_write_s"
    keys = profile_keys(figures)
    assert keys["storage.local_write_latency_s"][0] == 0.003
    assert keys["train.step_bookkeeping_s"][0] == pytest.approx(0.010 - 0.003 - 20e-6)
    measured = recorded_keys(figures)
    assert {"measured.storage_write_s", "measured.script_write_s"} <= measured
    assert "measured.script_writer_write_s" not in measured


def test_the_2_replica_contention_takes_that_runs_own_busy_share():
    """The emulator's contention takes a rank's busy share of the job's step period as it runs: in a 2-replica run
    the ranks wait in the all-reduce for part of the period, so its contention is 2K u2 / c with u2 = (step_compute_s
    + bookkeeping) / that run's period, not the 1-replica run's u (~1: a lone replica computes all the time)."""
    base = two_replica_figures(ranks=2)
    keys = profile_keys({f.name: f for f in (*base, fig("script_commit_to_quorum_2_replicas_s", 0.010))})
    u2 = 0.010 / 0.040  # no bookkeeping timed (no write figure): 4 ranks x 0.25 / 2 cores: no contention
    assert keys["train.step_compute_s"][0] == pytest.approx(0.010)
    assert keys["ftar.sync_overhead_s"][0] == pytest.approx(0.030 - 0.010 * max(1.0, 4 * u2 / 2))
    assert "u2 = 0.25" in keys["ftar.sync_overhead_s"][2]


def test_exchange_skews_pair_the_replicas_commits_of_every_step_all_committed():
    from harness.calibrate import exchange_skews

    commit = lambda rid, step, t, rank=0: {"event": "commit", "replica_id": rid, "incarnation": 0, "rank": rank,
                                           "step": step, "t": t}
    ev = [commit("r0", 1, 1.000), commit("r1", 1, 1.004), commit("r2", 1, 1.001), commit("r1", 1, 1.5, rank=1),
          commit("r0", 2, 2.000), commit("r1", 2, 2.004)]  # r2 did not commit step 2: left out
    assert sorted(exchange_skews(ev)) == pytest.approx([0.001, 0.003, 0.004])
    assert exchange_skews(ev[:1]) == []  # one replica: no pair


def test_the_exchange_skew_sets_its_key_and_leaves_the_leaders_wait_for_its_later_rank_out_of_the_overhead():
    from harness.calibrate.provenance import median_abs_diff_max_exp, median_max_exp

    assert median_abs_diff_max_exp(1) == pytest.approx(math.log(2), rel=1e-4)  # |a - b| of two exponentials
    assert median_abs_diff_max_exp(1) < median_abs_diff_max_exp(2) < median_abs_diff_max_exp(4)
    with pytest.raises(ValueError, match="k >= 1"):
        median_abs_diff_max_exp(0)
    base = two_replica_figures(ranks=2)
    plain = profile_keys({f.name: f for f in base})
    keys = profile_keys({f.name: f for f in (*base, fig("script_exchange_skew_s", 0.002))})
    assert keys["train.rank_exchange_skew_s"][0] == 0.002
    assert keys["train.step_compute_s"] == plain["train.step_compute_s"]  # one replica: no peer, no late wake
    assert plain["ftar.sync_overhead_s"][0] - keys["ftar.sync_overhead_s"][0] == pytest.approx(0.002 * median_max_exp(2))
    assert "late wakes" in keys["ftar.sync_overhead_s"][2]
    recorded = recorded_keys({f.name: f for f in (*base, fig("script_exchange_skew_s", 0.002))})
    assert "train.rank_exchange_skew_s" in recorded and "measured.script_exchange_skew_s" not in recorded


def test_the_read_latency_is_the_measured_file_read():
    keys = profile_keys({"storage_read_s": fig("storage_read_s", 14e-6)})
    assert keys["storage.local_read_latency_s"][0] == 14e-6
    assert recorded_keys({"storage_read_s": fig("storage_read_s", 14e-6)}) == {"storage.local_read_latency_s"}


def test_cpu_shares_are_each_ranks_cpu_over_wall_between_its_quorum_phases_of_consecutive_steps():
    from harness.calibrate import cpu_shares, cpu_steps, phase_figures

    def q(rid, rank, step, t, cpu, inc=0):
        return {**_phase(rid, rank, "quorum", step, t), "incarnation": inc, "cpu": cpu}

    events = [q("r0", 0, 1, 1.00, 0.50), q("r0", 0, 1, 1.05, 0.51),  # a retried quorum of step 1: the first counts
              q("r0", 0, 2, 1.10, 0.54), q("r0", 0, 3, 1.20, 0.60),
              q("r0", 1, 1, 1.00, 0.20), q("r0", 1, 3, 1.30, 0.30),  # rank 1 has no step 2: no pair
              q("r1", 0, 5, 2.00, 1.00, inc=1), q("r1", 0, 6, 2.10, 1.05, inc=1),
              q("r1", 0, 6, 9.00, 9.00, inc=2),  # another incarnation: not paired with the first
              _phase("r0", 0, "quorum", 4, 1.30)]  # no cpu (older events): left out
    assert sorted(cpu_shares(events)) == pytest.approx([0.4, 0.5, 0.6])
    assert sorted(cpu for cpu, _ in cpu_steps(events)) == pytest.approx([0.04, 0.05, 0.06])
    share, step = [f for f in phase_figures(events, "a run", "_2_replicas") if f.name.startswith("script_cpu")]
    assert share.name == "script_cpu_share_2_replicas" and share.value == pytest.approx(0.5) and share.unit == "share"
    assert step.name == "script_cpu_step_2_replicas_s" and step.value == pytest.approx(0.05) and step.unit == "s"
    assert cpu_shares(PHASED) == []


def test_the_2_replica_runs_cpu_figures_count_only_the_steps_both_replicas_trained():
    """In the 2-replica calibration run r1 is killed and restarted: r0's steps alone, the step a kill aborted and
    the joiner's catch-up step are not what a step of 2 replicas costs."""
    from harness.calibrate import cpu_steps, full_steps, phase_figures

    def q(rid, step, t, cpu, inc=0):
        return {**_phase(rid, 0, "quorum", step, t), "incarnation": inc, "cpu": cpu}

    def quorum(rid, step, members, behind=(), inc=0):
        return {"event": "quorum", "rank": 0, "replica_id": rid, "incarnation": inc, "step": step,
                "participants": list(members), "behind": list(behind)}

    both = ("r0", "r1")
    events = [quorum("r0", 1, both), q("r0", 1, 1.00, 0.50), quorum("r0", 2, both), q("r0", 2, 1.10, 0.56),
              quorum("r0", 3, both), q("r0", 3, 1.20, 0.62),  # 1 -> 2 -> 3: two steps of both, 6 ms of CPU each
              quorum("r0", 3, ("r0",)),  # the kill's retry of step 3 (its first quorum had both): still step 3's
              quorum("r0", 4, ("r0",)), q("r0", 4, 1.25, 0.625),  # alone: 3 -> 4 and 4 -> 5 left out
              quorum("r0", 5, both, behind=("r1",)), q("r0", 5, 1.30, 0.63),  # r1 catching up: 5 -> 6 left out
              quorum("r0", 6, both), q("r0", 6, 1.40, 0.70), quorum("r0", 7, both), q("r0", 7, 1.50, 0.76)]
    assert full_steps(events, 2) == {("r0", 0, s) for s in (1, 2, 3, 6, 7)}
    assert sorted(round(cpu, 6) for cpu, _ in cpu_steps(events, 2)) == [0.06, 0.06, 0.06]
    assert len(cpu_steps(events)) == 6  # unfiltered: every consecutive pair
    share, step = [f for f in phase_figures(events, "a run", "_2_replicas", participants=2)
                   if f.name.startswith("script_cpu")]
    assert step.value == pytest.approx(0.06) and step.samples == 3 and "all 2 replicas trained" in step.method
    assert share.value == pytest.approx(0.6)


def test_a_ranks_all_reduce_cpu_is_from_its_exchange_phase_to_its_before_commit_phase():
    from harness.calibrate import phase_cpu, phase_figures

    def ph(rid, phase, step, t, cpu, rank=0):
        return {**_phase(rid, rank, phase, step, t), "incarnation": 0, "cpu": cpu}

    def quorum(step, members):
        return {"event": "quorum", "rank": 0, "replica_id": "r0", "incarnation": 0, "step": step,
                "participants": list(members), "behind": []}

    both = ("r0", "r1")
    events = [quorum(1, both), ph("r0", "exchange", 1, 1.00, 0.50), ph("r0", "before_commit", 1, 1.01, 0.502),
              ph("r0", "exchange", 1, 1.00, 0.20, rank=1), ph("r0", "before_commit", 1, 1.02, 0.203, rank=1),
              quorum(2, ("r0",)), ph("r0", "exchange", 2, 1.10, 0.60), ph("r0", "before_commit", 2, 1.11, 0.601),
              ph("r0", "exchange", 3, 1.20, 0.70),  # no before_commit: the all-reduce failed, left out
              ph("r0", "exchange", 4, 1.30, 0.80), ph("r0", "before_commit", 5, 1.31, 0.81),  # another step's
              {**_phase("r0", 0, "exchange", 6, 1.4), "incarnation": 0}]  # no cpu (older events): left out
    assert sorted(round(c, 6) for c in phase_cpu(events, "exchange", "before_commit")) == [0.001, 0.002, 0.003]
    assert sorted(round(c, 6) for c in phase_cpu(events, "exchange", "before_commit", 2)) == [0.002, 0.003]
    cpu, = [f for f in phase_figures(events, "a run", "_2_replicas", participants=2)
            if f.name == "script_allreduce_cpu_2_replicas_s"]
    assert cpu.value == pytest.approx(0.0025) and cpu.samples == 2 and cpu.unit == "s"


def test_the_ring_cpu_is_the_all_reduce_cpus_rise_from_1_replica_to_2():
    keys = profile_keys({f.name: f for f in [fig("script_allreduce_cpu_s", 0.00005),
                                              fig("script_allreduce_cpu_2_replicas_s", 0.00113)]})
    assert keys["train.rank_ring_cpu_s"][0] == pytest.approx(0.00108)
    assert "less the 1-replica run's" in keys["train.rank_ring_cpu_s"][2]
    lower = profile_keys({f.name: f for f in [fig("script_allreduce_cpu_s", 0.002),
                                              fig("script_allreduce_cpu_2_replicas_s", 0.001)]})
    assert lower["train.rank_ring_cpu_s"][0] == 0.0  # noise below the 1-replica run's: no negative traffic cost
    assert "train.rank_ring_cpu_s" not in profile_keys({"script_allreduce_cpu_s": fig("script_allreduce_cpu_s", 1e-4)})


def test_the_2_replica_runs_cpu_share_sets_the_queues_calibration_point():
    keys = profile_keys({f.name: f for f in [fig("script_cpu_share_2_replicas", 0.42, "share"),
                                              fig("script_cpu_share", 0.3, "share"), fig("script_ranks", 2, "ranks"),
                                              fig("script_cpu_step_2_replicas_s", 0.006)]})
    assert keys["train.rank_cpu_share"][0] == pytest.approx(0.42) and keys["train.rank_cpu_step_s"][0] == 0.006
    assert keys["train.rank_cpu_share_ranks"][0] == 4
    busy = profile_keys({f.name: f for f in [fig("script_cpu_share_2_replicas", 1.3, "share"), fig("script_ranks", 1)]})
    assert busy["train.rank_cpu_share"][0] == 1.0  # a process's threads can add up past a core: at most 1
    assert "train.rank_cpu_share" not in profile_keys({"script_ranks": fig("script_ranks", 1)})


def test_a_retry_after_a_peer_died_costs_its_cpu_over_the_next_steps_with_as_many_replicas():
    """The first attempt of a rank whose leader's quorum event has fewer participants than its attempt before (a
    replica of its quorum died mid-step): its CPU from its quorum phase to the next less the median of its next
    attempts' with as many participants; not the joiner's rejoin (more participants), nor a retry without them."""
    from harness.calibrate import retry_cpus

    def q(step, t, cpu, rank=0):
        return {**_phase("r0", rank, "quorum", step, t), "cpu": cpu}

    def quorum(step, t, members):
        return {"event": "quorum", "rank": 0, "replica_id": "r0", "incarnation": 0, "step": step, "t": t,
                "participants": list(members)}

    both, alone = ("r0", "r1"), ("r0",)
    events = [q(1, 1.00, 0.500), quorum(1, 1.001, both),
              q(2, 1.10, 0.505), quorum(2, 1.101, both),  # step 2's first attempt: r1 died in it
              q(2, 1.20, 0.510), quorum(2, 1.201, alone),  # the retry: 9 ms of CPU
              q(3, 1.30, 0.519), quorum(3, 1.301, alone), q(4, 1.40, 0.522), quorum(4, 1.401, alone),
              q(5, 1.50, 0.525), quorum(5, 1.501, alone),  # 3, 3 and 4 ms alone
              q(6, 1.60, 0.529), quorum(6, 1.601, both),  # r1 back: more participants, no retry
              q(7, 1.70, 0.540)]
    assert retry_cpus(events, after=3) == pytest.approx([0.009 - 0.003])
    assert retry_cpus(events, after=4) == []  # the fourth attempt after it had both replicas
    assert retry_cpus([e for e in events if e["event"] != "quorum"]) == []  # no quorum events: no retry known


def test_a_retrys_cpu_is_the_ranks_own_retry_plus_the_ring_it_rebuilds_with_peers():
    """train.rank_retry_cpu_s: the 2-replica run's r0 retries into a ring of 1 (its own retry work), and an FTAR ring
    rebuilt with a peer (`ftar_rebuild`), which a ring of 1 does not have; either alone where only it was measured."""
    own, ring = fig("script_retry_cpu_2_replicas_s", 0.0005), fig("ftar_rebuild_cpu_s", 0.0006)
    both = profile_keys({f.name: f for f in (own, ring)})["train.rank_retry_cpu_s"]
    assert both[0] == pytest.approx(0.0011) and both[1] == "s" and "plus" in both[2]
    assert profile_keys({ring.name: ring})["train.rank_retry_cpu_s"][0] == 0.0006
    assert profile_keys({own.name: own})["train.rank_retry_cpu_s"][0] == 0.0005
    assert "train.rank_retry_cpu_s" not in profile_keys({})


@pytest.mark.timeout(120)
def test_ftar_rebuild_measures_two_real_engines_and_leaves_no_process():
    import multiprocessing

    from ftrun.config import FtarConfig
    from harness.calibrate.measure import ftar_rebuild

    f = ftar_rebuild(config=FtarConfig(chunk_bytes=2048, num_chunks=2), nbytes=8192, reps=3)
    assert f.name == "ftar_rebuild_cpu_s" and f.unit == "s" and 0.0 <= f.value < 0.5 and f.samples == 6
    assert "chunk_bytes 2048" in f.method
    assert multiprocessing.active_children() == []
