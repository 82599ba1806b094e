"""`ftrun emulate --comm flat|tree` end to end: the flat check-in (every rank messages its replica's
leader) and the real TreeComm run the same job to the same result; only the comm is swapped. How each
scales is asserted exactly in tests/unit/test_emulated_checkin.py and timed by benchmarks/checkin_scale.py.
"""

from __future__ import annotations

from harness.cli import execute
from harness.profile import apply_overrides, load_profile
from harness.run import JobOptions


def test_a_whole_emulated_job_checks_in_through_either_comm_to_the_same_result():
    profile = apply_overrides(load_profile("ci-small"), ["replicas=2", "ranks_per_replica=16", "failures.mode=none",
                                                        "emulation.cpu_charging=false"])  # virtual time only
    outcome = {}
    for comm in ("flat", "tree"):
        f, _ = execute(profile, JobOptions(steps=3, comm=comm))
        assert f["complete"] and f["unexpected_errors"] == [] and f["replicas_consistent"], comm
        outcome[comm] = (f["steps_committed"], f["participants_per_step"])
    assert outcome["flat"] == outcome["tree"]
    assert outcome["tree"][0]["r0"] == 3 and outcome["tree"][1][-1] == 2, "both replicas train the last step"
