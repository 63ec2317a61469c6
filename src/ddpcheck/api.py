"""The Python door: ``assert_equivalent`` and ``check_example`` admit what they are given
(``_runs.admission``: the same rules, defaults and messages as the command line's) and hand the
request to the run below (``_runs.equivalence``, ``_runs.example``). Door functions only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ddpcheck._base.options import DEFAULT_DEADLINE, DEFAULT_WORLD_SIZES, check_world_size
from ddpcheck._language.scenario import Scenario
from ddpcheck._oracle.reference import Reference
from ddpcheck._runs import example
from ddpcheck._runs.admission import admit
from ddpcheck._runs.equivalence import Report, assert_admitted
from ddpcheck._world.interrupts import interruptible
from ddpcheck.targets import Target

__all__ = ["Report", "assert_equivalent", "check_example"]


@interruptible
def check_example(
    target: Target,
    scenario: Scenario,
    world_size: int,
    *,
    deadline: float = DEFAULT_DEADLINE,
    reference: Reference | None = None,
    name: str | None = None,
    checks: Iterable[str] | None = None,
    device: str = "cpu",
    backend: str | None = None,
) -> tuple[str, ...]:
    """One example (``_runs.example.check_example``), admitted first (``_runs.admission``);
    returns what it left in the rank processes and ddpcheck put right: never a verdict."""
    check_world_size("world_size", world_size)
    request = admit(
        target,
        scenario=scenario,
        world_sizes=(world_size,),
        deadline=deadline,
        device=device,
        backend=backend,
    )
    return example.check_example(
        request.target,
        scenario,
        world_size,
        request.run,
        reference=reference,
        name=name,
        checks=checks,
    )


@interruptible
def assert_equivalent(
    target: Target,
    scenario: Scenario | None = None,
    *,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    deadline: float = DEFAULT_DEADLINE,
    without: Iterable[str] = (),
    dtypes: Iterable[str] | None = None,
    only: Iterable[str] = (),
    device: str = "cpu",
    backend: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    fuzz_config: bool = False,
    meshes: Iterable[object] | None = None,
) -> Report:
    """Check ``target`` against the oracle on ``scenario`` (default: the built-in battery).

    ``device="cuda"`` runs every rank on its GPU (rank r on cuda:r, NCCL; ``backend="gloo"``
    lets ranks share GPUs); the reference stays the CPU run. Refused before any world starts
    when the machine cannot run it (``ddpcheck._base.devices.check_fits``).

    A scenario that needs a feature the target does not support (``Target.supported_features``)
    or that ``without`` excludes (names from ``ddpcheck.features.FEATURES``) is skipped at that
    world size, naming the feature; ``dtypes`` (``"float64"``, ``"float32"``; default: both)
    keeps only the scenarios in those dtypes, ``only`` (feature names) those that exercise one
    of them. The arguments are admitted as at every door
    (``ddpcheck._runs.admission``: the same rules, defaults and messages as the command
    line's).

    Raises :class:`ddpcheck.EquivalenceError` on the first divergence, with a table and a replay
    command; returns a :class:`Report` when every example holds. Not the target's fault, so never
    an EquivalenceError: :class:`ddpcheck.ScenarioError` (a scenario the oracle cannot judge),
    :class:`ddpcheck.WorldStartError`, :class:`ddpcheck.NothingChecked` (every example skipped or
    declined: passing would be a silent no-op), :class:`ddpcheck.InvalidArgument`.

    ``progress(done, total)`` is called before the first example (``done`` 0) and after each
    (scenario, world size), run or skipped: how ``ddpcheck check`` keeps its live line moving.

    ``fuzz_config=True``: then again under each single option the target's ``config_space()``
    draws (``ddpcheck.targets.option_space``; refused for a target with none), each verdict
    naming its option and its replay line building it (``fuzz`` draws whole configurations).

    ``meshes``: ``(dp, pp, tp)`` mesh shapes, as ``(dp, tp)`` pairs, triples or as ``--mesh``
    spells them (``"tp=2"``, ``"dp=2xtp=2"``, ``"pp=2xtp=2"``), for a target that applies
    tensor-parallel plans (``Target.parallelizes``) or runs pipelines (``Target.pipelines``):
    the world sizes are theirs (``dp * pp * tp``; ``world_sizes`` beside them is refused), and a
    scenario whose mesh at a world size is none of them is skipped there.
    """
    request = admit(
        target,
        scenario=scenario,
        world_sizes=world_sizes,
        deadline=deadline,
        without=without,
        dtypes=dtypes,
        device=device,
        backend=backend,
        only=only,
        fuzz_config=fuzz_config,
        meshes=meshes,
    )
    return assert_admitted(request, progress)
