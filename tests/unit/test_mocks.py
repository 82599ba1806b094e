"""CPU mocks: shape-only compute (meta tensors, propagated once per layout), the object store's modeled
latency, the scheduler's allocation delays. Time is the emulator's virtual clock, so every check is exact."""

from __future__ import annotations

import numpy as np
import pytest

from harness.engine import EmulatedWorld, ShapeOnly
from harness.profile import SchedulerConfig, load_profile
from mocks.compute import ShapeCache, ShapeOnlyCompute, ShapeOnlyGrads, propagate_shapes
from mocks.scheduler import MockScheduler, NoCapacity
from mocks.storage import MockObjectStore


def emulated(fn):
    world = EmulatedWorld(seed=0, cpu_charging=False)
    env = world.host_env("h0")
    return env.run(fn, env)


# -- compute --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["ci-small", "crusoe-300", "meta-98k"])
def test_meta_shapes_match_the_profile_model(name):
    p = load_profile(name)
    s = propagate_shapes(p.model, p.ranks_per_replica)
    assert s.num_params == p.model.num_params  # meta-device forward/backward of a block agrees with the formula
    assert s.grad_bytes_per_rank == s.params_per_rank * {"fp32": 4, "bf16": 2}[p.model.dtype]
    assert s.activation_shape == (1, p.model.seq_len, p.model.hidden)
    assert s.flops_per_step_per_rank == 6.0 * s.num_params * p.model.seq_len


def test_shapes_are_propagated_once_per_replica_layout_not_once_per_rank():
    p = load_profile("meta-98k")
    cache = ShapeCache()

    def ranks(env):
        computes = [ShapeOnlyCompute(env=env, model=p.model, ranks_per_replica=8192, cache=cache, step_time_s=20.0)
                    for _ in range(200)]
        ShapeOnlyCompute(env=env, model=p.model, ranks_per_replica=4096, cache=cache, step_time_s=20.0)
        return computes

    computes = emulated(ranks)
    assert cache.num_propagations == 2  # two layouts, 201 ranks
    assert len({id(c.shapes) for c in computes}) == 1


def test_forward_backward_waits_out_the_modeled_step():
    p = load_profile("ci-small")

    def body(env):
        c = ShapeOnlyCompute(env=env, model=p.model, ranks_per_replica=8, cache=ShapeCache(), step_time_s=0.5)
        t0 = env.clock.now()
        assert c.forward_backward() == 0.5 and c.forward_backward(extra_s=2.0) == 2.5
        flops = ShapeOnlyCompute(env=env, model=p.model, ranks_per_replica=8, cache=ShapeCache(), flops_per_s=1e12)
        took = flops.forward_backward()
        return env.clock.now() - t0, took, flops.shapes.flops_per_step_per_rank

    elapsed, took, step_flops = emulated(body)
    assert elapsed == pytest.approx(3.0 + took) and took == pytest.approx(step_flops / 1e12)


def test_jittered_steps_stay_within_bounds():
    p = load_profile("ci-small")
    c = emulated(lambda env: ShapeOnlyCompute(env=env, model=p.model, ranks_per_replica=8, cache=ShapeCache(),
                                              step_time_s=1.0, jitter=0.1))
    times = [c.step_seconds() for _ in range(200)]
    assert 0.9 <= min(times) < max(times) <= 1.1
    with pytest.raises(ValueError):
        ShapeOnlyCompute(env=None, model=p.model, ranks_per_replica=8, cache=ShapeCache())


def test_shape_only_grads_slice_to_frames_and_ignore_arithmetic():
    g = ShapeOnlyGrads(1000, "bfloat16")
    part = g[100:300]
    assert type(part) is ShapeOnly and part.nbytes == 200 and g[990:2000].nbytes == 10
    assert type(ShapeOnlyGrads(64)) is ShapeOnlyGrads and ShapeOnlyGrads(64)[0:16].nbytes == 16
    assert np.divide(g, 4, out=g, casting="unsafe") is g
    g.fill(0)
    with pytest.raises(ValueError):
        g[0:10:2]


