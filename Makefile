# Two commands for a fresh clone:
#   make demo   - create .venv, install opfuse, optimise the built-in ResNet-50 (fusion log,
#                 verification), then measure the chapter's ablation table (opfuse bench)
#   make test   - create .venv, install opfuse with its test extras (and the QNN backend), run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.opfuse-installed

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test,bench,qnn]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/opfuse demo --target onnxruntime
	$(VENV)/bin/opfuse bench

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/ablation.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
