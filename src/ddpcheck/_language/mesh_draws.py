"""The scenarios a target that runs on a mesh is drawn at each world size: a target of plans
(tensor-parallel scenarios, their ``tp`` among the degrees asked for) or a pipeline target
(pipeline scenarios, their ``(pp, tp)`` among the layouts asked for).

Apart from ``strategies.per_world_size`` so that the mesh's rules -- which shapes ``--mesh``
asked for each kind of target can take, and the world sizes none is left at -- read as one.
"""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import strategies as st

from ddpcheck._base.errors import NothingChecked
from ddpcheck._language.pipeline_draws import pipeline_scenarios
from ddpcheck._language.plans import OwnPlanModels, tensor_parallel_scenarios
from ddpcheck._language.scenario import Scenario

__all__ = ["on_meshes"]


def on_meshes(
    sizes: tuple[int, ...],
    dtypes: tuple[str, ...],
    unsupported: frozenset[str],
    opt_in: frozenset[str],
    who: str,
    degrees: Mapping[int, tuple[int, ...]] | None = None,
    layouts: Mapping[int, tuple[tuple[int, int], ...]] | None = None,
    own_models: OwnPlanModels | None = None,
) -> dict[int, st.SearchStrategy[Scenario]]:
    """``{W: the scenarios drawn at W}`` for a target that runs pipelines (``pipeline-parallel``
    in ``opt_in``: pipelines only, their stages tensor-parallel where ``tensor-parallel`` is too)
    or applies plans (meshes and plans only). ``degrees``, ``layouts``: what ``--mesh`` asked
    for (None: every divisor of W); a world size whose shapes the target's scenarios cannot take
    is left out, and ``NothingChecked`` raised when none is left. ``own_models``: a plan
    target's models with their own plan, drawn beside the drawn plans."""
    if "pipeline-parallel" in opt_in:
        nd = "tensor-parallel" in opt_in  # its stages tensor-parallel: any tp, else tp = 1
        fit = {
            w: None if layouts is None else [(p, t) for p, t in layouts.get(w, ()) if nd or t == 1]
            for w in sizes
        }
        found = {
            w: pipeline_scenarios(world_size=w, dtypes=dtypes, without=unsupported, layouts=fit[w])
            for w in sizes
            if fit[w] is None or fit[w]
        }
    else:
        found = {
            w: tensor_parallel_scenarios(
                world_size=w,
                dtypes=dtypes,
                without=unsupported,
                degrees=None if degrees is None else degrees[w],
                own_models=own_models,
            )
            for w in sizes
            if degrees is None or w in degrees
        }
    if not found:
        raise NothingChecked(
            f"no mesh asked for (--mesh) is one {who}'s scenarios are drawn on: a pipeline "
            "target's shapes name its pp (and tp where its stages take plans); a target of "
            "plans alone runs on shapes without pp"
        )
    return found
