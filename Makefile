# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv with pip when it is missing. Without CUDA they install the CPU
# build of torch (torch==2.13.0, which this machine keeps on local disk).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.graphcap-installed
CPU_TORCH ?= torch==2.13.0
# The suite draws fixed hypothesis examples (tests/conftest.py): fixed for one version.
HYPOTHESIS ?= hypothesis==6.170.27

.PHONY: demo test lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q "torch>=2.11" "ninja>=1.11"; \
	else \
		$(PY) -m pip install -q "$(CPU_TORCH)"; \
	fi
	$(PY) -m pip install -q -e ".[test,hf]" "$(HYPOTHESIS)"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m graphcap demo

# pytest exits 5 when it collected nothing: a vanished suite must fail loudly. Two
# workers (pytest-xdist); tests marked xdist_group share one worker (test_tp's ranks).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

lint: $(STAMP)
	$(PY) -m ruff check graphcap tests examples

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache *.egg-info
