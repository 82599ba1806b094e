"""Where every emulated rank runs: (replica, rank) -> host -> rack / zone / building, and the hop class
between two hosts. Pure: no clocks, no I/O; built from a profile plus a cluster inventory.

Placement (paper §2.1: "places all GPUs of a replica within one AI Zone or DC"): hosts are taken in
physical order (building, zone, rack, slot) from the inventory; replica r gets the next
`hosts_per_replica` hosts, rank k of a replica runs on its host k // gpus_per_host; hot spares and then
cold spares follow the training hosts. With zones sized to a replica, each replica fills one zone.

Hosts the topology does not know (a lighthouse, a test's "host-0") share one extra rack in zone 0 of
building 0, so an empty topology puts every host in one rack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from harness.profile import HopClass, Profile, hosts_per_replica

if TYPE_CHECKING:
    from mocks.inventory import Inventory

__all__ = ["UNPLACED", "HopClass", "Location", "Topology", "hop_between", "hosts_per_replica"]


@dataclass(frozen=True, slots=True)
class Location:
    """Global indices (unique across the cluster, not per parent) of a host's rack, zone and building."""

    rack: int
    zone: int
    building: int


UNPLACED = Location(rack=-1, zone=0, building=0)


def hop_between(a: Location, b: Location, same_host: bool) -> HopClass:
    """The hop class between two locations (same_host wins over everything)."""
    if same_host:
        return HopClass.SAME_HOST
    if a.building != b.building:
        return HopClass.OTHER_BUILDING
    if a.zone != b.zone:
        return HopClass.OTHER_ZONE
    if a.rack != b.rack:
        return HopClass.OTHER_RACK
    return HopClass.SAME_RACK


