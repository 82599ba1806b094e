"""A torchrun-style FSDP2 script (tests/integration/torchrun_fsdp2_loop.py: `dist.init_process_group()` from
the launcher's environment, `fully_shard` with or without mesh=) unchanged under a real `ftrun launch` on the
CPU: torchrun's variables describe the replica's world and MASTER_ADDR/PORT a store of the replica's
incarnation (ftrun.launch.worker_env), so every rank's default group is its replica's; init_from_env adopts
it and job.wrap takes the sharded model as it is. A replica is killed mid-run: its next incarnation makes its
group again on a fresh store, catches up, and the job ends with identical replicas and the exactly-once audit.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.test_launch import launch

SCRIPT = "tests/integration/torchrun_fsdp2_loop.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks, mesh", [(1, "default"), (2, "default"), (2, "direct")])
def test_a_torchrun_style_script_survives_a_replica_kill_under_ftrun_launch(tmp_path, ranks, mesh):
    # --min-replicas 2: both replicas start training together, and the survivor waits for the restarted one.
    # With 1, a replica that started late healed from the only other one, which the kill at step 4 could take
    # down mid-transfer: that heal failed and its replica restarted too (a correct recovery, an extra crash).
    f = launch(tmp_path, "--replicas", "2", "--ranks-per-replica", str(ranks), "--steps", "200", "--min-replicas",
               "2", "--restart-delay", "0.2s", "--no-diagnose", "--inject", "kill replica=1 step=4", SCRIPT,
               "--mesh", mesh, timeout=100)
    assert f["complete"] and f["steps_reached"] == 200, f
    assert (f["failures_injected"], f["restarts"], f["crashes"]) == (1, 1, 0), f
    assert f["replicas_identical"] and f["identity_checks"] > 0, f
    assert (f["duplicate_batches"], f["skipped_batches"], f["audit_problems"]) == (0, 0, 0), f
    events = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert any(e["event"] == "commit" and e["replica_id"] == "r1" and e["incarnation"] == 1 for e in events), \
        "the restarted replica rejoined and committed"
    finals = {(e["replica_id"], e["rank"]): e["step"] for e in events if e["event"] == "final"}
    assert finals == {(rid, r): 200 for rid in ("r0", "r1") for r in range(ranks)}
    # every incarnation's ranks made the replica's group from the environment (not the job's 2 x ranks)
    for rid, inc in (("r0", 0), ("r1", 0), ("r1", 1)):
        for rank in range(ranks):
            log = (tmp_path / "logs" / f"{rid}.{inc}.{rank}.log").read_text()
            assert f"torchrun_fsdp2_loop: rank {rank} of {ranks} (gloo), cpu, {mesh} mesh" in log, (rid, inc, log[-2000:])
