# The README's two commands: `make run` (set up + main job) and `make test` (set up + test suite).
VENV ?= .venv
CONFIG ?= configs/tiny_cpu.yaml
export HF_HUB_OFFLINE = 1

.PHONY: setup run test lint bench

setup:
	@bash tools/setup_venv.sh

# The tiny CPU run: builds + warm-starts the tiny model if missing, then servers, trainer and actor.
# Re-running resumes from the last checkpoint; `make run ARGS="run_dir=runs/other"` starts afresh.
run: setup
	$(VENV)/bin/pipelinerl run $(CONFIG) $(ARGS)

# The suite on TEST_WORKERS parallel pytest-xdist workers (0: in this process), each test module whole on one
# worker and the slowest first (tests/conftest.py).
TEST_WORKERS ?= 2
test: setup
	$(VENV)/bin/python -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(ARGS)

# Every benchmark and one markdown table of their key rows (runs/bench_all/table.md, and after a full run
# docs/performance.md): tools/bench_all.py.
# `make bench ARGS=--quick` is a smoke test at small sizes; ARGS="--only streams,grading" picks benches.
bench: setup
	$(VENV)/bin/python tools/bench_all.py --page docs/performance.md $(ARGS)

lint: setup
	$(VENV)/bin/ruff check pipelinerl tools tests
