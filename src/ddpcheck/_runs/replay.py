"""Replay lines that rebuild exactly the target that failed.

Every failure prints ``python -m ddpcheck replay MODULE:EXPR --world-size W --scenario '...'``.
``MODULE:EXPR`` must rebuild, in a fresh process, a target equal to the one that failed: a line
that rebuilds another target (``MyTarget()`` for ``MyTarget(scale_bug=True)``) would pass and
silently clear the bug. So :func:`target_spec` tries, in order:

1. a module-level attribute that *is* the target: ``module:NAME``;
2. a dataclass: its fields as code (classes and functions by import path, defaults left out),
   then its ``repr``;
3. any target: the call that built it, ``module:Cls(args...)`` (``Target.__new__`` records the
   arguments), every argument as code;

and accepts a candidate only if evaluating it the way ``ddpcheck replay`` does (:func:`evaluate`:
import the module, evaluate the expression in it) rebuilds an object of the same class whose
state -- its instance attributes -- equals the target's. When none does (an argument whose repr
is not code, a target changed after construction, a class defined inside a function or in an
interactive session), :func:`verify_replayable` refuses with :class:`InvalidArgument` before any
world runs, saying how to make the target replayable; a different target is never printed.

A target written in the script being run (its class in ``__main__``, or its state naming the
script's functions and classes) is named by the script's path, ``check_my_ddp.py:EXPR``, and
verified by importing that file as a module (``ddpcheck._base.scripts``) -- exactly what the
replay process does -- and evaluating EXPR there; a class from ``__main__`` and the same class
from the imported file count as the same (same script, same qualified name), and so do their
functions inside the target's state. A module-level name of the script counts only if importing
the file defines it too (not a name bound under ``if __name__ == "__main__":``).

Verified specs are cached by the target's id and pickle, so the check costs one ``pickle.dumps``
per example, and a target changed after its check is verified again.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import io
import pickle
import re
import shlex
import sys
import types
from collections.abc import Iterator
from typing import Any

from ddpcheck._base.errors import EquivalenceError, InvalidArgument
from ddpcheck._base.scripts import (
    MAIN_NAMES,
    load,
    main_script,
    module_spec,
    public_module_name,
)
from ddpcheck._language.scenario import Scenario, _code, _is_default, import_path
from ddpcheck.targets import CONSTRUCTOR_CALL as _CALL  # metadata of a target, not its state

__all__ = [
    "RACE_REPEATS",
    "evaluate",
    "evaluate_in",
    "from_repr",
    "possibly_racy",
    "replay_command",
    "shell_word",
    "target_spec",
    "verify_replayable",
]


_VERIFIED: dict[tuple[int, type, bytes], str] = {}  # (id, class, pickle) -> verified spec
_MAX_CACHED = 256


def replay_command(
    target: Any, scenario: Any, world_size: int, *, device: str = "cpu", backend: str | None = None
) -> str:
    """The shell command that runs this one example again (the target's spec is verified); it
    names the device and backend only when they are not the defaults (scenarios carry neither)."""
    where = (f" --device {device}" if device != "cpu" else "") + (
        f" --backend {backend}" if backend is not None else ""
    )
    return (
        f"python -m ddpcheck replay {shell_word(target_spec(target))} "
        f"--world-size {world_size}{where} --scenario {shell_word(repr(scenario))}"
    )


#: How often a replay line repeats an example whose verdict may be a race (``--repeat``): a race
#: reproduced in 1 of 3 runs (``ReadsBeforeWait``) is missed by 20 runs with odds of 3e-4.
RACE_REPEATS = 20


def possibly_racy(error: EquivalenceError) -> EquivalenceError:
    """``error``, whose example failed once and passed when run again, its replay line made to
    repeat the example up to :data:`RACE_REPEATS` times (stopping at the first failure): a
    replay that does not reproduce it then says so, with exit 5, never "equivalent" and 0."""
    line = f"{error.replay} --repeat {RACE_REPEATS}"
    error.args = (error.args[0].replace(f"replay: {error.replay}", f"replay: {line}", 1),)
    error.replay = line
    return error


def shell_word(text: str) -> str:
    """``text`` as one shell word a reader can still read: single quotes, as ``shlex.quote``;
    double quotes when ``text`` holds single quotes (a dict's keys, a string argument) but
    nothing a shell expands inside double quotes; ``shlex.quote``'s ``'"'"'`` only if both."""
    if "'" in text and not any(c in text for c in '"$`\\!'):
        return f'"{text}"'
    return shlex.quote(text)


def target_spec(target: Any, pickled: bytes | None = None) -> str:
    """``MODULE:NAME`` or ``MODULE:EXPR`` that rebuilds ``target`` in another process, verified
    by rebuilding it here; :class:`InvalidArgument` when no such spec exists. ``pickled``: the
    target's pickle, when the caller has it already (the check's hot path pickles once)."""
    try:
        key: tuple[int, type, bytes] | None = (
            id(target),
            type(target),
            pickled if pickled is not None else pickle.dumps(target),
        )
    except Exception:  # unpicklable: the caller's pickle check says so; nothing to cache
        key = None
    spec = _VERIFIED.get(key) if key is not None else None
    if spec is None:
        spec = _find_spec(target)
        if key is not None:
            if len(_VERIFIED) >= _MAX_CACHED:
                _VERIFIED.clear()
            _VERIFIED[key] = spec
    return spec


#: What a check calls when it starts: the spec, or the refusal.
verify_replayable = target_spec


def evaluate(spec: str) -> Any:
    """``MODULE:EXPR`` or ``FILE.py:EXPR`` -> the object ``ddpcheck replay`` would use."""
    module_name, expr = spec.split(":", 1)
    return evaluate_in(load(module_name), expr)


def evaluate_in(module: Any, expr: str) -> Any:
    """Evaluate ``expr`` in ``module``'s namespace; dotted names it does not define, such as
    ``parallel.sharding.greedy``, are imported on use."""
    return _evaluate(expr, vars(module))


def from_repr(text: str) -> Any:
    """Rebuild a scenario from its ``repr`` (the modules it names are imported): the other half
    of a replay line."""
    scenario = _evaluate(text, {})
    if not isinstance(scenario, Scenario):
        raise InvalidArgument(f"{text!r} does not describe a ddpcheck.Scenario")
    return scenario


def _evaluate(expr: str, namespace: dict) -> Any:
    # Submodules are not always attributes of their package until imported (ddpcheck.models).
    for dotted in set(re.findall(r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+", expr)):
        parts = dotted.split(".")
        if parts[0] in namespace and not _is_module(namespace[parts[0]]):
            continue  # an attribute of something the namespace defines, not a module path
        for i in range(1, len(parts)):
            try:
                importlib.import_module(".".join(parts[:i]))
            except ImportError:
                break
    return eval(expr, _Namespace(namespace))  # the user's code, or our replay line


class _Namespace(dict):
    """A module's namespace in which unknown names are builtins or importable top-level modules
    (the names of a dataclass field's import path)."""

    def __missing__(self, name: str) -> Any:
        if hasattr(builtins, name):
            return getattr(builtins, name)
        try:
            module = importlib.import_module(name)
        except ImportError:
            raise NameError(f"name {name!r} is not defined") from None
        self[name] = module
        return module


def _is_module(value: Any) -> bool:
    return type(value).__name__ == "module"


# ---------------------------------------------------------------------------------------------
# Finding and verifying a spec


def _find_spec(target: Any) -> str:
    cls = type(target)
    if "<locals>" in cls.__qualname__:
        raise _refusal(
            target,
            f"its class {cls.__qualname__} is defined inside a function",
            f"define {cls.__name__} at module level",
        )
    if cls.__module__ in MAIN_NAMES or _ScriptPickler.mentions_script(target):
        return _spec_in_script(target)
    module_name = cls.__module__
    module = sys.modules.get(module_name)
    if module is None:
        raise _refusal(
            target,
            f"its module {module_name!r} is not imported",
            "define the class in an importable module",
        )
    prefix = module_spec(module_name) or module_name  # a file imported by path: by its path
    for attr, value in list(vars(module).items()):
        if value is target:
            return f"{prefix}:{attr}"
    found = _attribute_elsewhere(target)  # e.g. MY_TARGET = Target.from_wrappers(...) in yours
    if found is not None:
        return found
    reasons: list[str] = []
    spec = _first_rebuilding(target, prefix, module, _candidates(target, reasons), reasons)
    if spec is not None:
        return spec
    raise _refusal(
        target,
        "; ".join(dict.fromkeys(reasons)) or "no way to rebuild it was found",
        _fix(target, prefix),
    )


def _spec_in_script(target: Any) -> str:
    """``check_my_ddp.py:EXPR`` for a target the script being run defines or refers to, verified
    in the file imported as a module -- what the replay process evaluates it in."""
    cls = type(target)
    script = main_script()
    if script is None:
        raise _refusal(
            target,
            f"its class {cls.__qualname__} (or something it holds) is defined in "
            "__main__ of a session no other process can import (an interactive interpreter, "
            "python -c, a script read from standard input)",
            "save the code in a file and run it (python check_my_ddp.py), or define it in an "
            "importable module",
        )
    try:
        module = load(script.spec)
    except Exception as exc:
        raise _refusal(
            target,
            f"importing {script.spec} as the module {script.name} failed "
            f"({type(exc).__name__}: {_one_line(exc)})",
            'make the script importable: its work under `if __name__ == "__main__":`',
        ) from None
    if cls.__module__ in MAIN_NAMES and not _defines(module, cls.__qualname__):
        raise _refusal(
            target,
            f"its class {cls.__qualname__} is defined in {script.spec} under "
            '`if __name__ == "__main__":`, so importing the script (what '
            "a replay does) does not define it",
            f"define {cls.__qualname__} at module level, above that block",
        )
    main = sys.modules["__main__"]
    names = [attr for attr, value in list(vars(main).items()) if value is target]
    reasons: list[str] = []
    class_code = cls.__qualname__ if cls.__module__ in MAIN_NAMES else import_path(cls)
    exprs = [*names, *_candidates(target, reasons, class_code)]
    spec = _first_rebuilding(target, script.spec, module, exprs, reasons)
    if spec is not None:
        return spec
    raise _refusal(
        target,
        "; ".join(dict.fromkeys(reasons)) or "no way to rebuild it was found",
        _fix(target, script.spec),
    )


def _defines(module: Any, qualname: str) -> bool:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return True


def _first_rebuilding(
    target: Any, prefix: str, module: Any, exprs: Any, reasons: list[str]
) -> str | None:
    """The first ``prefix:expr`` whose evaluation in ``module`` rebuilds ``target``; what each
    other candidate did is added to ``reasons``."""
    for expr in exprs:
        try:
            rebuilt = evaluate_in(module, expr)
        except Exception as exc:
            reasons.append(
                f"{prefix}:{expr} does not evaluate ({type(exc).__name__}: {_one_line(exc)})"
            )
            continue
        why = _differs(target, rebuilt)
        if why is None:
            return f"{prefix}:{expr}"
        reasons.append(f"{prefix}:{expr} builds a different target ({why})")
    return None


def _fix(target: Any, where: str) -> str:
    name = type(target).__qualname__
    if dataclasses.is_dataclass(target):
        return (
            "give its fields values written as code (numbers, strings, module-level "
            f"functions and classes), or assign it to a module-level name (MY_TARGET = "
            f"{name}(...)) in {where}"
        )
    return (
        f"build it with arguments written as code and do not change it afterwards, assign "
        f"it to a module-level name (MY_TARGET = {name}(...)) in {where}, or make {name} a "
        "dataclass whose fields hold its whole state"
    )


def _attribute_elsewhere(target: Any) -> str | None:
    """``MODULE:NAME`` of a module-level name bound to ``target`` in any imported module but
    ``__main__`` (a replay process cannot import it by that name), in module order."""
    for name in sorted(n for n in list(sys.modules) if n not in MAIN_NAMES):
        namespace = getattr(sys.modules.get(name), "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if value is target and not attr.startswith("_"):
                return f"{module_spec(name) or name}:{attr}"
    return None


def _candidates(target: Any, reasons: list[str], class_code: str | None = None) -> Iterator[str]:
    """Expressions (in the class's module, or wherever ``class_code`` names the class) that may
    rebuild ``target``."""
    cls = type(target)
    name = class_code or cls.__qualname__
    seen: set[str] = set()

    def once(expr: str) -> list[str]:
        if expr not in seen:
            seen.add(expr)
            return [expr]
        return []

    if dataclasses.is_dataclass(target):
        try:
            fields = [
                f"{f.name}={_code(getattr(target, f.name))}"
                for f in dataclasses.fields(target)
                if f.init and not _is_default(target, f)
            ]
            yield from once(f"{name}({', '.join(fields)})")
        except Exception as exc:  # a field that cannot be compared or written as code
            reasons.append(
                f"its fields cannot be written as code ({type(exc).__name__}: {_one_line(exc)})"
            )
        yield from once(repr(target))
    call = _recorded_call(target)
    if call is not None:
        args, kwargs = call
        try:
            text = [_code(a) for a in args] + [f"{k}={_code(v)}" for k, v in kwargs.items()]
            yield from once(f"{name}({', '.join(text)})")
        except Exception as exc:
            reasons.append(
                f"the arguments it was built with cannot be written as code "
                f"({type(exc).__name__}: {_one_line(exc)})"
            )
    elif not dataclasses.is_dataclass(target):
        yield from once(f"{name}()")


def _recorded_call(target: Any) -> tuple[tuple, dict] | None:
    try:
        call = vars(target).get(_CALL)
    except TypeError:  # no instance dict
        return None
    if isinstance(call, tuple) and len(call) == 2:
        return call
    return None


def _state(obj: Any) -> dict | None:
    try:
        return {k: v for k, v in vars(obj).items() if k != _CALL}
    except TypeError:
        return None


def _differs(target: Any, rebuilt: Any) -> str | None:
    """None when ``rebuilt`` is the same target; otherwise what differs."""
    if not _same_class(type(rebuilt), type(target)):
        return (
            f"a {type(rebuilt).__module__}.{type(rebuilt).__qualname__}, not a "
            f"{type(target).__module__}.{type(target).__qualname__}"
        )
    mine, theirs = _state(target), _state(rebuilt)
    if mine is None or theirs is None:
        return None if _same(target, rebuilt) else "their pickles differ"
    diffs = []
    for key in sorted(set(mine) | set(theirs)):
        if key not in theirs:
            diffs.append(f"{key} is set on the target but not by the constructor")
        elif key not in mine:
            diffs.append(f"{key} is set by the constructor but absent from the target")
        elif not _same(mine[key], theirs[key]):
            diffs.append(f"{key}={_brief(mine[key])} on the target, {_brief(theirs[key])} rebuilt")
    if not diffs:
        return None
    more = f" and {len(diffs) - 3} more" if len(diffs) > 3 else ""
    return ", ".join(diffs[:3]) + more


def _same_class(a: type, b: type) -> bool:
    """One class, or the script's class seen from ``__main__`` and from the imported file."""
    return a is b or (
        a.__qualname__ == b.__qualname__
        and public_module_name(a.__module__) == public_module_name(b.__module__)
        and (a.__module__ in MAIN_NAMES) != (b.__module__ in MAIN_NAMES)
    )


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        equal = a == b
        if isinstance(equal, bool) and (equal or not _ScriptPickler.mentions_script(a)):
            return equal
    except Exception:
        pass
    try:  # tensors, objects without a useful __eq__: equal pickles mean equal state
        return _ScriptPickler.dumps(a) == _ScriptPickler.dumps(b)
    except Exception:
        return False


class _ScriptPickler(pickle.Pickler):
    """Pickles the classes and functions of the script being run by the script's module name
    and qualified name, whether they come from ``__main__`` or from the script imported as a
    file: the two copies of one source compare equal. Never unpickled."""

    def __init__(self, file: Any):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        script = main_script()
        self.script_modules = {*MAIN_NAMES, *([script.name] if script is not None else [])}
        self.mentions = False

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)):
            module = getattr(obj, "__module__", None)
            if module in self.script_modules:
                self.mentions = True
                return _script_global, (public_module_name(module), obj.__qualname__)
        return NotImplemented

    @classmethod
    def dumps(cls, obj: Any) -> bytes:
        buffer = io.BytesIO()
        cls(buffer).dump(obj)
        return buffer.getvalue()

    @classmethod
    def mentions_script(cls, obj: Any) -> bool:
        """True when ``obj`` holds (or is an instance of) a class or function of ``__main__``."""
        pickler = cls(io.BytesIO())
        pickler.script_modules = set(MAIN_NAMES)
        try:
            pickler.dump(obj)
        except Exception:
            return False
        return pickler.mentions


def _script_global(module: str, qualname: str) -> Any:
    """What :class:`_ScriptPickler` writes for a script's class or function (never called)."""
    raise NotImplementedError(f"{module}.{qualname}")


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


def _refusal(target: Any, why: str, fix: str) -> InvalidArgument:
    cls = type(target)
    return InvalidArgument(
        f"target {cls.__module__}.{cls.__qualname__} cannot be replayed: {why}. A failure's "
        "replay line must rebuild exactly this target in a fresh process, and none can; to make "
        f"it replayable, {fix}"
    )
