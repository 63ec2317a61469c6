"""A default hook a user could take for their own code is named (issue 50, item 6): a target that
shards optimizer state but keeps the default ``clip_grad_norm`` is told, in one line of ``check``'s
output, that clipping is checked through torch's ``clip_grad_norm_``, not its optimizer's own."""

from __future__ import annotations

from ddpcheck import cli, features, targets
from ddpcheck.errors import ExitCode
from ddpcheck.targets.support import checked_through_defaults

NOTE = "clipping is checked through torch.nn.utils.clip_grad_norm_, not your optimizer's own"


class ShardsWithTorchsClipping(targets.ParallelTarget):
    """parallel's ShardedOptimizer, its own clipping left out: the default hook clips."""

    clip_grad_norm = targets.Target.clip_grad_norm


class ShardsWithoutClipping(ShardsWithTorchsClipping):
    supported_features = features.FEATURES.keys() - {"clipping"}


class DeclinesEveryScenario(ShardsWithTorchsClipping):
    def supports(self, scenario):
        return "declines every scenario: only its note is under test"


def test_the_note_names_a_sharding_target_that_keeps_the_default_clipping():
    assert checked_through_defaults(targets.PARALLEL) == []  # clips through its optimizer
    assert checked_through_defaults(targets.PARALLEL_DDP) == []  # shards nothing
    (note,) = checked_through_defaults(ShardsWithTorchsClipping())
    assert note.startswith("ShardsWithTorchsClipping shards optimizer state") and NOTE in note
    assert checked_through_defaults(ShardsWithoutClipping()) == []  # never clips
    assert checked_through_defaults(ShardsWithTorchsClipping(), frozenset({"clipping"})) == []


def test_check_prints_the_note_once(capsys):
    spec = "tests.targets.test_default_hooks:DeclinesEveryScenario()"
    status = cli.main(["check", spec, "--world-sizes", "1", "--examples", "1"])
    out = capsys.readouterr().out
    assert status == ExitCode.NOTHING_CHECKED, out
    assert out.count(NOTE) == 1 and "note: DeclinesEveryScenario shards" in out, out
