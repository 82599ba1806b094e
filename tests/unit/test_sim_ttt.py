"""The time-to-train profile and simulation."""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

import pytest

from harness.analysis.sim.profile import apply_overrides, load_profile, profile_from_dict
from harness.analysis.sim.sweep import format_sweep, run_sweep
from harness.analysis.sim.ttt import simulate, wipeout_interval_s

pytestmark = pytest.mark.timeout(60)

PROFILE = Path(__file__).resolve().parents[2] / "scale_profiles" / "ttt-default.toml"
# Small enough for milliseconds per run, big enough for SPARe to mask many failures.
TINY = ["system.num_groups=60", "system.train_horizon_h=8", "sweep.redundancies=[1, 2, 4]", "sweep.num_seeds=2",
        "sweep.mc_trials=300"]
EXACT = ["failures.weibull_shape=1.0", "failures.jitter_frac=0.0"]  # exponential failures, no jitter


def test_default_profile_loads_with_the_seed_values():
    p = load_profile(PROFILE)
    assert p.failures.mtbf_s == 18 * 60 and p.failures.weibull_shape < 1
    assert p.system.global_restart_s == 600 and p.ft_hsdp.num_replicas == 12 and p.ft_hsdp.repair_s == 600
    assert p.sweep.redundancies == tuple(range(1, 13))


def test_every_profile_value_says_where_it_comes_from():
    for line in PROFILE.read_text().splitlines():
        if re.match(r"^\s*\w+\s*=", line):
            assert re.search(r"#\s*(seed \S+ (§|App\.)|assumption)", line), line


def tiny_data(*overrides: str) -> dict:
    return apply_overrides(tomllib.loads(PROFILE.read_text()), [*TINY, *overrides])


@pytest.mark.parametrize("override, field", [
    ("failures.mtbf_s=0", "failures.mtbf_s"),
    ("failures.weibull_shape=-0.5", "failures.weibull_shape"),
    ("failures.jitter_frac=1.0", "failures.jitter_frac"),
    ("failures.mtbf_s=inf", "failures.mtbf_s"),
    ("system.num_groups=1", "system.num_groups"),
    ("system.num_groups=60.5", "system.num_groups"),
    ("system.checkpoint_save_s=0", "system.checkpoint_save_s"),
    ("system.allreduce_s=-1", "system.allreduce_s"),
    ("system.train_horizon_h=long", "system.train_horizon_h"),
    ("system.global_restart_s=true", "system.global_restart_s"),
    ("ft_hsdp.min_replicas=13", "ft_hsdp.min_replicas"),
    ("ft_hsdp.rejoin_stall_s=700", "ft_hsdp.rejoin_stall_s"),
    ("ft_hsdp.num_replicas=0", "ft_hsdp.num_replicas"),
    ("sweep.redundancies=[]", "sweep.redundancies"),
    ("sweep.redundancies=[0, 2]", "sweep.redundancies"),
    ("sweep.redundancies=[2, 61]", "sweep.redundancies"),
    ("sweep.num_seeds=0", "sweep.num_seeds"),
    ("sweep.max_wall_factor=1", "sweep.max_wall_factor"),
    ("failures.mtbf=5", "failures.mtbf"),
    ("seed=-1", "seed"),
])
def test_bad_values_raise_naming_the_field(override, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        profile_from_dict(tiny_data(override))


def test_missing_and_unknown_sections():
    data = tiny_data()
    del data["sweep"]
    with pytest.raises(ValueError, match=r"\[sweep\]"):
        profile_from_dict(data)
    with pytest.raises(ValueError, match="bogus"):
        profile_from_dict({**tiny_data(), "bogus": {}})
    data = tiny_data()
    del data["system"]["shrink_s"]
    with pytest.raises(ValueError, match="system.shrink_s is missing"):
        profile_from_dict(data)
    with pytest.raises(ValueError, match="section.key=value"):
        apply_overrides({}, ["system.num_groups"])


@pytest.fixture(scope="module")
def tiny():
    return load_profile(PROFILE, TINY)


@pytest.mark.parametrize("scheme, r", [("ckpt_only", 1), ("rep", 2), ("spare", 4), ("ft_hsdp", 1)])
def test_runs_are_deterministic(tiny, scheme, r):
    assert simulate(tiny, scheme, r, 3) == simulate(tiny, scheme, r, 3)


def test_ft_hsdp_simulation_matches_the_closed_form():
    # Exponential failures, no jitter, ~2,000 failures: the simulated effective training time lands on
    # the paper's 80% model.
    p = load_profile(PROFILE, [*EXACT, "system.train_horizon_h=500"])
    res = simulate(p, "ft_hsdp", 1, 0)
    assert res.num_wipeouts == 0 and res.finished
    assert 1 / res.ttt_norm == pytest.approx(res.theory_availability, abs=0.015)
    assert res.theory_availability == pytest.approx(0.80, abs=0.005)


def test_ckpt_only_simulation_matches_eq2_when_restarts_are_short():
    # Eq. 2 ignores failures during a restart; with Tr << Tf the simulation should agree with it.
    p = load_profile(PROFILE, [*EXACT, "system.train_horizon_h=300", "failures.mtbf_s=3600",
                               "system.global_restart_s=60"])
    res = simulate(p, "ckpt_only", 1, 0)
    assert res.availability == pytest.approx(res.theory_availability, abs=0.015)
    assert res.period_s == pytest.approx(10 + math.sqrt(2 * 3660 * 10 + 100))


def test_wipeout_intervals(tiny):
    mtbf = tiny.failures.mtbf_s
    assert wipeout_interval_s(tiny, "ckpt_only", 1) == mtbf
    assert wipeout_interval_s(tiny, "spare", 1) == mtbf
    spare4, rep4 = wipeout_interval_s(tiny, "spare", 4), wipeout_interval_s(tiny, "rep", 4)
    assert 10 * mtbf < spare4 < rep4  # 15 blocks of 4 are harder to wipe out than 60 Golomb host sets
    assert wipeout_interval_s(tiny, "ft_hsdp", 1) > 1e6 * mtbf  # 12 replicas all down is very rare


def test_sweep_shapes_and_the_spare_story(tiny):
    result = run_sweep(tiny)
    assert [s.redundancy for s in result.rep] == [1, 2, 4] == [s.redundancy for s in result.spare]
    assert result.rep[0] is result.ckpt_only is result.spare[0]
    rep4, spare4 = result.rep[2], result.spare[2]
    assert rep4.mean_depth == 4 and spare4.mean_depth <= 2.2
    assert spare4.ttt_norm < rep4.ttt_norm
    assert min(rep4.availability, spare4.availability) > result.ckpt_only.availability
    text = format_sweep(result, tiny)
    assert "SPARe+CKPT" in text and "FT-HSDP" in text


def test_a_hopeless_job_is_reported_unfinished():
    # Failures every 2 minutes against 10-minute restarts: CKPT-only never gets anywhere.
    p = load_profile(PROFILE, [*TINY, "failures.mtbf_s=120", "sweep.max_wall_factor=3", "sweep.num_seeds=1"])
    res = simulate(p, "ckpt_only", 1, 0)
    assert not res.finished and math.isinf(res.ttt_norm)
    assert res.wall_s >= 3 * p.system.train_horizon_h * 3600
