# Quick start:  make demo   (set up, fetch the default model, compare drafters on real prompts)
#               make demo MODEL=gemma3-270m   (the same on Gemma 3 270M; Gemma Terms of Use, docs/MODELS.md)
#               make test   (set up, fetch the default model, run the test suite)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)
# Which torch: cpu = the CPU build pinned in constraints.txt (the default, what CI runs);
# cu126, cu128, ... = that CUDA build of the same version from download.pytorch.org;
# keep = the torch the Python running make already has (a GPU image's): the venv sees its site-packages.
TORCH ?= cpu
# Which extras of pyproject.toml: dev (tests, lint) by default; CI adds eval (lm-eval, for the harness test).
EXTRAS ?= dev
# One stamp per torch flavour and extras (only the installed one exists): `make setup TORCH=cu128` after a CPU
# setup installs, and so does `make setup EXTRAS=dev,eval` after a plain one.
comma := ,
STAMP := $(VENV)/.installed-$(TORCH)-$(subst $(comma),+,$(EXTRAS))
TORCH_VERSION := $(shell sed -n 's/^torch==//p' constraints.txt)
TORCH_INDEX ?= https://download.pytorch.org/whl/$(TORCH)
OTHERS := $(VENV)/constraints-without-torch.txt

.PHONY: setup demo test lint fetch-model compare lease clean
# Which model the demo (and fetch-model) runs on: default (SmolLM2-135M-Instruct) or gemma3-270m.
MODEL ?= default

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
ifeq ($(TORCH),cpu)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
else
ifeq ($(TORCH),keep)
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch; print('using torch', torch.__version__, 'CUDA', torch.version.cuda)"
else
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==$(TORCH_VERSION)" --index-url $(TORCH_INDEX)
endif
	grep -v '^torch==' constraints.txt > $(OTHERS)
	$(BIN)/pip install -q -c $(OTHERS) -e ".[$(EXTRAS)]"
endif
	rm -f $(VENV)/.installed $(VENV)/.installed-*
	touch $(STAMP)

fetch-model: setup
	$(BIN)/layerskip fetch-model $(MODEL)

# A quick look on a few held-out real prompts (HumanEval, GSM8K), per model: the best training-free row and the best
# trained row, both paying. quant_self: the model's own int4 copy drafting for itself (training-free; docs/RESULTS.md,
# "Quantized drafts"). The default model: the exit adapter shipped for it (trained on the frozen model: output
# unchanged) at the setting it was tuned with (kept in the adapter file's header: `--drafter best` on the command
# line) and SWIFT, which falls back to plain steps where drafting would not pay. Gemma 3 270M (no adapter ships for
# it): dynamic exit and SWIFT (docs/RESULTS.md, "Gemma 3 270M beside the default model"). The screen shows short
# labels, a legend and the recommendation with why; runs/demo*/results.md has every column and each method's spec.
ifeq ($(MODEL),gemma3-270m)
DEMO_DRAFTERS ?= autoregressive,quant_self,dynamic_exit,swift
DEMO_OUT ?= runs/demo-gemma3-270m
else
DEMO_DRAFTERS ?= autoregressive,quant_self,early_exit:adapter=default,swift
DEMO_OUT ?= runs/demo
endif
demo: fetch-model
ifeq ($(MODEL),gemma3-270m)
	@echo "demo rows: autoregressive = plain decoding; quant_self = the model's own int4 copy drafting for itself"
	@echo "  (training-free; its reduced draft vocabulary is built from the model's own generations on first use, 2-3"
	@echo "  minutes, then kept); dynamic_exit = the exit layer, draft length and stop chosen per context from the acceptance"
	@echo "  it watches, priced with this model's measured costs; swift = SWIFT, training-free, falling back to plain steps"
	@echo "  where drafting would not pay. About 10 minutes on 2 busy CPU cores after the fetch."
else
	@echo "demo rows: autoregressive = plain decoding; quant_self = the model's own int4 copy drafting for itself"
	@echo "  (training-free: weights quantized at load, output identical); early_exit:adapter=default = the exit adapter"
	@echo "  shipped for this model (one attention layer and an MLP on layer 4's input, distilled on CPU from the frozen"
	@echo "  model's own answers; model unchanged, output identical) at its tuned setting (k=6, confidence 0.5, the stopping"
	@echo "  token kept, a token tree of up to 4 nodes; --drafter best); swift = SWIFT, training-free."
	@echo "  About 6 minutes on 2 busy CPU cores after the setup."
endif
	$(BIN)/layerskip bench --model $(MODEL) --drafters $(DEMO_DRAFTERS) --peers hf_generate \
		--data humaneval,gsm8k --n 3 --max-new-tokens 64 --repeats 1 --threads 1 --out $(DEMO_OUT) --force

# One pytest worker per core (at most 4; xdist), each taking whole test files (--dist loadfile: a file's module
# fixtures, such as the GPU lease rehearsal, run once). A single file runs as usual: .venv/bin/python -m pytest tests/...
TEST_WORKERS ?= auto
# GEMMA=1 also fetches Gemma 3 270M and requires its tests (tests/infer/test_gemma_real.py: about 2 minutes of download
# and conversion once, 40 s of tests); CI sets it (.ci/run). A plain `make test` does not fetch a model under the
# Gemma Terms of Use on your behalf: its tests skip.
GEMMA ?= 0
test: setup
	$(BIN)/layerskip fetch-model
ifeq ($(GEMMA),1)
	$(BIN)/layerskip fetch-model gemma3-270m
endif
	WANDB_MODE=disabled $(if $(filter 1,$(GEMMA)),LAYERSKIP_REQUIRE_GEMMA=1 )$(BIN)/python -m pytest -q \
		-n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile

# Training-free vs trained drafting, measured side by side; writes docs/RESULTS.md (hours on a CPU).
compare: fetch-model
	BIN=$(BIN) bash tools/results/compare_trained_vs_free.sh

# The bundle an offline GPU machine needs (docs/GPU.md, "Running on an offline GPU machine with a time limit"):
# runs/lease/meta, runs/lease/a, runs/lease/b; it ends by saying what to copy there and what to run.
lease: fetch-model
	rm -rf runs/lease
	$(BIN)/python -m tools.gpu.gpu_bundle

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
