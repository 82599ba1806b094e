"""Linux network namespaces as hosts: a local rehearsal of a multi-host job on one machine.

    with NetnsHosts(NetnsConfig(num_hosts=4, delay_ms=0.2, rate_mbit=1000)) as hosts:
        hosts[0].addr                                  # "10.213.0.1": that host's only address
        proc = hosts.popen(1, [sys.executable, ...])   # a process on host 1
        hosts.cut(2); hosts.restore(2)                 # host 2 loses its link, then gets it back
        hosts.kill(3)                                  # SIGKILL every process on host 3

Each host is a namespace with loopback and one veth whose other end sits on a bridge (with no address:
the machine itself is not on the test subnet, so traffic goes only between the namespaces). Each link
is shaped with `tc netem` (delay, rate) where the kernel has netem, else with `tbf` (rate only; the
delay is then left out and `shaping` says so). Needs root (CAP_NET_ADMIN) and iproute2; `available()`
says why not. Teardown kills what runs in the namespaces and deletes them and the bridge, also when
building fails halfway. `build_commands`/`teardown_commands` are pure (table-tested); the driver runs them.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True, kw_only=True)
class NetnsConfig:
    """num_hosts namespaces on `subnet` (host i gets the subnet's (i+1)-th address).
    delay_ms: one-way delay added on each host's link in each direction (a round trip between two hosts
    crosses four shaped queues: 4 x delay_ms). rate_mbit: bandwidth cap per link and direction (None: none).
    tag: names are ftrun-{tag}-h{i} (namespaces), ft{tag}b (bridge), ft{tag}v{i} / ft{tag}p{i} (veth
    ends); random by default, so concurrent runs never collide."""

    num_hosts: int
    subnet: str = "10.213.0.0/24"
    delay_ms: float = 0.0
    rate_mbit: float | None = None
    buildings: int = 1  # hosts split into this many contiguous groups; between groups the delay is cross_delay_ms
    cross_delay_ms: float | None = None  # (default: delay_ms)
    tag: str = field(default_factory=lambda: secrets.token_hex(2))

    def __post_init__(self) -> None:
        net = ipaddress.ip_network(self.subnet)  # ValueError names the bad subnet
        if not net.is_private:
            raise ValueError(f"NetnsConfig.subnet must be a private range, got {self.subnet}")
        if not 1 <= self.num_hosts <= min(net.num_addresses - 2, 250):
            raise ValueError(f"NetnsConfig.num_hosts must be 1..{min(net.num_addresses - 2, 250)}, got {self.num_hosts}")
        if self.delay_ms < 0 or (self.rate_mbit is not None and self.rate_mbit <= 0):
            raise ValueError(f"NetnsConfig: delay_ms must be >= 0 and rate_mbit > 0, got {self.delay_ms}, {self.rate_mbit}")
        if not 1 <= self.buildings <= self.num_hosts or (self.cross_delay_ms is not None and self.cross_delay_ms < 0):
            raise ValueError(f"NetnsConfig: buildings must be 1..num_hosts and cross_delay_ms >= 0, got "
                             f"{self.buildings}, {self.cross_delay_ms}")
        if not (self.tag.isalnum() and self.tag.isascii() and 1 <= len(self.tag) <= 6):
            raise ValueError(f"NetnsConfig.tag must be 1-6 ASCII letters or digits, got {self.tag!r}")

    def building(self, i: int) -> int:
        """Host i's building: hosts are split into `buildings` contiguous groups of (nearly) equal size."""
        return i * self.buildings // self.num_hosts

    def namespace(self, i: int) -> str:
        return f"ftrun-{self.tag}-h{i}"

    def addr(self, i: int) -> str:
        return str(ipaddress.ip_network(self.subnet)[i + 1])

    @property
    def bridge(self) -> str:
        return f"ft{self.tag}b"

    def veth(self, i: int) -> tuple[str, str]:
        """(the bridge's end, the host's end) of host i's link."""
        return f"ft{self.tag}v{i}", f"ft{self.tag}p{i}"


def shaping_commands(cfg: NetnsConfig, i: int, *, netem: bool) -> list[list[str]]:
    """tc commands that shape both directions of host i's link (none when nothing is asked). With netem
    and more than one building, each direction gets a prio qdisc: band 1 (default) delays by delay_ms,
    band 2 by cross_delay_ms, and u32 filters send traffic to (from) other buildings' hosts to band 2."""
    if cfg.delay_ms == 0 and cfg.rate_mbit is None and not cfg.cross_delay_ms:
        return []
    if netem and cfg.buildings > 1:
        return _two_band_commands(cfg, i)
    if netem:
        qdisc = ["netem", "delay", f"{cfg.delay_ms}ms"] + (["rate", f"{cfg.rate_mbit}mbit"] if cfg.rate_mbit else [])
    elif cfg.rate_mbit:
        qdisc = ["tbf", "rate", f"{cfg.rate_mbit}mbit", "burst", "256kb", "latency", "50ms"]
    else:
        return []
    outer, inner = cfg.veth(i)
    return [["tc", "qdisc", "add", "dev", outer, "root", *qdisc],
            ["ip", "netns", "exec", cfg.namespace(i), "tc", "qdisc", "add", "dev", inner, "root", *qdisc]]


