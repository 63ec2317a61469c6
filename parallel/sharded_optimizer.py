"""ZeRO-1: parameters and gradients replicated, optimizer state sharded by a pluggable rule.

Invariant: after ``step()`` returns on every rank of the group, every parameter holds, bitwise on
every rank, the value the plain ``optimizer_cls`` would give it when stepped on the world-mean
gradient; the optimizer state of each parameter lives only on its owner
(``owner_of(param)``, a rank of the group, chosen per param group by the sharding rule).

One step moves, in this order:

1. gradients not already averaged by ``parallel.DDP`` in this step: one int32 all-reduce counting
   which ranks hold a gradient for each, then one flattened all-reduce per dtype. A parameter no
   rank used keeps ``grad=None``; one used by some ranks is averaged with zeros for the others.
   DDP marks each gradient it averaged (``param.ddp_averaged_grad``); averaging it again would
   give the same numbers but send every gradient byte a second time, so with DDP nothing is
   all-reduced here and gradient bytes cross the wire once per step;
2. nothing: each rank steps its inner optimizer on the parameters it owns;
3. updated parameters: one flattened broadcast per (owner rank, dtype) from the owner's *global*
   rank, covering the parameters that have a gradient (the others were not updated anywhere),
   owner after owner through one reusable buffer per dtype.

``clip_grad_norm_`` (``parallel.clipping``), called before ``step()``, does step 1 early and adds
one all-reduce of one scalar per rank: each rank's share of the global gradient norm.

Checkpoints use the plain optimizer's layout (indices over all param groups), so they load at any
world size, with any rule, and into (or from) a plain ``optimizer_cls``.
"""

from __future__ import annotations

import ctypes
import io
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from parallel import _checks, handover, sharding
from parallel._checks import InvalidArgument, describe
from parallel.clipping import GlobalNormClipping

__all__ = ["ShardedOptimizer", "hyperparameters"]

# Keys of a param group that are not hyperparameters: they describe membership, which differs
# between the full (outer) group and its owned subset in the inner optimizer.
_MEMBERSHIP_KEYS = ("params", "param_names")


