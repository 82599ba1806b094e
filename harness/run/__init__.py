"""Emulated jobs: the real runtime for every emulated rank on the virtual-time engine (see job.py)."""

from harness.run.job import EmulatedJob
from harness.run.options import JobOptions, Kill, kills_from_profile, parse_inject

__all__ = ["EmulatedJob", "JobOptions", "Kill", "kills_from_profile", "parse_inject"]
