# One command sets up the environment and runs everything it names.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test install demo bench docs lint wheel-check check-orbax-range gpu-probe clean

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

# The checkpoint tests against both ends of the orbax-checkpoint range that
# pyproject.toml declares, each in a new virtual environment: the floor
# (pinned) and the newest release the range allows (pip's choice).
# Dependencies come from the package index.
ORBAX_FLOOR := $(shell sed -n 's/^checkpoint = \["orbax-checkpoint>=\([0-9.]*\),.*/\1/p' pyproject.toml)
ORBAX_TESTS ?= tests/test_train_checkpoint.py tests/test_checkpoint_integrity.py tests/test_checkpoint_manager.py \
	tests/test_demo_resume.py tests/test_killed_process.py tests/test_demo_faults.py
check-orbax-range:
	@test -n "$(ORBAX_FLOOR)" || { echo "no orbax-checkpoint floor in pyproject.toml"; exit 1; }
	@for pin in "orbax-checkpoint==$(ORBAX_FLOOR)" ""; do \
	  tmp=$$(mktemp -d) && \
	  $(PYTHON) -m venv "$$tmp/venv" && \
	  "$$tmp/venv/bin/python" -m pip install -q -e '.[test]' -e './examples[full]' $$pin && \
	  "$$tmp/venv/bin/python" -c "from importlib.metadata import version; print('orbax-checkpoint', version('orbax-checkpoint'))" && \
	  "$$tmp/venv/bin/python" -m pytest -n 2 -q -m "" $(ORBAX_TESTS); \
	  status=$$?; rm -rf "$$tmp"; test $$status -eq 0 || exit $$status; \
	done

bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

# The GPU figures that the stored GPU results lack for the current code
# (benchmarks/_probe.py's PROBE, most wanted first, each in its own
# process), within PROBE_BUDGET_S seconds that it never exceeds; each
# results file is written as its measurement ends. PROBE_ALL=1 measures
# everything again. Refuses without a GPU. On a machine whose Python
# already has JAX for CUDA, Flax and optax (no network needed),
# `make gpu-probe PROBE_PY=python3 OUT=folder`; results go to OUT (default
# benchmarks/results). A quarter of the GPU's memory stays free for the
# first-call measurements' own processes.
PROBE_PY ?= $(PY)
PROBE_BUDGET_S ?= 420
PROBE_ALL ?=
gpu-probe:
	test "$(PROBE_PY)" != "$(PY)" || $(MAKE) $(STAMP)
	XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 BENCH_PROBE_BUDGET_S=$(PROBE_BUDGET_S) BENCH_PROBE_ALL=$(PROBE_ALL) \
	PYTHONPATH="$(CURDIR):$(CURDIR)/examples$${PYTHONPATH:+:$$PYTHONPATH}" PYTHONUNBUFFERED=1 \
	$(PROBE_PY) -m benchmarks --gpu-probe $(if $(OUT),--out $(OUT))

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache docs/_build
