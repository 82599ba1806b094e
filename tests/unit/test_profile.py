"""Scale profiles: the shipped TOML files load with their seed-document numbers; overrides and
validation errors name the offending key."""

from __future__ import annotations

import re
import tomllib

import pytest

from harness.profile import (NetworkConfig, Profile, apply_overrides, list_profiles,
                             load_profile, profile_from_dict, profile_path, weibull_scale_for_mean)
from harness.topology import HopClass

SHIPPED = ["meta-98k", "llama3-16k", "design-4k", "crusoe-300", "ci-small"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_load(name):
    p = load_profile(name)
    assert p.name == name and p.num_hosts <= p.topology.capacity_hosts and p.model.num_params > 0


def test_list_profiles_finds_the_scale_profiles():
    assert set(SHIPPED) <= set(list_profiles())
    assert all(load_profile(n).name == n for n in list_profiles())


def test_meta_98k_numbers_come_from_the_paper():
    p = load_profile("meta-98k")
    assert (p.replicas, p.ranks_per_replica, p.num_ranks) == (12, 8192, 98_304)
    assert p.topology.buildings == 4 and p.train.step_compute_s == 20.0 and p.timeouts.heartbeat_timeout_s == 60.0 == p.timeouts.ftar_timeout_s
    assert p.failures.cluster_mtbf_s(p.num_hosts) == pytest.approx(18 * 60)  # a failure every 18 minutes
    ratios = [p.network.latency_s(h) / p.network.latency_s(HopClass.SAME_RACK)
              for h in (HopClass.OTHER_RACK, HopClass.OTHER_ZONE, HopClass.OTHER_BUILDING)]
    assert ratios == [7, 15, 30] and p.network.cross_zone_oversubscription == 2.8
    assert p.ftar.engine.chunk_bytes == 8 * 2**20 and p.checkpoint.every_steps == 100


def test_the_other_profiles_match_their_seeds():
    design = load_profile("design-4k")
    assert design.num_ranks == 3968 and design.spares.hot_spare_hosts * 8 == 32 and design.num_hosts == 500
    assert 450e9 < design.model.num_params < 550e9
    crusoe = load_profile("crusoe-300")
    assert (crusoe.replicas, crusoe.ranks_per_replica, crusoe.num_hosts) == (30, 10, 30)
    assert crusoe.failures.mode == "periodic" and crusoe.failures.interval_s == 60.0
    assert crusoe.train.step_compute_s == pytest.approx(11, abs=0.2) and crusoe.checkpoint is None
    llama = load_profile("llama3-16k")
    assert llama.num_ranks == 16_384 and 400e9 < llama.model.num_params < 410e9
    assert llama.failures.cluster_mtbf_s(llama.num_hosts) == pytest.approx(54 * 86400 / 419, rel=1e-3)
    ci = load_profile("ci-small")
    assert ci.failures.events == ("kill replica=1 step=3",)
    assert ci.emulation.cpu_charging is False


def test_overrides_are_typed_and_validated():
    p = load_profile("ci-small")
    q = apply_overrides(p, ["ftar.engine.num_chunks=8", "replicas=2", "emulation.cpu_charging=true",
                            "failures.distribution=weibull", "failures.protected_replicas=[0]"])
    assert q.ftar.engine.num_chunks == 8 and q.ftar.engine.chunk_bytes == p.ftar.engine.chunk_bytes and q.replicas == 2
    assert q.emulation.cpu_charging is True and q.failures.distribution == "weibull"
    assert q.failures.protected_replicas == (0,) and p.replicas == 4  # the original is untouched
    assert load_profile("ci-small", ["train.steps=3"]).train.steps == 3
    with pytest.raises(ValueError, match="ftar.engine.chunk_mb"):
        apply_overrides(p, ["ftar.engine.chunk_mb=8"])
    with pytest.raises(ValueError, match="nosuch.key"):
        apply_overrides(p, ["nosuch.key=1"])
    with pytest.raises(ValueError, match="chunk_bytes must be a positive multiple of 16, got 1000"):
        apply_overrides(p, ["ftar.engine.chunk_bytes=1000"])  # raised, never rounded
    with pytest.raises(ValueError, match=r"\[ftar\] engine.timeout_s"):
        apply_overrides(p, ["ftar.engine.timeout_s=3.0"])  # the job's FTAR timeout is [timeouts]
    with pytest.raises(ValueError, match="replicas"):
        apply_overrides(p, ["replicas=two"])
    with pytest.raises(ValueError, match="distribution"):
        apply_overrides(p, ["failures.distribution=gamma"])
    with pytest.raises(ValueError, match="dotted.key=value"):
        apply_overrides(p, ["replicas"])


def base() -> dict:
    with open(profile_path("ci-small"), "rb") as f:
        return tomllib.load(f)


@pytest.mark.parametrize("patch, message", [
    ({"replicaz": 3}, "unknown key 'replicaz'"),
    ({"ftar": {"engine": {"chunk_bytes": 1024, "chunks": 2}}}, "unknown key 'ftar.engine.chunks'"),
    ({"ftar": {"chunk_mb": 1}}, "unknown key 'ftar.chunk_mb'"),
    ({"replicas": 0}, "replicas must be > 0"),
    ({"replicas": 2.5}, "replicas must be int"),
    ({"train": {"steps": "ten"}}, "train.steps must be int"),
    ({"train": {"min_replicas": 9}}, "min_replicas"),
    ({"replicas": 100}, "topology"),
    ({"model": {"hidden": 100, "heads": 3}}, "hidden"),
    ({"network": {"other_rack_factor": 0.5}}, "_factor"),
    ({"timeouts": {"heartbeat_interval_s": 5.0}}, "heartbeat_interval_s"),
    ({"failures": {"mode": "scripted"}}, "events"),
    ({"failures": {"mode": "often"}}, "failures.mode"),
    ({"failures": {"mode": "scripted", "events": ["kill replica=1"]}}, "a kill with step= or time="),
    ({"failures": {"mode": "scripted", "events": ["kill replica=7 time=1"]}}, "failures"),
    ({"failures": {"mode": "scripted", "events": ["explode replica=1"]}}, "unknown fault 'explode'"),
    ({"failures": {"mode": "scripted", "events": ["kill replica=1 time=1 speed=2"]}}, "unknown fields: speed"),
    ({"topology": "big"}, "topology must be a table"),
    ({"catchup": {"max_shard_bytes": 1000}},
     "[catchup] CatchupConfig.max_shard_bytes must be a positive multiple of 64"),
    ({"catchup": {"wait_limit_s": -1.0}}, "[catchup] CatchupConfig.wait_limit_s must be >= 0"),
    ({"catchup": {"max_source_failures": 0}}, "[catchup] CatchupConfig.max_source_failures must be >= 1"),
    ({"catchup": {"shard_bytes": 4096}}, "unknown key 'catchup.shard_bytes'"),
    ({"catchup": {"timeouts": {"catchup_stall_s": 1.0}}}, "[catchup] timeouts must be left unset"),
    ({"catchup": {"bind": "0.0.0.0:0"}}, "[catchup] bind/advertise_host must be left unset"),
    ({"checkpoint": {"every_steps": 0}}, "[checkpoint] CheckpointConfig.every_steps must be an int >= 1, got 0"),
    ({"checkpoint": {"keep": 0}}, "[checkpoint] CheckpointConfig.keep must be an int >= 1, got 0"),
    ({"checkpoint": {"every_steps": 2.5}}, "checkpoint.every_steps must be int, got 2.5"),
    ({"checkpoint": {"local_write_latency_s": 0.1}}, "unknown key 'checkpoint.local_write_latency_s'"),
    ({"storage": {"local_write_latency_s": -1.0}}, "[storage] local_write_latency_s must be >= 0, got -1.0"),
    ({"storage": {"checkpoint_bandwidth_bytes_per_s": 0.0}},
     "[storage] checkpoint_bandwidth_bytes_per_s must be > 0, got 0.0"),
    ({"storage": {"checkpoint_stage_bytes_per_s": -2.0}}, "[storage] checkpoint_stage_bytes_per_s must be > 0, got -2.0"),
    ({"checkpoint": {"async_write": 1}}, "checkpoint.async_write must be bool, got 1"),
])
def test_validation_errors_name_the_key(patch, message):
    data = base()
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    if patch.get("failures", {}).get("mode") == "scripted" and "events" not in patch["failures"]:
        data["failures"].pop("events", None)
    with pytest.raises(ValueError, match=re.escape(message)):
        profile_from_dict(data)


def test_missing_required_keys_and_defaults():
    with pytest.raises(ValueError, match="missing key 'name'"):
        profile_from_dict({"replicas": 1, "ranks_per_replica": 1})
    p = profile_from_dict({"name": "x", "replicas": 2, "ranks_per_replica": 8})
    assert isinstance(p, Profile) and p.network == NetworkConfig() and p.num_hosts == 2


def test_catchup_table_is_the_runtimes_catchup_config():
    from ftrun.catchup.config import CatchupConfig
    from harness.run.job import catchup_config_of

    p = load_profile("ci-small")
    assert p.catchup is None  # no table: the emulator cuts a rank's state into about 8 shards
    assert catchup_config_of(p, 8 << 20) == CatchupConfig(max_shard_bytes=1 << 20, timeouts=p.timeouts)
    q = apply_overrides(p, ["catchup.max_shard_bytes=4096", "catchup.wait_limit_s=2.5"])  # starts the table
    assert q.catchup == CatchupConfig(max_shard_bytes=4096, wait_limit_s=2.5)
    c = catchup_config_of(q, 8 << 20)
    assert c.max_shard_bytes == 4096 and c.wait_limit == 2.5 and c.timeouts == q.timeouts
    unset = apply_overrides(q, ["catchup.wait_limit_s=none"])
    assert catchup_config_of(unset, 1).wait_limit == q.timeouts.ftar_timeout_s
    assert apply_overrides(q, ["catchup=none"]).catchup is None
    with pytest.raises(ValueError, match="max_shard_bytes must be a positive multiple of 64, got 100"):
        apply_overrides(p, ["catchup.max_shard_bytes=100"])  # raised, never rounded


def test_checkpoint_table_is_the_runtimes_checkpoint_config():
    from ftrun.checkpoint.policy import CheckpointConfig

    p = load_profile("ci-small")
    assert p.checkpoint == CheckpointConfig(every_steps=5)  # keep: the runtime's default
    assert apply_overrides(p, ["checkpoint.keep=2"]).checkpoint == CheckpointConfig(every_steps=5, keep=2)
    off = apply_overrides(p, ["checkpoint=none"])
    assert off.checkpoint is None and profile_from_dict({"name": "x", "replicas": 1, "ranks_per_replica": 1}).checkpoint is None
    assert apply_overrides(off, ["checkpoint.every_steps=7"]).checkpoint == CheckpointConfig(every_steps=7)
    with pytest.raises(ValueError, match="every_steps must be an int >= 1, got 0"):
        apply_overrides(p, ["checkpoint.every_steps=0"])  # off is checkpoint=none, not a zero cadence


def test_weibull_scale_gives_the_mean():
    assert weibull_scale_for_mean(10.0, 1.0) == pytest.approx(10.0)  # shape 1 is exponential
    assert weibull_scale_for_mean(10.0, 0.7) < 10.0
