"""The namespace hosts' command plan (pure) and the driver's teardown-on-failure, with a fake runner."""

from __future__ import annotations

import subprocess

import pytest

from ftrun.launch.netns import NetnsConfig, NetnsError, NetnsHosts, build_commands, shaping_commands, teardown_commands

CFG = NetnsConfig(num_hosts=2, tag="ab12", delay_ms=0.2, rate_mbit=1000)


def test_names_and_addresses():
    assert [CFG.namespace(i) for i in range(2)] == ["ftrun-ab12-h0", "ftrun-ab12-h1"]
    assert [CFG.addr(i) for i in range(2)] == ["10.213.0.1", "10.213.0.2"]
    assert CFG.bridge == "ftab12b" and CFG.veth(1) == ("ftab12v1", "ftab12p1")
    assert all(len(n) <= 15 for n in (CFG.bridge, *CFG.veth(249)))  # Linux interface names


def test_build_plan_puts_each_host_on_the_bridge_with_one_address():
    cmds = [" ".join(c) for c in build_commands(CFG, netem=True)]
    assert cmds[:2] == ["ip link add ftab12b type bridge", "ip link set ftab12b up"]
    assert "ip link add ftab12v1 type veth peer name ftab12p1 netns ftrun-ab12-h1" in cmds
    assert "ip link set ftab12v1 master ftab12b" in cmds
    assert "ip -n ftrun-ab12-h1 addr add 10.213.0.2/24 dev ftab12p1" in cmds
    assert not any("addr add" in c and "-n" not in c for c in cmds), "the machine itself gets no test address"
    assert cmds.index("ip netns add ftrun-ab12-h0") < cmds.index("ip -n ftrun-ab12-h0 link set lo up")


@pytest.mark.parametrize("cfg, netem, expected", [
    (CFG, True, ["tc qdisc add dev ftab12v0 root netem delay 0.2ms rate 1000mbit",
                 "ip netns exec ftrun-ab12-h0 tc qdisc add dev ftab12p0 root netem delay 0.2ms rate 1000mbit"]),
    (CFG, False, ["tc qdisc add dev ftab12v0 root tbf rate 1000mbit burst 256kb latency 50ms",
                  "ip netns exec ftrun-ab12-h0 tc qdisc add dev ftab12p0 root tbf rate 1000mbit burst 256kb latency 50ms"]),
    (NetnsConfig(num_hosts=1, tag="ab12", delay_ms=2.0), True,
     ["tc qdisc add dev ftab12v0 root netem delay 2.0ms",
      "ip netns exec ftrun-ab12-h0 tc qdisc add dev ftab12p0 root netem delay 2.0ms"]),
    (NetnsConfig(num_hosts=1, tag="ab12", delay_ms=2.0), False, []),  # delay without netem: nothing to do
    (NetnsConfig(num_hosts=1, tag="ab12"), True, []),
])
def test_shaping_both_directions(cfg, netem, expected):
    assert [" ".join(c) for c in shaping_commands(cfg, 0, netem=netem)] == expected


def test_teardown_plan_removes_links_namespaces_then_the_bridge():
    assert [" ".join(c) for c in teardown_commands(CFG)] == [
        "ip link del ftab12v0", "ip netns del ftrun-ab12-h0", "ip link del ftab12v1", "ip netns del ftrun-ab12-h1",
        "ip link del ftab12b"]


@pytest.mark.parametrize("kwargs, message", [
    ({"num_hosts": 0}, "num_hosts must be 1..250"),
    ({"num_hosts": 3, "subnet": "10.0.0.0/30"}, "num_hosts must be 1..2"),
    ({"num_hosts": 2, "subnet": "8.8.8.0/24"}, "private range"),
    ({"num_hosts": 2, "subnet": "10.0.0.1/24"}, "has host bits set"),
    ({"num_hosts": 2, "delay_ms": -1}, "delay_ms must be >= 0"),
    ({"num_hosts": 2, "rate_mbit": 0}, "rate_mbit > 0"),
    ({"num_hosts": 2, "tag": "x;y"}, "tag must be"),
])
def test_bad_config_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NetnsConfig(**kwargs)


class FakeRunner:
    """Records commands; fails the first one containing `fail`; netem is unknown to its kernel."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def __call__(self, cmd):
        line = " ".join(cmd)
        self.calls.append(line)
        bad = (self.fail is not None and self.fail in line) or " netem " in line
        return subprocess.CompletedProcess(cmd, 2 if bad else 0, stdout="", stderr="boom" if bad else "")


def test_a_failed_build_tears_down_what_was_made():
    runner = FakeRunner(fail="addr add 10.213.0.2")
    with pytest.raises(NetnsError, match=r"`ip -n ftrun-ab12-h1 addr add 10.213.0.2/24 dev ftab12p1` failed: boom"):
        with NetnsHosts(CFG, runner=runner):
            pytest.fail("entered a half-built set of hosts")
    assert runner.calls[-5:] == [" ".join(c) for c in teardown_commands(CFG)]


def test_without_netem_the_links_get_a_rate_cap_and_say_the_delay_is_missing():
    runner = FakeRunner()
    with NetnsHosts(CFG, runner=runner) as hosts:
        assert hosts.shaping == "tbf rate 1000mbit (no netem in this kernel: delay not applied)"
        assert hosts[1].addr == "10.213.0.2" and hosts[1].namespace == "ftrun-ab12-h1"
        hosts.cut(1)
        hosts.restore(1)
    assert "ip link set ftab12v1 down" in runner.calls and "ip link set ftab12v1 up" in runner.calls
    assert runner.calls[-5:] == [" ".join(c) for c in teardown_commands(CFG)]


def test_buildings_split_hosts_and_netem_sends_far_traffic_to_the_slow_band():
    cfg = NetnsConfig(num_hosts=4, delay_ms=0.2, cross_delay_ms=2.0, buildings=2, rate_mbit=100, tag="t")
    assert [cfg.building(i) for i in range(4)] == [0, 0, 1, 1]
    cmds = shaping_commands(cfg, 0, netem=True)
    text = [" ".join(c) for c in cmds]
    assert "tc qdisc add dev fttv0 parent 1:1 handle 10: netem delay 0.2ms rate 100mbit" in text
    assert "tc qdisc add dev fttv0 parent 1:2 handle 20: netem delay 2.0ms rate 100mbit" in text
    # into host 0 (the bridge's end) from the other building; out of host 0 (its own end) to it
    far = [c for c in text if "u32" in c]
    assert [c.split(" match ip ")[1] for c in far] == ["src 10.213.0.3/32 flowid 1:2", "src 10.213.0.4/32 flowid 1:2",
                                                       "dst 10.213.0.3/32 flowid 1:2", "dst 10.213.0.4/32 flowid 1:2"]
    assert all(c.startswith("ip netns exec ftrun-t-h0 tc") for c in far[2:])
    # without netem: the rate cap only, the same on every link
    assert [" ".join(c) for c in shaping_commands(cfg, 0, netem=False)][0].startswith("tc qdisc add dev fttv0 root tbf rate 100")


def test_buildings_must_fit_the_hosts():
    with pytest.raises(ValueError, match="buildings"):
        NetnsConfig(num_hosts=2, buildings=3)
