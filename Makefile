# Two commands for a fresh clone:
#   make demo   - create .venv, install opfuse, optimise the built-in ResNet-50 (fusion log,
#                 verification), then measure the chapter's ablation table (opfuse bench)
#   make test   - create .venv, install opfuse with its test extras (and the QNN backend), lint (ruff), run
#                 the test suite on two workers (pytest-xdist; a test file's tests run on one worker, so a
#                 module-scoped model is built once)
#   make test-thorough - the property tests that draw hundreds of examples, with all of them (`make test`
#                 draws a third: tests/profiles.py)
#   make check-models - opfuse with no flag on models it did not build (wheels' models, exported decoder LLMs):
#                 every run must exit 0, and what it writes must load (and, for the decoders, equal the input)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.opfuse-installed
# the extras `make` installs; `make test` declares them installed (OPFUSE_REQUIRE_EXTRAS): a test
# that needs one of their packages then fails when it is missing instead of skipping (tests/extras.py)
EXTRAS := test,bench,qnn,ethos-u,llm

.PHONY: demo test test-thorough check-models bench install clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/opfuse demo --target onnxruntime
	$(VENV)/bin/opfuse bench

test: $(STAMP)
	$(PY) -m ruff check .
	# (bytecode written: with PYTHONDONTWRITEBYTECODE set, every worker and child interpreter compiles
	# the tests and rewrites their assertions again, 10-20 s of CPU a run)
	env -u PYTHONDONTWRITEBYTECODE OPFUSE_REQUIRE_EXTRAS=$(EXTRAS) $(PY) -m pytest -q -n 2 --dist loadfile

# the test files whose counts tests/profiles.py's `examples` sets
THOROUGH_TESTS := tests/test_fold_properties.py
test-thorough: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q --hypothesis-profile=thorough $(THOROUGH_TESTS)

# Every script runs even when one fails; the target fails if any did. A wheel that cannot be
# downloaded prints "not run: ..." and is skipped. Exports are cached in ~/.cache/opfuse-decoders.
CHECK_MODELS := benchmarks/wild.py benchmarks/layouts.py benchmarks/decoders.py
check-models: $(STAMP)
	@failed=""; for script in $(CHECK_MODELS); do \
		echo "== $$script --verify-only"; start=$$(date +%s); \
		OMP_NUM_THREADS=1 $(PY) $$script --verify-only || failed="$$failed $$script"; \
		echo "== $$script: $$(( $$(date +%s) - start )) s"; \
	done; \
	if [ -n "$$failed" ]; then echo "check-models failed:$$failed"; exit 1; fi

bench: $(STAMP)
	$(PY) benchmarks/ablation.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
