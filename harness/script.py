"""`ftrun emulate SCRIPT.py --profile P`: the emulator's side of a training script run unchanged.

The script runs once, in this process, under `shadow.active(profile, session=ScriptSession(...))`. Its
`ftrun.train` calls reach mocks.train_api (the shadow registry maps ftrun.train.api there), which builds
its model on meta and hands `ScriptSession.run` a mocks.script.ScriptModel: the per-rank FSDP2 shard
sizes and the FLOPs of one rank's micro-batch. `run` then runs the profile's emulated job (harness.run)
with that model: every emulated rank runs the real trainer over the model's shard sizes, and its compute
takes FLOPs / the profile's sustained rate, where the rate is what the profile implies for its own
[model] (its FLOPs per rank-step over train.step_compute_s). A model whose FLOPs torch's counter does not
see (0 counted) keeps the profile's step time, and the figures say so.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any, Callable

from ftrun.cli import emit_json
from harness import report
from harness.profile import Profile, apply_overrides
from mocks.compute import propagate_shapes
from mocks.script import ScriptModel


def script_step_time(profile: Profile, script: ScriptModel) -> tuple[float, str, float]:
    """(modeled compute seconds of one step of the script's model, where it came from, the profile's
    sustained FLOP/s per rank)."""
    own = propagate_shapes(profile.model, profile.ranks_per_replica).flops_per_step_per_rank
    rate = own / profile.train.step_compute_s
    flops = script.shapes.flops_per_step_per_rank
    if flops <= 0:
        return profile.train.step_compute_s, "profile (no FLOPs counted in the script's step)", rate
    return flops / rate, "script FLOPs / profile FLOP rate", rate


class ScriptSession:
    """What mocks.train_api hands the script's training to (see shadow.current). Not thread-safe: the
    script's thread only. `figures`: the last job's; `reported`: its report has been printed."""

    def __init__(self, profile: Profile, args: argparse.Namespace, *, job_options: Callable[..., Any],
                 execute: Callable[..., tuple[dict[str, Any], Any]]) -> None:
        """job_options(profile, args) and execute(profile, options, progress=, out=): harness.cli's."""
        self.profile, self.args = profile, args
        self._job_options, self._execute = job_options, execute
        self.replicas, self.ranks_per_replica = profile.replicas, profile.ranks_per_replica
        self.steps = profile.train.steps
        self.figures: dict[str, Any] | None = None
        self.reported = False

    def run(self, script: ScriptModel, *, steps: int) -> dict[str, Any]:
        """Run the profile's emulated job for `steps` steps with the script's model; returns its figures."""
        step_s, source, rate = script_step_time(self.profile, script)
        profile = apply_overrides(self.profile, [f"train.step_compute_s={step_s!r}", f"train.steps={steps}"])
        options = replace(self._job_options(profile, self.args), script=script)  # --inject checked by the caller
        f, _ = self._execute(profile, options, progress=not self.args.no_progress, out=self.args.out)
        f["script"] = {**script.describe(), "step_compute_s": step_s, "step_time_from": source,
                       "profile_flops_per_s_per_rank": rate}
        self.figures = f
        return f

    def report(self) -> None:
        """Print the report, and with --json the figures as the last line (once)."""
        if self.figures is None or self.reported:
            return
        self.reported = True
        f = self.figures
        s = f["script"]
        print(report.text(f))
        print(f"  script model: {s['num_params']:,} parameters, {s['params_per_rank']:,} per rank (FSDP2 dim-0 "
              f"shards of {self.ranks_per_replica}), {s['flops_per_step_per_rank']:.3g} FLOPs per rank-step -> "
              f"{s['step_compute_s']:.4g} s ({s['step_time_from']})", flush=True)
        if self.args.json:
            emit_json(f)

    def ok(self) -> bool:
        return self.figures is not None and report.succeeded(self.figures)
