# Two commands do everything on a fresh machine (see README):
#   make check   create .venv, install (the frameworks of the ready-made targets too), fuzz the
#                built-in `parallel` target
#   make test    create .venv, install, lint, run the test suite but its `thorough` variants
# and the gate `make test` runs first:
#   make lint    ruff check and ruff format --check (every Python folder) and mypy (src/ddpcheck
#                and parallel/), at the releases constraints.txt pins (pyproject.toml's
#                dependency group `lint`); `ruff format .` writes what the format check wants
# and the whole suite, the `thorough` variants too (pyproject.toml's markers; ~150 s more CPU):
#   make test-thorough
# and one to package:
#   make dist    the wheel and the sdist in dist/ (`python -m build`, from a tool venv: `build` is
#                no dependency of ddpcheck)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WARMED := $(VENV)/.warmed
TOOLS := .venv-build

.PHONY: check lint test test-thorough bench dist clean

# --no-compile: byte-compiling every installed module (torch's thousands) was two thirds of the
# install's CPU (50 s against 19 s on the 2-core machine). Yet under PYTHONDONTWRITEBYTECODE=1 (our
# machines' and CI's environment) no import writes a .pyc either, so every process -- pytest's
# workers, each command and its fork server -- compiled torch and the rest again (reading .pyc
# files still works under that variable). The install therefore imports, once and with bytecode
# written (-I ignores that variable and the current folder), what those processes import: .pyc
# files for the ~2,900 of the venv's 11,700 modules that run, at the interpreter's own
# optimization level, none in src/ or the repository (that comes below); a module it
# misses compiles at import, as before. Measured 2026-12-07 on clean clones, the machine loaded
# (load 3-12), CPU seconds: this warm-up 13-19 s, where `compileall -j 0` of all of site-packages
# took 40-43 s and of the 38 packages the tests import 40-45 s (a quarter of the source is
# transformers' per-model files); the whole install 30-38 s -> 41-48 s; after it, `import torch,
# hypothesis, pytest` 4.6 -> 2.3 s, a fork server's torch and dynamo 8.8 -> 3.7 s, a pytest
# worker's collection 17.7 -> 10.8 s, `ddpcheck check parallel --examples 2 --world-sizes 2`
# 17.6 -> 8.2 s (wall figures in docs/figures.md).
define WARM_UP
import importlib, sys

def warm(name):
    try:
        return importlib.import_module(name)
    except Exception as error:  # left to compile at import, as before
        print(f"bytecode warm-up: {name}: {error!r}", file=sys.stderr)

torch = warm("torch")
if torch:  # a rank's first optimizer imports dynamo
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
for name in [
    "torch.distributed", "torch.nn.parallel", "torch.distributed.optim",
    "torch.distributed.fsdp", "torch.distributed.algorithms.ddp_comm_hooks",
    "numpy", "hypothesis", "pytest", "xdist.plugin", "xdist.remote", "execnet",
    "lightning", "accelerate", "transformers.trainer",
]:
    warm(name)
for plugin in getattr(warm("_pytest.config"), "default_plugins", ()):  # every pytest loads them
    warm(f"_pytest.{plugin}")
endef

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile -c constraints.txt -e '.[frameworks]'
	$(BIN)/pip install --quiet --no-compile -c constraints.txt --group lint
	touch $(STAMP)

# Its own step, so that `make test` runs it beside the lint (both use one core: ~15 s of wall
# saved on the 2-core machine). After the venv's modules, the repository's own code, which the
# warm-up above leaves alone: `compileall` of src/, parallel/ and the tests (ranks and commands
# import ddpcheck and tests.x helpers by name), and one `pytest --collect-only`, which writes the
# assertion-rewritten bytecode of every test module (pytest writes it only where bytecode may be
# written). Each xdist worker collects the whole suite: measured 2026-12-07 (load 9-11), a
# collection took 5.5-5.8 s of CPU without that bytecode and 3.0-3.4 s with it; the two steps
# add ~6 s of CPU here, beside the lint. (`__pycache__/` is git-ignored.)
$(WARMED): export WARM_UP := $(WARM_UP)
$(WARMED): $(STAMP)
	$(BIN)/python -I -c "$$WARM_UP"
	$(BIN)/python -I -m compileall -q src parallel tests properties
	$(BIN)/python -I -m pytest --collect-only -q tests properties > /dev/null
	touch $(WARMED)

check: $(WARMED)
	$(BIN)/ddpcheck check

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The lint gates the suite; the bytecode warm-up runs beside it. `thorough`: a test that checks
# once more what another test of `make test` checks already (another signal, phase or mutant of
# the same class), kept out of CI's ten minutes.
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 lint $(WARMED)
	$(BIN)/pytest -n auto -q -m "not thorough" tests properties

test-thorough: $(STAMP)
	$(MAKE) --no-print-directory -j2 lint $(WARMED)
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
