"""How close a workload comes to this machine's matmul rate: the FLOPs its linear layers do, and the rate of a
plain matmul measured in the same process.

How it measures: docs/benchmark-methods.md#flops.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

# A light door: torch is imported inside the functions that use it, so commands importing this answer --help at once.

MATMUL_SHAPE = (512, 576, 1536)  # (tokens, hidden, MLP width)


class LinearFlops:
    """A context manager summing the FLOPs of every nn.Linear call made while it is active, apart by whether
    autograd records the call (`trained`: forward + backward, 6 per weight and row) or not (`forward`: 2)."""

    def __init__(self) -> None:
        self.forward = 0.0
        self.trained = 0.0
        self._handle = None

    def _hook(self, module: nn.Module, inputs: tuple, output) -> None:
        import torch
        from torch import nn

        if not isinstance(module, nn.Linear) or not inputs:
            return
        rows = inputs[0].numel() // module.in_features
        flops = 2.0 * rows * module.in_features * module.out_features
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            self.trained += 3 * flops
        else:
            self.forward += flops

    @property
    def total(self) -> float:
        return self.forward + self.trained

    def __enter__(self) -> LinearFlops:
        from torch import nn

        self._handle = nn.modules.module.register_module_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def matmul_gflops(dtype: torch.dtype, repeats: int = 20) -> float:
    """Median GFLOP/s of a MATMUL_SHAPE matmul in `dtype` at the current thread count (after a warm-up)."""
    import torch

    m, k, n = MATMUL_SHAPE
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / statistics.median(times) / 1e9
