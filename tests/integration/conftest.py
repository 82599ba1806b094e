"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from ftrun.launch.netns import NetnsConfig, NetnsHosts, available


def skip_without_namespaces() -> None:
    """Skip the calling test where network namespaces cannot be created (no root / CAP_NET_ADMIN, no iproute2)."""
    ok, why = available()
    if not ok:
        pytest.skip(f"network namespaces cannot be created here: {why}")


@pytest.fixture
def need_namespaces() -> None:
    """For `netns` tests that build their namespaces themselves (or through a command): skip where they cannot be."""
    skip_without_namespaces()


@pytest.fixture
def netns_hosts():
    """Factory: `netns_hosts(num_hosts, delay_ms=..., rate_mbit=...)` builds that many network-namespace
    hosts (ftrun.launch.netns) and tears them down after the test, also when it fails. Skips the test
    where namespaces cannot be created (no root / CAP_NET_ADMIN, no iproute2). Mark such tests `netns`."""
    made: list[NetnsHosts] = []

    def build(num_hosts: int, **shaping) -> NetnsHosts:
        skip_without_namespaces()
        hosts = NetnsHosts(NetnsConfig(num_hosts=num_hosts, **shaping))
        made.append(hosts)
        return hosts.__enter__()

    yield build
    for hosts in reversed(made):
        hosts.teardown()
