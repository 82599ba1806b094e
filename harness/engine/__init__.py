"""The emulated Env: greenlet tasks on a discrete-event loop with a virtual clock and a modeled network.

    world = EmulatedWorld(seed, topology, network=profile.network, cpu_charging=True)
    # or EmulatedWorld.from_profile(load_profile("meta-98k"))
    env = world.host_env(host_name)          # an ftrun.env.base.Env bound to one emulated host
    env.run(main, *args)                     # drive the loop until main returns (DeadlockError if stuck)
    world.kill_host(host_name, silent=False) # crash a host's processes; peers see PeerClosed
    conn.send_bytes(ShapeOnly(nbytes))       # a modeled transfer with a size and no bytes

Modules: core (scheduler, tasks, CPU charging), sync (Event/Queue/Lock), linkmodel (pure frame
timing), net (listeners, connections), world (EmulatedWorld, EmulatedEnv); ShapeOnly comes from
mocks.shapes, below both the engine and the shape-only mocks.
"""

from harness.engine.core import DeadlockError, Task
from harness.engine.net import parse_addr
from harness.engine.world import EmulatedEnv, EmulatedWorld
from mocks.shapes import ShapeOnly

__all__ = ["DeadlockError", "EmulatedEnv", "EmulatedWorld", "ShapeOnly", "Task", "parse_addr"]
