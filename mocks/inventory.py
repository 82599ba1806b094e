"""A made-up but realistic cluster inventory: buildings, AI zones, racks and hosts, generated with Faker.

Deterministic: the same layout and seed give the same names (Faker is seeded per call, never globally).
Hosts come out in physical order (building, zone, rack, slot), which is the order harness.topology
places replicas in. Only as many hosts as asked for are generated; the last rack may be partly filled.

Names are DNS-like and never contain ':' so "name:port" addresses parse:
building "ash2", zone "ash2-z1", rack "ash2-z1-r007", host "gtx00042.ash2".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from faker import Faker


@dataclass(frozen=True, slots=True)
class Building:
    index: int
    name: str
    site: str  # the (fake) city it stands in


@dataclass(frozen=True, slots=True)
class Zone:
    index: int  # global across buildings
    name: str
    building: int


@dataclass(frozen=True, slots=True)
class Rack:
    index: int  # global across zones
    name: str
    zone: int
    building: int


@dataclass(frozen=True, slots=True)
class HostRecord:
    index: int
    name: str
    rack: int
    zone: int
    building: int
    num_gpus: int
    serial: str


@dataclass(frozen=True)
class Inventory:
    buildings: tuple[Building, ...]
    zones: tuple[Zone, ...]
    racks: tuple[Rack, ...]
    hosts: tuple[HostRecord, ...]
    _by_name: dict[str, HostRecord] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_name.update((h.name, h) for h in self.hosts)

    def host(self, name: str) -> HostRecord:
        """Raises KeyError for a host not in the inventory."""
        return self._by_name[name]


def _site_code(city: str, used: set[str]) -> str:
    """Three lowercase letters from a city name, unique among `used` (falls back to suffixing x's)."""
    letters = re.sub(r"[^a-z]", "", city.lower()) + "xxx"
    code = letters[:3]
    while code in used:
        code = code[:2] + chr(ord("a") + (ord(code[2]) - ord("a") + 1) % 26)
    used.add(code)
    return code


def build_inventory(*, num_hosts: int, gpus_per_host: int, hosts_per_rack: int, racks_per_zone: int,
                    zones_per_building: int, buildings: int, seed: int) -> Inventory:
    """Generate `num_hosts` hosts filling racks, zones and buildings in order.

    Raises:
        ValueError: a count is not positive, or the layout holds fewer than num_hosts hosts.
    """
    counts = dict(num_hosts=num_hosts, gpus_per_host=gpus_per_host, hosts_per_rack=hosts_per_rack,
                  racks_per_zone=racks_per_zone, zones_per_building=zones_per_building, buildings=buildings)
    for key, value in counts.items():
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")
    capacity = hosts_per_rack * racks_per_zone * zones_per_building * buildings
    if num_hosts > capacity:
        raise ValueError(f"num_hosts={num_hosts} exceeds the layout's capacity of {capacity} hosts")
    fake = Faker("en_US")
    fake.seed_instance(seed)
    pool = fake.lexify("???").lower()  # one host-name prefix per cluster, like a fleet pool
    num_racks = -(-num_hosts // hosts_per_rack)
    num_zones = -(-num_racks // racks_per_zone)
    num_buildings = -(-num_zones // zones_per_building)
    used: set[str] = set()
    bldgs = []
    for b in range(num_buildings):
        city = fake.city()
        bldgs.append(Building(index=b, name=f"{_site_code(city, used)}{b + 1}", site=city))
    zones = tuple(Zone(index=z, name=f"{bldgs[z // zones_per_building].name}-z{z % zones_per_building + 1}",
                       building=z // zones_per_building) for z in range(num_zones))
    racks = tuple(Rack(index=r, name=f"{zones[r // racks_per_zone].name}-r{r % racks_per_zone + 1:03d}",
                       zone=r // racks_per_zone, building=zones[r // racks_per_zone].building)
                  for r in range(num_racks))
    hosts = []
    for i in range(num_hosts):
        rack = racks[i // hosts_per_rack]
        hosts.append(HostRecord(index=i, name=f"{pool}{i:05d}.{bldgs[rack.building].name}", rack=rack.index,
                                zone=rack.zone, building=rack.building, num_gpus=gpus_per_host,
                                serial=fake.bothify("??########").upper()))
    return Inventory(buildings=tuple(bldgs), zones=zones, racks=racks, hosts=tuple(hosts))