def _netem(delay_ms: float, rate_mbit: float | None) -> list[str]:
    return ["netem", "delay", f"{delay_ms}ms"] + (["rate", f"{rate_mbit}mbit"] if rate_mbit else [])


def _two_band_commands(cfg: NetnsConfig, i: int) -> list[list[str]]:
    cross = cfg.delay_ms if cfg.cross_delay_ms is None else cfg.cross_delay_ms
    far = [cfg.addr(j) for j in range(cfg.num_hosts) if cfg.building(j) != cfg.building(i)]
    outer, inner = cfg.veth(i)
    out = []
    # the bridge's end sends to host i: match the sender; host i's end sends out: match the receiver
    for prefix, dev, field in (([], outer, "src"), (["ip", "netns", "exec", cfg.namespace(i)], inner, "dst")):
        tc = [*prefix, "tc"]
        out += [[*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "prio", "bands", "2", "priomap", *["0"] * 16],
                [*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                 *_netem(cfg.delay_ms, cfg.rate_mbit)],
                [*tc, "qdisc", "add", "dev", dev, "parent", "1:2", "handle", "20:", *_netem(cross, cfg.rate_mbit)]]
        out += [[*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
                 field, f"{addr}/32", "flowid", "1:2"] for addr in far]
    return out


def build_commands(cfg: NetnsConfig, *, netem: bool) -> list[list[str]]:
    """Every command that builds the hosts, in order (shaping included)."""
    prefix = ipaddress.ip_network(cfg.subnet).prefixlen
    cmds = [["ip", "link", "add", cfg.bridge, "type", "bridge"], ["ip", "link", "set", cfg.bridge, "up"]]
    for i in range(cfg.num_hosts):
        ns, (outer, inner) = cfg.namespace(i), cfg.veth(i)
        cmds += [
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns],
            ["ip", "link", "set", outer, "master", cfg.bridge],
            ["ip", "link", "set", outer, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"{cfg.addr(i)}/{prefix}", "dev", inner],
            ["ip", "-n", ns, "link", "set", inner, "up"],
            *shaping_commands(cfg, i, netem=netem),
        ]
    return cmds


def teardown_commands(cfg: NetnsConfig) -> list[list[str]]:
    """Each veth pair (deleted at once; a deleted namespace frees its own only later, asynchronously),
    the namespaces, the bridge. Each may fail (not built, or already gone): the driver ignores that."""
    return [cmd for i in range(cfg.num_hosts) for cmd in
            (["ip", "link", "del", cfg.veth(i)[0]], ["ip", "netns", "del", cfg.namespace(i)])] + \
           [["ip", "link", "del", cfg.bridge]]


def _run(cmd: Sequence[str]) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


def available(runner: Runner = _run) -> tuple[bool, str]:
    """(True, "") when this process can create namespaces, veth pairs and bridges; else (False, why)."""
    probe = NetnsConfig(num_hosts=1)
    try:
        for cmd in build_commands(probe, netem=False)[:4]:
            done = runner(cmd)
            if done.returncode != 0:
                return False, f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}"
        return True, ""
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"cannot run iproute2: {e}"
    finally:
        for cmd in teardown_commands(probe):
            try:
                runner(cmd)
            except (OSError, subprocess.SubprocessError):
                pass


@dataclass(frozen=True)
class Host:
    index: int
    namespace: str
    addr: str


class NetnsError(RuntimeError):
    """A namespace command failed; the message names the command and what iproute2 said."""


