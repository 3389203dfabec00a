# The README's two commands: `make run` (set up + main job) and `make test` (set up + test suite).
VENV ?= .venv
CONFIG ?= configs/tiny_cpu.yaml
export HF_HUB_OFFLINE = 1

.PHONY: setup run test lint

setup:
	@bash tools/setup_venv.sh

# Until `pipelinerl run` lands: build the tiny model and show the config it will run with.
run: setup
	$(VENV)/bin/pipelinerl make-tiny-model runs/models/tiny_addition
	$(VENV)/bin/pipelinerl show-config $(CONFIG) $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest -q $(ARGS)

lint: setup
	$(VENV)/bin/ruff check pipelinerl tools tests
