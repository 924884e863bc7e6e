# Two entry points: `make run` (the default experiment) and `make test`. Each sets up .venv first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# torch==2.13.0 is pinned in the install step so pip takes the CPU wheel on CPU machines instead of a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv run test test-all lint bench gpu-check clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

venv: $(BIN)/.installed

run: venv
	$(BIN)/python -m experiments.pipeline $(ARGS)

test: venv
	$(BIN)/python -m pytest -q -n 2 $(ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

test-all: venv
	$(BIN)/python -m pytest -q -m "not gpu and not bench" $(ARGS)

lint: venv
	$(BIN)/ruff check .

bench: venv
	$(BIN)/python -m pytest -q -m bench -s $(ARGS)

# GPU tests + GPU benchmark + calibration profile -> outputs/gpu_check/report.md (< 10 min on one H100/H200).
# Exits 2 with a "no GPU" line on a machine without CUDA, 1 when a test or section failed.
gpu-check: venv
	$(BIN)/python -m experiments.gpu_check $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun
