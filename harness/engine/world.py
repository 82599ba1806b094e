"""EmulatedWorld: many emulated hosts on one virtual clock, and the Env each host hands to the runtime.

    world = EmulatedWorld(seed=0, topology=Topology.from_profile(profile), network=profile.network)
    env = world.host_env(topology.host_of(replica=0, rank=0))   # satisfies ftrun.env.base.Env
    result = env.run(main, arg)          # drives the event loop until main returns

`env.spawn` starts a task on that env's host; any task may spawn on any host through that host's env.
`world.kill_host(name)` kills every task on a host and closes its connections (peers see PeerClosed
after one latency); `silent=True` instead makes the host vanish (peers only see timeouts) until
`revive_host`. `world.cut_building(b, start, end)` partitions building b from the rest for a while.
A killed host can run new tasks at once (a restarted process).
"""

from __future__ import annotations

import random
from typing import Any, Callable, TypeVar

from ftrun.env.admission import ListenLimits
from harness.engine.core import Host, Scheduler, Task
from harness.engine.linkmodel import LinkModel
from harness.engine.net import EmuNetwork, Fabric, NetHost
from harness.engine.sync import EmuEvent, EmuLock, EmuQueue
from harness.profile import NetworkConfig, Profile
from harness.topology import Topology

T = TypeVar("T")


class EmuClock:
    """Virtual time; the same clock for every host (no skew is modeled)."""

    __slots__ = ("_sched",)

    def __init__(self, sched: Scheduler) -> None:
        self._sched = sched

    def now(self) -> float:
        return self._sched.vnow()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._sched.wait(None, seconds, "sleep")
        else:
            self._sched.yield_now()

    def cpu(self) -> float:
        """The calling task's process's modeled busy time (Scheduler.cpu): the Env seam's CPU counter."""
        return self._sched.cpu()

    def charge(self, seconds: float) -> None:
        """Count `seconds` of modeled CPU to the calling task's process, without waiting (the emulator's compute
        and bookkeeping, whose wall time it models as sleeps)."""
        self._sched.charge_cpu(seconds)


