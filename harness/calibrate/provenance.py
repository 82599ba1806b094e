"""From measured figures to a calibrated profile document, and that document to TOML. Pure: no I/O.

    keys = profile_keys(figures)                       # profile key -> (value, unit, method, samples)
    doc = calibrated_document(base, figures, measured_at=..., host=..., command=..., quick=...)
    text = to_toml(doc)                                # load_profile reads it back (and checks it)

Every key set from a measurement appears in `[[calibration.values]]` with its value, unit, how it was
measured (or derived from which measurements) and when; every figure that sets no key is recorded there
too, as `measured.NAME`. `harness.profile.Profile` checks on load that each calibrated key still holds the
value its entry says (an override of a calibrated key drops that entry).
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any, Mapping

from harness.calibrate.measure import Figure

# On one machine every hop between emulated hosts is the same 127.0.0.1 path: no hop classes, no
# oversubscription. These keys are set by that fact, not by a measurement (their method says so).
ONE_MACHINE = {
    "network.same_host_factor": 1.0,
    "network.same_rack_factor": 1.0,
    "network.other_rack_factor": 1.0,
    "network.other_zone_factor": 1.0,
    "network.other_building_factor": 1.0,
    "network.cross_zone_oversubscription": 1.0,
}
# Round trips the emulated catch-up already charges per fetch on the modeled network (the manifest
# request and the shard request): the measured per-fetch cost above them is the real client and server's
# own work, which train.catchup_fetch_extra_s adds.
CATCHUP_MODELED_ROUND_TRIPS = 2


def profile_keys(figures: Mapping[str, Figure]) -> dict[str, tuple[float, str, str, int]]:
    """Profile key -> (value in the key's unit, unit, method, samples), for the figures present."""
    out: dict[str, tuple[float, str, str, int]] = {}

    def direct(key: str, name: str, scale: float = 1.0, unit: str | None = None, note: str = "") -> None:
        f = figures.get(name)
        if f is not None:
            out[key] = (f.value * scale, unit or f.unit, f.method + note, f.samples)

    direct("train.step_compute_s", "step_s")
    direct("network.base_latency_us", "tcp_one_way_us")
    direct("network.host_nic_gbps", "tcp_gb_s", 8.0, "Gbit/s", " (x 8: GB/s to Gbit/s)")
    direct("network.loopback_gbps", "tcp_gb_s", 8.0, "Gbit/s",
           " (x 8: GB/s to Gbit/s; same-host ranks of `ftrun launch` talk over 127.0.0.1 TCP too)")
    direct("ftar.kernel_reduce_gb_s", "ftar_reduce_gb_s")
    direct("ftar.kernel_copy_gb_s", "ftar_copy_gb_s")
    direct("scheduler.crash_detect_s", "crash_detect_s")
    # The OS's teardown of a killed process, not a survivor's notice of it (measured.script_crash_detect_s, which
    # adds the survivor's own way to its next all-reduce: the emulator models that way itself): a killed rank of
    # the script as its job's lighthouse saw it reset, where timed (a training rank's teardown under the job's
    # load took 11-81 ms in 64 kills at load 4-10, an idle child's 8-19 ms: benchmarks/results/fidelity.md), else the
    # idle child's.
    direct("network.crash_fin_delay_s", "script_peer_reset_s" if "script_peer_reset_s" in figures else "peer_reset_s")
    write = write_figure(figures)
    if write is not None:
        direct("storage.local_write_latency_s", write.name)
    direct("train.shared_cpu_cores", "cpu_cores_effective",
           note=" (the rank processes of an `ftrun launch` job on this machine share them)")
    if "script_start_s" in figures:  # the script's own start, where a script was timed
        direct("scheduler.process_start_s", "script_start_s")
    else:
        direct("scheduler.process_start_s", "zygote_start_s", note=" (a restarted replica's ranks are zygote children)")
    fetch, lat = figures.get("catchup_per_fetch_s"), figures.get("tcp_one_way_us")
    if fetch is not None and lat is not None:
        modeled = CATCHUP_MODELED_ROUND_TRIPS * 2 * lat.value * 1e-6
        out["train.catchup_fetch_extra_s"] = (
            max(fetch.value - modeled, 0.0), "s",
            f"measured.catchup_per_fetch_s ({fetch.value:.6g} s) minus the {CATCHUP_MODELED_ROUND_TRIPS} round trips "
            f"the emulated fetch already pays on the modeled network (2 x 2 x {lat.value:.3g} us), floored at 0",
            fetch.samples)
    direct("storage.local_append_latency_s", "storage_append_s")
    direct("storage.local_read_latency_s", "storage_read_s")
    direct("ftar.sync_overhead_s", "ftar_sync_overhead_s")
    skew = figures.get("script_start_skew_s")
    m = skew.value if skew is not None else 0.0
    if skew is not None:
        out["train.rank_start_skew_s"] = (m, "s", skew.method, skew.samples)
    direct("train.rank_exchange_skew_s", "script_exchange_skew_s")
    # a rank's busy share where the skews above are measured (the 2-replica run), and that run's rank processes: the
    # calibration point of the CPU queue (train.shared_cpu_model = "queue", harness.run.cpu_queue)
    share, ranks = figures.get("script_cpu_share_2_replicas"), figures.get("script_ranks")
    if share is not None and ranks is not None:
        out["train.rank_cpu_share"] = (min(share.value, 1.0), "share", share.method + ", at most 1", share.samples)
        out["train.rank_cpu_share_ranks"] = (2 * ranks.value, "ranks", "2 x measured.script_ranks: the rank processes "
                                             "of the 2-replica run that measured train.rank_cpu_share (not measured: "
                                             "its layout)", 1)
    direct("train.rank_cpu_step_s", "script_cpu_step_2_replicas_s")
    # a retry after a peer died: the rank's own retry work (the 2-replica run's r0 retries into a ring of 1) and the
    # FTAR ring it rebuilds with its peers (a ring of 1 has none)
    own, ring = figures.get("script_retry_cpu_2_replicas_s"), figures.get("ftar_rebuild_cpu_s")
    if own is not None or ring is not None:
        parts = [f for f in (own, ring) if f is not None]
        out["train.rank_retry_cpu_s"] = (sum(f.value for f in parts), "s", " plus ".join(
            f"measured.{f.name} ({f.value:.6g} s: {f.method})" for f in parts), min(f.samples for f in parts))
    # what a rank's all-reduce CPU rises by from 1 replica (a ring of one: no traffic) to 2: its ring's traffic
    one, two = figures.get("script_allreduce_cpu_s"), figures.get("script_allreduce_cpu_2_replicas_s")
    if one is not None and two is not None:
        out["train.rank_ring_cpu_s"] = (max(two.value - one.value, 0.0), "s", f"{two.method}: {two.value:.6g} s, less "
                                        f"the 1-replica run's ({one.value:.6g} s: {one.method}), floored at 0",
                                        min(one.samples, two.samples))
    # the 2-replica run's, where timed: the runs the emulator stands in for have 2 or more replicas
    after = figures.get("script_commit_to_quorum_2_replicas_s") or figures.get("script_commit_to_quorum_s")
    if after is not None and write is not None and lat is not None:
        append = figures["storage_append_s"].value if "storage_append_s" in figures else 0.0
        late = m * math.log(2)  # the leader's own late start after the decision, the median draw
        out["train.step_bookkeeping_s"] = (
            max(after.value - write.value - append - 2 * lat.value * 1e-6 - late, 0.0), "s",
            f"measured.{after.name} ({after.value:.6g} s) minus what the emulator charges there itself: "
            f"one loader_state write ({write.name} {write.value:.6g} s), one audit append ({append:.3g} s), the "
            f"quorum round trip (2 x {lat.value:.3g} us) and the leader's late start (train.rank_start_skew_s x "
            f"ln 2: {late:.3g} s), floored at 0", after.samples)
    vote = figures.get("script_commit_vote_2_replicas_s") or figures.get("script_commit_vote_s")
    if vote is not None and lat is not None:
        out["network.replica_collective_pass_s"] = (
            collective_pass_s(vote.value, lat.value), "s",
            f"(measured.{vote.name} ({vote.value:.6g} s) minus the 2 one-way latencies ({lat.value:.3g} us) the "
            "emulated tree all-reduce already pays) / 2 passes, floored at 0: what a pass of a collective over the "
            "replica's gloo comm costs on this machine beyond the modeled network", vote.samples)
    out.update(_without_contention(figures, out))
    if "tcp_one_way_us" in figures:
        for key, value in ONE_MACHINE.items():
            out[key] = (value, "", "derived, not measured: on one machine every hop is 127.0.0.1", 1)
    return out


# The loader_state write, best first: the script's own writer in its 2-replica run (its phase events), a write
# sampled in this process while the script's runs ran (the job's own load slows the disk), an idle disk's.
WRITE_FIGURES = ("script_writer_write_s", "script_write_s", "storage_write_s")


def write_figure(figures: Mapping[str, Figure]) -> Figure | None:
    """The write the script's runs met (WRITE_FIGURES' first present): what storage.local_write_latency_s takes
    and the bookkeeping leaves out. Pure."""
    return next((figures[n] for n in WRITE_FIGURES if n in figures), None)


# Tree passes of the collectives of one step over a replica's comm that the emulator charges
# network.replica_collective_pass_s for on the leader's way from quorum to commit (harness.run.fold.FoldedComm):
# the decision's broadcast (1: its other ranks start that much later, and the vote waits for them) and the commit
# vote's all-reduce (2).
STEP_PASSES = 3


def collective_pass_s(vote_s: float, one_way_us: float) -> float:
    """One pass of a collective over the replica's comm beyond the modeled network: the measured vote (an
    all-reduce, 2 passes) less its 2 modeled one-way latencies, halved, floored at 0. Pure."""
    return max(vote_s - 2 * one_way_us * 1e-6, 0.0) / 2


def median_max_exp(n: int) -> float:
    """The median of the largest of n independent exponential draws of mean 1: -ln(1 - 2^(-1/n)). A step of n
    ranks with late starts of mean m waits about m x (this - ln 2) for its latest rank beyond its leader's own
    (ln 2: the median of one draw; the leader's lies before its quorum event). Pure."""
    if n < 1:
        raise ValueError(f"median_max_exp needs n >= 1 ranks, got {n}")
    return -math.log(1.0 - 0.5 ** (1.0 / n))


def median_abs_diff_max_exp(k: int) -> float:
    """The median of |X - Y| for X, Y each the largest of k independent exponential draws of mean 1 (ln 2 for k = 1:
    the difference of two exponentials is exponential again): how far apart two replicas of k ranks commit when
    each rank wakes from the all-reduce that late and the replica's vote waits for its latest rank. Numerical
    (Simpson's rule over P(|X - Y| <= d), bisection on d). Pure."""
    if k < 1:
        raise ValueError(f"median_abs_diff_max_exp needs k >= 1 ranks, got {k}")
    return _median_abs_diff_max_exp(k)


@functools.lru_cache(maxsize=None)
def _median_abs_diff_max_exp(k: int) -> float:
    n, top = 2000, 30.0 + math.log(k)  # Simpson intervals (even) over [0, top]: the tail beyond is < 1e-12
    h = top / n
    xs = [i * h for i in range(n + 1)]
    weights = [h / 3 * (1 if i in (0, n) else 4 if i % 2 else 2) for i in range(n + 1)]
    pdf = [k * math.exp(-x) * (1 - math.exp(-x)) ** (k - 1) for x in xs]

    def cdf(x: float) -> float:
        return (1 - math.exp(-x)) ** k if x > 0 else 0.0

    def within(d: float) -> float:  # P(|X - Y| <= d)
        return sum(w * f * (cdf(x + d) - cdf(x - d)) for w, f, x in zip(weights, pdf, xs))

    lo, hi = 0.0, top
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if within(mid) < 0.5 else (lo, mid)
    return (lo + hi) / 2


def _without_contention(figures: Mapping[str, Figure], keys: Mapping[str, tuple]) -> dict[str, tuple]:
    """The script's step and all-reduce overhead less the CPU contention the emulator charges on top of them
    (harness.run.job's contention_extra_s: a step of N live ranks takes step_compute_s x max(1, N u / c)):
    the script's 1-replica step of K ranks already met the contention of K ranks, its 2-replica step that of
    2K, so step_compute_s = step / max(1, K u / c) and the overhead is the 2-replica step less
    step_compute_s x max(1, 2K u / c). u: the share of a step a rank computes, (step + bookkeeping) / the
    script's step period. Only with the script's ranks, its period and the machine's cores measured. With the
    phase figures: each step also less its collectives over the replica's comm (STEP_PASSES x the pass cost
    its own run's vote gives: the emulator charges them in the comm), and of the 2-replica step's rise, what lands
    in a rank's compute phase (its measured rise from 1 to 2 replicas beyond the contention model's) is
    train.replica_compute_extra_s, the rest ftar.sync_overhead_s."""
    need = ("step_s", "script_ranks", "script_step_period_s", "cpu_cores_effective")
    if not all(name in figures for name in need) or figures["cpu_cores_effective"].value <= 0:
        return {}
    one, k = figures["step_s"], figures["script_ranks"].value
    c = figures["cpu_cores_effective"].value
    bookkeeping = keys.get("train.step_bookkeeping_s", (0.0,))[0]
    u = min(1.0, (one.value + bookkeeping) / figures["script_step_period_s"].value)
    lat = figures["tcp_one_way_us"].value if "tcp_one_way_us" in figures else 0.0

    def comm_s(name: str) -> float:  # the collectives the emulator charges in a step, as the run `name` met them
        f = figures.get(name)
        return 0.0 if f is None or k < 2 else STEP_PASSES * collective_pass_s(f.value, lat)

    comm_1 = comm_s("script_commit_vote_s")
    m = keys.get("train.rank_start_skew_s", (0.0,))[0]

    def skew_s(ranks: float) -> float:  # the wait for the latest of `ranks` ranks' late starts beyond the leader's own
        return m * (median_max_exp(round(ranks)) - math.log(2)) if m else 0.0

    base = max(one.value - comm_1 - skew_s(k), 0.0) / max(1.0, k * u / c)
    why = f"(K = {k:g} ranks, u = {u:.3g}, c = {c:.3g} cores)"
    less = (f" less the step's collectives over the replica's comm as that run met them ({STEP_PASSES} passes of "
            f"measured.script_commit_vote_s / 2: {comm_1:.6g} s)") if comm_1 else ""
    if m:
        less += (f" less the wait for the latest of its K ranks' late starts beyond the leader's (train.rank_start_skew_s "
                 f"{m:.6g} s x (median_max_exp(K) - ln 2): {skew_s(k):.6g} s)")
    out = {"train.step_compute_s": (base, "s", f"{one.method} ({one.value:.6g} s){less}, divided by the contention "
                                    f"of its K ranks, max(1, K u / c) {why}", one.samples)}
    two = figures.get("script_step_2_replicas_s")
    if two is None:
        return out
    comm_2 = comm_s("script_commit_vote_2_replicas_s")
    # u of the 2-replica run: the emulator's contention takes a rank's busy share of the job's step period as the
    # job runs (its ranks wait in the all-reduce for part of it), so the 2-replica step's is (step_compute_s +
    # bookkeeping) / that run's period (its quorum-to-commit plus commit-to-quorum), where timed; else the 1-replica u
    after_2 = figures.get("script_commit_to_quorum_2_replicas_s")
    u2 = min(1.0, (base + bookkeeping) / (two.value + after_2.value)) if after_2 is not None else u
    # the leader's commit waits for the latest of its K ranks' late wakes from the all-reduce (a 1-replica step's
    # all-reduce has no peer to wait for: no wake there)
    mx = keys.get("train.rank_exchange_skew_s", (0.0,))[0]
    woke = mx * median_max_exp(round(k))
    rise = max(two.value - comm_2 - skew_s(2 * k) - woke - base * max(1.0, 2 * k * u2 / c), 0.0)
    what = (f"measured.script_step_2_replicas_s ({two.value:.6g} s) less its collectives over the replica's comm "
            f"({comm_2:.6g} s), the wait for the latest of its 2K ranks' late starts beyond the leader's "
            f"({skew_s(2 * k):.6g} s), the wait for the latest of its K ranks' late wakes from the all-reduce "
            f"(train.rank_exchange_skew_s x median_max_exp(K): {woke:.6g} s) "
            f"and the step of 2K ranks under contention, step_compute_s x max(1, 2K u2 / c) "
            f"(u2 = {u2:.3g}: that run's busy share of its step period) {why}, floored at 0")
    c1, c2 = figures.get("script_compute_s"), figures.get("script_compute_2_replicas_s")
    if c1 is None or c2 is None:
        out["ftar.sync_overhead_s"] = (rise, "s", what, two.samples)
        return out
    # Where the rise lands: a rank's compute phase grows with a second replica (the other replica's ranks compute
    # on the same CPUs); that part is compute, the rest is the all-reduce's overhead.
    modeled = base * (max(1.0, 2 * k * u2 / c) - max(1.0, k * u / c))  # the compute's rise the contention model makes
    compute = min(max(c2.value - c1.value - modeled, 0.0), rise)
    out["train.replica_compute_extra_s"] = (
        compute, "s", f"measured.script_compute_2_replicas_s ({c2.value:.6g} s) less measured.script_compute_s "
        f"({c1.value:.6g} s: a rank's compute phase at 2 replicas and at 1) and the rise the contention model "
        f"charges between K and 2K ranks ({modeled:.6g} s), within [0, the 2-replica step's rise {rise:.6g} s]: "
        f"{what}", min(c1.samples, c2.samples))
    out["ftar.sync_overhead_s"] = (rise - compute, "s", f"the 2-replica step's rise ({rise:.6g} s: {what}) less "
                                   f"what of it lands in the compute (train.replica_compute_extra_s {compute:.6g} s)",
                                   two.samples)
    return out


# Figures that set a key one to one are recorded under that key only.
_ONE_TO_ONE = {"step_s", "cpu_cores_effective", "storage_append_s", "storage_read_s", "ftar_sync_overhead_s", "ftar_reduce_gb_s", "ftar_copy_gb_s", "crash_detect_s", "tcp_one_way_us", "peer_reset_s",
               *WRITE_FIGURES, "script_peer_reset_s", "script_start_skew_s", "script_exchange_skew_s",
               "script_cpu_step_2_replicas_s"}


def calibrated_document(base: Mapping[str, Any], figures: Mapping[str, Figure], *, measured_at: str, host: str,
                        command: str, quick: bool) -> dict[str, Any]:
    """`base` (a profile as a dict, harness.profile._to_dict) with the measured keys set and a
    [calibration] table. The name becomes "<base>-calibrated" unless the base is calibrated already."""
    doc = json.loads(json.dumps(base))  # a deep copy of plain data
    doc.pop("calibration", None)
    if not str(doc.get("name", "")).endswith("-calibrated"):
        doc["name"] = f"{doc.get('name', 'profile')}-calibrated"
    doc["description"] = f"{base.get('description', '')} -- calibrated on {host} at {measured_at}".lstrip(" -")
    values = []
    for key, (value, unit, method, samples) in profile_keys(figures).items():
        *parents, leaf = key.split(".")
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        values.append({"key": key, "value": float(value), "unit": unit, "method": method,
                       "measured_at": measured_at, "samples": samples})
    # the writes / peer_reset_s that set no key (it took a better figure): recorded as measured
    write = write_figure(figures)
    alone = {n for n in WRITE_FIGURES if write is not None and n != write.name} | (
        {"peer_reset_s"} if "script_peer_reset_s" in figures else set())
    for name, f in figures.items():
        if name not in _ONE_TO_ONE or name in alone:
            values.append({"key": f"measured.{name}", "value": float(f.value), "unit": f.unit, "method": f.method,
                           "measured_at": measured_at, "samples": f.samples})
    doc["calibration"] = {"measured_at": measured_at, "host": host, "command": command, "quick": quick,
                          "values": values}
    return doc


# -- TOML ------------------------------------------------------------------------------------------

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE.match(k) else json.dumps(k)


def _scalar(v: Any, where: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"{where}: TOML cannot hold {v!r}")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list) and not any(isinstance(x, dict) for x in v):
        return "[" + ", ".join(_scalar(x, where) for x in v) + "]"
    raise ValueError(f"{where}: cannot write {type(v).__name__} {v!r} as a TOML value")


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _emit(table: Mapping[str, Any], path: list[str], lines: list[str]) -> None:
    for k, v in table.items():
        if not isinstance(v, dict) and not _is_table_array(v):
            lines.append(f"{_key(k)} = {_scalar(v, '.'.join(path + [k]))}")
    for k, v in table.items():
        sub = path + [k]
        name = ".".join(_key(p) for p in sub)
        if isinstance(v, dict):
            lines.extend(["", f"[{name}]"])
            _emit(v, sub, lines)
        elif _is_table_array(v):
            for item in v:
                lines.extend(["", f"[[{name}]]"])
                _emit(item, sub, lines)


def to_toml(doc: Mapping[str, Any], header: str = "") -> str:
    """`doc` (str/bool/int/float values, lists, nested dicts, lists of dicts) as TOML text.
    Raises ValueError for a value TOML cannot hold (None, NaN, a mixed list)."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    _emit(doc, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"
