# Two commands do everything on a fresh machine (see README):
#   make check   create .venv, install (the frameworks of the ready-made targets too), fuzz the
#                built-in `parallel` target
#   make test    create .venv, install, run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: check test bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[frameworks]'
	touch $(STAMP)

check: $(STAMP)
	$(BIN)/ddpcheck check

test: $(STAMP)
	$(BIN)/pytest -n auto -q tests properties

bench: $(STAMP)
	for f in bench/*.py; do $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) build src/*.egg-info
