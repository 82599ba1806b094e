"""The diagnose bench with rank folding (harness.run.diag_mirror): ci-small stretched to 512 ranks per replica
(above FOLD_RANKS_ABOVE) runs 4 of each replica's 512 ranks (its two lead hosts), serves the other 508 from
their reference lead's telemetry over the modeled network, and still names every injected culprit exactly.
ci-small runs without CPU charging, so the run is deterministic."""

from __future__ import annotations

import pytest

from harness.diagbench import run_bench
from harness.profile import apply_overrides, load_profile


@pytest.mark.timeout(180)
def test_bench_with_rank_folding_names_every_culprit_on_the_first_host():
    profile = apply_overrides(load_profile("ci-small"), ["ranks_per_replica=512", "topology.racks_per_zone=128"])
    out = run_bench(profile, scenarios=6, seed=1, fault_free=3, ftar_detail="folded")
    results = {r["kind"]: r for r in out["results"]}
    # seed 1 draws every kind; ci-small's all-reduce never waits on the wire, so the slow link is unscored
    assert set(results) == {"hang_rank", "hang_host", "slow_host", "cut_building", "kill_rank"}
    assert [u["kind"] for u in out["unscored"]] == ["slow_link"]
    assert out["accuracy"] == 1.0 and out["misses"] == [], out["misses"]
    hung = results["hang_rank"]
    assert hung["verdict_kind"] == "hang" and len(hung["verdict_ranks"]) == 1
    assert int(hung["verdict_ranks"][0].split("/")[1]) < 2  # the hung rank is on its replica's first host
    assert out["false_positive_runs"] == 0 and out["false_evictions"] == 0 and out["fault_free_runs"] == 3
    assert out["ranks_collected_max"] == 4 * 512  # every rank's rows, 16 of them from ranks that run
    assert out["telemetry_ranks"] == 16 and out["telemetry_mirrored_ranks_per_replica"] == 508
    assert out["telemetry_mirror_register_failures"] == 0 and out["telemetry_bytes_per_rank"] <= 1_000_000
    assert out["fault_places"] == "each replica's first host" and out["ftar_detail"] == "folded"
    assert out["errors"] == [] and out["stalled"] == []
