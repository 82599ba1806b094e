"""The zygote's spares: requests are served by children forked ahead (pids handed out, argv/env/stdio
applied, exits reported), more requests than spares still work, spares are forked again once requests
pause, and closing the fork server leaves no process behind, spares included. A plain script (no torch):
fast."""

from __future__ import annotations

import json
import os

import psutil
import pytest

from ftrun.env.real import RealEnv
from ftrun.launch.procs import ForkServer

SCRIPT = '''
import json, os, sys, time
print(json.dumps({"argv": sys.argv[1:], "tag": os.environ["TAG"], "pid": os.getpid(),
                  "forked_at": os.environ.get("FTRUN_FORKED_AT")}), flush=True)
if sys.argv[1:] == ["wait"]:
    time.sleep(60)
'''


def zygote_family(run_dir: str) -> list[psutil.Process]:
    """Live processes whose command line names the run folder (the zygote, its spares and children)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(run_dir in arg for arg in p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.timeout(60)
def test_spares_run_requests_and_leave_nothing_behind(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    env = RealEnv()
    server = ForkServer(env=env, script=str(script), module=False, cwd=str(tmp_path),
                        log_path=str(tmp_path / "zygote.log"), run_dir=run_dir, spares=2)
    try:
        assert server.fallback_reason is None
        handles = []
        for i, argv in enumerate([["a"], ["wait"], ["c"], ["d"]]):  # 4 requests, 2 spares: spares are refilled
            out = tmp_path / f"{i}.out"
            handles.append((server.start([str(script), *argv], env={**os.environ, "TAG": str(i)}, cwd=str(tmp_path),
                                         stdout=str(out), stderr=str(tmp_path / f"{i}.log")), out, argv))
        for i, (h, out, argv) in enumerate(handles):
            if argv == ["wait"]:
                continue
            assert h.wait(30) == 0, (tmp_path / f"{i}.log").read_text()
            line = json.loads(out.read_text().splitlines()[0])
            assert line["argv"] == argv and line["tag"] == str(i) and line["pid"] == h.pid
            assert float(line["forked_at"]) > 0
        waiting = handles[1][0]
        assert waiting.poll() is None
        waiting.kill()
        assert waiting.wait(30) == -9
        used = {h.pid for h, _, _ in handles}
        deadline = env.clock.now() + 30  # spares are forked again once requests pause (REFILL_IDLE_S)
        while len(rest := [p for p in zygote_family(run_dir) if p.pid not in used]) < 3 and env.clock.now() < deadline:
            env.clock.sleep(0.05)
        assert len(rest) == 3  # the zygote and its two spares, ready for the next requests
    finally:
        server.close()
    assert zygote_family(run_dir) == []
