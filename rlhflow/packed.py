"""oneDNN-packed `nn.Linear` weights for no-grad inference on CPU (generation).

On CPU a float32 `nn.Linear` runs MKL's sgemm on the plain [out, in] weight and pays for arranging the weight on
every call. While decoding, a call multiplies only batch-size rows, so that cost dominates: a SmolLM2-135M decode
step at batch 8 on a 2-core EPYC took 239 ms plain and 121 ms with the weights packed once into oneDNN's blocked
layout (`torch.ops.mkldnn._reorder_linear_weight`) and multiplied by `_linear_pointwise`. Packing costs one
pass over the weights (about 0.4 s for 135M parameters), so it pays off over a whole generation, not a single
forward pass.

`packed_linears(model)` packs on entry and restores the plain modules on exit; the packed copies exist only
inside the block (one extra copy of the weights while generating). Outside CPU float32, without oneDNN, or with
gradients enabled it changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Iterator

import torch
from torch import nn
from torch.nn import functional as F


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _packable(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) and isinstance(w, torch.Tensor) and w.device.type == "cpu"
            and w.dtype == torch.float32 and "forward" not in module.__dict__)


def _packed_forward(module: nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() or x.dtype != torch.float32:  # the packed kernel has no autograd: plain path
        return F.linear(x, module.weight, module.bias)
    bias = None if module.bias is None else module.bias.detach()
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), packed, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], module.out_features)


@contextlib.contextmanager
def packed_linears(model: nn.Module, batch_size: int = 8, enabled: bool = True) -> Iterator[int]:
    """Run `model`'s float32 CPU `nn.Linear` layers on oneDNN-packed weights inside the block (under
    `torch.no_grad()`); yields how many layers were packed. `batch_size` is the row count the packing is tuned
    for (decoding: the number of sequences). The weights must not change inside the block."""
    patched: list[nn.Module] = []
    if enabled and _available():
        try:
            for module in model.modules():
                if _packable(module):
                    packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), max(1, batch_size))
                    module.forward = functools.partial(_packed_forward, module, packed)  # instance attribute
                    patched.append(module)
        except RuntimeError as err:  # e.g. a oneDNN build without this primitive: run plain
            warnings.warn(f"oneDNN weight packing unavailable ({err}); generating with plain weights")
            for module in patched:
                del module.forward
            patched = []
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward
