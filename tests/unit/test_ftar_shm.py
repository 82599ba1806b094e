"""Stale FTAR staging files (owner killed between create and unlink) are swept; live owners' are kept."""

from __future__ import annotations

import os
import subprocess
import sys

from ftrun.ftar import shm


def test_sweep_removes_only_files_of_dead_owners(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    names = {"dead": f"ftrun-ftar-e3-{dead_pid}-abcdef012345", "live": f"ftrun-ftar-e3-{os.getppid()}-abcdef012345",
             "mine": f"ftrun-ftar-e3-{os.getpid()}-abcdef012345", "other": "unrelated-file",
             "odd": "ftrun-ftar-no-pid-here"}
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
    assert shm.sweep_stale() == [names["dead"]]
    assert sorted(os.listdir(tmp_path)) == sorted(v for k, v in names.items() if k != "dead")


def test_create_sweeps_first_and_unlink_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    (tmp_path / f"ftrun-ftar-e1-{int(dead.stdout)}-000000000000").write_bytes(b"x")
    slots = shm.SharedSlots.create(4096, tag="e2")
    assert os.listdir(tmp_path) == [os.path.basename(slots.path)]
    slots.close()
    assert os.listdir(tmp_path) == []


def test_same_machine_ignores_only_the_network_namespace():
    me = shm.host_identity()
    node, boot, netns = me.split("/", 2)
    assert shm.same_machine(me, me)
    assert shm.same_machine(me, f"{node}/{boot}/net:[4026532999]")  # another namespace on this machine
    assert not shm.same_machine(me, f"{node}/another-boot/{netns}")
    assert not shm.same_machine(me, f"other-node/{boot}/{netns}")
