"""What the decoder fuzz tests (test_decoders_fuzz.py, test_lighthouse_decoders_fuzz.py) share.

`PROFILE`: hypothesis settings. The default suite runs the `decoders` profile (40 derandomized examples
per decoder); HYPOTHESIS_PROFILE=fuzz (`make test-fuzz`) runs the `fuzz` profile, 100,000 examples per
decoder (FUZZ_EXAMPLES=N for another count). `HOSTILE_TEXT`: JSON texts a parser must survive.
`doc_paths(doc)`: every key/index path into a document, its root first.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("decoders", max_examples=40, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
settings.register_profile("fuzz", max_examples=int(os.environ.get("FUZZ_EXAMPLES", "100000")), deadline=None,
                          database=None, suppress_health_check=list(HealthCheck))
PROFILE = settings(settings.get_profile("fuzz" if os.environ.get("HYPOTHESIS_PROFILE") == "fuzz" else "decoders"))

# 1e400 and 5,000 digits (out of range, slow to parse), NaN, a superscript digit, deep nesting.
HOSTILE_TEXT = ["1e400", "-1e400", "NaN", "9" * 5000, "\u00b2", "[" * 100_000 + "]" * 100_000,
                '{"a":' * 50_000 + "1" + "}" * 50_000]


def doc_paths(doc, prefix=()):
    yield list(prefix)
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from doc_paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from doc_paths(v, (*prefix, i))