# -- storage --------------------------------------------------------------------------------------

def test_object_store_charges_latency_plus_size_over_bandwidth():
    def body(env):
        store = MockObjectStore(env=env, write_latency_s=0.02, read_latency_s=0.01, bandwidth_bytes_per_s=1e6)
        t0 = env.clock.now()
        store.write_atomic("ckpt/loader_state.json", b"x" * 1000)
        t1 = env.clock.now()
        got = store.read("ckpt/loader_state.json")
        t2 = env.clock.now()
        missing = store.read("nope")
        t3 = env.clock.now()
        return store, got, missing, (t1 - t0, t2 - t1, t3 - t2)

    store, got, missing, (w, r, m) = emulated(body)
    assert got == b"x" * 1000 and missing is None
    assert w == pytest.approx(0.02 + 1000 / 1e6) and r == pytest.approx(0.01 + 1000 / 1e6) and m == pytest.approx(0.01)
    assert (store.num_writes, store.num_reads, store.bytes_written, store.keys()) == (1, 2, 1000, ["ckpt/loader_state.json"])


def test_object_store_writes_are_atomic_and_keys_checked():
    def body(env):
        store = MockObjectStore.remote(env)
        store.write_atomic("state", b"old")
        writer = env.spawn(store.write_atomic, "state", b"new", name="writer")
        env.clock.sleep(0.001)  # the write is in flight: a reader still sees the old blob
        during = store.read("state")
        writer.join()
        return during, store.read("state")

    assert emulated(body) == (b"old", b"new")
    for bad in ("", "/abs", "a/../b"):
        with pytest.raises(ValueError):
            emulated(lambda env, bad=bad: MockObjectStore.local_disk(env).write_atomic(bad, b""))


def test_the_lighthouse_persists_through_the_mock_store():
    from ftrun.quorum.service import STATE_KEY, load_state

    def body(env):
        store = MockObjectStore.local_disk(env)
        store.write_atomic(STATE_KEY, b'{"quorum_id": 7, "participants": ["r0", "r1"]}')
        return load_state(store)

    state = emulated(body)
    assert state.quorum_id == 7 and state.prev_participants == ("r0", "r1")


# -- scheduler ------------------------------------------------------------------------------------

CFG = SchedulerConfig(alloc_delay_cold_s=300.0, alloc_delay_warm_s=30.0, process_start_s=60.0)


def test_relaunch_gives_the_same_hosts_after_the_warm_delay():
    def body(env):
        s = MockScheduler(env=env, config=CFG)
        t0 = env.clock.now()
        a = s.relaunch(["h1", "h2"])
        return a, env.clock.now() - t0

    a, took = emulated(body)
    assert a.hosts == ("h1", "h2") and a.kind == "relaunch" and took == 30.0


def test_replace_uses_hot_spares_then_cold_then_runs_out():
    def body(env):
        s = MockScheduler(env=env, config=CFG, hot_spares=["hot0", "hot1"], cold_spares=["c0", "c1", "c2"])
        out = []
        for n in (2, 2, 2):
            t0 = env.clock.now()
            try:
                a = s.replace(n)
                out.append((a.kind, a.hosts, env.clock.now() - t0))
            except NoCapacity as e:
                out.append(("none", str(e), env.clock.now() - t0))
        return out

    hot, cold, none = emulated(body)
    assert hot == ("hot", ("hot0", "hot1"), 30.0)
    assert cold == ("cold", ("c0", "c1"), 300.0)
    assert none[0] == "none" and "1 cold" in none[1] and none[2] == 0.0


def test_plans_are_pure():
    s = MockScheduler(env=None, config=CFG, hot_spares=["a"])
    assert s.plan_replace(1).delay_s == 30.0 and s.free_hot == 1
    assert s.plan_relaunch(["x"]).hosts == ("x",)
    with pytest.raises(NoCapacity):
        s.plan_replace(2)
