"""Data parallelism over the processes that `accelerate launch` (or torchrun) starts: which process is the
main one, how many there are, and sums across them. In a single process every function here is a no-op
that returns its input, so single-process runs do exactly what they did before.

Conventions (as OpenRLHF's global batch sizes): the batch sizes in params.yaml are global, for the whole
optimisation step across all processes; each of N processes takes 1/N of every batch. Only the main process
(rank 0) writes outputs, metrics files and checkpoints, and logs to MLflow.
"""

from __future__ import annotations

# accelerate is imported only when a multi-process run joins its process group: a single process never loads it.
# torch is imported by the functions that take tensors: which process this is needs none (a stage that trains
# nothing, such as demo_data, starts without it).
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _process_group():
    """torch.distributed once a process group is joined, else None (without torch loaded there is none)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _collectives():
    """torch and torch.distributed, for the functions that work across the processes of a multi-process run."""
    import torch
    import torch.distributed as dist

    return torch, dist


def world_size() -> int:
    """Number of data-parallel processes (1 without a launcher)."""
    group = _process_group()
    return group.get_world_size() if group else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    group = _process_group()
    return group.get_rank() if group else int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    return rank() == 0


def init() -> None:
    """Join the process group the launcher described in the environment (RANK, WORLD_SIZE, MASTER_ADDR...):
    NCCL on GPUs, gloo on CPUs, DeepSpeed's when launched with a DeepSpeed config. Nothing in a single process."""
    if world_size() > 1 and not _process_group():
        import torch
        from accelerate import PartialState

        # cpu=True on a machine without CUDA: accelerate then picks gloo (without it, a torchrun-style launch on
        # CPUs would leave accelerate, and so the HF Trainer, believing it runs alone)
        PartialState(cpu=not torch.cuda.is_available())


def local_device(device: torch.device) -> torch.device:
    """With several processes on one GPU node, process i uses GPU LOCAL_RANK instead of all sharing cuda:0."""
    if device.type == "cuda" and device.index is None and world_size() > 1:
        import torch

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"process LOCAL_RANK={local_rank} has no GPU of its own: this node has {torch.cuda.device_count()}; "
                "start at most one process per GPU"
            )
        return torch.device("cuda", local_rank)
    return device


def shard_size(total: int, what: str) -> int:
    """This process's share of a global batch of `total` rows; the batch must split evenly."""
    n = world_size()
    if total % n:
        raise ValueError(f"{what} ({total}) must be a multiple of the number of processes ({n})")
    return total // n


def sum_across(tensor: torch.Tensor) -> torch.Tensor:
    """The elementwise sum of `tensor` over all processes (the tensor itself in a single process)."""
    if world_size() == 1:
        return tensor
    _, dist = _collectives()
    total = tensor.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def gather(tensor: torch.Tensor) -> torch.Tensor:
    """The processes' equally sized tensors concatenated along dim 0 in rank order (itself in a single process)."""
    if world_size() == 1:
        return tensor
    torch, dist = _collectives()
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(parts, tensor.detach().contiguous())
    return torch.cat(parts)


def sum_gradients(params: list[torch.nn.Parameter]) -> None:
    """Replace each gradient by its sum over all processes, in one collective (missing gradients count as 0).
    With each process's loss scaled by its share of the global batch, the sum is the global-batch gradient."""
    if world_size() == 1:
        return
    torch, dist = _collectives()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(params, grads):
        summed = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
        if p.grad is None:
            p.grad = summed.clone()
        else:
            p.grad.copy_(summed)


def broadcast_parameters(module: torch.nn.Module) -> None:
    """Make every process start from the main process's weights (as DDP does when it wraps a model)."""
    if world_size() == 1:
        return
    torch, dist = _collectives()
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)


def broadcast_object(obj):
    """The main process's `obj` on every process (pickled: small states and CPU tensors); `obj` itself alone."""
    if world_size() == 1:
        return obj
    _, dist = _collectives()
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def barrier() -> None:
    if world_size() > 1:
        _collectives()[1].barrier()