class ShardedOptimizer(GlobalNormClipping, torch.optim.Optimizer):
    """Wraps ``optimizer_cls`` so each rank keeps state for, and updates, only the params it owns.

    ``param_groups`` is the full view (every parameter, every hyperparameter); edits to it -- an
    LR scheduler, a user changing ``lr`` -- reach the inner optimizer at the next ``step()``.
    ``state`` is this rank's shard (``optimizer.state[p]`` for owned ``p``).
    ``zero_grad(set_to_none=True)`` (inherited) clears the gradient of every parameter, owned or
    not.

    With ``parallel.DDP``: ``step()`` does not all-reduce a gradient DDP already averaged --
    averaging W equal gradients again gives the same numbers but sends every gradient byte a
    second time. DDP's ``finish_gradient_sync()`` leaves ``param.ddp_averaged_grad`` on each
    parameter it averaged; ``step()`` consumes that mark (``_take_ddp_mark``) and averages only
    the others.

    Seams: each step is one method a subclass may override to change exactly that step --
    ``_record_owners`` (who owns what), ``_owned_group`` (what the inner optimizer holds),
    ``_average_gradients`` and ``_take_ddp_mark`` (which gradients are averaged here),
    ``_sync_hyperparameters`` (``param_groups`` edits into the inner optimizer),
    ``_broadcast_parameters``, ``_broadcasting_owners`` and ``_source_of`` (who sends updated
    parameters, from which global rank); ``_norm_shares`` and ``_global_norm`` for
    ``clip_grad_norm_``. :func:`hyperparameters` is the group filter they share.

    Collective: constructing it is a collective over ``process_group`` (default: the world): call
    it on all ranks of the group, with the same parameters in the same order (or, behind
    ``parallel.DDP``, in any: rank 0's wins, ``parallel.handover``), or the world hangs.

    Raises:
        InvalidArgument: ``params`` empty or not tensors/param-group dicts, a parameter repeated,
            ``optimizer_cls`` not a ``torch.optim.Optimizer`` subclass or rejecting
            ``optimizer_kwargs``, ``sharding_rule`` not callable or answering badly, this rank not
            in ``process_group``, ``torch.distributed`` not initialised, or the ranks passing
            different parameters. All but the last are raised before any collective.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_cls: type,
        sharding_rule: Callable[..., Any] = sharding.modulo,
        process_group: Any = None,
        **optimizer_kwargs: Any,
    ):
        # validated before any collective, so a mistake fails the same way on every rank
        _checks.check_optimizer_cls(optimizer_cls, sharded_cls=ShardedOptimizer)
        _checks.check_sharding_rule(sharding_rule)
        rank, world_size, global_ranks = _checks.check_optimizer_process_group(process_group)
        groups = _checks.check_params(params)
        first = _checks.check_has_a_param(groups)
        defaults = _checks.probe_defaults(optimizer_cls, optimizer_kwargs, first)

        # fixed at construction
        self._rule = sharding_rule
        self._group = process_group  # None: the default group
        self._rank = rank  # this rank, in the group
        self._world_size = world_size
        self._global_ranks = global_ranks  # group rank -> global rank, for src=/dst=
        # extended by add_param_group
        self._owners: dict[int, int] = {}  # id(param) -> group rank of its owner
        self._inner: torch.optim.Optimizer  # built after the first groups are known (below)
        # the owned subsets until the inner optimizer is built; None after
        self._pending_inner_groups: list[dict[str, Any]] | None = []
        self._scratch: dict[torch.dtype, torch.Tensor] = {}  # broadcast buffers (_scratch_for)
        # per consolidation: the full state gathered on this rank, dropped by anything that
        # changes the state (step, load_state_dict, add_param_group)
        self._consolidated: dict[str, Any] | None = None
        self._consolidated_on: int | None = None  # group rank holding it (known on every rank)

        super().__init__(groups, defaults)  # calls self.add_param_group once per group
        self._inner = optimizer_cls(self._pending_inner_groups, **optimizer_kwargs)
        self._pending_inner_groups = None
        self.state = self._inner.state  # this rank's shard

    # ------------------------------------------------------------------ membership and ownership

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its parameters get owners from the sharding rule, earlier ones keep theirs.

        Collective: call on all ranks of the group with the same group, or the world hangs. It
        exchanges a small fingerprint (count, shapes, dtypes, owners) to catch ranks that disagree.
        """
        index = len(self.param_groups)
        param_group = _checks.check_param_group(param_group, index)
        super().add_param_group(param_group)  # fills defaults, rejects params already in a group
        group = self.param_groups[-1]
        # behind parallel.DDP ranks may list parameters in their own orders: rank 0's wins
        # (broadcast)
        handover.put_in_rank0_order(group, self._group, self._global_ranks[0])
        try:
            try:
                answer = self._rule(list(group["params"]), self._world_size)
            except TypeError as e:  # most often the wrong signature; the message says which
                raise InvalidArgument(
                    f"sharding_rule={sharding.rule_name(self._rule)} failed for param group "
                    f"{index} with TypeError: {e}; a sharding rule is called as "
                    "rule(params, world_size) and returns one owner rank per parameter"
                ) from e
            owners = sharding.check_owners(
                answer, group["params"], self._world_size, rule=self._rule, group_index=index
            )
            self._check_same_on_all_ranks(index, group["params"], owners)
        except BaseException:
            self.param_groups.pop()
            raise
        self._record_owners(group["params"], owners)
        owned = self._owned_group(group, owners)
        if self._pending_inner_groups is not None:  # still in __init__
            self._pending_inner_groups.append(owned)
        else:
            self._inner.add_param_group(owned)
        self._consolidated, self._consolidated_on = None, None

    def _record_owners(self, params: list[torch.Tensor], owners: list[int]) -> None:
        """Remember each parameter's owner: ``owner_of`` and the broadcasts read it."""
        for p, owner in zip(params, owners):
            self._owners[id(p)] = owner

    def _owned_group(self, group: dict[str, Any], owners: list[int]) -> dict[str, Any]:
        """The inner optimizer's copy of ``group``: its hyperparameters, this rank's params only."""
        return {
            **hyperparameters(group),
            "params": [p for p, o in zip(group["params"], owners) if o == self._rank],
        }

    def owner_of(self, param: torch.Tensor) -> int:
        """The rank, within the optimizer's process group, that holds ``param``'s state."""
        try:
            return self._owners[id(param)]
        except (KeyError, TypeError):
            raise InvalidArgument(
                f"param={describe(param)} is not managed by this ShardedOptimizer; pass one of "
                "the tensors in optimizer.param_groups[i]['params']"
            ) from None

    def _check_same_on_all_ranks(
        self, index: int, params: list[torch.Tensor], owners: list[int]
    ) -> None:
        layout = repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode()
        mine = torch.tensor(
            [len(params), zlib.crc32(layout), zlib.crc32(repr(owners).encode())],
            dtype=torch.int64,
            device=params[0].device if params else None,
        )
        everyone = [torch.empty_like(mine) for _ in range(self._world_size)]
        # all-gather 3 int64 per rank (param count, layout hash, owners hash) once per new param
        # group, so a rank passing other params or getting other owners fails here, not mis-paired
        dist.all_gather(everyone, mine, group=self._group)
        for what, column in (
            ("parameter counts", 0),
            ("parameter shapes/dtypes", 1),
            ("owners from the sharding rule", 2),
        ):
            values = [int(t[column]) for t in everyone]
            if len(set(values)) > 1:
                raise InvalidArgument(
                    f"param group {index} differs across ranks in its {what} (per rank: "
                    f"{values if column == 0 else [hex(v) for v in values]}); every rank must "
                    "pass the same parameters in the same order, and sharding_rule="
                    f"{sharding.rule_name(self._rule)} must be deterministic"
                )

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    # ------------------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Average gradients (unless DDP did), step the owned params, broadcast them from owners.

        Collective: call on all ranks of the group, every step, or the world hangs.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._consolidated, self._consolidated_on = None, None
        params = self._params()
        self._average_gradients(params)
        self._sync_hyperparameters()
        self._inner.step()
        self._broadcast_parameters(params)
        return loss

    def _sync_hyperparameters(self) -> None:
        """Copy each full group's hyperparameters into its inner group: schedulers and users
        edit ``param_groups``, the inner optimizer steps."""
        for group, inner_group in zip(self.param_groups, self._inner.param_groups):
            inner_group.update(hyperparameters(group))

    def _average_gradients(self, params: list[torch.Tensor]) -> None:
        """Average the gradients DDP did not (all of them without DDP, none after its sync)."""
        # every param's DDP mark is consumed every step, so a later step that skipped DDP's sync
        # finds none and is averaged here again
        pending = [p for p in params if not self._take_ddp_mark(p)]
        if not pending:
            return
        present = torch.tensor(
            [p.grad is not None for p in pending], dtype=torch.int32, device=pending[0].device
        )
        # all-reduce (sum) one int32 per not-yet-averaged param among all ranks, so every rank
        # builds the same gradient buffers even where only some ranks produced a gradient
        dist.all_reduce(present, group=self._group)
        # .tolist(): sync point, the counts decide the layout of the gradient buffers below
        used = [p for p, n in zip(pending, present.tolist()) if n > 0]
        average = dist.get_backend(self._group) == "nccl"  # gloo: SUM, then divide
        for dtype_params in _by_dtype(used).values():
            flat = torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                    for p in dtype_params
                ]
            )  # (sum of numels,)
            # all-reduce one flat buffer per dtype of gradients among all ranks, before the
            # inner step reads them; gloo has AVG too, but SUM-then-divide works on every build
            dist.all_reduce(
                flat, op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM, group=self._group
            )
            if not average:
                flat.div_(self._world_size)
            for p, view in zip(dtype_params, flat.split([p.numel() for p in dtype_params])):
                if p.grad is None:
                    p.grad = view.view_as(p).clone()
                else:
                    p.grad.copy_(view.view_as(p.grad))

    @staticmethod
    def _take_ddp_mark(param: torch.Tensor) -> bool:
        """Consume ``param.ddp_averaged_grad``: whether DDP averaged the gradient it still holds.

        The mark (``parallel.ddp.AveragedGrad``) is deleted whatever the answer: each counts once.
        """
        mark = vars(param).pop("ddp_averaged_grad", None)
        return mark is not None and mark.holds(param.grad)

    def _broadcast_parameters(self, params: list[torch.Tensor]) -> None:
        # grad presence is identical on all ranks here (averaged above, or by DDP), so every rank
        # lists the same params; params without a gradient were not updated and need not move
        updated = [p for p in params if p.grad is not None]
        for owner in self._broadcasting_owners():
            mine = owner == self._rank
            owned = [p for p in updated if self._owners[id(p)] == owner]
            for dtype, dtype_params in _by_dtype(owned).items():
                sizes = [p.numel() for p in dtype_params]
                flat = self._scratch_for(dtype, sum(sizes), dtype_params[0].device)
                if mine:
                    torch.cat([p.detach().reshape(-1) for p in dtype_params], out=flat)
                # broadcast this owner's updated params of one dtype (one flat buffer) to the
                # other ranks, right after the inner step changed them
                dist.broadcast(flat, src=self._source_of(owner), group=self._group)
                if not mine:
                    for p, view in zip(dtype_params, flat.split(sizes)):
                        p.copy_(view.view_as(p))

    def _broadcasting_owners(self) -> range:
        """Group ranks whose updated parameters are broadcast: every rank may own some."""
        return range(self._world_size)

    def _source_of(self, owner: int) -> int:
        """The global rank broadcast's ``src`` needs for group rank ``owner``."""
        return self._global_ranks[owner]

    def _scratch_for(self, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        """A (numel,) slice of this dtype's reusable broadcast buffer, grown when too small.

        NOTE: one buffer reused slab after slab, not a fresh buffer per slab: allocating tens of
        MB each step page-faults fresh memory, which made the broadcast phase about twice as
        slow here (bench/sharding_balance.py), and fresh buffers for all slabs at once would
        briefly hold a full extra copy of the parameters. Cost: the largest slab, kept.
        """
        buffer = self._scratch.get(dtype)
        if buffer is None or buffer.numel() < numel or buffer.device != device:
            buffer = self._scratch[dtype] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]

    # ------------------------------------------------------------------------------ checkpoints

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full optimizer state on group rank ``to``; then ``state_dict()`` works there.

        Collective: call on all ranks of the group, or the world hangs. Any later ``step()``,
        ``load_state_dict()`` or ``add_param_group()`` makes the gathered copy stale (dropped).
        """
        _checks.check_consolidation_rank(to, self._world_size)
        params = self._params()
        index = {id(p): i for i, p in enumerate(params)}
        mine = _to_bytes({index[id(p)]: s for p, s in self._inner.state.items() if s})
        shards = self._gather_bytes(mine.to(params[0].device if params else "cpu"), to)
        self._consolidated_on = to
        self._consolidated = None
        if self._rank == to:
            state = {i: s for shard in shards for i, s in _from_bytes(shard).items()}
            self._consolidated = {
                "state": dict(sorted(state.items())),
                "param_groups": self._packed_groups(),
            }

    def _gather_bytes(self, mine: torch.Tensor, to: int) -> list[torch.Tensor]:
        """Every rank's uint8 buffer, on group rank ``to`` (an empty list elsewhere), on ``mine``'s
        device (NCCL carries only CUDA tensors). NOTE: not ``dist.gather_object``: it decodes
        through numpy, which torch does not require. Same two steps: sizes, then padded bytes."""
        sizes = [mine.new_zeros(1, dtype=torch.int64) for _ in range(self._world_size)]
        # all-gather one int64 per rank (its shard's byte count), so `to` can size the buffers
        dist.all_gather(sizes, sizes[0].new_tensor([mine.numel()]), group=self._group)
        longest = max(int(s) for s in sizes)
        padded = mine.new_zeros(longest)
        padded[: mine.numel()] = mine
        received = (
            [mine.new_empty(longest) for _ in range(self._world_size)] if self._rank == to else None
        )
        # gather every rank's serialized state shard on rank `to` only, now, because the caller
        # is about to save a checkpoint there
        dist.gather(padded, received, dst=self._global_ranks[to], group=self._group)
        if received is None:
            return []
        return [buf[: int(n)] for buf, n in zip(received, sizes)]

    def state_dict(self) -> dict[str, Any]:
        """The full state in the plain ``optimizer_cls`` layout, on the rank it was gathered on.

        Raises:
            RuntimeError: ``consolidate_state_dict(to=<this rank>)`` was not called on all ranks
                since the last change of the state.
        """
        if self._consolidated is None:
            if self._consolidated_on is None:
                why = "has not been consolidated since the last step() or load_state_dict()"
            else:
                why = (
                    f"was consolidated on rank {self._consolidated_on}, not on this rank "
                    f"({self._rank})"
                )
            raise RuntimeError(
                f"ShardedOptimizer state {why}; each rank holds only its shard. Call "
                f"`consolidate_state_dict(to={self._rank})` on all ranks of the group first "
                "(a collective), then state_dict() on this rank"
            )
        return {
            "state": dict(self._consolidated["state"]),
            "param_groups": [dict(g) for g in self._consolidated["param_groups"]],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (ours, saved at any world size or rule, or a plain optimizer's).

        Local: no collective. Every rank must load the same dict to stay consistent; each keeps the
        state of the parameters it owns now, and the hyperparameters of every group.
        """
        saved_groups = _checks.check_loadable(state_dict, self.param_groups)
        by_index = {
            i: p
            for saved, group in zip(saved_groups, self.param_groups)
            for i, p in zip(saved["params"], group["params"])
        }
        inner_groups, inner_state, next_index = [], {}, 0
        for saved, group, inner_group in zip(
            saved_groups, self.param_groups, self._inner.param_groups
        ):
            # the full groups are updated in place, so schedulers holding them keep working
            group.update({k: v for k, v in saved.items() if k not in _MEMBERSHIP_KEYS})
            indices = []
            owned = {id(p) for p in inner_group["params"]}
            for i in saved["params"]:
                if id(by_index[i]) in owned:
                    if i in state_dict["state"]:
                        inner_state[next_index] = state_dict["state"][i]
                    indices.append(next_index)
                    next_index += 1
            inner_groups.append({**hyperparameters(group), "params": indices})
        self._inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        self.state = self._inner.state  # the inner optimizer replaced its state dict
        self._consolidated, self._consolidated_on = None, None

    def _packed_groups(self) -> list[dict[str, Any]]:
        # the plain Optimizer.state_dict layout: params become indices counted across groups
        packed, start = [], 0
        for group in self.param_groups:
            n = len(group["params"])
            packed.append(
                {
                    **{k: v for k, v in group.items() if k != "params"},
                    "params": list(range(start, start + n)),
                }
            )
            start += n
        return packed


# ---------------------------------------------------------------------------------- helpers


def _to_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor) -> Any:
    # weights_only=False: the bytes come from our own group's ranks (like gather_object's
    # pickles), and an optimizer's state may hold more than tensors and numbers
    compact = data.cpu().contiguous()  # data.numel() bytes of CPU memory, read in one copy
    # (not bytes(storage): that iterates byte by byte, 60 ms for a 20 kB shard; not numpy,
    # which torch does not require)
    raw = ctypes.string_at(compact.data_ptr(), compact.numel())
    return torch.load(io.BytesIO(raw), weights_only=False)


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group without its membership keys (``params``, ``param_names``): what the full
    group and its owned subset in the inner optimizer must agree on."""
    return {k: v for k, v in group.items() if k not in _MEMBERSHIP_KEYS}


def _by_dtype(params: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    """Params grouped by dtype, dtypes in name order, params in their given order within each."""
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        out.setdefault(p.dtype, []).append(p)
    return dict(sorted(out.items(), key=lambda item: str(item[0])))
