"""examples/own_loop.py is examples/own_loop_plain.py ported to ftrun in at most 20 changed lines.

The count is over code: each file's module docstring (which describes the file) is left out, then
difflib's added lines (a changed line counts once, as the new line) and removed lines are counted.
"""

from __future__ import annotations

import ast
import difflib
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MAX_CHANGED = 20


def code_lines(path: Path) -> list[str]:
    src = path.read_text()
    doc = ast.get_docstring(ast.parse(src), clean=False)
    return src.replace(f'"""{doc}"""', "", 1).splitlines()


def port_diff() -> tuple[list[str], list[str]]:
    diff = difflib.unified_diff(code_lines(EXAMPLES / "own_loop_plain.py"), code_lines(EXAMPLES / "own_loop.py"),
                                lineterm="", n=0)
    lines = [line for line in diff if not line.startswith(("---", "+++", "@@"))]
    return [line[1:] for line in lines if line.startswith("+")], [line[1:] for line in lines if line.startswith("-")]


def test_the_port_changes_at_most_20_lines():
    added, removed = port_diff()
    assert len(added) <= MAX_CHANGED and len(removed) <= MAX_CHANGED, "\n".join(["+" + a for a in added]
                                                                                + ["-" + r for r in removed])


def test_the_port_uses_every_primitive():
    added, _ = port_diff()
    text = "\n".join(added)
    for used in ("init_from_env", "job.wrap(", "job.sampler(", "job.register_state(", "opt.clip_grad_norm_(",
                 "opt.step()", "job.log_metrics(", "job.step"):
        assert used in text, used
