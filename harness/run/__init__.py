"""Emulated jobs: the real runtime for every emulated rank on the virtual-time engine (see job.py)."""

from harness.run.job import EmulatedJob
from harness.run.options import (CutBuilding, Fault, JobOptions, Kill, KillLighthouse, SlowFetch, SlowHost,
                                 check_faults, faults_from_profile, kills_from_profile, parse_inject, split_faults)

__all__ = ["CutBuilding", "EmulatedJob", "Fault", "JobOptions", "Kill", "KillLighthouse", "SlowFetch", "SlowHost",
           "check_faults", "faults_from_profile", "kills_from_profile", "parse_inject", "split_faults"]
