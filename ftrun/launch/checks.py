"""What `ftrun launch` refuses to start with, and what makes a finished job incomplete. Pure.

Flag types (`positive_int`, `duration`, `kill_at`) run inside argparse, so a bad value exits 2 with
argparse's message naming the flag. `problems(args)` checks the flags against each other (a quorum larger
than the job, a kill aimed at a replica that does not exist, a kill step past the job's end) and returns
one message per problem, each naming its flag. `incomplete_reasons(figures)` says why a finished job does
not count as complete; `unfired_kills` names the kill options that never fired.
"""

from __future__ import annotations

import argparse
import os

from ftrun.launch.faults import KillAt, parse_duration
from ftrun.launch.inject import check as check_injected


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def duration(text: str) -> float:
    """argparse type: '90', '30s', '1.5m', '2h', '250ms' -> seconds."""
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_duration(text: str) -> float:
    """argparse type: a duration > 0."""
    seconds = duration(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return seconds


def kill_at(text: str) -> KillAt:
    """argparse type: step=N[,replica=ID] with N >= 0."""
    try:
        kill = KillAt.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("bad --kill-at ", "")) from None
    if kill.step < 0:
        raise argparse.ArgumentTypeError(f"step must be >= 0, got {kill.step}")
    return kill


def replica_ids(num_replicas: int) -> list[str]:
    return [f"r{i}" for i in range(num_replicas)]


def problems(args: argparse.Namespace) -> list[str]:
    """Flags that contradict each other or the script to run; [] when the job can start."""
    out = []
    if args.min_replicas is not None and not 1 <= args.min_replicas <= args.replicas:
        out.append(f"--min-replicas {args.min_replicas}: must be between 1 and --replicas ({args.replicas})")
    if args.kill_every is not None and args.kill_random_mean is not None:
        out.append("--kill-every and --kill-random-mean: choose one")
    ids = replica_ids(args.replicas)
    for kill in args.kill_at:
        if kill.replica is not None and kill.replica not in ids:
            out.append(f"--kill-at {describe_kill_at(kill)}: no replica {kill.replica!r} "
                       f"(this job has {_id_range(ids)})")
        if kill.step >= args.steps:
            out.append(f"--kill-at {describe_kill_at(kill)}: the job ends at step {args.steps} (--steps), "
                       f"so it would never fire")
    try:
        check_injected(list(getattr(args, "inject", None) or []), replicas=args.replicas,
                       ranks_per_replica=args.ranks_per_replica)
    except ValueError as e:
        out.append(str(e))
    for f in getattr(args, "inject", None) or []:
        if f.at_step is not None and f.at_step >= args.steps:
            out.append(f"--inject {f.describe()!r}: the job ends at step {args.steps} (--steps), so it would never "
                       f"fire")
    if args.max_kills is not None and not (args.kill_every or args.kill_random_mean or args.kill_at):
        out.append("--max-kills: needs a kill option (--kill-every, --kill-random-mean or --kill-at)")
    if args.stop_file is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.stop_file))):
        out.append(f"--stop-file {args.stop_file}: its folder does not exist")
    if not args.module and not os.path.isfile(args.script):
        out.append(f"SCRIPT {args.script!r}: no such file (use -m to run a module)")
    return out


def _id_range(ids: list[str]) -> str:
    return ids[0] if len(ids) == 1 else f"{ids[0]}..{ids[-1]}"


def describe_kill_at(kill: KillAt) -> str:
    return f"step={kill.step}" + (f",replica={kill.replica}" if kill.replica is not None else "")


def unfired_kills(*, pending: list[KillAt], every_s: float | None, random_mean_s: float | None,
                  num_timed_kills: int, max_kills: int | None, num_kills: int) -> list[str]:
    """One warning per kill option that never fired (or, for --max-kills, fired fewer times than asked).

    pending: --kill-at entries still waiting; num_timed_kills: kills made by --kill-every/--kill-random-mean."""
    out = [f"--kill-at {describe_kill_at(k)} never fired (the job never reached that step with a replica it "
           f"could kill and keep its --min-replicas healthy)" for k in pending]
    for flag, value in (("--kill-every", every_s), ("--kill-random-mean", random_mean_s)):
        if value is not None and num_timed_kills == 0:
            out.append(f"{flag} {value:g}s never fired: the job ended before the first kill was due "
                       f"(the kill clock starts once every replica has committed a step)")
    if max_kills is not None and num_kills < max_kills:
        out.append(f"--max-kills {max_kills}: only {num_kills} kill(s) happened")
    return out


def incomplete_reasons(figures: dict, *, goal: int) -> list[str]:
    """Why the job does not count as complete; [] when it reached `goal` steps with identical replicas,
    no duplicated or skipped batch, and was neither interrupted nor given up on."""
    out = []
    if figures.get("interrupted"):
        out.append("interrupted")
    for g in figures.get("gave_up") or []:
        out.append(f"gave up on {g['replica_id']} after {g['count']} crashes in a row with the same error "
                   f"and no progress (a crash loop)")
    if figures.get("timed_out"):
        out.append("--timeout expired")
    if figures["steps_reached"] < goal:
        out.append(f"reached step {figures['steps_reached']} of {goal}")
    if not figures["replicas_identical"]:
        out.append(f"replicas diverged ({figures.get('num_divergences', '?')} param_hash mismatches)")
    if figures.get("user_state_identical") is False:
        out.append("registered user state diverged (user_state_hash mismatches)")
    for key, what in (("duplicate_batches", "duplicated"), ("skipped_batches", "skipped")):
        if figures.get(key):
            out.append(f"{figures[key]} batch(es) {what}")
    if figures.get("audit_problems"):
        out.append(f"{figures['audit_problems']} audit problem(s)")
    return out