class Topology:
    """Immutable map of hosts to locations and of (replica, rank) to hosts.

    Args:
        host_names: every placed host, in placement order (training hosts replica-major, then spares).
        locations: the Location of each host, same order.
        replicas, ranks_per_replica, gpus_per_host: the training layout over the first hosts.
        num_hot_spares, num_cold_spares: hosts after the training hosts, in that order.
    Raises:
        ValueError: lengths disagree, duplicate names, or too few hosts for the layout.
    """

    def __init__(self, *, host_names: Sequence[str], locations: Sequence[Location], replicas: int = 0,
                 ranks_per_replica: int = 0, gpus_per_host: int = 1, num_hot_spares: int = 0,
                 num_cold_spares: int = 0) -> None:
        if len(host_names) != len(locations):
            raise ValueError(f"host_names ({len(host_names)}) and locations ({len(locations)}) differ in length")
        if gpus_per_host < 1:
            raise ValueError(f"gpus_per_host must be >= 1, got {gpus_per_host}")
        self.hosts: tuple[str, ...] = tuple(host_names)
        self._index = {name: i for i, name in enumerate(self.hosts)}
        if len(self._index) != len(self.hosts):
            raise ValueError("host_names contains duplicates")
        self._locations: tuple[Location, ...] = tuple(locations)
        self.replicas = replicas
        self.ranks_per_replica = ranks_per_replica
        self.gpus_per_host = gpus_per_host
        self.hosts_per_replica = hosts_per_replica(ranks_per_replica, gpus_per_host) if replicas else 0
        num_training = replicas * self.hosts_per_replica
        if num_training + num_hot_spares + num_cold_spares > len(self.hosts):
            raise ValueError(f"{num_training} training + {num_hot_spares + num_cold_spares} spare hosts "
                             f"needed, topology has {len(self.hosts)}")
        self.training_hosts = self.hosts[:num_training]
        self.hot_spare_hosts = self.hosts[num_training:num_training + num_hot_spares]
        self.cold_spare_hosts = self.hosts[num_training + num_hot_spares:
                                           num_training + num_hot_spares + num_cold_spares]
        self._zone_sizes: dict[int, int] = {}
        for loc in self._locations:
            self._zone_sizes[loc.zone] = self._zone_sizes.get(loc.zone, 0) + 1

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def single_rack(cls) -> "Topology":
        """No placed hosts: every host is unknown, so all share one rack."""
        return cls(host_names=(), locations=())

    @classmethod
    def from_inventory(cls, inventory: "Inventory", *, replicas: int, ranks_per_replica: int,
                       gpus_per_host: int, num_hot_spares: int = 0, num_cold_spares: int = 0) -> "Topology":
        return cls(host_names=[h.name for h in inventory.hosts],
                   locations=[Location(rack=h.rack, zone=h.zone, building=h.building) for h in inventory.hosts],
                   replicas=replicas, ranks_per_replica=ranks_per_replica, gpus_per_host=gpus_per_host,
                   num_hot_spares=num_hot_spares, num_cold_spares=num_cold_spares)

    @classmethod
    def from_profile(cls, profile: Profile, *, seed: int | None = None) -> "Topology":
        """Generate the profile's inventory (Faker, seeded with `seed` or the profile's seed): its
        training hosts plus hot and cold spares, and place its replicas on it."""
        from mocks.inventory import build_inventory  # Faker is imported only when an inventory is made

        topo = profile.topology
        inventory = build_inventory(num_hosts=profile.num_hosts, gpus_per_host=topo.gpus_per_host,
                                    hosts_per_rack=topo.hosts_per_rack, racks_per_zone=topo.racks_per_zone,
                                    zones_per_building=topo.zones_per_building, buildings=topo.buildings,
                                    seed=profile.seed if seed is None else seed)
        return cls.from_inventory(inventory, replicas=profile.replicas,
                                  ranks_per_replica=profile.ranks_per_replica,
                                  gpus_per_host=profile.topology.gpus_per_host,
                                  num_hot_spares=profile.spares.hot_spare_hosts,
                                  num_cold_spares=profile.spares.cold_spare_hosts)

    # -- queries -----------------------------------------------------------------------------------
    def host_of(self, replica: int, rank: int) -> str:
        """The host that runs `rank` of `replica`. Raises IndexError outside the layout."""
        if not (0 <= replica < self.replicas and 0 <= rank < self.ranks_per_replica):
            raise IndexError(f"(replica={replica}, rank={rank}) outside {self.replicas} x {self.ranks_per_replica}")
        return self.hosts[replica * self.hosts_per_replica + rank // self.gpus_per_host]

    def replica_hosts(self, replica: int) -> tuple[str, ...]:
        if not 0 <= replica < self.replicas:
            raise IndexError(f"replica {replica} outside 0..{self.replicas - 1}")
        start = replica * self.hosts_per_replica
        return self.hosts[start:start + self.hosts_per_replica]

    def ranks_on(self, host: str) -> list[tuple[int, int]]:
        """(replica, rank) pairs placed on a training host; [] for spares and unknown hosts."""
        i = self._index.get(host)
        if i is None or i >= len(self.training_hosts):
            return []
        replica, slot = divmod(i, self.hosts_per_replica)
        first = slot * self.gpus_per_host
        return [(replica, r) for r in range(first, min(first + self.gpus_per_host, self.ranks_per_replica))]

    def knows(self, host: str) -> bool:
        return host in self._index

    def location(self, host: str) -> Location:
        i = self._index.get(host)
        return UNPLACED if i is None else self._locations[i]

    def hop_class(self, a: str, b: str) -> HopClass:
        return hop_between(self.location(a), self.location(b), a == b)

    def zone_size(self, zone: int) -> int:
        """Placed hosts in a zone (at least 1, so unplaced hosts get a usable zone uplink)."""
        return max(1, self._zone_sizes.get(zone, 0))

    @property
    def num_zones(self) -> int:
        return len(self._zone_sizes)

    @property
    def num_buildings(self) -> int:
        return len({loc.building for loc in self._locations})

    def __len__(self) -> int:
        return len(self.hosts)
