"""The mutant catalogue: every seeded bug is caught, and the unmutated target is not.

One test runs the whole catalogue through ``ddpcheck mutants`` in one process, so the persistent
worlds are spawned once for all mutants.
"""

from __future__ import annotations

import pickle
import re
import shlex

import pytest

from ddpcheck.cli import main
from ddpcheck.mutation import catalogue as mutants
from ddpcheck.targets import ParallelDDPTarget, TorchFSDPTarget

#: Seconds per mutant in CI: a ceiling, not the expected cost -- every kill takes at most 8
#: examples, under a second in warm worlds on an idle machine, but a 2-core machine shared with
#: other test runs slows examples down by 10-50x, and a mutant out of budget counts as surviving.
CI_BUDGET = 30.0
_CATALOGUE_CLASSES = re.compile(r"^[A-M][0-9]{1,2}$")


def test_the_catalogue_has_one_seeded_bug_per_class_it_covers():
    assert len(mutants.CATALOGUE) >= 25
    names = [m.name for m in mutants.CATALOGUE]
    assert len(set(names)) == len(names)
    for m in mutants.CATALOGUE:
        assert _CATALOGUE_CLASSES.match(m.bug_class), m
        assert m.description and "\n" not in m.description
        assert pickle.loads(pickle.dumps(m.target)) == m.target
        if isinstance(m.target, TorchFSDPTarget):  # family I (and J3): the class is the bug
            assert m.bug_class.startswith("I") or m.bug_class == "J3", m
            assert type(m.target).__module__ == "ddpcheck.mutation.broken_fsdp"
            assert type(m.target).__doc__ and type(m.target) is not TorchFSDPTarget
            continue
        if m.control is not None:  # the loop hooks', the data path's and tensor parallelism's
            assert isinstance(m.target, type(m.control)) and type(m.target) is not type(m.control)
            module = type(m.target).__module__
            assert module in (
                "ddpcheck.mutation.broken_loop",
                "ddpcheck.mutation.broken_data",
                "ddpcheck.mutation.broken_metrics",
                "ddpcheck.mutation.broken_tp",
                "ddpcheck.mutation.broken_pp",
            )
            broken = [
                type(m.target),
                getattr(type(m.target), "optimizer_class", None),
                getattr(type(m.target), "scheduler_class", None),
            ]
            assert any(
                cls is not None
                and cls.__doc__
                and cls.__module__ == module
                and cls
                not in (
                    type(m.control),
                    getattr(type(m.control), "optimizer_class", None),
                    getattr(type(m.control), "scheduler_class", None),
                )
                for cls in broken
            ), f"{m.name} seeds no bug"
            continue
        assert isinstance(m.target, ParallelDDPTarget)
        assert type(m.target).__module__ == "ddpcheck.mutation.catalogue"
        broken = [
            type(m.target).ddp_class,
            getattr(type(m.target), "optimizer_class", None),
            getattr(type(m.target), "batches_class", None),
            *type(m.target).__mro__,
        ]  # checkpoint bugs: a broken_checkpoint hooks mixin
        assert any(
            cls is not None
            and cls.__module__.startswith("ddpcheck.mutation.broken_")
            and cls.__doc__
            for cls in broken
        ), f"{m.name} seeds no bug"
    assert len({m.bug_class for m in mutants.CATALOGUE}) >= 20


def test_every_override_of_a_mutant_still_overrides_something_in_parallel():
    # parallel renamed a seam -> the mutant would silently stop being one and "survive"
    assert mutants.stale_overrides() == []


def test_by_name_rejects_unknown_mutants():
    assert mutants.by_name("nodivide").name == "NoDivide"
    with pytest.raises(ValueError, match="mutant 'Nope' is not in the catalogue; known: NoDivide"):
        mutants.by_name("Nope")


