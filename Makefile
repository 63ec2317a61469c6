# Two commands do everything on a fresh machine (see README):
#   make check   create .venv, install (the frameworks of the ready-made targets too), fuzz the
#                built-in `parallel` target
#   make test    create .venv, install, lint, run the test suite
# and the gate `make test` runs first:
#   make lint    ruff check and ruff format --check (every Python folder) and mypy (src/ddpcheck
#                and parallel/), at the releases constraints.txt pins (pyproject.toml's
#                dependency group `lint`); `ruff format .` writes what the format check wants
# and one to package:
#   make dist    the wheel and the sdist in dist/ (`python -m build`, from a tool venv: `build` is
#                no dependency of ddpcheck)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TOOLS := .venv-build

.PHONY: check lint test bench dist clean

# --no-compile: byte-compiling every installed module (torch's thousands) was two thirds of the
# install's CPU (50 s against 19 s on the 2-core machine); the first import of a module writes its
# .pyc, so only what runs is compiled, once.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile -c constraints.txt -e '.[frameworks]'
	$(BIN)/pip install --quiet --no-compile -c constraints.txt --group lint
	touch $(STAMP)

check: $(STAMP)
	$(BIN)/ddpcheck check

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -n auto -q tests properties

bench: $(STAMP)
	for f in bench/*.py; do $(BIN)/python $$f || exit 1; done

$(TOOLS)/.installed:
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --quiet build
	touch $@

dist: $(TOOLS)/.installed
	$(TOOLS)/bin/python -m build --outdir dist .

# Everything the commands above write: the venvs, the linters' caches, and what builds leave
# (setuptools writes build/ and the egg-info at the root or under src/ depending on the command).
clean:
	rm -rf $(VENV) $(TOOLS) .mypy_cache .ruff_cache build dist *.egg-info src/*.egg-info
