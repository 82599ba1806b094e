"""examples/own_loop.py, unchanged, with one test hook: while a replica is missing from the step's
quorum (killed, restarting), each step waits --missing-wait seconds after its quorum, so the job
cannot end before a restarted replica is back (its start-up takes many steps' time on a loaded
machine). The example itself runs through runpy as `ftrun launch` would run it; OWN_LOOP_SCRIPT names
another example (relative to the checkout) slowed the same way: every FaultTolerantTrainer begins its
steps there, `ft.train()` too. (tests/integration/test_own_loop.py, tests/gpu/test_gpu_train.py)"""

from __future__ import annotations

import os
import runpy
import sys
import time

from ftrun.train.trainer import FaultTolerantTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    wait_s = float(os.environ.get("OWN_LOOP_MISSING_WAIT_S", "1.0"))
    replicas = int(os.environ["FTRUN_NUM_REPLICAS"])
    begin = FaultTolerantTrainer.begin_step

    def slow_while_missing(self):
        q = begin(self)
        if len(q.participants) < replicas and q.step > 0:
            time.sleep(wait_s)
        return q

    FaultTolerantTrainer.begin_step = slow_while_missing
    script = os.environ.get("OWN_LOOP_SCRIPT", os.path.join("examples", "own_loop.py"))
    sys.argv = [os.path.join(ROOT, script), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
