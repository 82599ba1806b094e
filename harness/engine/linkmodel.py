"""When a frame leaves and when it arrives: the emulated network's timing model. No I/O, no clock.

Model (cheap enough to run per frame at 100K ranks; see NetworkConfig for the parameters):
- Latency: one-way, base latency x the hop class's factor (paper §2.1), optional uniform jitter.
- Serialization: every resource a frame crosses is a work-conserving FIFO that is busy B / rate
  seconds per frame of B bytes (payload + per-frame overhead): the sending host's NIC (tx); for
  cross-zone and cross-building frames, the source zone's uplink and the destination zone's downlink;
  and the receiving host's NIC (rx). A resource starts a frame no earlier than the frame could reach
  it (send time, plus the latency for the receiving side), and the frame arrives when the last of
  them is done with it (the sending side's completion plus the latency). Zone links run at (hosts in
  zone x NIC rate / oversubscription): one flow gets its full NIC rate, a zone whose hosts all send
  out at once gets 1/oversubscription of it. Same-host frames skip the NICs: B / loopback rate.
- `sent` (when the last byte left the sender's NIC) drives sender back-pressure.
This is a fluid, per-frame FIFO approximation: no packet loss, no congestion control, no ECMP.
"""

from __future__ import annotations

import random

from harness.profile import NetworkConfig
from harness.topology import HopClass, Topology


class Timeline:
    """A serializing resource: the virtual time it is busy until."""

    __slots__ = ("free",)

    def __init__(self) -> None:
        self.free = 0.0


class Route:
    """Everything `transmit` needs for frames from one host to another, resolved once per connection."""

    __slots__ = ("hop", "latency", "host_rate", "tx", "rx", "up", "down", "up_rate", "down_rate", "sndbuf_s",
                 "buildings")

    def __init__(self, hop: HopClass, latency: float, host_rate: float, tx: Timeline | None,
                 rx: Timeline | None, up: Timeline | None = None, down: Timeline | None = None,
                 up_rate: float = 0.0, down_rate: float = 0.0, sndbuf_bytes: int = 0) -> None:
        self.hop, self.latency, self.host_rate = hop, latency, host_rate
        self.tx, self.rx, self.up, self.down = tx, rx, up, down
        self.up_rate, self.down_rate = up_rate, down_rate
        self.sndbuf_s = sndbuf_bytes / host_rate  # how far the NIC may run behind before a send blocks
        self.buildings: tuple[int, int] | None = None  # (src, dst) building of a cross-building route


class LinkModel:
    """Routes between hosts and per-frame timing. Owns the zone link timelines."""

    def __init__(self, config: NetworkConfig, topology: Topology, rng: random.Random) -> None:
        self.config = config
        self.topology = topology
        self._rng = rng
        self._jitter = config.latency_jitter
        self._overhead = config.frame_overhead_bytes
        self._nic_rate = config.host_nic_bytes_per_s
        self._loop_rate = config.loopback_bytes_per_s
        self._zone_links: dict[int, tuple[Timeline, Timeline, float]] = {}
        # Fraction of each zone's hosts whose bulk traffic is emulated. 1.0 normally; a run that folds
        # identical FTAR rings onto a few representative hosts sets it (before the first frame) so the
        # zone links are scaled to the hosts that actually send and keep their per-host share.
        self.zone_share = 1.0

    def _zone(self, zone: int) -> tuple[Timeline, Timeline, float]:
        link = self._zone_links.get(zone)
        if link is None:
            rate = (self.topology.zone_size(zone) * self.zone_share * self._nic_rate
                    / self.config.cross_zone_oversubscription)
            link = self._zone_links[zone] = (Timeline(), Timeline(), rate)
        return link

    def route(self, src: str, dst: str, src_nic: tuple[Timeline, Timeline],
              dst_nic: tuple[Timeline, Timeline]) -> Route:
        """The route from host src to host dst; *_nic are each host's (tx, rx) timelines."""
        hop = self.topology.hop_class(src, dst)
        latency = self.config.latency_s(hop)
        sndbuf = self.config.send_buffer_kib * 1024
        if hop is HopClass.SAME_HOST:
            return Route(hop, latency, self._loop_rate, None, None, sndbuf_bytes=sndbuf)
        if not hop.crosses_zone:
            return Route(hop, latency, self._nic_rate, src_nic[0], dst_nic[1], sndbuf_bytes=sndbuf)
        up, _, up_rate = self._zone(self.topology.location(src).zone)
        _, down, down_rate = self._zone(self.topology.location(dst).zone)
        r = Route(hop, latency, self._nic_rate, src_nic[0], dst_nic[1], up, down, up_rate, down_rate, sndbuf)
        if hop is HopClass.OTHER_BUILDING:
            r.buildings = (self.topology.location(src).building, self.topology.location(dst).building)
        return r

    def transmit(self, r: Route, depart: float, nbytes: int) -> tuple[float, float]:
        """Send a frame of `nbytes` on route r at virtual time `depart`: returns (sent, arrival) and
        books the time on every resource it crosses."""
        size = nbytes + self._overhead
        latency = r.latency
        if self._jitter:
            latency *= 1.0 + self._rng.uniform(-self._jitter, self._jitter)
        tx = r.tx
        if tx is None:  # same host
            sent = depart + size / r.host_rate
            return sent, sent + latency
        # each resource: start when both it and the frame are ready, then busy for size / its rate
        sent = tx.free = (tx.free if tx.free > depart else depart) + size / r.host_rate
        done = sent
        up = r.up
        if up is not None:
            up.free = (up.free if up.free > depart else depart) + size / r.up_rate
            if up.free > done:
                done = up.free
        done += latency
        reach = depart + latency
        down = r.down
        if down is not None:
            down.free = (down.free if down.free > reach else reach) + size / r.down_rate
            if down.free > done:
                done = down.free
        rx = r.rx
        rx.free = (rx.free if rx.free > reach else reach) + size / r.host_rate
        return sent, (rx.free if rx.free > done else done)
