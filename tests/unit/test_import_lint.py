"""Layering rules enforced on the source tree.

Only the real Env may touch the OS's clock, threads and sockets; everything else goes through the Env
seam so it runs unchanged under the emulator.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"time", "threading", "socket", "selectors", "torch.cuda"}
REAL_ENV = {ROOT / "ftrun/env/real.py", ROOT / "ftrun/env/real_net.py", ROOT / "ftrun/env/real_store.py"}


def forbidden_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        hits = [n for n in names if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]
        if hits:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {hits[0]}")
    return found


def test_only_the_real_env_imports_os_concurrency_modules():
    sources = [p for p in (ROOT / "ftrun").rglob("*.py") if p not in REAL_ENV]
    assert sources, "no sources found"
    offenders = [hit for p in sources for hit in forbidden_imports(p)]
    assert offenders == []


def test_the_lint_catches_offenders(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom threading import Thread\nfrom torch.cuda import Stream\nimport torch.cuda\nfrom torch import cuda\nimport torch\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert len(forbidden_imports(bad)) == 5
    finally:
        ROOT = saved
