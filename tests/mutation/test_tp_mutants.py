"""The tensor-parallel mutants (family K, ``ddpcheck.mutation.broken_tp``): each seeds one bug
into ``parallel_tp``; the whole catalogue's test (``test_mutants.py``) kills them with the
battery. Here: the family's shape, the one bug only the reference can see (the ranks of a
tensor-parallel group fed different samples: replicas bitwise identical, every number wrong),
and the shrinking search's counterexamples (small: <= 3 layers, <= 2 steps, W <= 4).
"""

from __future__ import annotations

import pickle
import re

import pytest

import ddpcheck
from ddpcheck.mutation import broken_tp
from ddpcheck.mutation import catalogue as mutants
from ddpcheck.targets.catalogue import PARALLEL_TP, TORCH_TP
from ddpcheck.targets.parallel_tp import ParallelTPTarget
from ddpcheck.targets.tensor_parallel import TorchTPTarget
from tests.patience import patience

FAMILY = [m for m in mutants.CATALOGUE if m.bug_class.startswith("K")]


def _scenario(global_batch):
    """A plan that shards every layer rank-specific data reaches: the input projection and the
    head column-wise (gathered); the MLP between them replicated."""
    from ddpcheck._language.sharded_models import ShardedBlock, ShardedSpec, sequence_data
    from ddpcheck._language.tensor_parallel import TensorParallel

    return ddpcheck.Scenario(
        ShardedSpec(blocks=(ShardedBlock("mlp", 2),), width=2),
        data=sequence_data,
        global_batch=global_batch,
        steps=1,
        tensor_parallel=TensorParallel(
            (("inp", "colwise-replicate"), ("head", "colwise-replicate"))
        ),
    )


def test_the_tensor_parallel_family_seeds_one_bug_each_into_parallel_tp():
    assert len(FAMILY) >= 14
    assert len({m.bug_class for m in FAMILY}) >= 12
    on_torch = {name for name, _, _ in broken_tp.TORCH_ENTRIES}
    for m in FAMILY:
        assert type(m.target).__module__ == broken_tp.__name__ and type(m.target).__doc__
        assert m.target.parallelizes
        assert pickle.loads(pickle.dumps(m.target)) == m.target
        if m.name in on_torch:  # loss_parallel(), which parallel_tp has not: torch_tp's hook
            assert m.control is TORCH_TP and type(m.target).__mro__[1] is TorchTPTarget
            assert [n for n in vars(type(m.target)) if callable(getattr(TorchTPTarget, n, None))]
            continue
        assert m.control is PARALLEL_TP
        assert isinstance(m.target, ParallelTPTarget) and type(m.target) is not ParallelTPTarget
        pieces = ("column_class", "row_class", "norm_class")
        swapped = [
            getattr(type(m.target), piece)
            for piece in pieces
            if getattr(type(m.target), piece) is not getattr(ParallelTPTarget, piece)
        ]
        own = [n for n in vars(type(m.target)) if callable(getattr(ParallelTPTarget, n, None))]
        # a layer swapped in (its class the bug), or a hook of the target overridden
        assert swapped or own, m.name
        for layer in swapped:
            assert layer.__module__ == broken_tp.__name__ and layer.__doc__


@pytest.mark.slow
def test_tp_ranks_fed_different_samples_stay_identical_but_differ_from_the_reference():
    # The data not following the mesh: W=2, tp=2, two samples, each rank of the one tp group
    # trains on its own. Every rank-specific tensor is reduced (the input projection's and the
    # head's outputs gathered, the input gradient all-reduced), so the replicas agree bitwise --
    # a digest of the parameters and gradients sees nothing -- and the one-process reference
    # shows the bug; so does each rank's loss, its own sample's: one group, two losses.
    scenario = _scenario(global_batch=2)
    ddpcheck.check_example(PARALLEL_TP, scenario, 2, deadline=patience(60))  # the control
    with pytest.raises(ddpcheck.EquivalenceError) as caught:
        ddpcheck.check_example(
            broken_tp.DataNotFollowingMeshTP(), scenario, 2, deadline=patience(60)
        )
    kinds = {d.kind for d in caught.value.divergences}
    assert "reference differs (gradient)" in kinds, kinds
    assert kinds <= {
        "reference differs (gradient)",
        "reference differs (parameter)",
        "loss differs",
        "replicas differ along tp (loss)",
    }, kinds


@pytest.mark.slow
def test_the_shrinking_search_kills_tp_mutants_with_small_counterexamples():
    from ddpcheck.mutation.score import score, table_lines

    chosen = [mutants.by_name(n) for n in ("RowBiasOnEveryRankTP", "ReplicatedNotBroadcastTP")]
    rows = score(chosen, patience(60), world_sizes=(1, 2))
    out = "\n".join(table_lines([r.row() for r in rows]))
    assert all(r.killed for r in rows), out
    for r in rows:
        found = r.outcome.counterexample
        scenario = found.scenario
        assert len(scenario.model.blocks) <= 2, out  # shrunk: inp, a block or two, head
        assert scenario.steps <= 2 and found.world_size <= 4, out
        assert re.search(r"random\[inp\+.*\+head .* tp=", found.one_line()), out
    assert (
        "replicas differ along tp (initial state)" in rows[1].outcome.counterexample.one_line()
    ), out


@pytest.mark.slow
def test_a_norm_over_dtensors_counting_replicas_is_killed_by_the_norm_alone():
    # K9 over torch's DTensors (LocalNormsSummedTP): the local tensors' norms summed over tp,
    # the LayerNorm's Replicate gradients counted twice. At max_grad_norm=100 nothing is clipped,
    # every gradient and parameter is right; the norm the clipping returned is not (1.408x), and
    # the report shows the step's DTensor collectives by mesh axis.
    from ddpcheck._language.sharded_models import ShardedBlock, ShardedSpec, sequence_data
    from ddpcheck._language.tensor_parallel import TensorParallel

    scenario = ddpcheck.Scenario(
        ShardedSpec(blocks=(ShardedBlock("mlp", 4), ShardedBlock("norm", 4)), width=4),
        data=sequence_data,
        global_batch=4,
        steps=1,
        rank_seeds=False,
        max_grad_norm=100.0,
        tensor_parallel=TensorParallel((("blocks.0.up", "colwise"), ("blocks.0.down", "rowwise"))),
    )
    with pytest.raises(ddpcheck.EquivalenceError) as caught:
        ddpcheck.check_example(broken_tp.LocalNormsSummedTP(), scenario, 2, deadline=patience(60))
    assert caught.value.kinds == ["gradient norm differs"], caught.value
    report = str(caught.value)
    assert "the reference's 17.5717768 (1.408x)" in report, report
    # the row-wise output's all-reduce, the column-wise input gradient's, the mutant's norm
    assert "communication at step 0" in report and "ranks 0, 1: tp all_reduce x3" in report, report
