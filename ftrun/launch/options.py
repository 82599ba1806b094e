"""The options of `ftrun launch`, by group: the job, failure injection, hosts (namespaces), output.

cli.py runs the job; checks.py checks the options against each other; this file only declares them.
"""

from __future__ import annotations

import argparse

from ftrun.cli import add_listen_arguments
from ftrun.launch.checks import duration, kill_at, non_negative_int, positive_duration, positive_int
from ftrun.launch.host_faults import KINDS, parse_kinds
from ftrun.launch.inject import Injected, parse as parse_inject


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=positive_int, default=3,
                   help="replicas (units of failure) (default: %(default)s)")
    p.add_argument("--ranks-per-replica", type=positive_int, default=1,
                   help="rank processes per replica (default: %(default)s)")
    p.add_argument("--steps", type=positive_int, required=True,
                   help="the job ends when it has committed this many steps (required)")
    p.add_argument("--min-replicas", type=positive_int, default=None,
                   help="smallest quorum, and the fewest healthy replicas a kill may leave (default: a majority)")
    p.add_argument("--kill-every", type=positive_duration, default=None, metavar="DURATION",
                   help="SIGKILL a random replica this often, e.g. 30s (default: never)")
    p.add_argument("--kill-random-mean", type=positive_duration, default=None, metavar="DURATION",
                   help="SIGKILL a random replica at exponential intervals of this mean (default: never)")
    p.add_argument("--kill-at", type=kill_at, action="append", default=[], metavar="step=N[,replica=ID]",
                   help="SIGKILL a replica (rI, default: a random one) once the job commits step N; repeatable "
                        "(default: none)")
    p.add_argument("--inject", type=inject_spec, action="append", default=[], metavar="SPEC",
                   help='a fault in the one grammar of `ftrun emulate --inject` (ftrun.faultspec): "kill replica=R '
                        'step=S [at=F]" (a crash: SIGKILL), "hang replica=R [rank=K] step=S [duration=D]" (SIGSTOP), '
                        '"cut replica=R step=S [duration=D]" (a host loss: a network cut with --netns-hosts, else its '
                        'ranks stopped), "slow fetch replica=R [factor=F] [delay=D]"; repeatable (default: none)')
    p.add_argument("--max-kills", type=non_negative_int, default=None,
                   help="inject this many kills, then end the job (needs --stop-file) or let it run to --steps "
                        "(default: no limit)")
    p.add_argument("--stop-file", default=None, help="to end early, the supervisor writes the last step here "
                   "(pass the same path to the script, e.g. ft_worker --stop-file) (default: none)")
    p.add_argument("--restart-delay", type=duration, default=0.5, metavar="DURATION",
                   help="wait before restarting a killed replica; doubles after each crash in a row "
                        "(default: %(default)ss)")
    p.add_argument("--max-startup-failures", type=positive_int, default=3, metavar="N",
                   help="stop restarting a replica that crashed N times in a row with the same error, each time "
                        "before its first commit or without the job getting further (a crash loop); the job ends if "
                        "the others cannot make a quorum, and exits 1 either way (default: %(default)s)")
    p.add_argument("--start-method", choices=("fork-server", "spawn"), default="fork-server",
                   help="fork rank processes from a preloaded zygote, or spawn fresh interpreters "
                        "(default: %(default)s)")
    p.add_argument("--prepared-spares", action="store_true",
                   help="the zygote's spares run the script up to ftrun.train.init_from_env before a replica "
                        "restarts (its arguments, data, unsharded model), then take the restarted rank's identity; "
                        "the script must read nothing rank-specific before init_from_env (fork-server only)")
    p.add_argument("--baseline", action="store_true", help="first run the same job without failures")
    p.add_argument("--seed", type=int, default=0, help="seeds the choice of victims and kill times "
                   "(default: %(default)s)")
    p.add_argument("--timeout", type=positive_duration, default=None, metavar="DURATION",
                   help="end the job after this long, e.g. 90s, 12h (default: no limit: a real job runs until "
                        "--steps; crash loops end it through --max-startup-failures)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--out", default=None, help="folder for events, metrics, report.png and rank logs "
                   "(default: a new temporary folder)")
    add_host_arguments(p)
    add_listen_arguments(p)  # the lighthouse's, the diagnosis monitor's and the host agents' listeners
    p.add_argument("--json", action="store_true", help="print one JSON object with all figures as the last line")
    p.add_argument("--no-diagnose", action="store_true", help="no root-cause monitor: a hung rank is found by "
                   "the FTAR and heartbeat timeouts only")
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT names a module to run as python -m")
    p.add_argument("script", help="training script (or module, with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed on to the script")


def inject_spec(text: str) -> Injected:
    """argparse type: one --inject fault."""
    try:
        return parse_inject(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace(f"bad --inject {text!r}: ", "")) from None


def fault_kinds(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated host fault kinds."""
    try:
        return parse_kinds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_host_arguments(p: argparse.ArgumentParser) -> None:
    """A local rehearsal of a multi-host job: network namespaces as hosts (netns_job.py)."""
    g = p.add_argument_group("hosts: a multi-host rehearsal on this machine (network namespaces; needs root)")
    g.add_argument("--netns-hosts", type=positive_int, default=None, metavar="N",
                   help="run the job on N network namespaces as hosts: the lighthouse on host 0, each replica's "
                        "ranks on one of the others (default: no namespaces)")
    g.add_argument("--netns-delay", type=duration, default=0.0002, metavar="DURATION",
                   help="netem delay per link and direction inside a building (\"rack\") (default: 0.2ms)")
    g.add_argument("--netns-cross-delay", type=duration, default=0.002, metavar="DURATION",
                   help="netem delay per link and direction between buildings (default: 2ms)")
    g.add_argument("--netns-buildings", type=positive_int, default=2, metavar="B",
                   help="hosts are split into B buildings, contiguous (default: %(default)s)")
    g.add_argument("--netns-rate", type=non_negative_float, default=1000.0, metavar="MBIT",
                   help="bandwidth cap per link and direction in Mbit/s, 0 for none (default: %(default)s)")
    g.add_argument("--host-faults", type=fault_kinds, default=KINDS, metavar="KINDS",
                   help=f"with --netns-hosts, what --kill-every/--kill-random-mean inject, drawn at random: "
                        f"{','.join(KINDS)} (default: all of them)")
    m = p.add_argument_group("hosts: a job over several machines (multihost.py)")
    m.add_argument("--hosts", default=None, metavar="FILE",
                   help="one address per line; run this same command on every host, each with its --host-index: "
                        "host 0 runs the job, the others an agent (default: none, this machine only)")
    m.add_argument("--host-index", type=non_negative_int, default=None, metavar="I",
                   help="this host's line in --hosts, from 0 (default: none)")
    m.add_argument("--agent-port", type=positive_int, default=29511, metavar="PORT",
                   help="the agents' port on hosts 1.. (default: %(default)s)")
    g.add_argument("--cut-for", type=positive_duration, default=4.0, metavar="DURATION",
                   help="how long a host_cut keeps a host's link down (default: %(default)ss)")
