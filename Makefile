# The README's commands. Every target creates .venv and installs the project when needed, so a fresh
# machine needs nothing but Python 3.10+.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv train demo test compat device-bundle device-dryrun bench speculators lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU build this machine class has on disk.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# Each run gets a new directory (runs/train-<date>-<time>), so earlier checkpoints are never mixed in or
# overwritten; RUN_DIR=... picks one.
train: $(STAMP)
	$(BIN)/dflash train --config configs/tiny-cpu.toml $(if $(RUN_DIR),--run-dir $(RUN_DIR))

demo: $(STAMP)
	bash scripts/demo.sh

test: $(STAMP)
	# One intra-op thread: the tests use tiny models, and oversubscribed OpenMP threads on a small
	# machine made them several times slower.
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

# The whole suite at both ends of the declared torch and transformers ranges, each in a throwaway venv
# under .compat/ (END=lowest or END=newest for one; TORCH=2.12.0 [TRANSFORMERS=5.20.0] for another torch):
# the check behind the ranges. Not in CI: each end runs the suite once more.
compat:
	@if [ -n "$(TORCH)" ]; then bash scripts/compat.sh $(TORCH); else \
	  rc=0; for end in $(or $(END),lowest newest); do bash scripts/compat.sh $$end || rc=1; done; exit $$rc; fi

# The wheels scripts/gpu_check.py needs that the lent GPU machine's image lacks, and the call to make
# there; device-dryrun repeats that call on CPU in a copy of the machine's software (docs/gpu.md).
device-bundle:
	bash scripts/device_bundle.sh

device-dryrun:
	bash scripts/device_dryrun.sh

bench: $(STAMP)
	$(BIN)/python scripts/bench_telemetry.py
	$(BIN)/python scripts/bench_pipeline.py
	$(BIN)/python scripts/bench_tui.py
	$(BIN)/python scripts/bench_distributed.py
	$(BIN)/python scripts/bench_gil.py
	$(BIN)/python scripts/bench_eval.py
	$(BIN)/python scripts/bench_masks.py
	$(BIN)/python scripts/bench_rollback.py
	$(BIN)/python scripts/bench_cache.py
	$(BIN)/python scripts/bench_target_memory.py
	$(BIN)/python scripts/bench_fp8_taps.py

# speculators' own code for tests/test_speculators_interop.py, beside this venv's torch and without vLLM:
# --no-deps, since its pins would replace this venv's datasets/transformers; the few imports it needs follow.
speculators: $(STAMP)
	$(BIN)/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(BIN)/pip install -q openai loguru pydantic-settings

lint: $(STAMP)
	$(BIN)/ruff check dflash dflash_tui tests scripts

clean:
	rm -rf $(VENV) runs .pytest_cache .compat .device-bundle
