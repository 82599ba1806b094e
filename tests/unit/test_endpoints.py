"""The per-rank endpoint string: round trip, malformed input, unroutable (wildcard) addresses refused."""

from __future__ import annotations

import pytest

from ftrun.replica.endpoints import decode_endpoints, encode_endpoints


def test_round_trip_keeps_advertised_addresses():
    eps = {"ftar": "10.213.0.2:4100", "catchup": "http://node-7.rack2:8080", "local": "unix:/tmp/r.sock"}
    assert decode_endpoints(encode_endpoints(eps)) == eps
    assert decode_endpoints("") == {}


@pytest.mark.parametrize("addr", ["0.0.0.0:4100", "http://0.0.0.0:81", ":4100", "[::]:9", "http://:80"])
def test_a_wildcard_or_empty_host_is_refused_naming_the_fix(addr):
    with pytest.raises(ValueError, match=r"not routable from another host.*FTRUN_ADVERTISE_HOST"):
        encode_endpoints({"ftar": addr})


@pytest.mark.parametrize("endpoints", [{"Ftar": "h:1"}, {"ftar": "h:1;x"}, {"ftar": "a=b:1"}])
def test_malformed_endpoints_are_refused(endpoints):
    with pytest.raises(ValueError, match="bad endpoint"):
        encode_endpoints(endpoints)


@pytest.mark.parametrize("encoded", ["ftar", "FTAR=h:1", "ftar=h:1;;"])
def test_malformed_encodings_are_refused(encoded):
    with pytest.raises(ValueError, match="malformed endpoint"):
        decode_endpoints(encoded)
