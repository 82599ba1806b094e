# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-slow test-scale test-fuzz test-multihost test-slurm test-browser chaos kernels bench torchft-venv clean

setup: $(STAMP)

# The CPU torch build is installed first, pinned, so nothing pulls a CUDA build.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/ftrun emulate

test: setup
	bash ci/build_kernels.sh
	$(PY) -m pytest -n 2 -q tests

# Longer end-to-end variants of default-suite scenarios (other layouts, reshards, parity runs): ~10 minutes.
test-slow: setup
	$(PY) -m pytest -n 2 -q -m slow tests

test-scale: setup
	$(PY) -m pytest -q -m scale tests/scale

# Every on-disk/wire decoder, 100,000 hypothesis examples each (the default suite runs a few).
test-fuzz: setup
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -m fuzz -p no:randomly -o timeout=0 --hypothesis-show-statistics tests/unit/test_decoders_fuzz.py tests/unit/test_lighthouse_decoders_fuzz.py

# Multi-host tests on one machine (network namespaces as hosts: needs root, skips cleanly without) and
# real torchrun jobs; about a minute each, so outside `make test`.
test-multihost: setup
	bash ci/ensure_iproute2.sh
	$(PY) -m pytest -q -m 'netns or torchrun' tests

# ftrun slurm against a real Slurm (Debian's slurmctld/slurmd/munge, private daemons in a temp dir; root
# needed, skips cleanly without); a few minutes, so outside `make test`.
test-slurm: setup
	bash ci/install_slurm.sh
	$(PY) -m pytest -q -m slurm -p no:randomly tests/integration/test_slurm.py

# The lighthouse status page in headless Chromium (Debian's package, installed as root; skips cleanly without).
test-browser: setup
	bash ci/install_chromium.sh
	$(PY) -m pytest -q -m browser -p no:randomly tests/integration/test_status_page_browser.py

# Randomized fault schedules, Jepsen-style: 1,000 real small jobs (3 replicas x 1 rank, 12 steps) under seeded
# random faults, each checked for forks, exactly-once data, identical state and leaks (about an hour).
CHAOS_SCHEDULES ?= 1000
CHAOS_SEED ?= 1
chaos: setup
	$(VENV)/bin/ftrun chaos --schedules $(CHAOS_SCHEDULES) --seed $(CHAOS_SEED) --json

# A separate environment with torchft 0.2.0, the baseline of benchmarks/catchup_torchft.py (kept apart from
# the project's: torchft is not a dependency of ftrun, and its own dependencies stay out of .venv).
TORCHFT_VENV ?= /tmp/ftrun-torchft-venv
torchft-venv:
	python3 -m venv $(TORCHFT_VENV)
	$(TORCHFT_VENV)/bin/pip install -q torch==2.13.0 torchft==0.2.0

clean:
	rm -rf $(VENV) build csrc/build
