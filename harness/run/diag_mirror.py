"""Telemetry of the ranks a folded replica does not run (rank folding under diagnose, harness.run.job_fold).

With rank folding a replica runs its two lead hosts (the first, where the diagnose bench places every fault,
and the reference host) and mirrors every other rank onto a reference lead (harness.run.fold.lead_of): the
same quorum, vote and FTAR timing. Their telemetry is the same too, so each collection serves a mirrored
rank's SUMMARY/HIST rows as its reference lead's rows under the mirrored rank's own name (key "rid/rank",
replica, ring, host; the rows carry no rank identity of their own: ring position and peers are ring indices,
the same for every ring). The rows travel over the modeled network like every rank's: one real
TelemetryServer per mirrored host (its 8 ranks), on that host, registered with the real Collector, so a
collection pulls 98,304 ranks' rows from 12,288 hosts at meta-98k and its modeled cost stays visible. The
servers start once the incarnation's reference leads have their recorders, and die with the incarnation's
hosts (a killed replica's hosts stop answering until its restart registers anew).

What is modeled: a mirrored host's rows are copies, so whatever happens only on a mirrored host (a fault
there) is not represented; the bench places faults on the first host only (harness.diagbench Shape). Memory:
no buffer per mirrored rank (its rows come from the reference lead's recorder); the telemetry bytes per rank
reported are those of the ranks that run.

`mirrored_hosts` (which ranks each mirrored host serves, and whose rows) is pure; `SummaryCache` makes the
98K summaries per collection cost one summarize per reference lead and change of its records.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ftrun.diagnose.collect import DiagnoseError, RankInfo, TelemetryServer, summarize_recorder
from ftrun.diagnose.telemetry import Recorder
from harness.profile import hosts_per_replica
from harness.run.fold import lead_of


def mirrored_hosts(ranks_per_replica: int, gpus_per_host: int, run: Sequence[int], num_leads: int,
                   reference: int) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
    """(host slot, ((rank, lead it mirrors), ...)) for every host slot of a replica with ranks not run (pure):
    a rank not in `run` is served from lead `lead_of(rank, num_leads, reference)`, which must be run."""
    if gpus_per_host < 1 or ranks_per_replica < 1:
        raise ValueError(f"gpus_per_host and ranks_per_replica must be >= 1, got {gpus_per_host}, {ranks_per_replica}")
    running = set(run)
    if not set(range(num_leads)) <= running:
        raise ValueError(f"every lead 0..{num_leads - 1} must be run, got {sorted(running)[:16]}")
    out = []
    for slot in range(hosts_per_replica(ranks_per_replica, gpus_per_host)):
        ranks = range(slot * gpus_per_host, min((slot + 1) * gpus_per_host, ranks_per_replica))
        pairs = tuple((k, lead_of(k, num_leads, reference)) for k in ranks if k not in running)
        if pairs:
            out.append((slot, pairs))
    return out


class SummaryCache:
    """`summarize_recorder` with a cache: a summary depends on the recorder's records (unchanged while its
    `written` count is) and on `now` only through its "now" field, so one summarize per recorder and change
    serves every mirror of it, exactly (the HIST rows are shared, read-only; the SUMMARY row is a copy)."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[Recorder, int, np.ndarray, np.ndarray]] = {}
        self.computed = self.served = 0

    def __call__(self, rec: Recorder, now: float) -> tuple[np.ndarray, np.ndarray]:
        self.served += 1
        hit = self._rows.get(id(rec))
        if hit is None or hit[0] is not rec or hit[1] != rec.written:
            s, h = summarize_recorder(rec, now)
            h.flags.writeable = False
            hit = self._rows[id(rec)] = (rec, rec.written, s, h)
            self.computed += 1
        s = hit[2].copy()
        s["now"] = now
        return s, hit[3]

    def forget(self, recorders: Any) -> None:
        """Drop the rows of recorders no longer served (a dead incarnation's): they would keep them alive."""
        for rec in recorders:
            self._rows.pop(id(rec), None)


class MirrorTelemetry:
    """Serves the ranks not run of every replica incarnation once its reference leads have recorders."""

    def __init__(self, job: Any, collector_addr: str) -> None:
        p = job.profile
        self.job, self.addr = job, collector_addr
        self.gpus = p.topology.gpus_per_host
        self.hosts = mirrored_hosts(p.ranks_per_replica, self.gpus, job.ranks, job._num_leads,
                                    job._mirror_reference())
        self.leads = {lead for _, pairs in self.hosts for _, lead in pairs}
        self.cache = SummaryCache()
        self._recorders: dict[tuple[int, int], dict[int, Recorder]] = {}  # (replica, incarnation) -> lead -> rec
        # replica -> (its latest served incarnation, that one's lead recorders, its mirrored hosts' servers):
        # an older incarnation's are dropped, so a dead one's buffers do not stay alive
        self._served: dict[int, tuple[int, dict[int, Recorder], list[TelemetryServer]]] = {}
        self.servers_started = 0
        self.register_failures = 0

    @property
    def servers(self) -> list[TelemetryServer]:
        """The mirrored hosts' servers of each replica's latest incarnation."""
        return [server for _, _, servers in self._served.values() for server in servers]

    @property
    def ranks_served(self) -> int:
        return sum(len(pairs) for _, pairs in self.hosts)

    def attached(self, inc: Any, rank: int, rec: Recorder) -> None:
        """A rank of `inc` has its recorder; once every lead the mirrors follow has one, start the servers."""
        if rank not in self.leads:
            return
        mine = self._recorders.setdefault((inc.replica, inc.number), {})
        mine[rank] = rec
        if len(mine) == len(self.leads):
            self._recorders.pop((inc.replica, inc.number))
            self._start(inc, mine)

    def _start(self, inc: Any, recorders: dict[int, Recorder]) -> None:
        world = self.job.world
        old = self._served.get(inc.replica)
        if old is not None and old[0] > inc.number:
            return  # a newer incarnation serves already
        if old is not None:
            self.cache.forget(old[1].values())
        self._served[inc.replica] = (inc.number, recorders, [])
        for slot, pairs in self.hosts:
            host = inc.hosts[slot]
            ranks = {RankInfo(f"{inc.replica_id}/{k}", inc.replica, k, host, inc.number): recorders[lead]
                     for k, lead in pairs}
            world.host_env(host).spawn(self._serve, host, ranks, inc, name=f"telemetry-{inc.replica_id}.{inc.number}-{slot}")

    def _serve(self, host: str, ranks: dict[RankInfo, Recorder], inc: Any) -> None:
        """Task body on the mirrored host: its telemetry server (its accept loop lives on as this process)."""
        server = TelemetryServer(env=self.job.world.host_env(host), token=self.job.token, ranks=ranks,
                                 summaries=self.cache)
        server.start()
        self.servers_started += 1
        served = self._served.get(inc.replica)
        if served is not None and served[0] == inc.number:
            served[2].append(server)
        try:
            server.register(self.addr, timeout=self.job.timeouts.connect_timeout_s)
        except DiagnoseError:
            self.register_failures += 1  # its ranks stay unknown to the collector (counted in the figures)