class NetnsHosts:
    """The hosts of one NetnsConfig, built on enter and torn down on exit. Threading: one owner."""

    def __init__(self, config: NetnsConfig, *, runner: Runner = _run) -> None:
        self.config, self._run = config, runner
        self.hosts = [Host(i, config.namespace(i), config.addr(i)) for i in range(config.num_hosts)]
        self.shaping = "none"

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __enter__(self) -> "NetnsHosts":
        try:
            self.build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def build(self) -> None:
        netem = self._has_netem()
        for cmd in build_commands(self.config, netem=netem):
            self._check(cmd)
        cfg = self.config
        if cfg.delay_ms == 0 and cfg.rate_mbit is None:
            self.shaping = "none"
        elif netem:
            self.shaping = f"netem delay {cfg.delay_ms}ms" + (f" rate {cfg.rate_mbit}mbit" if cfg.rate_mbit else "")
            if cfg.buildings > 1:
                self.shaping += f", {cfg.cross_delay_ms}ms between {cfg.buildings} buildings"
        else:
            self.shaping = (f"tbf rate {cfg.rate_mbit}mbit" if cfg.rate_mbit else "none") + \
                " (no netem in this kernel: delay not applied)"

    def _has_netem(self) -> bool:
        """Whether the kernel has the netem qdisc (tried on a scratch veth pair, then removed)."""
        a, b = f"ft{self.config.tag}xa", f"ft{self.config.tag}xb"
        try:
            if self._run(["ip", "link", "add", a, "type", "veth", "peer", "name", b]).returncode != 0:
                return False
            return self._run(["tc", "qdisc", "add", "dev", a, "root", "netem", "delay", "1ms"]).returncode == 0
        finally:
            self._run(["ip", "link", "del", a])

    def _check(self, cmd: Sequence[str]) -> None:
        done = self._run(cmd)
        if done.returncode != 0:
            raise NetnsError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or f'exit {done.returncode}'}")

    def popen(self, i: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on host i (`ip netns exec` execs it: the Popen's pid is the program's)."""
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[i].namespace, *argv], **kwargs)

    def pids(self, i: int) -> list[int]:
        done = self._run(["ip", "netns", "pids", self.hosts[i].namespace])
        return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []

    def kill(self, i: int) -> list[int]:
        """SIGKILL every process on host i (a host failure); returns their pids. Never this process (it
        may have created sockets there from a thread, see in_netns)."""
        pids = [p for p in self.pids(i) if p != os.getpid()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def cut(self, i: int) -> None:
        """Take host i's link down (its processes live on, unreachable)."""
        self._check(["ip", "link", "set", self.config.veth(i)[0], "down"])

    def restore(self, i: int) -> None:
        self._check(["ip", "link", "set", self.config.veth(i)[0], "up"])

    def teardown(self) -> None:
        """Kill every process in the namespaces, then delete them and the bridge. Never raises."""
        for i in range(len(self.hosts)):
            try:
                self.kill(i)
            except (OSError, subprocess.SubprocessError):
                pass
        for cmd in teardown_commands(self.config):
            try:
                self._run(cmd)
            except (OSError, subprocess.SubprocessError):
                pass


CLONE_NEWNET = 0x40000000


def netns_path(namespace: str) -> str:
    """The file `ip netns add` made for `namespace` (what setns opens)."""
    for base in ("/run/netns", "/var/run/netns"):
        if os.path.exists(os.path.join(base, namespace)):
            return os.path.join(base, namespace)
    raise NetnsError(f"no network namespace {namespace!r} (looked in /run/netns and /var/run/netns)")


def setns(fd: int) -> None:
    """Move the calling thread into the network namespace open at `fd` (setns(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(namespace: str):
    """Run the block with the calling thread in `namespace`'s network: sockets it opens, and threads it
    starts (they inherit the namespace and keep it), live there. The thread moves back on exit."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(netns_path(namespace), os.O_RDONLY)
    try:
        setns(target)
        try:
            yield
        finally:
            setns(home)
    finally:
        os.close(target)
        os.close(home)


class HostLauncher:
    """A procs.Launcher whose rank processes live on one host (namespace) of a NetnsHosts: forked by the
    zygote, which setns's each child into it, or spawned with `ip netns exec`. `env` is added to each
    rank's environment (e.g. GLOO_SOCKET_IFNAME, the host's interface). Closing it leaves `base` open."""

    def __init__(self, base, namespace: str, env: dict[str, str] | None = None) -> None:
        self.base, self.namespace, self.env = base, namespace, dict(env or {})

    def start(self, argv: list[str], *, env: dict[str, str], cwd: str, stdout: str, stderr: str,
              netns: str | None = None):
        return self.base.start(argv, env={**env, **self.env}, cwd=cwd, stdout=stdout, stderr=stderr,
                               netns=netns or self.namespace)

    def close(self) -> None:
        pass


class NetnsLauncher:
    """A procs.Launcher that starts `python ARGV` on host i of `hosts` (its own session, like SpawnLauncher)."""

    def __init__(self, hosts: NetnsHosts, i: int) -> None:
        self.namespace = hosts[i].namespace

    def start(self, argv: list[str], *, env: dict[str, str], cwd: str, stdout: str, stderr: str):
        from ftrun.launch.procs import _Spawned

        with open(stdout, "ab") as out, open(stderr, "ab") as err:
            proc = subprocess.Popen(["ip", "netns", "exec", self.namespace, sys.executable, *argv], env=env, cwd=cwd,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        return _Spawned(proc)

    def close(self) -> None:
        pass
