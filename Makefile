# Two commands: `make demo` and `make test`. Each creates .venv when missing and installs
# the project into it (torch resolves to the wheel on local disk where pip is capped).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow install format clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/prunepipe demo

test: $(STAMP)
	$(BIN)/pytest -q

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

format: $(STAMP)
	$(BIN)/ruff check --fix --quiet .
	$(BIN)/ruff format --quiet .

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
