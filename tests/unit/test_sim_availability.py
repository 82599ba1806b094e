"""Effective training time (FT-HSDP paper §3, §6.1) and the availability-optimal checkpoint period."""

from __future__ import annotations

import json

import pytest

from ftrun.cli import main
from harness.analysis.sim.availability import (
    AvailabilityInputs,
    checkpoint_availability,
    ft_hsdp_effective_training_time,
    inputs_from_report,
    optimal_checkpoint_period,
    repairs_overlap,
    sync_effective_training_time,
)

pytestmark = pytest.mark.timeout(60)

MIN = 60.0


def test_paper_figures_44_and_80_percent():
    # 18 min interval, 10 min sync stall, 3 min FT-HSDP stall, 12 replicas, 10 min repair
    paper = AvailabilityInputs()
    assert sync_effective_training_time(paper) == pytest.approx(8 / 18)
    assert ft_hsdp_effective_training_time(paper) == pytest.approx((8 + 7 * 11 / 12) / 18)
    assert round(sync_effective_training_time(paper), 2) == 0.44
    assert round(ft_hsdp_effective_training_time(paper), 2) == 0.80


# (name, inputs, sync, ft_hsdp)
CASES = [
    ("one replica: FT-HSDP loses the whole repair",
     dict(failure_interval_s=60 * MIN, stall_per_failure_s=60, rejoin_stall_s=60, num_replicas=1, repair_s=30 * MIN),
     1 - 10 / 60, 1 - 30 / 60),
    ("no stall: only the degraded replica costs",
     dict(failure_interval_s=100.0, sync_stall_s=0, stall_per_failure_s=0, rejoin_stall_s=0, num_replicas=4,
          repair_s=40),
     1.0, 1 - 10 / 100),
    ("stall longer than the repair: no degraded time",
     dict(failure_interval_s=1000.0, stall_per_failure_s=300, rejoin_stall_s=0, repair_s=200), 0.4, 0.7),
    ("repairs overlap: the linear expected-loss form (pessimistic there)",
     dict(failure_interval_s=5 * MIN, stall_per_failure_s=30, rejoin_stall_s=30, num_replicas=12, repair_s=10 * MIN),
     0.0, 1 - (60 + 540 / 12) / 300),
    ("stalls beyond the interval clamp to zero",
     dict(failure_interval_s=60.0, sync_stall_s=120, stall_per_failure_s=100, rejoin_stall_s=0), 0.0, 0.0),
]


@pytest.mark.parametrize("name, kwargs, sync, ft", CASES, ids=[c[0] for c in CASES])
def test_effective_training_time_table(name, kwargs, sync, ft):
    inputs = AvailabilityInputs(**kwargs)
    assert sync_effective_training_time(inputs) == pytest.approx(sync)
    assert ft_hsdp_effective_training_time(inputs) == pytest.approx(ft)


@pytest.mark.parametrize("kwargs, field", [
    (dict(failure_interval_s=0), "failure_interval_s"),
    (dict(sync_stall_s=-1), "sync_stall_s"),
    (dict(num_replicas=0), "num_replicas"),
    (dict(num_replicas=2.5), "num_replicas"),
    (dict(repair_s=float("nan")), "repair_s"),
    (dict(rejoin_stall_s="100"), "rejoin_stall_s"),
])
def test_bad_inputs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AvailabilityInputs(**kwargs)


def test_repairs_overlap_flag():
    assert not repairs_overlap(AvailabilityInputs())
    assert repairs_overlap(AvailabilityInputs(failure_interval_s=300.0))


def test_report_keys_override_and_missing_keys_fall_back():
    fallback = AvailabilityInputs(num_replicas=8)
    inputs, source = inputs_from_report({"stall_per_failure_s": 90, "rejoin_stall_s": 100, "other": 1}, fallback)
    assert inputs.ft_stall_s == 190 and inputs.num_replicas == 8
    assert source["stall_per_failure_s"] == "report" and source["num_replicas"] == "default"
    nested, _ = inputs_from_report({"availability": {"failure_interval_s": 600}}, fallback)
    assert nested.failure_interval_s == 600
    with pytest.raises(ValueError, match="repair_s"):
        inputs_from_report({"repair_s": -5}, fallback)
    with pytest.raises(ValueError):
        inputs_from_report([1, 2], fallback)


@pytest.mark.parametrize("tf, tr, ts", [(1080.0, 600.0, 10.0), (3600.0, 60.0, 30.0), (1e6, 600.0, 10.0)])
def test_optimal_period_maximizes_availability(tf, tr, ts):
    best = optimal_checkpoint_period(tf, tr, ts)
    a_best = checkpoint_availability(tf, tr, ts, best)
    for factor in (0.5, 0.9, 0.99, 1.01, 1.1, 2.0):
        assert checkpoint_availability(tf, tr, ts, best * factor) < a_best


def test_checkpoint_formula_values():
    assert optimal_checkpoint_period(1080.0, 600.0, 10.0) == pytest.approx(10 + (2 * 1680 * 10 + 100) ** 0.5)
    assert checkpoint_availability(100.0, 0.0, 10.0, 20.0) == pytest.approx(0.5 * 100 / 110)
    assert checkpoint_availability(100.0, 0.0, 10.0, 10.0) == 0.0
    assert checkpoint_availability(float("inf"), 600.0, 10.0, 1000.0) == pytest.approx(0.99)
    with pytest.raises(ValueError):
        optimal_checkpoint_period(0.0, 1.0, 1.0)


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_prints_44_and_80(capsys):
    assert main(["sim", "availability"]) == 0
    out = capsys.readouterr().out
    assert "44%" in out and "80%" in out
    assert main(["sim", "availability", "--json"]) == 0
    figures = last_json(capsys)
    assert round(figures["sync"], 2) == 0.44 and round(figures["ft_hsdp"], 2) == 0.80


def test_cli_reads_a_report(tmp_path, capsys):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"failure_interval_s": 1800, "stall_per_failure_s": 20, "rejoin_stall_s": 40}))
    assert main(["sim", "availability", "--report", str(report), "--replicas", "6", "--json"]) == 0
    figures = last_json(capsys)
    assert figures["sync"] == pytest.approx(1 - 600 / 1800)
    assert figures["ft_hsdp"] == pytest.approx(1 - (60 + 540 / 6) / 1800)
    assert figures["sources"]["num_replicas"] == "default" and figures["inputs"]["num_replicas"] == 6


def test_cli_rejects_a_bad_report(tmp_path, capsys):
    report = tmp_path / "report.json"
    report.write_text('{"num_replicas": 0}')
    assert main(["sim", "availability", "--report", str(report)]) == 2
    assert "num_replicas" in capsys.readouterr().err
