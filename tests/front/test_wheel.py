"""The stranger's install: a wheel built from this tree, installed without ``-e`` into a fresh
virtualenv with exactly the dependencies it declares, works from an empty folder -- the README's
blocks run there and print what it shows, every public module imports, ``ddpcheck check`` runs a
world, and the pytest plugin loads by its entry point.

Why: an editable install (what ``make`` and CI use) imports from ``src/`` and hides a wheel that
leaves subpackages out; a development venv holds packages the wheel does not declare (numpy: a
rank once needed it for every record, and a stranger's install reported the correct quick-start
target as diverged). So pip resolves the wheel's own requirements into an empty venv, nothing
linked in -- about a minute, once per run.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from typing import Any

import pytest

from tests.front.test_docs import _blocks, assert_prints

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "src", "parallel")  # what a build reads
#: Every public module (and parallel's) imports from the installed wheel, not the checkout.
IMPORTS = textwrap.dedent("""
    import importlib, pkgutil
    import ddpcheck

    def test_every_public_module_imports_from_the_wheel():
        assert ddpcheck.__file__.startswith({purelib!r}), ddpcheck.__file__
        missing = [n for n in ddpcheck.__all__ if getattr(ddpcheck, n, None) is None]
        assert not missing, missing
        public = [m.name for m in pkgutil.walk_packages(ddpcheck.__path__, "ddpcheck.")
                  if "._" not in m.name and not m.name.endswith("__main__")]
        for name in public + ["parallel", "parallel.sharding"]:
            importlib.import_module(name)
        print()
        print(len(public), "public modules")
""")
PROPERTY = (
    "import ddpcheck\n"
    "def test_parallel(ddpcheck_run): ddpcheck_run(ddpcheck.targets.PARALLEL, "
    "ddpcheck.Scenario(), world_sizes=(2,))\n"
)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, pathlib.Path]:
    """The wheel and the sdist, built by setuptools' PEP 517 hooks (what ``python -m build
    --no-isolation`` calls) from a copy of the tree, so the checkout gets no build/ or egg-info."""
    tree = tmp_path_factory.mktemp("tree")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            shutil.copy(ROOT / name, tree / name)
    out = tree / "dist"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta as b; "
            "out = sys.argv[1]; b.build_wheel(out); b.build_sdist(out)",
            str(out),
        ],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return {"wheel": next(out.glob("*.whl")), "sdist": next(out.glob("*.tar.gz"))}


def _modules_of_the_tree() -> set[str]:
    """Every .py file the packages hold, as a path inside an installed package."""
    found = set()
    for top, base in (("ddpcheck", ROOT / "src"), ("parallel", ROOT)):
        for path in (base / top).rglob("*.py"):
            found.add(path.relative_to(base).as_posix())
    return found


@pytest.mark.slow  # (as the fixture it shares: slow and quick tests of one fixture stay together)
def test_the_wheel_and_the_sdist_ship_every_module(built):
    modules = _modules_of_the_tree()
    assert "ddpcheck/_world/janitor.py" in modules  # it runs as a script file
    with zipfile.ZipFile(built["wheel"]) as wheel:
        missing = modules - set(wheel.namelist())
    assert not missing, f"the wheel lacks {sorted(missing)}"
    with tarfile.open(built["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    missing = {m for m in modules if m not in names and f"src/{m}" not in names}
    assert not missing, f"the sdist lacks {sorted(missing)}"


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> pathlib.Path:
    """A fresh venv holding the wheel and exactly what it declares, resolved by pip (torch from
    the constraints file, as the README's install line does): nothing of this interpreter's
    site-packages is visible, so an import the wheel does not declare fails here as it fails
    for a stranger (numpy: torch's CPU build does not bring it)."""
    venv = tmp_path_factory.mktemp("installed") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    install = subprocess.run(
        # --no-compile: pip's byte-compiling of torch is two thirds of the install's CPU; the
        # first import writes what later ones use
        [
            venv / "bin" / "python",
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-compile",
            "-c",
            ROOT / "constraints.txt",
            built["wheel"],
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    return venv


def _run_in(
    venv: pathlib.Path, folder: pathlib.Path, *argv: Any, timeout: float = 600, **env_extra: str
) -> subprocess.CompletedProcess:
    """``argv`` in ``folder`` with the venv's commands first on PATH and nothing of the checkout
    or of the developer's interpreter in the environment."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST", "VIRTUAL_ENV"))
    }
    env.update(
        PYTHONNOUSERSITE="1", PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", **env_extra
    )
    return subprocess.run(
        [str(a) for a in argv],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_the_install_holds_what_the_wheel_declares_and_no_more(installed, tmp_path):
    probe = _run_in(
        installed,
        tmp_path,
        "python",
        "-c",
        "import importlib.util, ddpcheck; print(ddpcheck.__file__); "
        "print(importlib.util.find_spec('numpy') is None)",
    )
    assert probe.returncode == 0, probe.stdout
    where, numpy_missing = probe.stdout.split()[-2:]
    assert where.startswith(str(installed)), where  # the wheel's ddpcheck, not the checkout's
    # The point of this venv: what the wheel does not declare is not there. If a future torch
    # requires numpy, this line says so and the test needs another undeclared package to miss.
    assert numpy_missing == "True", "numpy is installed: torch now requires it?"


@pytest.mark.slow
def test_the_readme_runs_as_written_from_the_installed_wheel(installed, tmp_path):
    """The README's quick start, its blocks written and run in an empty folder exactly as a
    stranger would after ``pip install -c constraints.txt <the wheel>``, prints what it shows."""
    last = ""
    for block in _blocks(ROOT / "README.md"):
        where = f"{block.page}:{block.line} (from the installed wheel)"
        if block.kind == "output":
            assert_prints(block.code, last, where)
            continue
        if block.lang == "python":
            (tmp_path / block.file).write_text(block.code)
            argv: tuple = ("python", block.file)
        else:
            argv = ("bash", "-e", "-o", "pipefail", "-c", block.code)
        done = _run_in(installed, tmp_path, *argv)
        last = done.stdout
        assert done.returncode == block.exit, (
            f"{where}: exit status {done.returncode}, the README says {block.exit}:\n{last}"
        )


@pytest.mark.slow
def test_an_installed_wheel_works_from_an_empty_folder(installed, tmp_path):
    # The console script runs a world from an empty folder in the README's last block (above);
    # here one interpreter (torch imported once) for the plugin, running the built-in target,
    # and for the imports of every public module from the wheel, the latter a test of its own,
    # run first.
    purelib = _run_in(
        installed,
        tmp_path,
        "python",
        "-c",
        "import sysconfig; print(sysconfig.get_paths()['purelib'])",
    ).stdout.strip()
    (tmp_path / "test_imports.py").write_text(IMPORTS.format(purelib=purelib))
    (tmp_path / "test_property.py").write_text(PROPERTY)
    # the plugin loads by its entry point's name
    plugin = _run_in(
        installed,
        tmp_path,
        "python",
        "-m",
        "pytest",
        "-p",
        "ddpcheck",
        "-p",
        "no:cacheprovider",
        "-q",
        "-s",
        "test_imports.py",
        "test_property.py",
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
    )
    assert plugin.returncode == 0, plugin.stdout
    assert "2 passed" in plugin.stdout, plugin.stdout
    public = re.search(r"^(\d+) public modules$", plugin.stdout, re.M)
    assert public and int(public.group(1)) >= 12, plugin.stdout
    assert "ddpcheck: 1 data-parallel examples run" in plugin.stdout, plugin.stdout
