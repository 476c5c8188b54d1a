# distlib: set-up, demo, tests, training. `make help` lists the targets.
# Every target sets up the virtual environment first (once; again when pyproject.toml changes).

PYTHON ?= python3
VENV ?= .venv
# the CPU machines' torch; a GPU host may want its own build: make setup TORCH_PKGS="torch==2.11.0 ..."
TORCH_PKGS ?= torch==2.14.1 torchvision==0.29.1
NPROC ?= 2
RECIPE ?= recipes/cifar.yaml
ARGS ?=
PYTEST_ARGS ?=
# make test: pytest-xdist workers, each taking a whole test file at a time (its module fixtures run
# once); 0 runs every test in the pytest process, one after the other
PYTEST_JOBS ?= 2

# make test-compat: the GPU machine's torch and transformers, on the CPU, in an environment of their
# own, for the tests nearest torch's internals (compile, fake tensors, FSDP2, DCP, float8, transformers)
COMPAT_PKGS ?= torch==2.11.0 torchvision==0.26.0 transformers==5.17.0 torchao==0.18.0
COMPAT_TESTS ?= tests/library/test_compile.py tests/library/test_float8.py tests/library/test_fsdp.py \
	tests/library/test_sharded_checkpoint.py tests/runner/test_memory_plan.py tests/runner/test_hf_families.py \
	tests/runner/test_compilation.py tests/runner/test_float8.py tests/runner/test_hf_causal_lm.py \
	tests/runner/test_chunked_loss.py

BIN := $(VENV)/bin
STAMP := $(VENV)/.distlib-installed

.PHONY: help setup demo test test-compat train lint format reference clean

help:
	@echo "make setup                       virtual environment in $(VENV) (PYTHON=$(PYTHON))"
	@echo "make demo                        offline demo: $(NPROC) processes on the CPU, about a minute"
	@echo "make test                        ruff check + the whole test suite"
	@echo "make test-compat                 the tests nearest torch's internals on torch 2.11 (in .venv-compat)"
	@echo "make train RECIPE=... ARGS=...   torchrun --nproc-per-node=\$$NPROC launch.py RECIPE ARGS"
	@echo "make lint | format               ruff check and format check | format in place"
	@echo "make reference                   regenerate docs/configuration.md from the config dataclasses"
	@echo "make clean                       remove the environment, runs/ and caches"

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(TORCH_PKGS)
	$(BIN)/python -m pip install -e '.[runner,images,plots,test]'
	@# the PyPI name distlib is also pypa's (virtualenv needs it): this install replaces it, pip check says so
	$(BIN)/python -m pip check
	@touch $@

demo: $(STAMP)
	$(BIN)/torchrun --standalone --nproc-per-node=$(NPROC) launch.py recipes/demo.yaml $(ARGS)

# pytest exits 5 when it collected no test: that is a failure too
test: $(STAMP)
	$(BIN)/ruff check .
	@$(BIN)/python -m pytest -p no:cacheprovider -n $(PYTEST_JOBS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-compat:
	$(MAKE) test VENV=.venv-compat TORCH_PKGS="$(COMPAT_PKGS)" PYTEST_ARGS="$(COMPAT_TESTS)"

train: $(STAMP)
	$(BIN)/torchrun --standalone --nproc-per-node=$(NPROC) launch.py $(RECIPE) $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

reference: $(STAMP)
	$(BIN)/python -m distlib.runner.config --write-docs docs/configuration.md

clean:
	rm -rf $(VENV) .venv-compat runs .pytest_cache .ruff_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# docker-build, docker-run, docker-test: docker/ (their own section below)
-include docker/docker.mk
