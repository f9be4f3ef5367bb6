"""The CUDA path of the precision and device choices, on a machine without a GPU: torch.cuda's queries are mocked
to describe a GPU of a given compute capability (7.0: V100, bf16 only emulated; 7.5: T4; 8.0: A100)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from rlhflow.models.loading import (
    TRAINER_BF16_ON_CPU,
    attn_implementation_for,
    bf16_is_native,
    enable_tf32,
    fp32_matmuls_exact,
    pick_device,
    resolve_precision,
    trainer_bf16,
)
from rlhflow.training import distributed

CUDA = torch.device("cuda")


@pytest.fixture
def gpu(monkeypatch):
    """gpu(capability): torch.cuda answers as on a node of two GPUs of that compute capability."""

    def describe(capability: tuple[int, int], count: int = 2):
        def is_bf16_supported(including_emulation: bool = True) -> bool:
            return capability >= (8, 0) or including_emulation  # what torch answers: emulated counts by default

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)

    return describe


@pytest.fixture
def matmul_precision():
    """Restore the process-wide fp32 matmul precision (TF32 on or off) after the test."""
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("capability", [(7, 0), (7, 5)])
def test_emulated_bf16_gpus_get_fp32_under_auto(gpu, matmul_precision, capability):
    gpu(capability)
    assert torch.cuda.is_bf16_supported()  # torch's default answer counts emulation: not enough
    assert not bf16_is_native(CUDA)
    assert resolve_precision("auto", CUDA) == torch.float32
    assert resolve_precision("bf16", CUDA) == torch.bfloat16  # forced: runs, with a warning
    assert not any(trainer_bf16("auto", CUDA, t) for t in TRAINER_BF16_ON_CPU)  # the Hugging Face Trainer stages too
    before = torch.get_float32_matmul_precision()
    assert enable_tf32(CUDA) is False and torch.get_float32_matmul_precision() == before


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)])
def test_ampere_and_later_get_bf16_and_tf32(gpu, matmul_precision, capability):
    gpu(capability)
    torch.set_float32_matmul_precision("highest")
    assert bf16_is_native(CUDA) and bf16_is_native("cuda:1")
    assert resolve_precision("auto", CUDA) == torch.bfloat16
    assert resolve_precision("auto", CUDA, bf16_on_cpu=False) == torch.bfloat16  # the CPU switch leaves GPUs alone
    for trainer in TRAINER_BF16_ON_CPU:  # the CPU switch leaves GPUs alone
        assert trainer_bf16("auto", CUDA, trainer) and not trainer_bf16("fp32", CUDA, trainer)
    assert enable_tf32(CUDA) is True
    assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"


def test_tf32_is_left_alone_on_the_cpu(gpu, matmul_precision):
    gpu((8, 0))
    torch.set_float32_matmul_precision("highest")
    assert enable_tf32(torch.device("cpu")) is False
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cuda.matmul.allow_tf32


def test_fp32_matmuls_are_exact_until_tf32_is_on(gpu, matmul_precision):
    """PPO takes float32 old log-probs from the sampling pass only where fp32 matmuls are exact: with TF32 on, a
    CUDA GPU's decoding and full pass differ by ~1e-3 (measured on an H200), not ~1e-6."""
    gpu((8, 0))
    torch.set_float32_matmul_precision("highest")
    assert fp32_matmuls_exact(CUDA) and fp32_matmuls_exact("cpu")
    enable_tf32(CUDA)
    assert not fp32_matmuls_exact(CUDA) and not fp32_matmuls_exact("cuda:1")
    assert fp32_matmuls_exact("cpu")  # TF32 is a CUDA flag
    torch.set_float32_matmul_precision("highest")
    gpu((7, 0))
    assert enable_tf32(CUDA) is False and fp32_matmuls_exact(CUDA)  # no TF32 before Ampere


def test_flash_attention_2_only_on_cuda_in_half_precision_with_flash_attn_installed(gpu, monkeypatch):
    gpu((8, 0))
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not importable
    assert attn_implementation_for(CUDA, torch.bfloat16) == "sdpa"
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    assert attn_implementation_for(CUDA, torch.bfloat16) == "flash_attention_2"
    assert attn_implementation_for(CUDA, torch.float16) == "flash_attention_2"
    assert attn_implementation_for(CUDA, torch.float32) == "sdpa"
    assert attn_implementation_for("cpu", torch.bfloat16) == "sdpa"


@pytest.mark.parametrize("local_rank", [0, 1])
def test_each_process_of_a_node_takes_its_own_gpu(gpu, monkeypatch, local_rank):
    gpu((8, 0), count=2)
    monkeypatch.setenv("WORLD_SIZE", "4")  # two nodes of two GPUs: this is the node's process local_rank
    monkeypatch.setenv("RANK", str(2 + local_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert pick_device("auto") == CUDA
    assert distributed.local_device(pick_device("auto")) == torch.device("cuda", local_rank)
    assert distributed.local_device(torch.device("cuda", 0)) == torch.device("cuda", 0)  # an explicit index stays
    assert distributed.local_device(torch.device("cpu")) == torch.device("cpu")


def test_a_process_without_a_gpu_of_its_own_fails_clearly(gpu, monkeypatch):
    gpu((8, 0), count=2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2 has no GPU of its own: this node has 2"):
        distributed.local_device(pick_device("auto"))


def test_a_single_process_uses_the_default_gpu(gpu, monkeypatch):
    gpu((8, 0), count=2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")  # without a launcher's WORLD_SIZE, one process: cuda (the current GPU)
    assert distributed.local_device(pick_device("auto")) == CUDA
