"""A KV cache written in place: each layer's keys and values live in buffers sized for the whole generation.

transformers' `DynamicCache` concatenates every layer's keys and values with the new token's at each decode step, so
a step copies the whole cache. `PreallocatedCache` writes the new positions into buffers of `capacity` positions and
hands attention a view of the filled part: attention reads the same values, the logits are the same to every bit
(tests/test_kv_cache.py), and a decode step takes 0.88-0.91x of the time on a 2-core CPU (docs/benchmarks.md,
"The KV cache and the decode roofline").
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

KVCache = Literal["preallocated", "dynamic"]
KV_CACHES = get_args(KVCache)


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values [B, H, capacity, D], filled up to `length`; `keys` / `values` are views of the
    filled part (what DynamicLayer holds)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_buffer = _buffer_like(key_states, key_states.shape[0], self.capacity)
        self.value_buffer = _buffer_like(value_states, value_states.shape[0], self.capacity)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions; this step needs {end}")
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices`, copying only the filled positions into new buffers."""
        if not self.is_initialized:
            return
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = _buffer_like(old, len(indices), self.capacity)
            new[:, :, : self.length] = old[indices, :, : self.length]
            setattr(self, name, new)
        self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]

    def reset(self) -> None:
        super().reset()
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a PreallocatedCache is not cropped (no assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a PreallocatedCache holds one row per prompt (no beam search)")


def _buffer_like(states: torch.Tensor, rows: int, capacity: int) -> torch.Tensor:
    return states.new_empty(rows, states.shape[1], capacity, states.shape[3])


class PreallocatedCache(Cache):
    """A cache of PreallocatedLayers, one per attention layer, created as the forward pass reaches them."""

    def __init__(self, capacity: int):
        super().__init__(layer_class_to_replicate=lambda: PreallocatedLayer(capacity))


def new_kv_cache(kind: KVCache, capacity: int) -> Cache:
    """An empty cache for prompts and answers of at most `capacity` tokens in all; "dynamic": transformers' own."""
    if kind == "dynamic":
        return DynamicCache()
    if kind == "preallocated":
        return PreallocatedCache(capacity)
    raise ValueError(f"unknown kv_cache {kind!r} (expected one of {', '.join(KV_CACHES)})")
