"""The import graph: every arrow points one way, and the folder names tell the story.

Read from the source with ``ast`` (imports inside functions count too: a lazy import is still a
dependency), so the test needs no torch and runs in milliseconds. The layers, lowest first, are
the ones the README's layout section describes; a module may import its own layer or lower ones.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"ddpcheck": ROOT / "src" / "ddpcheck", "parallel": ROOT / "parallel"}

#: ddpcheck's layers, lowest first. A module not listed fails the test: place it on purpose.
LAYERS = [
    ("errors and options", ["ddpcheck.errors", "ddpcheck._internal.validation",
                            "ddpcheck._internal.options", "ddpcheck._internal.vocabulary"]),
    ("world", ["ddpcheck._internal.failures", "ddpcheck._internal.rank",
               "ddpcheck._internal.fitness", "ddpcheck._internal.janitor",
               "ddpcheck._internal.processes", "ddpcheck._internal.freshness",
               "ddpcheck._internal.world", "ddpcheck._internal.recorder",
               "ddpcheck._internal.sequences", "ddpcheck._internal.transport",
               "ddpcheck._internal.devices"]),
    ("scenarios and targets", ["ddpcheck.scenario", "ddpcheck.models", "ddpcheck.zoo",
                               "ddpcheck.features", "ddpcheck.batches", "ddpcheck.target_protocol",
                               "ddpcheck.targets",
                               "ddpcheck.fsdp_setup", "ddpcheck._internal.messages"]),
    ("runner", ["ddpcheck._internal.records", "ddpcheck._internal.train",
                "ddpcheck._internal.rank_orders",
                "ddpcheck._internal.runner"]),
    ("oracle", ["ddpcheck.reference", "ddpcheck.budget", "ddpcheck.sample_weights",
                "ddpcheck.shards", "ddpcheck.schedules", "ddpcheck.tolerances", "ddpcheck.oracle",
                "ddpcheck.resumed",
                "ddpcheck.validity"]),
    ("strategies", ["ddpcheck.strategies", "ddpcheck.battery", "ddpcheck.rule_params"]),
    ("front ends", ["ddpcheck", "ddpcheck.__main__", "ddpcheck.replay",
                    "ddpcheck.resuming", "ddpcheck.api", "ddpcheck.fuzz", "ddpcheck.surveys",
                    "ddpcheck.torchrun", "ddpcheck.trace", "ddpcheck.rules", "ddpcheck.cli",
                    "ddpcheck.pytest_plugin", "ddpcheck._internal", "ddpcheck._internal.rule_calls",
                    "ddpcheck._internal.cli_parser",
                    "ddpcheck.mutation",
                    "ddpcheck.mutation.*"]),
]


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, "", node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                out.append((base, alias.name, node.lineno))
    return out


def _edges() -> dict[str, set[str]]:
    """Module -> the modules of this repository it imports."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for module, imported, _ in _imports(name, path):
            target = f"{module}.{imported}" if f"{module}.{imported}" in MODULES else module
            if target in MODULES and target != name:
                graph[name].add(target)
    return graph


GRAPH = _edges()


def _layer(module: str) -> int:
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if module == member or (member.endswith(".*") and module.startswith(member[:-1])):
                return index
    raise AssertionError(f"{module} is in no layer of tests/test_architecture.py; place it")


def test_there_is_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for nxt in sorted(GRAPH[module]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_parallel_imports_nothing_from_ddpcheck():
    # parallel/ is teaching code that must be copyable out of the repository on its own.
    bad = [f"{name} imports {module or imported} (line {line})"
           for name, path in MODULES.items() if name.split(".")[0] == "parallel"
           for module, imported, line in _imports(name, path)
           if module.split(".")[0] == "ddpcheck"]
    assert not bad, bad


def test_only_the_targets_and_the_self_test_import_parallel():
    allowed = ("ddpcheck.targets", "ddpcheck.mutation")
    bad = [f"{name} imports {target}" for name, targets in GRAPH.items()
           if name.startswith("ddpcheck") and not name.startswith(allowed)
           for target in targets if target.split(".")[0] == "parallel"]
    assert not bad, bad


def test_the_core_never_imports_the_self_test():
    # Only the self-test itself and the command line (its `mutants` command) may.
    bad = [f"{name} imports {target}" for name, targets in GRAPH.items()
           if not name.startswith(("ddpcheck.mutation", "ddpcheck.cli"))
           for target in targets if target.startswith("ddpcheck.mutation")]
    assert not bad, bad


def test_no_private_name_is_imported_across_packages():
    # A package's private modules and names (a leading underscore) are its own business; torch's
    # too. Within one package, ddpcheck._internal is where ddpcheck keeps them on purpose.
    bad = []
    for name, path in MODULES.items():
        home = name.split(".")[0]
        for module, imported, line in _imports(name, path):
            top = module.split(".")[0]
            if top == home or top == "__future__":
                continue
            private = [p for p in module.split(".")[1:] + [imported]
                       if p.startswith("_") and not p.startswith("__")]
            if private:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}"
                           f"{'.' + imported if imported else ''}")
    assert not bad, bad


def test_every_import_points_down_the_layers():
    bad = [f"{name} ({LAYERS[_layer(name)][0]}) imports {target} ({LAYERS[_layer(target)][0]})"
           for name, targets in GRAPH.items() if name.startswith("ddpcheck")
           for target in targets if target.startswith("ddpcheck")
           and _layer(target) > _layer(name)]
    assert not bad, bad


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("ddpcheck")))
def test_every_module_is_placed_in_a_layer(module):
    _layer(module)


def test_no_module_is_longer_than_a_reader_can_hold():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > 420}
    assert not long, long
