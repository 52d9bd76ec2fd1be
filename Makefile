# One command sets up the environment and runs everything it names.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test install demo bench docs lint wheel-check gpu-probe clean

# The library with its test extra, and the examples beside it (examples/:
# the jmp-train demo, its data and models), both editable.
$(STAMP): pyproject.toml examples/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]' -e './examples[full]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist worksteal -m "" --durations=15 $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/jmp-train $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

# The site, with every warning an error (a broken reference, a missing page).
docs: $(DOCS_STAMP)
	$(PY) -m sphinx -W --keep-going -n -q -b html docs docs/_build/html

# What a user installs: the sdist and the wheel built from it, the wheel
# holding the library alone (.ci/wheel_contents.py), the wheel
# (not editable) in a new virtual environment, and README.md's quick start
# run there from a folder outside the repository, so that it imports the
# installed package. Dependencies come from the package index.
wheel-check: $(STAMP)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(PY) -m build -q --outdir "$$tmp/dist" . && \
	ls "$$tmp/dist" && \
	$(PYTHON) -m venv "$$tmp/venv" && \
	$(PY) .ci/wheel_contents.py "$$tmp"/dist/jmp_train-*.whl && \
	"$$tmp/venv/bin/python" -m pip install -q "$$tmp"/dist/jmp_train-*.whl && \
	cd "$$tmp" && "$$tmp/venv/bin/python" -I "$(CURDIR)/.ci/quickstart_check.py" "$(CURDIR)/README.md"

bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

# Every GPU figure in one process (refuses without a GPU). On a machine
# whose Python already has JAX for CUDA, Flax and optax (no network needed),
# `make gpu-probe PROBE_PY=python3 OUT=folder`; results go to OUT (default
# benchmarks/results). A quarter of the GPU's memory stays free for the
# first-call measurements' own processes.
PROBE_PY ?= $(PY)
PROBE_BUDGET_S ?= 420
gpu-probe:
	test "$(PROBE_PY)" != "$(PY)" || $(MAKE) $(STAMP)
	XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 BENCH_PROBE_BUDGET_S=$(PROBE_BUDGET_S) \
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" PYTHONUNBUFFERED=1 \
	$(PROBE_PY) -m benchmarks --gpu-probe $(if $(OUT),--out $(OUT))

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache docs/_build
