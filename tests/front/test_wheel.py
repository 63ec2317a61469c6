"""The stranger's install: a wheel built from this tree, installed without ``-e`` into a fresh
virtualenv, works from an empty folder -- every public module imports, ``ddpcheck check`` runs a
world, and the pytest plugin loads by its entry point.

Why: an editable install (what ``make`` and CI use) imports from ``src/`` and hides a wheel that
leaves subpackages out. To stay fast the fresh venv does not install torch again: a ``.pth`` line
points it at a folder of links to this interpreter's site-packages, minus the editable ddpcheck
(its finder, its ``.pth`` files and its metadata), so only the wheel's ddpcheck is visible.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile

import pytest

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
PROPERTY = ("import ddpcheck\n"
            "def test_parallel(ddpcheck_run): ddpcheck_run(ddpcheck.targets.PARALLEL, "
            "ddpcheck.Scenario(), world_sizes=(2,))\n")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, pathlib.Path]:
    """The wheel and the sdist, built by setuptools' PEP 517 hooks (what ``python -m build
    --no-isolation`` calls) from a copy of the tree, so the checkout gets no build/ or egg-info."""
    tree = tmp_path_factory.mktemp("tree")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, tree / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(ROOT / name, tree / name)
    out = tree / "dist"
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
         "out = sys.argv[1]; b.build_wheel(out); b.build_sdist(out)", str(out)],
        cwd=tree, capture_output=True, text=True, timeout=300)
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
    assert "ddpcheck/_internal/world/janitor.py" in modules  # it runs as a script file
    with zipfile.ZipFile(built["wheel"]) as wheel:
        missing = modules - set(wheel.namelist())
    assert not missing, f"the wheel lacks {sorted(missing)}"
    with tarfile.open(built["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    missing = {m for m in modules if m not in names and f"src/{m}" not in names}
    assert not missing, f"the sdist lacks {sorted(missing)}"


def _shadow_site_packages(folder: pathlib.Path) -> pathlib.Path:
    """Links to every entry of this interpreter's site-packages but the editable ddpcheck."""
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    folder.mkdir()
    for entry in site.iterdir():
        name = entry.name
        if name.startswith(("ddpcheck", "__editable__", "parallel")) or name.endswith(".pth"):
            continue
        (folder / name).symlink_to(entry)
    return folder


@pytest.mark.slow
def test_an_installed_wheel_works_from_an_empty_folder(built, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    shadow = _shadow_site_packages(tmp_path / "deps")
    pathlib.Path(purelib, "ddpcheck_test_deps.pth").write_text(f"{shadow}\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
         "--no-index", "--disable-pip-version-check", str(built["wheel"])],
        capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr

    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST"))}
    env["PYTHONNOUSERSITE"] = "1"

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in argv], cwd=empty, env=env, capture_output=True,
                              text=True, timeout=600)

    check = run(venv / "bin" / "ddpcheck", "check", "--examples", "5", "--world-sizes", "2")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "nothing found" in check.stdout, check.stdout

    # One interpreter (torch imported once) for the plugin and for the imports of every public
    # module from the wheel, the latter a test of its own, run first.
    (empty / "test_imports.py").write_text(IMPORTS.format(purelib=purelib))
    (empty / "test_property.py").write_text(PROPERTY)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the plugin loads by its entry point's name
    plugin = run(python, "-m", "pytest", "-p", "ddpcheck", "-p", "no:cacheprovider", "-q", "-s",
                 "test_imports.py", "test_property.py")
    assert plugin.returncode == 0, plugin.stdout + plugin.stderr
    assert "2 passed" in plugin.stdout, plugin.stdout
    public = re.search(r"^(\d+) public modules$", plugin.stdout, re.M)
    assert public and int(public.group(1)) >= 12, plugin.stdout
    assert "ddpcheck: 1 data-parallel examples run" in plugin.stdout, plugin.stdout
