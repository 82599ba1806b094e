"""`ftrun launch --netns-hosts` and `ftrun bench ftar --netns`, run as a user would (root; skips cleanly
where network namespaces cannot be created).

The launch test runs 3 replicas x 2 ranks on 4 namespace hosts with every kind of host fault allowed and
checks what the JSON promises: the hosts and where everything ran, training across hosts (catch-up
bytes fetched from the other hosts' addresses only), identical replicas, exactly-once data, faults
counted per kind, and nothing left behind (processes or namespaces). How many faults fire depends on
the machine's speed: the test checks their accounting, not their number.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.test_launch import ROOT, launch

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300), pytest.mark.usefixtures("need_namespaces")]


def _namespaces() -> set[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in done.stdout.splitlines() if line.strip()}


def test_launch_on_namespace_hosts_with_host_faults(tmp_path):
    f = launch(tmp_path, "--netns-hosts", "4", "--replicas", "3", "--ranks-per-replica", "2", "--kill-every", "3s",
               "--steps", "60", "--cut-for", "3s", "-m", "ftrun.train.ft_worker", "--step-time", "0.05",
               "--ftar-timeout", "3", timeout=280)
    assert f["complete"] and f["hosts"] == 4
    layout = f["host_layout"]
    assert [h["lighthouse"] for h in layout] == [True, False, False, False]
    assert [h["replicas"] for h in layout] == [[], ["r0"], ["r1"], ["r2"]]
    assert f["replicas_identical"] and f["duplicate_batches"] == 0 and f["skipped_batches"] == 0
    assert f["user_state_identical"] is None  # ft_worker registers no user state
    assert f["failures_injected"] == sum(f["faults"].values())
    assert set(f["faults"]) <= {"replica_kill", "host_kill", "host_cut"}
    assert f["shaping"] != "none"
    assert not {h["namespace"] for h in layout} & _namespaces(), "namespaces left behind"
    # ranks ran inside their hosts: every catch-up came from the other hosts' addresses
    addrs = {h["addr"] for h in layout[1:]}
    with open(tmp_path / "events.jsonl") as fh:
        events = [json.loads(line) for line in fh]
    for ev in (e for e in events if e.get("event") == "catchup"):
        sources = {url.rpartition("://")[2].rpartition(":")[0] for url in ev["bytes_by_source"]}
        assert sources <= addrs - {layout[int(ev["replica_id"][1:]) + 1]["addr"]}, ev
    kinds = [e["kind"] for e in events if e.get("event") == "fault"]
    assert sorted(kinds) == sorted(k for k, n in f["faults"].items() for _ in range(n))
    print(f"\n[netns launch] {f['faults']}, {f['steps_committed']} replica-steps committed, efficiency "
          f"{f['step_efficiency']:.3f} (theory {f['theoretical_efficiency']}), shaping {f['shaping']}")


def test_bench_ftar_across_namespaces_reports_hosts():
    proc = subprocess.run([sys.executable, "-m", "ftrun.cli", "bench", "ftar", "--netns", "--procs", "2",
                           "--sizes", "1M", "--iters", "1", "--json"], capture_output=True, text=True, timeout=200, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["hosts"] == 2 and [r["hosts"] for r in out["results"]] == [2]
    assert out["results"][0]["ratio"] > 0