@pytest.mark.slow
def test_every_mutant_is_killed_and_the_unmutated_target_passes(capsys):
    # The battery search: every class in seconds. The shrinking search is tested below. At
    # W=2 and 3, where every mutant is killed (`ddpcheck mutants` at 1-4: docs/mutants.md): W=4
    # and W=1 cost the five controls' batteries half of this test's time, and the controls pass
    # at every W in tests/world/test_harness.py and properties/.
    status = main(
        [
            "mutants",
            "--budget-seconds",
            str(CI_BUDGET),
            "--search",
            "battery",
            "--world-sizes",
            "2,3",
        ]
    )
    out = capsys.readouterr().out
    n = len(mutants.CATALOGUE)
    assert f"killed {n}/{n} (100 %)" in out, out
    assert "unmutated target passes" in out, out
    assert status == 0, out
    rows = [line for line in out.splitlines() if line.startswith("| ")][1:]
    # a control per family: parallel's, FSDP2's for families I and J3, the loop hooks' two,
    # torch DDP's for the data path, parallel_tp's and torch_tp's for tensor parallelism
    # (family K; torch_tp's for loss_parallel) and torch_pp's for pipelines (family M)
    controls = (
        "TorchFSDPTarget",
        "EngineTarget",
        "Zero2Target",
        "TorchDDPTarget",
        "ParallelTPTarget",
        "TorchTPTarget",
        "TorchPPTarget",
    )
    assert len(rows) == n + 1 + len(controls)
    assert "| (unmutated)" in rows[0] and "| passes " in rows[0]
    for row, name in zip(rows[1:], controls):
        assert f"| (unmutated {name})" in row and "| passes " in row, out
    assert all("| killed " in row for row in rows[1 + len(controls) :]), out
    # the data path's mutants, named by what their steps consumed where that is the bug
    for name in ("IgnoresSplit", "DividesBatchTwice", "PadsCounted"):
        row = next(r for r in rows if r.startswith(f"| {name} "))
        assert re.search(r": sample (of another step|dropped|duplicated) sample \d+", row), row
    # the loop hooks' mutants, each named by what only it breaks; the metrics', by the metric
    for name, kind in (
        ("StepsInsideWindow", "stepped inside accumulation window"),
        ("ReducesTwiceZero2", "communication over budget"),
        ("SkipsFirstReduce", "replicas differ"),
        ("PaddingCountedMetric", "metric differs"),
        ("DropsUnevenLastBatch", "metric differs"),
    ):
        row = next(r for r in rows if r.startswith(f"| {name} "))
        assert kind in row, row
    # the batch-plan mutants are named by their cause, before any number differs
    for name in ("MeanOfRankMeans", "SamplerSeededPerRank", "FlooredShards", "PaddingSampler"):
        # (SkipsEmptyShard is a rank failure: the other ranks synchronise without it)
        row = next(r for r in rows if r.startswith(f"| {name} "))
        assert re.search(r": sample (dropped|duplicated|misweighted) sample \d+", row), row
    # the token means: the battery's language model names the tokens, before any number
    for name in ("MicroBatchTokenMean", "RankTokenMean"):
        row = next(r for r in rows if r.startswith(f"| {name} "))
        assert re.search(r": (sample|token) misweighted sample \d+", row), row
    # a reduction in bfloat16 where float32 was promised: its dtype, not its rounding
    row = next(r for r in rows if r.startswith("| ReducesInParamDtypeFSDP "))
    assert "communication in a narrower dtype" in row, row


def test_a_surviving_mutant_fails_the_command(capsys, monkeypatch):
    # The unmutated target stands in for a mutant the harness cannot kill.
    from ddpcheck.targets import PARALLEL

    monkeypatch.setattr(
        mutants, "CATALOGUE", [mutants.Mutant("Unbroken", "A1", "no bug at all", PARALLEL)]
    )
    status = main(
        ["mutants", "--budget-seconds", "60", "--world-sizes", "2", "--search", "battery"]
    )
    out = capsys.readouterr().out
    assert status == 1
    from ddpcheck.battery import BATTERY
    from ddpcheck.features import declines

    # it ran the whole battery at W=2 (what parallel supports of it) and survived
    ran = sum(declines(PARALLEL, scenario, 2) is None for _, scenario in BATTERY)
    assert re.search(rf"\| Unbroken +\| A1 +\| SURVIVED +\| {ran} ", out), out
    assert "killed 0/1 (0 %)" in out


def test_mutants_only_rejects_unknown_names(capsys):
    assert main(["mutants", "--only", "NoSuchBug"]) == 2
    assert "mutant 'NoSuchBug' is not in the catalogue" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.thorough  # `make test` runs the same search on the TP and option mutants
