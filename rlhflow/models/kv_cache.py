"""A KV cache written in place: each layer's keys and values live in buffers sized for the whole generation.

transformers' `DynamicCache` concatenates every layer's keys and values with the new token's at each decode step, so
a step copies the whole cache. `PreallocatedCache` writes the new positions into buffers of `capacity` positions and
hands attention a view of the filled part: attention reads the same values, the logits are the same to every bit
(tests/test_kv_cache.py), and a decode step takes 0.88-0.91x of the time on a 2-core CPU (docs/benchmarks.md,
"The KV cache and the decode roofline"). "compiled": transformers' `StaticCache`, fixed shapes, with the decode step
under torch.compile (CUDA graphs on a GPU); the decoders round its rows and positions up to a few sizes
(`compiled_rows`, `static_capacity`), so a run compiles a few times, not per batch.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import Cache, DynamicLayer
from transformers.generation import CompileConfig

KVCache = Literal["preallocated", "dynamic", "compiled"]
KV_CACHES = get_args(KVCache)
# a compiled cache's positions are a multiple of this: prompts of other lengths reuse the compiled step
POSITION_BUCKET = 64
# torch.compile's backend for the compiled decode step ("eager": the same graph, uncompiled, for debugging)
COMPILE_BACKEND = "inductor"


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


def new_kv_cache(kind: KVCache, capacity: int, model_config=None) -> Cache:
    """An empty cache for prompts and answers of at most `capacity` tokens in all; "dynamic": transformers' own;
    "compiled": a StaticCache for the model of `model_config`, its capacity rounded up (`static_capacity`)."""
    if kind == "dynamic":
        return DynamicCache()
    if kind == "preallocated":
        return PreallocatedCache(capacity)
    if kind == "compiled":
        return StaticCache(config=model_config, max_cache_len=static_capacity(capacity))
    raise ValueError(f"unknown kv_cache {kind!r} (expected one of {', '.join(KV_CACHES)})")


def static_capacity(capacity: int) -> int:
    """`capacity` rounded up to a multiple of POSITION_BUCKET."""
    return -(-capacity // POSITION_BUCKET) * POSITION_BUCKET


def compiled_rows(rows: int) -> int:
    """The compiled step's batch for `rows` rows: the next power of two, so a batch shrinking as its rows end
    compiles once per halving."""
    return 1 << max(rows - 1, 0).bit_length()


def compile_config(device: torch.device) -> CompileConfig:
    """torch.compile's settings for the decode step: fixed shapes, and CUDA graphs on a GPU (reduce-overhead)."""
    mode = "reduce-overhead" if device.type == "cuda" and COMPILE_BACKEND == "inductor" else None
    config = CompileConfig(fullgraph=False, dynamic=False, backend=COMPILE_BACKEND, mode=mode)
    config._compile_all_devices = True  # transformers' generate compiles on accelerators only unless told
    # a few (rows, positions) shapes compile each; torch's default limit (8) would fall back to eager silently
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return config


def select_static_rows(cache: StaticCache, keep: torch.Tensor, model_config) -> StaticCache:
    """A new StaticCache holding the rows `keep` of `cache` (fixed shapes: a smaller batch is another cache)."""
    kept = StaticCache(config=model_config, max_cache_len=cache.layers[0].max_cache_len)
    for old, new in zip(cache.layers, kept.layers):
        if not old.is_initialized:
            continue
        new.lazy_initialization(old.keys[keep], old.values[keep])
        new.keys.copy_(old.keys[keep])
        new.values.copy_(old.values[keep])
        new.cumulative_length.copy_(old.cumulative_length)
    return kept
