"""Teardown shared by the integration tests that run replicas as ftrun.launch.supervisor.ReplicaProcesses
next to an in-process lighthouse and stop (SIGSTOP) some of their processes."""

from __future__ import annotations

import os
import signal
from typing import Any, Iterable


def stop_replicas(reps: Iterable[Any], lighthouse: Any) -> None:
    """Resume every process of `reps` (a test may have stopped it), kill them all and wait for them,
    then stop `lighthouse`."""
    for rep in reps:
        for p in rep.procs:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        rep.kill()
    lighthouse.stop()