def test_the_shrinking_search_reports_minimal_random_counterexamples():
    # The search `ddpcheck mutants` runs, without its control's pass: the unmutated target
    # passing the same search is the whole catalogue's test above and the properties' claim, and
    # its 200 random examples were half of this test's time.
    from ddpcheck.mutation.score import score, table_lines

    chosen = [
        mutants.by_name(n) for n in ("NoDivide", "EveryRankStepsEverything", "ZeroFillsUnused")
    ]
    rows = score(chosen, CI_BUDGET, world_sizes=(1, 2))
    out = "\n".join(table_lines([r.row() for r in rows]))
    assert all(r.killed for r in rows), out
    # Shrunk: the smallest model (the head alone, or one unused layer), one sample, one step.
    # (Hypothesis shrinks well, not canonically: a leftover flag such as f32 may remain.)
    assert re.search(
        r"\| NoDivide +\| A1 +\| killed .*random\[head \w+ B=1 steps=1\] W=2 "
        r"step 0: reference differs \(gradient\) head.weight",
        out,
    ), out
    # (or, found first at W=1, the smallest run that leaves W=1: one step, a checkpoint after it
    # resumed at W=2 -- which of the two the search meets first moves with the strategies' draws)
    assert re.search(
        r"\| EveryRankStepsEverything .*random\[.* B=1 steps=1\] W=2 "
        r"step 0: optimizer state misplaced",
        out,
    ) or re.search(
        r"\| EveryRankStepsEverything .*random\[head \w+ B=1 steps=2 ckpt@0->W=2\] W=1 "
        r"step 1: optimizer state misplaced",
        out,
    ), out
    # (a layer used "by some samples" that the one sample skips is unused everywhere: no gradient;
    # plain linear layers before it may be left -- the shrinker deletes the list's prefix only
    # when its trials reach that far, which a change of the strategies' draws can move)
    assert re.search(
        r"\| ZeroFillsUnused .*random\[(linear\+){0,2}linear\((unused|sample)[^)]*\) "
        r"SGD B=1 steps=1\] W=1 "
        r"step 0: reference differs \(gradient\) l[0-2].fc.weight",
        out,
    ), out


class _Scheduler:
    def step(self):
        pass


class _NoScheduler(ParallelDDPTarget):
    pass


class _GainsScheduler(_NoScheduler):
    scheduler_class = _Scheduler


def test_a_piece_the_control_lacks_is_reported_not_a_crash(monkeypatch):
    """A mutant whose class adds ``scheduler_class`` to a control without one: the addition is
    the stale override (it mutates nothing). stale_overrides once compared the piece with the
    control's missing one (None) and raised AttributeError on ``None.__module__``."""
    mutant = mutants.Mutant(
        "GainsScheduler",
        "Z1",
        "a piece the control lacks",
        _GainsScheduler(),
        control=_NoScheduler(),
    )
    monkeypatch.setattr(mutants, "CATALOGUE", [mutant])
    assert mutants.stale_overrides() == [
        "mutant GainsScheduler: _GainsScheduler.scheduler_class overrides nothing in "
        f"{__name__}._NoScheduler"
    ]


@pytest.mark.slow
def test_a_logged_loss_with_the_wrong_weights_exits_1_and_its_replay_line_reproduces_it(capsys):
    # issue 54: every gradient right, the step's reported loss the mean of micro-batch means
    status = main(
        [
            "check",
            "ddpcheck.mutation.catalogue:MicroBatchMeanLoss()",
            "--examples",
            "20",
            "--world-sizes",
            "2",
            "--seed",
            "3",
        ]
    )
    out = capsys.readouterr().out
    assert status == 1, out
    assert "diverged at world size 2: loss differs" in out, out
    assert "step   reference   target" in out, out
    replay = next(line for line in out.splitlines() if line.startswith("replay: "))
    argv = shlex.split(replay.removeprefix("replay: "))
    assert argv[:3] == ["python", "-m", "ddpcheck"], replay
    assert main(argv[3:]) == 1
    assert "loss differs" in capsys.readouterr().out.splitlines()[0]
