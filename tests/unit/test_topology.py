"""Placement of (replica, rank) on hosts, hop classes, and the Faker-made inventory behind them."""

from __future__ import annotations

import pytest

from harness.profile import load_profile
from harness.topology import UNPLACED, HopClass, Location, Topology, hop_between
from mocks.inventory import build_inventory


@pytest.mark.parametrize("a, b, same_host, want", [
    (Location(0, 0, 0), Location(0, 0, 0), True, HopClass.SAME_HOST),
    (Location(0, 0, 0), Location(0, 0, 0), False, HopClass.SAME_RACK),
    (Location(0, 0, 0), Location(1, 0, 0), False, HopClass.OTHER_RACK),
    (Location(0, 0, 0), Location(5, 1, 0), False, HopClass.OTHER_ZONE),
    (Location(0, 0, 0), Location(9, 4, 1), False, HopClass.OTHER_BUILDING),
])
def test_hop_between(a, b, same_host, want):
    assert hop_between(a, b, same_host) is want and hop_between(b, a, same_host) is want


def test_ci_small_placement_covers_every_hop_class():
    topo = Topology.from_profile(load_profile("ci-small"))  # 4 x 8 ranks, 2 GPUs per host: 16 hosts
    assert len(topo) == 16 and topo.hosts_per_replica == 4
    assert topo.host_of(0, 0) == topo.host_of(0, 1) == topo.hosts[0]
    assert topo.host_of(3, 7) == topo.hosts[15]
    assert topo.replica_hosts(1) == topo.hosts[4:8]
    assert topo.ranks_on(topo.hosts[5]) == [(1, 2), (1, 3)]
    h = topo.hosts
    got = [topo.hop_class(h[0], x) for x in (h[0], h[1], h[2], h[4], h[8])]
    assert got == [HopClass.SAME_HOST, HopClass.SAME_RACK, HopClass.OTHER_RACK, HopClass.OTHER_ZONE,
                   HopClass.OTHER_BUILDING]
    assert topo.num_zones == 4 and topo.num_buildings == 2 and topo.zone_size(0) == 4


def test_meta_98k_puts_each_replica_in_its_own_zone():
    topo = Topology.from_profile(load_profile("meta-98k"))
    assert len(topo) == 12 * 1024 and topo.num_zones == 12 and topo.num_buildings == 4
    zones = [{topo.location(h).zone for h in topo.replica_hosts(r)} for r in range(12)]
    assert all(len(z) == 1 for z in zones) and len(set().union(*zones)) == 12
    buildings = [topo.location(topo.host_of(r, 0)).building for r in range(12)]
    assert buildings == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert topo.hop_class(topo.host_of(0, 0), topo.host_of(11, 0)) is HopClass.OTHER_BUILDING
    assert topo.hop_class(topo.host_of(0, 0), topo.host_of(0, 8191)) is HopClass.OTHER_RACK


def test_design_4k_spares_follow_the_training_hosts():
    topo = Topology.from_profile(load_profile("design-4k"))
    assert len(topo.training_hosts) == 496 and len(topo.hot_spare_hosts) == 4 and len(topo) == 500
    assert topo.ranks_on(topo.hot_spare_hosts[0]) == []


def test_unknown_hosts_share_one_rack():
    topo = Topology.single_rack()
    assert topo.location("anything") == UNPLACED
    assert topo.hop_class("host-0", "host-1") is HopClass.SAME_RACK
    assert topo.hop_class("host-0", "host-0") is HopClass.SAME_HOST
    placed = Topology.from_profile(load_profile("ci-small"))
    assert placed.hop_class("lighthouse", placed.hosts[0]) is HopClass.OTHER_RACK  # zone 0 of building 0
    assert placed.hop_class("lighthouse", placed.hosts[8]) is HopClass.OTHER_BUILDING


def test_bad_layouts_are_rejected():
    locs = [Location(0, 0, 0)] * 2
    with pytest.raises(ValueError, match="duplicates"):
        Topology(host_names=["a", "a"], locations=locs)
    with pytest.raises(ValueError, match="differ in length"):
        Topology(host_names=["a"], locations=locs)
    with pytest.raises(ValueError, match="needed"):
        Topology(host_names=["a", "b"], locations=locs, replicas=2, ranks_per_replica=16, gpus_per_host=8)
    topo = Topology(host_names=["a", "b"], locations=locs, replicas=2, ranks_per_replica=8, gpus_per_host=8)
    with pytest.raises(IndexError):
        topo.host_of(2, 0)
    with pytest.raises(IndexError):
        topo.host_of(0, 8)


def test_inventory_is_deterministic_and_well_formed():
    kw = dict(num_hosts=40, gpus_per_host=8, hosts_per_rack=4, racks_per_zone=3, zones_per_building=2, buildings=2)
    a, b, c = build_inventory(seed=7, **kw), build_inventory(seed=7, **kw), build_inventory(seed=8, **kw)
    assert a == b and [h.name for h in a.hosts] != [h.name for h in c.hosts]
    names = [h.name for h in a.hosts]
    assert len(set(names)) == 40 and not any(":" in n for n in names)
    assert len(a.racks) == 10 and len(a.zones) == 4 and len(a.buildings) == 2
    assert a.host(names[13]).rack == 3 and a.racks[3].zone == 1 and a.zones[3].building == 1
    assert len({bld.name for bld in a.buildings}) == 2
    with pytest.raises(ValueError, match="capacity"):
        build_inventory(seed=0, **{**kw, "num_hosts": 49})
    with pytest.raises(ValueError, match="hosts_per_rack"):
        build_inventory(seed=0, **{**kw, "hosts_per_rack": 0})
