"""Running an example that checkpoints: save in one world, resume in another (front end).

Invariant: :func:`run_in_two_worlds` runs the steps ``0..checkpoint_after`` of a scenario on
every rank of the persistent world of size W -- ending with the target's ``save_checkpoint`` --
then, in the persistent world of size ``resume_world_size`` (W again when None), a fresh run on
every rank that builds everything anew (rank seeds still differ, so the checkpoint must override
them), ``load_checkpoint``s rank 0's checkpoint and trains the remaining steps. The checkpoint
crosses to the parent as ``torch.save`` bytes on rank 0's ordinary return path, and from there to
every rank of the second world: what a file on shared storage would carry. A ``WorldFailure`` in
either part propagates, with that part's world size in its rows.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_in_two_worlds"]


def run_in_two_worlds(target: Any, scenario: Any, world_size: int, *, deadline: float,
                      what: str, device: str = "cpu", backend: str | None = None
                      ) -> tuple[tuple[list, list], tuple[list, list], list]:
    """``((records before, records after), (their collective sequences), the two worlds)``;
    both worlds compute on ``device`` over ``backend`` (``ddpcheck.api.check_example``'s)."""
    from ddpcheck._internal.devices import check_fits
    from ddpcheck._internal.options import check_fits_machine
    from ddpcheck._internal.runner import run_example_packed
    from ddpcheck._internal.transport import unpack
    from ddpcheck._internal.world import get_world


    resumed_size = scenario.resume_world_size or world_size
    check_fits_machine((resumed_size,), flag="resume_world_size")
    check_fits(device, (resumed_size,), backend)  # GPUs for the resumed world too
    world = get_world(world_size, backend=backend, device=device)
    saved = [unpack(p) for p in world.run(run_example_packed, target, scenario,
                                          "until checkpoint", None, deadline=deadline,
                                          what=f"{what} until its checkpoint")]
    sequences = world.collective_sequences()
    checkpoint = saved[0][1]
    resumed_world = get_world(resumed_size, backend=backend, device=device)
    resumed = [unpack(p) for p in resumed_world.run(run_example_packed, target, scenario,
                                                    "resumed", checkpoint, deadline=deadline,
                                                    what=f"{what} resumed from its checkpoint")]
    return (([record for record, _ in saved], resumed),
            (sequences, resumed_world.collective_sequences()), [world, resumed_world])
