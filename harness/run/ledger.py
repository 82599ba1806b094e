"""After an emulated run: the exactly-once audit and the data-plane figures, read from the job's store.

Every replica incarnation's leader wrote its audit records (attempts and commits) to the mock object
store, and the step's writer the loader_state; this checks them with the real checker
(ftrun.data.audit.audit) against the final ledger. Catch-up and checkpoint figures come from the
trainers' events and the store.
"""

from __future__ import annotations

from typing import Any

from ftrun.data.audit import audit, read_log
from ftrun.data.loader_state import LoaderStateStore


class _Peek:
    """Storage reads of a mock object store without modeled time (outside the emulated run)."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def read(self, key: str) -> bytes | None:
        return self._store.peek(key)

    def write_atomic(self, key: str, data: bytes) -> None:
        raise RuntimeError("read-only view")


def audit_figures(store: Any, checkpoints: Any, events: list[dict[str, Any]], ranks_per_replica: int) -> dict[str, Any]:
    """audit_batches (trained along the final lineage, each checked), duplicate_batches, skipped_batches,
    audit_problems, exactly_once; catchup_bytes (all ranks: each leader's fetch x the replica's ranks,
    which fetch equal shards, folded ones through their lead), catchup_sources (most sources one fetch
    used), catchup_fetches; checkpoints_committed (manifests in the `checkpoints` store)."""
    records, problems = [], []
    for key in store.keys():
        if key.startswith("audit/"):
            recs, bad = read_log(store.peek(key), name=key)
            records += recs
            problems += bad
    final = LoaderStateStore(storage=_Peek(store)).load()
    report = audit(records, final=final)
    fetches = [e for e in events if e.get("event") == "catchup"]
    return {
        "audit_batches": len(report.trained), "duplicate_batches": len(report.duplicates),
        "skipped_batches": len(report.gaps), "audit_problems": len(report.problems) + len(problems),
        "exactly_once": report.ok and not problems and final is not None, "audit_summary": report.summary(),
        "catchup_bytes": sum(int(e["num_bytes"]) for e in fetches) * ranks_per_replica,
        "catchup_sources": max((sum(1 for n in e["bytes_by_source"].values() if n) for e in fetches), default=0),
        "catchup_fetches": len(fetches),
        "checkpoints_committed": sum(1 for k in checkpoints.keys() if k.endswith("/manifest.json")),
    }
