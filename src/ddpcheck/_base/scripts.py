"""Scripts as modules: the name under which another process reaches what a script defines.

Writing the target in the script you run (``python check_my_ddp.py``) is what everyone does
first, and its classes live in ``__main__`` -- a name that means ddpcheck itself in a replay
process. So a script is known to other processes by the module it is as a file: ``check_my_ddp``,
imported from its folder (:func:`import_file`, which puts the folder first on ``sys.path`` as
``python path/to/check_my_ddp.py`` does, and imports the file under its own name, so its
``if __name__ == "__main__":`` block does not run again). A target spec names it by path
(``path/to/check_my_ddp.py:MyTarget()``); code that ddpcheck prints names its functions and
classes by that module (``check_my_ddp.my_data``).

Rank processes need nothing more: spawn re-imports the parent's main module in each rank and
registers it as ``__main__`` there too, so a target pickled as ``__main__.MyTarget`` unpickles;
and a file imported here is importable by name in ranks spawned afterwards, which inherit
``sys.path``. A script run with ``python -m pkg.mod`` is simply the module ``pkg.mod``.

Stdlib only: the scenario language (printing) and the front doors (loading specs) both use it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import keyword
import os
import sys
from types import ModuleType

from ddpcheck._base.errors import InvalidArgument

__all__ = [
    "MAIN_NAMES",
    "Script",
    "import_file",
    "is_file_spec",
    "load",
    "main_script",
    "module_spec",
    "public_module_name",
]

#: Module names of the script being run: ``__main__`` here, ``__mp_main__`` in spawned ranks.
MAIN_NAMES = ("__main__", "__mp_main__")

#: Module name -> absolute path of each file imported by :func:`import_file`.
_FILES: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class Script:
    """How another process reaches the script being run: ``spec`` goes before the colon of a
    target spec (a path, or the module of ``python -m``), ``name`` is the module it imports."""

    spec: str
    name: str


def is_file_spec(module_part: str) -> bool:
    """True for the ``FILE.py`` of ``FILE.py:EXPR`` (as opposed to ``MODULE:EXPR``)."""
    return module_part.endswith(".py")


def main_script() -> Script | None:
    """The running script as another process reaches it; None when no other process can (an
    interactive interpreter, ``python -c``, a script read from stdin, a console entry point)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name not in MAIN_NAMES:
        return Script(spec.name, spec.name)  # python -m pkg.mod
    path = getattr(main, "__file__", None)
    if not (isinstance(path, str) and path.endswith(".py") and os.path.isfile(path)):
        return None
    name = _module_name(path)
    if name is None:
        return None
    return Script(_shown(path), name)


def public_module_name(module: str) -> str:
    """The module another process imports for objects of ``module``: the script's own name for
    ``__main__``, the module itself otherwise."""
    if module in MAIN_NAMES:
        script = main_script()
        if script is not None:
            return script.name
    return module


def module_spec(module: str) -> str | None:
    """What a target spec writes before the colon for objects of ``module`` when that is not the
    module's name: the script's path (or ``-m`` module) for ``__main__``, the path of a file
    imported by :func:`import_file`; None for an ordinary module."""
    if module in MAIN_NAMES:
        script = main_script()
        return script.spec if script is not None else None
    path = _FILES.get(module)
    if path is not None and getattr(sys.modules.get(module), "__file__", None) == path:
        return _shown(path)
    return None


def load(module_part: str) -> ModuleType:
    """The module of a spec's ``MODULE`` or ``FILE.py`` part (the script itself for ``__main__``
    as :func:`module_spec` writes it)."""
    if is_file_spec(module_part):
        return import_file(module_part)
    return importlib.import_module(module_part)


def import_file(path: str) -> ModuleType:
    """Import ``path/to/name.py`` as the module ``name``, its folder first on ``sys.path`` (its
    sibling imports work, and so does importing ``name`` in ranks spawned afterwards). The same
    file twice is the same module; another module already imported under that name is refused."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise InvalidArgument(f"{path!r} is not a file")
    name = _module_name(full)
    if name is None:
        raise InvalidArgument(
            f"{path!r} cannot be imported as a module: {os.path.basename(full)[:-3]!r} is not a "
            "Python name; rename the file with letters, digits and underscores only"
        )
    existing = sys.modules.get(name)
    if existing is not None:
        where = getattr(existing, "__file__", None)
        if where is not None and os.path.exists(where) and os.path.samefile(where, full):
            _FILES.setdefault(name, where)
            return existing
        raise InvalidArgument(
            f"{path!r} cannot be imported as the module {name!r}: a module of that name is "
            f"already imported (from {where or 'no file'}); rename the file"
        )
    folder = os.path.dirname(full)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, full)
    assert spec is not None and spec.loader is not None  # a .py file always has a loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    _FILES[name] = full  # the module's __file__: the spec's origin
    return module


def _module_name(path: str) -> str | None:
    stem = os.path.basename(path)[:-3]
    if stem.isidentifier() and not keyword.iskeyword(stem):
        return stem
    return None


def _shown(path: str) -> str:
    """The path as a command line run from here names it: relative below the current folder."""
    full = os.path.abspath(path)
    relative = os.path.relpath(full)
    return full if relative.startswith(os.pardir) else relative
