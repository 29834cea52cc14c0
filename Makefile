# Two commands do all set-up: `make demo` and `make test` (see README.md).
VENV := .venv
BIN := $(VENV)/bin
DEMO := build/demo

.PHONY: demo test bench clean

$(BIN)/.installed: requirements-dev.txt
	python3 -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements-dev.txt
	touch $@

# Generate a project with the default answers, then train it on 2 CPU processes.
demo: $(BIN)/.installed
	rm -rf $(DEMO)
	$(BIN)/cookiecutter . --no-input --output-dir $(DEMO)
	cd $(DEMO)/ddp_classifier && PATH="$(CURDIR)/$(BIN):$$PATH" \
		torchrun --standalone --nproc_per_node=2 train.py model.name=mlp train.epochs=5

# Every test: the template's, and each generated project's own suite; two at a time
# (the SLURM tests share one cluster, so they stay together on one worker).
test: $(BIN)/.installed
	$(BIN)/python benchmarks/bench.py --quick  # figures only: the step against a plain loop and the last version
	$(BIN)/python -m pytest -n 2 --dist loadgroup --durations=25 tests

# Generated loop vs a hand-written one and vs the previous version (default and lean bakes),
# DDP vs FSDP memory, speed switches. Prints figures.
bench: $(BIN)/.installed
	$(BIN)/python benchmarks/bench.py --switches

clean:
	rm -rf $(VENV) $(DEMO)
