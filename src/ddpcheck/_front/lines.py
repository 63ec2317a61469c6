"""What the commands' report lines say of where a run's examples ran and what a verdict points
to: the world sizes or the mesh shapes asked for (``--mesh``), the ``ddpcheck survey`` command a
verdict ends with, the drawn examples the target declined, the meshes it runs nothing on, and
which losses were checked.
Imports no torch (the target's module has loaded it by the time a note is written)."""

from __future__ import annotations

import argparse
import shlex

from ddpcheck._base.options import mesh_text
from ddpcheck._runs.admission import Request

__all__ = ["declined", "losses", "mesh_notes", "sizes_flag", "survey_command", "where"]


def where(request: Request) -> str:
    """Where the examples run: ``world sizes 1,2,3,4``, or the mesh shapes asked for
    (``--mesh``), which fix them."""
    if request.meshes is not None:
        return "meshes " + ",".join(map(mesh_text, request.meshes))
    return "world sizes " + ",".join(map(str, request.world_sizes))


def sizes_flag(request: Request) -> list[str]:
    """``--world-sizes W,...`` or ``--mesh SHAPE,...``: the same examples' places, as asked."""
    if request.meshes is not None:
        return ["--mesh", ",".join(map(mesh_text, request.meshes))]
    return ["--world-sizes", ",".join(map(str, request.world_sizes))]


def survey_command(target_word: str, request: Request, args: argparse.Namespace) -> str:
    """The ``ddpcheck survey`` that maps which features fail at which of the world sizes (or
    meshes) this check ran (a verdict ends with it: ``_runs.smaller.with_features``)."""
    survey = ["ddpcheck", "survey", target_word, *sizes_flag(request)]
    for flag, value in (
        ("--config", args.config),
        ("--without", args.without),
        ("--device", None if args.device == "cpu" else args.device),
        ("--backend", args.backend),
    ):
        survey += [flag, value] if value else []
    return shlex.join(survey + (["--fuzz-config"] if getattr(args, "fuzz_config", False) else []))


def declined(counts: dict[str, int]) -> str:
    """The drawn random examples not run, as the closing line counts them: those the target
    declined (``supports``, a hook that cannot serve them), then those the oracle could not
    judge (``fuzz`` keys them ``unjudgeable: ...``)."""
    judged = {why: n for why, n in counts.items() if not why.startswith("unjudgeable: ")}
    unjudgeable = sum(counts.values()) - sum(judged.values())
    text = f"{sum(judged.values())} more drawn and declined by the target"
    if judged:
        text += f", most often: {max(judged, key=lambda why: judged[why])}"
    return text + (f"; {unjudgeable} the oracle could not judge" if unjudgeable else "")


def mesh_notes(request: Request, target_spec: str) -> list[str]:
    """Each mesh asked for (``--mesh``) that the target runs nothing on, and why
    (``targets.support.declined_mesh``): said before the run, since every example drawn on it is
    declined at no cost to the budget and would otherwise go unsaid."""
    from ddpcheck.targets.support import declined_mesh

    notes = []
    for shape in request.meshes or ():
        why = declined_mesh(request.target, shape)
        if why is not None:
            shown = mesh_text(shape)
            notes.append(f"{target_spec} runs nothing on the mesh {shown} (--mesh): {why}")
    return notes


def losses(target: object) -> str:
    """Which losses were checked: every step's where the harness sees it computed, and the one
    the target reports if it reports one; and, for a target with its own data path over epochs,
    whether the evaluation metric it reports after every epoch was; never more than was."""
    seen = getattr(target, "step_losses_seen", True)
    reports = getattr(target, "reports_loss", False)
    text = {
        (True, True): "every step's loss checked, and the loss it reports",
        (True, False): "every step's loss checked; it reports none to check "
        "(Target.reported_loss: docs/targets.md)",
        (False, True): "the loss it reports checked every step",
        (False, False): "no loss checked: its framework computes them out of sight and it "
        "reports none (Target.reported_loss: docs/targets.md)",
    }[seen, reports]
    if seen and callable(getattr(target, "fit_epochs", None)):  # what the harness sees
        text += " (not over epochs, where its framework's data path computes them)"
        text += (
            "; over epochs, the evaluation metric it reports checked after every epoch"
            if getattr(target, "reports_metric", False)
            else "; over epochs it reports no evaluation metric (EpochRun.evaluated: "
            "docs/targets.md)"
        )
    return text
