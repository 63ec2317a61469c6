"""The worked examples of docs/your-own-ddp.md: three independent data-parallel implementations
in ``examples/``, each with a target of at most 15 lines written against ddpcheck's public API
only. Each correct ``TARGET`` passes the battery at W=2,3; each ``BUGGY`` (one seeded bug of
docs/bug-catalogue.md) is found by random examples, and its replay line fails the same way (run
by the command line's entry point in this process, on the worlds the fuzzing warmed: that the line
also runs as a process is tests/runs/test_replay.py's and the README's). The guide shows each
target exactly as written."""

from __future__ import annotations

import ast
import pathlib
import shlex

import pytest

import ddpcheck
from ddpcheck import cli, features
from ddpcheck._runs.fuzz import fuzz
from examples import explicit_finish, reset_after_step, sync_in_backward

ROOT = pathlib.Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "your-own-ddp.md"
EXAMPLES = {
    "explicit_finish": explicit_finish,
    "sync_in_backward": sync_in_backward,
    "reset_after_step": reset_after_step,
}
#: What each declines (the guide explains why), and the first divergence its seeded bug shows.
DECLINES = {
    "explicit_finish": {"unused-everywhere", "lr-schedule", "rank-orders", "checkpoint"},
    "sync_in_backward": {"unused-on-some-ranks", "unused-everywhere", "rank-orders"},
    "reset_after_step": {"rank-orders"},
}
BUG_KIND = dict.fromkeys(EXAMPLES, "reference differs (gradient)")
#: Top-level names that make up an example's target definition.
TARGET_NAMES = {"TARGET", "BUGGY", "SUPPORTS"}


def _tree(name: str) -> ast.Module:
    path = ROOT / "examples" / f"{name}.py"
    return ast.parse(path.read_text(), filename=str(path))


def _target_statements(tree: ast.Module) -> list[ast.stmt]:
    """The module-level statements that define the targets: assignments to TARGET, BUGGY or
    SUPPORTS, and classes deriving from a Target."""
    found = []
    for node in tree.body:
        assigns = isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in TARGET_NAMES for t in node.targets
        )
        derives = isinstance(node, ast.ClassDef) and any(
            ast.unparse(base).endswith("Target") for base in node.bases
        )
        if assigns or derives:
            found.append(node)
    return found


def _first_line(node: ast.stmt) -> int:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_target_takes_at_most_15_lines(name):
    statements = _target_statements(_tree(name))
    defined = {
        t.id
        for node in statements
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    assert {"TARGET", "BUGGY"} <= defined, defined
    lines = sum(node.end_lineno - _first_line(node) + 1 for node in statements)
    assert lines <= 15, f"{name}: the target definition takes {lines} lines"


@pytest.mark.parametrize("name", EXAMPLES)
def test_imports_only_ddpchecks_public_api(name):
    private = []
    for node in ast.walk(_tree(name)):
        modules, names = [], []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules, names = [node.module or ""], [alias.name for alias in node.names]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "ddpcheck"
            and node.attr.startswith("_")
        ):
            private.append(f"ddpcheck.{node.attr}")
        for module in modules:
            parts = module.split(".")
            if parts[0] == "parallel":
                private.append(module)  # independent implementations: not ours in disguise
            if parts[0] == "ddpcheck" and (
                any(p.startswith("_") for p in parts)
                or module in ("ddpcheck.models", "ddpcheck.zoo")
            ):
                private.append(module)
            if parts[0] == "ddpcheck":
                private += [f"{module}.{n}" for n in names if n.startswith("_")]
    assert not private, f"{name} imports {private}"


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_guide_shows_each_target_as_written(name):
    source = (ROOT / "examples" / f"{name}.py").read_text().splitlines()
    guide = GUIDE.read_text()
    for node in _target_statements(_tree(name)):
        block = "\n".join(source[_first_line(node) - 1 : node.end_lineno])
        assert block in guide, f"docs/your-own-ddp.md does not show {name}'s\n{block}"


@pytest.fixture(scope="module")
def fuzzed():
    """Each BUGGY target fuzzed once, for the two tests of its verdict and its replay line."""
    return {
        name: fuzz(module.BUGGY, examples=100, world_sizes=(2,))
        for name, module in EXAMPLES.items()
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_the_seeded_bug_is_found_by_random_examples(name, fuzzed):
    result = fuzzed[name]
    assert result.found, f"{name}: BUGGY passed {result.examples} random examples"
    error = result.error
    assert isinstance(error, ddpcheck.EquivalenceError)
    assert error.divergences[0].kind == BUG_KIND[name], error
    assert f" examples.{name}:BUGGY " in error.replay, error.replay


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    # make test: the first example's matrix; the others' are thorough variants of the same survey
    [pytest.param(n, marks=() if i == 0 else pytest.mark.thorough) for i, n in enumerate(EXAMPLES)],
)
def test_the_survey_matrix_of_the_correct_target(name):
    """The capability matrix the guide shows: every feature row passes at W=2, but exactly the
    declined ones, and the battery passes wherever it is not declined."""
    target = EXAMPLES[name].TARGET
    supported = target.supported_features
    declined = set() if supported is None else set(features.FEATURES) - set(supported)
    assert declined == DECLINES[name]
    declined |= set(features.FEATURES) - features.supported_by(target)  # opt-in: param-dtype
    survey = ddpcheck.survey(target, world_sizes=(2,), examples=3)
    assert survey.exit_code == 0, str(survey)
    rows = {
        cell.row: cell.status
        for cell in survey.cells
        if cell.section == "feature" and cell.world_size == 2
    }
    assert {row for row, status in rows.items() if status == "declined"} == declined, rows
    ok = {row for row, status in rows.items() if status == "ok"}
    assert ok == set(features.FEATURES) - declined
    battery = [cell for cell in survey.cells if cell.section == "battery"]
    assert all(cell.status in ("ok", "declined") for cell in battery), str(survey)
    assert sum(cell.status == "ok" for cell in battery) >= 5


@pytest.mark.slow  # (as the fixture it shares: slow and quick tests of one fixture stay together)
@pytest.mark.parametrize("name", EXAMPLES)
def test_the_replay_line_fails_the_same_way(name, fuzzed, capsys):
    result = fuzzed[name]
    assert result.error is not None, f"{name}: nothing to replay"
    argv = shlex.split(result.error.replay)
    assert argv[:3] == ["python", "-m", "ddpcheck"], result.error.replay
    capsys.readouterr()
    status = cli.main(argv[3:])
    out = capsys.readouterr().out
    assert status == 1, (status, out)
    header = out.splitlines()[0]  # "<Target> diverged at world size W: <kind>"
    assert header.rpartition(": ")[2] == result.error.divergences[0].kind == BUG_KIND[name], out