class EmulatedEnv:
    """The Env of one emulated host (ftrun.env.base.Env)."""

    __slots__ = ("world", "host", "clock", "net", "_core")

    def __init__(self, world: "EmulatedWorld", core: Host) -> None:
        self.world = world
        self.host = core.name
        self._core = core
        self.clock = world.clock
        self.net = EmuNetwork(world.fabric, core.net)

    def spawn(self, fn: Callable[..., Any], *args: Any, name: str) -> Task:
        return self.world.sched.spawn(self._core, fn, args, name)

    def event(self) -> EmuEvent:
        return EmuEvent(self.world.sched)

    def queue(self) -> EmuQueue:
        return EmuQueue(self.world.sched)

    def lock(self) -> EmuLock:
        return EmuLock(self.world.sched)

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) as a main task on this host until it returns; re-raises its exception.

        Called from inside a running task it is a plain call (like the real Env). Raises
        DeadlockError if the main task blocks with nothing left that could wake it.
        """
        return self.world.run_on(self.host, fn, *args)

    def __repr__(self) -> str:
        return f"<EmulatedEnv {self.host}>"


class EmulatedWorld:
    """A set of emulated hosts sharing one event loop, virtual clock and modeled network.

    Args:
        seed: seeds `world.rng` (latency jitter, and whatever the harness draws from it).
        topology: host placement; None puts every host in one rack.
        network: latency / bandwidth parameters (default NetworkConfig()).
        cpu_charging: charge each task slice's measured CPU time to its host (off: fully
            deterministic; on: timings vary slightly between runs).
        cpu_scale: modeled seconds per measured second.
        host_cpu_cores: slices that may run at once on one host.
        cpu_clock: "thread" (thread_time: the CPU the slice used, unaffected by other processes on
            the box) or "perf" (perf_counter: cheaper, but charges time the OS gave to others).
        trace: record (virtual time, task name) for every resume in `world.trace`.
        net_limits: caps on every listener's connections (ftrun.env.admission, as RealEnv's); None: uncapped,
            the default (a modeled network has no hostile peers, and its simultaneous connects, which a real
            kernel's accept queue would spread, would count as a flood).
    """

    def __init__(self, seed: int, topology: Topology | None = None, *, network: NetworkConfig | None = None,
                 cpu_charging: bool = True, cpu_scale: float = 1.0, host_cpu_cores: int = 8,
                 cpu_clock: str = "thread", trace: bool = False, net_limits: ListenLimits | None = None) -> None:
        if host_cpu_cores < 1:
            raise ValueError(f"host_cpu_cores must be >= 1, got {host_cpu_cores}")
        self.seed = seed
        self.rng = random.Random(seed)
        self.topology = topology if topology is not None else Topology.single_rack()
        self.network = network if network is not None else NetworkConfig()
        self.sched = Scheduler(cpu_charging=cpu_charging, cpu_scale=cpu_scale, cpu_clock=cpu_clock, trace=trace)
        self.clock = EmuClock(self.sched)
        self.fabric = Fabric(self.sched, LinkModel(self.network, self.topology, self.rng), self._host)
        self.fabric.crash_fin_delay_s = self.network.crash_fin_delay_s
        self.fabric.listen_limits = net_limits
        self._cores = host_cpu_cores
        self._hosts: dict[str, Host] = {}
        self._envs: dict[str, EmulatedEnv] = {}

    @classmethod
    def from_profile(cls, profile: Profile, *, seed: int | None = None, topology: Topology | None = None,
                     **overrides: Any) -> "EmulatedWorld":
        """A world laid out and parameterized by a scale profile (keyword overrides win)."""
        seed = profile.seed if seed is None else seed
        emu = profile.emulation
        kwargs: dict[str, Any] = dict(network=profile.network, cpu_charging=emu.cpu_charging,
                                      cpu_scale=emu.cpu_scale, cpu_clock=emu.cpu_clock,
                                      host_cpu_cores=emu.host_cpu_cores)
        kwargs.update(overrides)
        return cls(seed, topology if topology is not None else Topology.from_profile(profile, seed=seed), **kwargs)

    def _host(self, name: str) -> Host:
        core = self._hosts.get(name)
        if core is None:
            if not name or ":" in name:
                raise ValueError(f"bad host name {name!r}")
            core = self._hosts[name] = Host(name, self._cores)
            core.net = NetHost(name)
        return core

    def host_env(self, host: str) -> EmulatedEnv:
        """The Env bound to `host` (created on first use; the same object on every call)."""
        env = self._envs.get(host)
        if env is None:
            env = self._envs[host] = EmulatedEnv(self, self._host(host))
        return env

    def run_on(self, host: str, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) as a main task on `host` until it returns (see EmulatedEnv.run)."""
        sched = self.sched
        if sched.running:
            return fn(*args)
        main = sched.spawn(self._host(host), fn, args, name=f"main@{host}")
        sched.run_until_done(main)
        if main.exception is not None:
            raise main.exception
        return main.result

    def kill_host(self, host: str, *, silent: bool = False) -> None:
        """Kill every task on `host` and close its listeners and connections.

        silent=False: a crashed process; peers see PeerClosed one latency later, connects are refused.
        silent=True: a dead machine; nothing is sent, arriving frames are dropped and connects get no
        answer, so peers notice only through timeouts; lasts until revive_host(host).
        Callable from any task; a caller running on `host` itself gets TaskKilled from this call,
        after everything else on the host has been killed and closed.
        """
        core = self._host(host)
        self.fabric.kill_host(core.net, silent)
        current = self.sched.current
        for task in list(core.tasks):
            if task is not current:
                self.sched.kill(task)
        if current is not None and current.host is core:
            self.sched.kill(current)  # raises TaskKilled here

    def freeze(self, host: str, proc: Any = None) -> None:
        """Stop process `proc` (a root Task: `task.proc`) on `host`, or the whole host: see Scheduler.freeze."""
        self.sched.freeze(self._host(host), proc)

    def thaw(self, host: str, proc: Any = None) -> None:
        self.sched.thaw(self._host(host), proc)

    def kill_process(self, host: str, proc: Any) -> None:
        """A crashed process: kill its tasks and close the listeners and connections it opened (peers see
        the FIN); the host's other processes run on. Not callable from the process itself."""
        core = self._host(host)
        self.fabric.kill_owner(core.net, proc)
        for task in [t for t in core.tasks if t.proc is proc]:
            self.sched.kill(task)

    def cut_building(self, building: int, start_s: float, end_s: float) -> None:
        """Cut building `building` off from the others from virtual time start_s to end_s (silent: frames,
        FINs and connects across the cut are held until it heals; see harness.engine.net)."""
        if not 0 <= start_s < end_s:
            raise ValueError(f"a cut needs 0 <= start < end, got {start_s}, {end_s}")
        self.fabric.cuts.append((building, start_s, end_s))

    def revive_host(self, host: str) -> None:
        """Undo a silent kill: the host answers and receives again (its old connections stay closed)."""
        self._host(host).net.silent = False

    @property
    def now(self) -> float:
        return self.sched.vnow()

    @property
    def trace(self) -> list | None:
        return self.sched.trace

    def hosts(self) -> list[str]:
        return list(self._hosts)

    def stats(self) -> dict[str, float]:
        s = self.sched
        return {"virtual_s": s.now, "events": s.num_events, "resumes": s.num_resumes,
                "tasks_spawned": s.num_spawned, "tasks_live": len(s.live_tasks),
                "frames": self.fabric.num_frames, "bytes": self.fabric.num_bytes, "hosts": len(self._hosts)}
