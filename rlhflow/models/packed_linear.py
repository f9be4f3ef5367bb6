"""oneDNN-packed `nn.Linear` weights for no-grad inference on CPU (generation).

A float32 `nn.Linear` on CPU rearranges its plain weight on every call, which dominates a decode step's small
matmuls: a SmolLM2-135M step at batch 8 took 239 ms plain, 121 ms packed (docs/benchmarks.md). Packing costs one
pass over the weights, so it pays over a generation, not one forward pass. `packed_linears(model)` packs on entry
and restores the plain modules on exit (one extra copy of the weights meanwhile); a peft LoRA layer is packed with
its adapter merged in, and with the adapter disabled (the reference) runs peft's forward. Outside CPU float32,
without oneDNN, or with gradients enabled it changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _packable(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (
        isinstance(module, nn.Linear)
        and isinstance(w, torch.Tensor)
        and w.device.type == "cpu"
        and w.dtype == torch.float32
        and "forward" not in module.__dict__
    )


def _lora_packable(module: nn.Module) -> bool:
    """A peft LoRA layer around a packable Linear: plain LoRA (no DoRA-like variant, no LoRA bias), not merged."""
    base = getattr(module, "base_layer", None)
    return (
        base is not None
        and _packable(base)
        and hasattr(module, "get_delta_weight")
        and hasattr(module, "lora_A")
        and not getattr(module, "lora_variant", None)
        and not any(getattr(module, "lora_bias", {}).values())
        and not module.merged
        and "forward" not in module.__dict__
    )


def _run_packed(packed: torch.Tensor, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if linear.bias is None else linear.bias.detach()
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), packed, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], linear.out_features)


def _kernel_applies(x: torch.Tensor) -> bool:
    """The packed kernel has no autograd and takes float32 only; anything else runs the plain path."""
    return not torch.is_grad_enabled() and x.dtype == torch.float32


def _packed_forward(module: nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if not _kernel_applies(x):
        return F.linear(x, module.weight, module.bias)
    return _run_packed(packed, module, x)


def _packed_lora_forward(module: nn.Module, packed: torch.Tensor, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """W x + b with W = W_base + scaling * B A packed (one matmul instead of three); peft's own forward when the
    adapter is disabled (the reference), merged, or called with gradients or extra arguments."""
    if not _kernel_applies(x) or args or kwargs or module.disable_adapters or module.merged:
        return type(module).forward(module, x, *args, **kwargs)
    return _run_packed(packed, module.base_layer, x)


def _pack(weight: torch.Tensor, batch_size: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), max(1, batch_size))


@contextlib.contextmanager
def packed_linears(model: nn.Module, batch_size: int = 8, enabled: bool = True) -> Iterator[int]:
    """Run `model`'s float32 CPU `nn.Linear` layers on oneDNN-packed weights inside the block (under
    `torch.no_grad()`); yields how many layers were packed. `batch_size` is the row count the packing is tuned
    for (decoding: the number of sequences). The weights must not change inside the block."""
    patched: list[nn.Module] = []
    if enabled and _available():
        try:
            inside_lora: set[int] = set()  # the base and adapter layers of a packed LoRA layer
            for module in model.modules():
                if id(module) in inside_lora:
                    continue
                if _lora_packable(module):  # the adapter as it is now, merged into one packed weight
                    with torch.no_grad():
                        weight = module.base_layer.weight + sum(
                            module.get_delta_weight(name) for name in module.active_adapters if name in module.lora_A
                        )
                    module.forward = functools.partial(_packed_lora_forward, module, _pack(weight, batch_size))
                    inside_lora.update(id(m) for m in module.modules())
                elif _packable(module):
                    module.forward = functools.partial(_packed_forward, module, _pack(module.weight, batch_size))
                else:
                    continue
                patched.append(module)  # forward is an instance attribute: deleting it restores the class's
        except RuntimeError as err:  # e.g. a oneDNN build without this primitive: run plain
            warnings.warn(f"oneDNN weight packing unavailable ({err}); generating with plain weights", stacklevel=2)
            for module in patched:
                del module.forward
            patched = []
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward
