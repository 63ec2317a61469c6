"""torch's ``loss_parallel()`` back-propagates a wrong gradient through ``log_softmax`` when its
output goes anywhere but ``nll_loss``: confirmed without ddpcheck (exit 1 when the installed
torch shows it, 0 when it does not).

Under ``loss_parallel()`` (``torch/distributed/tensor/parallel/loss.py``) the backward of
``aten._log_softmax`` is the identity (``_log_softmax_backward_handler``: "does not actually do
any computation"): ``nll_loss``'s backward returns the gradient of the fused pair, ``(onehot +
exp(x)) * grad``, so the softmax's Jacobian is never applied again. That is right for the
cross-entropy, the only loss its docstring supports. An entropy bonus or a KL term computed from
the same log-probabilities -- ``logp = F.log_softmax(logits)``, ``(logp.exp() * logp).sum(-1)``,
what RL fine-tuning adds to the loss -- then gets its gradient with respect to the
log-probabilities handed on as if it were the logits' gradient: the forward is right (the loss
value matches a one-process one), the gradient is wrong, silently.

Here: W=2, logits ``(6, 5)`` sharded over the vocabulary (``Shard(-1)``, uneven 3 + 2), loss
``sum(nll) - 0.1 * sum(entropy)`` from one ``F.log_softmax``; the gradient of the logits
compared with one process's. Controls: the cross-entropy alone, and a policy gradient
(``nll_loss(reduction="none")`` times fixed per-token weights), both right under
``loss_parallel()``. ddpcheck therefore computes its ``entropy_bonus`` and ``token_kl`` losses
only on gathered logits: ``torch_tp`` and ``torch_2d`` decline them with a plan whose head leaves
the logits sharded (``ddpcheck.targets.tensor_parallel.no_loss_parallel``), naming this script.

    python bench/loss_parallel_entropy.py
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

LOSSES = ("cross-entropy", "policy gradient", "cross-entropy - 0.1 x entropy")


def _loss(name: str, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logp = F.log_softmax(logits, dim=-1)
    if name == "cross-entropy":
        return F.nll_loss(logp, y, reduction="sum")
    nll = F.nll_loss(logp, y, reduction="none")
    if name == "policy gradient":
        nll = nll.to_local() if hasattr(nll, "to_local") else nll
        return (torch.linspace(-0.5, 1.5, y.shape[0], dtype=nll.dtype) * nll).sum()
    entropy = -(logp.exp() * logp).sum(-1)
    return nll.sum() - 0.1 * entropy.sum()


def _rank(rank: int, path: str, queue: mp.SimpleQueue) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(0)
    full = torch.randn(6, 5, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 4, 2, 1, 3, 1])
    for name in LOSSES:
        one = full.clone().requires_grad_()
        _loss(name, one, y).backward()
        sharded = distribute_tensor(full.clone(), mesh, [Shard(-1)]).requires_grad_()
        with loss_parallel():
            loss = _loss(name, sharded, y)
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            loss.backward()
        grad = sharded.grad.full_tensor()
        if rank == 0:
            queue.put((name, float((grad - one.grad).abs().max())))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    print(f"torch {torch.__version__}: logits (6, 5) Shard(-1) over 2 ranks, under loss_parallel()")
    folder = tempfile.mkdtemp(prefix="loss-parallel-entropy-")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, (os.path.join(folder, "store"), queue), nprocs=2)
    found = dict(queue.get() for _ in LOSSES)
    for name in LOSSES:
        print(f"  {name}: the logits' gradient differs from one process's by {found[name]:.3g}")
    if max(found[n] for n in LOSSES[:2]) > 1e-12:
        print("the controls differ too: loss_parallel() is wrong even for the cross-entropy")
        return 1
    if found[LOSSES[2]] > 1e-6:
        print("an entropy term of loss_parallel()'s log-probabilities: wrong gradient (present)")
        return 1
    print("an entropy term of loss_parallel()'s log-probabilities trains right (absent)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
