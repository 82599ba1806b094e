"""What an emulated job folds (EmulatedJob's part about it, kept apart from the supervision): which ranks a
replica runs (rank folding: harness.run.fold), the latency the full replica tree adds, and whether and how
all-reduces are modeled per ring (harness.run.ring_model)."""

from __future__ import annotations

from typing import Any

from ftrun.env.wire import HEADER_SIZE
from harness.engine.net import parse_addr
from harness.run.fold import represented_ranks, tree_depth_latency
from harness.run.options import ANALYTIC_RINGS_ABOVE, FOLD_RANKS_ABOVE
from harness.run.ring_model import Cost, RankCost, StepSummary, rank_cost, ring_seconds


class JobFolding:
    """Mixed into EmulatedJob, whose profile, options, world, topology, folded, _num_leads, ranks, ring_board,
    _ring_costs and kernels() it uses."""

    profile: Any
    options: Any
    world: Any
    topology: Any
    folded: bool
    _num_leads: int | None
    ranks: tuple[int, ...]
    ring_board: Any
    _ring_costs: dict

    def kernels(self) -> Any: ...

    def _folds_ranks(self) -> bool:
        """Whether a replica runs only its represented ranks (JobOptions.fold_ranks; "auto": folded rings and
        more than FOLD_RANKS_ABOVE ranks per replica, with or without diagnose)."""
        o = self.options
        if o.fold_ranks == "on" and not self.folded:
            raise ValueError("fold_ranks=on needs folded FTAR rings (ftar_detail=folded)")
        return self.folded and (o.fold_ranks == "on" or (o.fold_ranks == "auto"
                                                         and self.profile.ranks_per_replica > FOLD_RANKS_ABOVE))

    def _lead_hosts(self) -> int:
        """Hosts per replica whose ranks are FTAR leads (run the real engine): the first; under diagnose with
        rank folding also the second, the reference host the ranks not run mirror (harness.run.fold.lead_of):
        the bench's faults go on the first host, and a mirror of a faulty lead would carry the fault to every
        rank (a hung first host would leave no healthy rank to copy)."""
        return 2 if self.options.diagnose and self._folds_ranks() and self.profile.hosts_per_replica >= 2 else 1

    def _lead_count(self) -> int | None:
        """The FTAR leads per replica (None: rings not folded, every rank runs FTAR)."""
        if not self.folded:
            return None
        return min(self._lead_hosts() * self.profile.topology.gpus_per_host, self.profile.ranks_per_replica)

    def _mirror_reference(self) -> int:
        """The first lead the mirrors follow (harness.run.fold.lead_of): 0, or the reference host's first rank."""
        return self.profile.topology.gpus_per_host if self._lead_hosts() == 2 else 0

    def _represented_ranks(self) -> tuple[int, ...]:
        """The ranks each replica incarnation runs: every rank, or with rank folding (JobOptions.fold_ranks)
        the leads and every rank a fault names (harness.run.fold.represented_ranks)."""
        n = self.profile.ranks_per_replica
        if not self._folds_ranks():
            return tuple(range(n))
        targets = [f.rank for f in self.options.injected if isinstance(getattr(f, "rank", None), int)]
        return represented_ranks(n, self._num_leads or 1, targets)

    def _analytic_rings(self) -> bool:
        """Whether all-reduces are modeled per ring (harness.run.ring_model; JobOptions.ftar_model)."""
        o = self.options
        if o.ftar_model != "auto":
            return o.ftar_model == "analytic"
        return self.profile.num_ranks > ANALYTIC_RINGS_ABOVE and not o.needs_chunk_rings

    def ring_cost(self, host: str) -> Cost:
        """cost(step summary, next rank's FTAR address): the RankCost of one all-reduce of a rank on `host`
        (ring_model.ring_seconds over the route to the next rank, its NIC shared by the host's rings, and what
        its send busy time needs; the route's rate is a slowed link's, Fabric.slow_link, while it lasts)."""
        fab, net, kernels = self.world.fabric, self.world.fabric.model.config, self.kernels()
        share = min(self.profile.topology.gpus_per_host, self.profile.ranks_per_replica)
        kernel_s = lambda nbytes: kernels.launch_s + nbytes / kernels.reduce_bw  # noqa: E731
        cache = self._ring_costs

        overhead = net.frame_overhead_bytes + HEADER_SIZE

        def cost(summary: StepSummary, next_addr: str) -> RankCost:
            peer = parse_addr(next_addr)[0] or host
            route = fab.route(fab.net_host(host), fab.net_host(peer))
            key = (summary, route.hop, route.host_rate, route.up is not None)
            if key not in cache:
                rate = route.host_rate / share / (net.cross_zone_oversubscription if route.up is not None else 1.0)
                seconds = ring_seconds(summary, rate=rate, latency=route.latency, kernel_s=kernel_s,
                                       overhead_bytes=overhead)
                cache[key] = rank_cost(summary, seconds=seconds, nic_rate=route.host_rate, share=share,
                                       sndbuf_s=route.sndbuf_s, overhead_bytes=overhead)
            return cache[key]
        return cost

    def folding(self) -> dict[str, Any]:
        """What the run folded (for the report): rings run per replica, ranks run and mirrored per replica."""
        n = self.profile.ranks_per_replica
        run = len(self.ranks)
        leads = "the first two hosts'" if self._lead_hosts() == 2 else "the first host's"
        return {"ftar_rings_run_per_replica": self._num_leads or n, "ranks_run_per_replica": run,
                "ftar_model": "analytic" if self.ring_board is not None else "chunks",
                "analytic_all_reduces": self.ring_board.num_rings if self.ring_board is not None else 0,
                "chunked_all_reduces": self.ring_board.num_chunked if self.ring_board is not None else 0,
                "ranks_mirrored_per_replica": n - run,
                "folding": (f"each replica runs {run} of its {n} ranks ({leads} and "
                            f"every fault target); the other {n - run} mirror a lead's quorum, vote, FTAR and catch-up"
                            f"{' (and telemetry)' if self.options.diagnose else ''}, and each "
                            f"replica collective waits out the full {n}-rank tree's extra depth" if run < n
                            else "every rank runs its trainer")}

    def tree_extra_s(self, hosts: tuple[str, ...]) -> float:
        """With rank folding: the latency one pass of the full replica's TreeComm takes beyond the represented
        ranks' tree on these hosts (the ranks not run would be the deeper levels). 0 when every rank runs."""
        n = self.profile.ranks_per_replica
        if len(self.ranks) == n:
            return 0.0
        gpus, topo, net = self.profile.topology.gpus_per_host, self.topology, self.world.fabric.model.config
        cache: dict[tuple[int, int], float] = {}

        def latency(a: int, b: int) -> float:
            key = (a // gpus, b // gpus)
            if key not in cache:
                cache[key] = net.latency_s(topo.hop_class(hosts[key[0]], hosts[key[1]]))
            return cache[key]

        fanout = self.options.fanout
        full = tree_depth_latency(range(n), fanout, latency)
        return max(0.0, full - tree_depth_latency(self.ranks, fanout, latency))
