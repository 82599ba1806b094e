"""Process measurements for `ftrun calibrate`: how long a rank process takes to start (spawned fresh, or
forked from `ftrun launch`'s zygote) and how long after a SIGKILL its death is seen.

The child is a tiny script that imports torch at its top level (so a spawned child pays the import and a
zygote preloads it, as for a real training script), connects back to this process over 127.0.0.1 TCP and
sends its `time.monotonic()` (system-wide on Linux, so comparable across processes), then blocks.
- start: from the launcher's start() call to the child's first line after its imports;
- crash detection: from the SIGKILL (Handle.kill, as `ftrun launch` kills a replica) to (a) the peer's
  read returning EOF / reset (what a healthy replica's connection sees) and (b) the launcher's Handle.poll()
  returning the exit (what the supervisor acts on), polled every millisecond.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness.calibrate.measure import Figure

CHILD = """\
import socket
import sys
import time

{imports}

t = time.monotonic()
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(repr(t).encode() + b"\\n")
s.recv(1)  # until killed
"""


def _one(launcher, script: str, listener: socket.socket, workdir: str) -> tuple[float, float, float]:
    """(start_s, peer_reset_s, supervisor_detect_s) for one child."""
    port = listener.getsockname()[1]
    log = os.path.join(workdir, "child.log")
    t0 = time.monotonic()
    handle = launcher.start([script, str(port)], env=dict(os.environ), cwd=workdir, stdout=log, stderr=log)
    try:
        listener.settimeout(120.0)
        conn, _ = listener.accept()
    except BaseException:
        handle.kill()
        raise
    with conn:
        conn.settimeout(60.0)
        line = b""
        while not line.endswith(b"\n"):
            chunk = conn.recv(64)
            if not chunk:
                raise RuntimeError(f"calibration child exited early (see {log})")
            line += chunk
        started = float(line) - t0
        t_kill = time.monotonic()
        handle.kill()
        try:
            conn.recv(1)
        except (ConnectionError, OSError):
            pass
        peer = time.monotonic() - t_kill
        deadline = t_kill + 60.0
        while handle.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        detect = time.monotonic() - t_kill
    return started, peer, detect


def process_figures(*, zygote_reps: int = 5, spawn_reps: int = 2, import_torch: bool = True) -> list[Figure]:
    """Zygote child start, spawned process start, crash detection (peer and supervisor), zygote preload.
    import_torch=False (--quick): the child imports nothing heavy, so the zygote starts in a fraction of a
    second instead of paying torch's import (the fork itself is then cheaper than a real rank's too)."""
    from ftrun.env.real import RealEnv
    from ftrun.launch.procs import ForkServer, SpawnLauncher

    with tempfile.TemporaryDirectory(prefix="ftrun-calibrate-") as workdir:
        script = str(Path(workdir) / "calibrate_child.py")
        imports = ("import torch  # noqa: F401  (a spawned child pays the import; a zygote has it preloaded)"
                   if import_torch else "")
        Path(script).write_text(CHILD.replace("{imports}", imports))
        listener = socket.create_server(("127.0.0.1", 0))
        try:
            server = ForkServer(env=RealEnv(), script=script, module=False, cwd=workdir,
                                log_path=os.path.join(workdir, "zygote.log"))
            try:
                if server.fallback_reason is not None:
                    raise RuntimeError(f"the zygote could not start: {server.fallback_reason}")
                zyg = [_one(server, script, listener, workdir) for _ in range(zygote_reps)]
                preload = server.preload_s
            finally:
                server.close()
            spawn = SpawnLauncher()
            spawned = [_one(spawn, script, listener, workdir)
                       for _ in range(spawn_reps)] if spawn_reps else []
        finally:
            listener.close()
    med = statistics.median
    child = "import torch" if import_torch else "no heavy imports (--quick)"
    out = [
        Figure("zygote_start_s", med(z[0] for z in zyg), "s",
               f"median time from ForkServer.start() (ftrun launch's zygote) to a forked child's first line after "
               f"its imports (child: {child}, connect to 127.0.0.1, report time.monotonic())", zygote_reps),
        Figure("crash_detect_s", med(z[2] for z in zyg), "s",
               "median time from SIGKILL (Handle.kill of a zygote child) until the launcher's Handle.poll() "
               "reports the exit, polled every 1 ms", zygote_reps),
        Figure("peer_reset_s", med(z[1] for z in zyg), "s",
               "median time from SIGKILL of a zygote child until its 127.0.0.1 TCP peer's recv returns EOF/reset",
               zygote_reps),
    ]
    if preload is not None:
        out.append(Figure("zygote_preload_s", float(preload), "s",
                          "the zygote's own report of its preload (imports + warm-up) time", 1))
    if spawned:
        out.append(Figure("spawn_start_s", med(s[0] for s in spawned), "s",
                          f"median time from SpawnLauncher.start() ({sys.executable}) to the child's first line "
                          f"after its imports ({child})", spawn_reps))
    return out
