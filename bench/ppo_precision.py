"""PPO update time and peak memory by precision and memory knob (ppo.precision, ppo.gradient_checkpointing,
ppo.micro_batch_size) on the CPU, printed as Markdown tables.

    .venv/bin/python -m bench.ppo_precision --model models/sft --prompts data/validated/train.jsonl --threads 2,1

How it measures: docs/benchmark-methods.md#ppo_precision.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import last_result
from bench.flops import MATMUL_SHAPE

# A light door: torch, transformers and pandas are imported inside the functions that use them: --help is quick.

MEMORY_SETTINGS = {
    "fp32": dict(precision="fp32"),
    "bf16": dict(precision="bf16"),
    "fp32 + checkpointing": dict(precision="fp32", gradient_checkpointing=True),
    "bf16 + checkpointing": dict(precision="bf16", gradient_checkpointing=True),
    "fp32 + micro-batches of 1": dict(precision="fp32", micro_batch_size=1),
    "bf16 + micro-batches of 1": dict(precision="bf16", micro_batch_size=1),
    "bf16 + checkpointing + micro-batches of 1": dict(
        precision="bf16", gradient_checkpointing=True, micro_batch_size=1
    ),
}
PROMPTS = [
    "How do I make a good cup of coffee?",
    "Explain photosynthesis in simple terms.",
    "What should I pack for a weekend hiking trip?",
    "Write a short poem about the sea.",
    "How can I improve my sleep?",
    "What is the difference between a virus and a bacterium?",
    "Give me three tips for learning a new language.",
    "Why is the sky blue?",
]
SMOLLM2_SHAPE = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
)
GiB = 2**30


def peak_rss() -> int:
    """This process's peak resident set size in bytes (VmHWM: since its exec, not inherited from its parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_prompts(path: str | None, n: int = 64) -> list[list[dict]]:
    """The first `n` distinct prompts of a validated split, else the built-in PROMPTS."""
    if path and Path(path).exists():
        import pandas as pd

        rows = pd.read_json(path, lines=True)
        return list(rows.drop_duplicates("prompt")["prompt_messages"])[:n]
    return [[{"role": "user", "content": p}] for p in PROMPTS]


def load_policy(model: str | None):
    """(policy, tokenizer): the model dir, or a random Llama of SmolLM2-135M's shape with the tiny test tokenizer."""
    import torch

    from rlhflow.models.loading import load_causal_lm, load_tokenizer

    if model:
        tok = load_tokenizer(model)
        return load_causal_lm(model, pad_token_id=tok.pad_token_id), tok
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.fixtures import tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        **SMOLLM2_SHAPE,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(config).eval(), tok


def make_trainer(policy, tok, prompts, **settings):
    import torch

    from rlhflow.config.params import PPOConfig
    from rlhflow.ppo.trainer import PPOTrainer

    cfg = PPOConfig(**settings, steps=100, checkpoint_every=0, checkpoint_dir="/tmp/ppo_precision_bench")
    return PPOTrainer(
        cfg,
        policy=policy,
        tokenizer=tok,
        score_fn=lambda p, texts: torch.tensor([min(len(t), 200) / 100 for t in texts]),
        prompts=prompts,
        seed=0,
    )


def fix_rollout_responses(trainer, gen) -> None:
    """Make every update of `trainer` reuse the sampled responses `gen` (the same batch for every setting)."""
    trainer._sample = lambda messages, *, stream, **outputs: gen


def sample_fixed_batch(policy, tok, prompts):
    """The responses every measurement reuses: one fp32 rollout of the first update's prompts (seed 0), with the
    sampling pass's logits and hidden states (fp32's default old log-probs come from them)."""
    trainer = make_trainer(policy, tok, prompts, precision="fp32")
    messages = [trainer.prompts[i] for i in trainer._next_prompts()]
    return trainer._sample(messages, stream=1, return_logits=True, return_hidden=True), messages


def update_times(trainer) -> dict[str, float]:
    """One update's times, and the FLOPs of its linear layers: the rollout's forward passes run without autograd
    (old and reference log-probs, values), the PPO epochs with it (bench.flops)."""
    from bench.flops import LinearFlops

    with LinearFlops() as flops:
        start = time.perf_counter()
        stats = trainer.update()
        update_s = time.perf_counter() - start
    return {
        "update_s": update_s,
        "forward_s": stats["time/forward_s"],
        "training_s": stats["time/training_s"],
        "forward_flops": flops.forward,
        "training_flops": flops.trained,
    }


def time_precisions(args: argparse.Namespace) -> dict:
    """fp32 and bf16 updates on the fixed batch and sampling, alternating in this process, at each thread count."""
    import torch

    from bench.flops import LinearFlops, matmul_gflops
    from rlhflow.models.loading import PRECISIONS, resolve_precision
    from rlhflow.ppo.trainer import PPOTrainer

    threads = [int(t) for t in args.threads.split(",")]
    torch.set_num_threads(threads[0])
    policy, tok = load_policy(args.model)
    prompts = load_prompts(args.prompts)
    gen, messages = sample_fixed_batch(policy, tok, prompts)
    trainers = {p: make_trainer(copy.deepcopy(policy), tok, prompts, precision=p) for p in ("fp32", "bf16")}
    del policy
    for trainer in trainers.values():
        fix_rollout_responses(trainer, gen)
        trainer.update()  # warm-up
    times: dict[int, dict[str, list[dict]]] = {n: {p: [] for p in trainers} for n in threads}
    matmul: dict[int, dict[str, list[float]]] = {n: {p: [] for p in trainers} for n in threads}  # GFLOP/s
    for round_ in range(args.rounds):
        for n in threads:
            torch.set_num_threads(n)
            for p in ("fp32", "bf16") if round_ % 2 == 0 else ("bf16", "fp32"):
                matmul[n][p].append(matmul_gflops(PRECISIONS[p]))  # the limit, beside the work it bounds
                row = update_times(trainers[p])
                with LinearFlops() as flops:
                    start = time.perf_counter()
                    sampled = PPOTrainer._sample(trainers[p], messages, stream=1)  # the real sampling, in p
                    generation_s = time.perf_counter() - start
                tokens = int(sampled.response_mask.sum())
                row.update(generation_s=generation_s, tokens=tokens, generation_flops=flops.total)
                times[n][p].append(row)
                print(f"round {round_ + 1}, {n} threads, {p}: {row}", file=sys.stderr, flush=True)
    return {
        "times": times,
        "matmul_gflops": matmul,
        "tokens_fixed": int(gen.response_mask.sum()),
        "auto": str(resolve_precision("auto", "cpu")),
    }


def first_ratio_probe(trainer) -> dict:
    """max |delta log p| between the rollout's log-probs (training's micro-batches) and (a) one forward pass of all
    rows at once, (b) the sampling pass's logits, on a fresh rollout of the trainer's policy."""
    import torch

    from rlhflow.models.policy import logprobs_and_entropy, sequence_logprobs

    cfg = trainer.cfg
    messages = [trainer.prompts[i] for i in range(min(cfg.batch_size, len(trainer.prompts)))]
    gen = trainer._sample(messages, stream=10_000, return_logits=True)
    qr, am, ctx, mask = gen.query_response, gen.attention_mask, gen.context_length, gen.response_mask.bool()
    with torch.no_grad():
        groups = trainer._micro_batches(torch.arange(qr.shape[0]))
        (grouped,) = trainer._in_chunks(
            lambda q, a, c: (trainer.model(q, a, c, cfg.temperature)[0],), qr, am, ctx, mask.shape[1], groups
        )
        whole = sequence_logprobs(trainer.policy, qr, am, ctx, cfg.temperature, compute_dtype=trainer.dtype)
        sampled, _ = logprobs_and_entropy(gen.logits, gen.response, cfg.temperature, return_entropy=False)
    return {
        "dlogp_other_grouping": (grouped - whole).abs()[mask].max().item(),
        "dlogp_sampling_pass": (grouped - sampled).abs()[mask].max().item(),
    }


@contextlib.contextmanager
def first_ratio_recorded():
    """While active, the first call of the PPO policy loss (the first minibatch of the first update) records
    max |pi / pi_old - 1| in the list it yields."""
    from rlhflow.ppo import core

    ratios: list[float] = []
    policy_loss = core.policy_loss

    def recording(logprobs, old_logprobs, advantages, mask, *rest, **options):
        if not ratios:
            ratios.append(((logprobs - old_logprobs).exp() - 1).abs().mul(mask).max().item())
        return policy_loss(logprobs, old_logprobs, advantages, mask, *rest, **options)

    core.policy_loss = recording
    try:
        yield ratios
    finally:
        core.policy_loss = policy_loss


def memory_worker(args: argparse.Namespace) -> dict:
    """One update of one setting in this (fresh) process: its peak RSS and time; with --probe, the first ratio of a
    real rollout and the log-prob gaps."""
    import torch

    torch.set_num_threads(int(args.threads))
    settings = json.loads(args.worker)
    policy, tok = load_policy(args.model)
    prompts = load_prompts(args.prompts)
    result: dict = {}
    if args.probe:
        with first_ratio_recorded() as ratios:
            trainer = make_trainer(copy.deepcopy(policy), tok, prompts, **settings)
            trainer.update()
        result.update(first_ratio=ratios[0], **first_ratio_probe(trainer))
        print("RESULT " + json.dumps(result), flush=True)
        return result
    gen, _ = sample_fixed_batch(policy, tok, prompts)
    trainer = make_trainer(policy, tok, prompts, **settings)
    fix_rollout_responses(trainer, gen)
    result.update(update_times(trainer))
    result["peak_rss"] = peak_rss()
    print("RESULT " + json.dumps(result), flush=True)
    return result


def subprocess_run(args: argparse.Namespace, settings: dict, probe: bool = False) -> dict:
    cmd = [sys.executable, "-m", "bench.ppo_precision", "--worker", json.dumps(settings)]
    cmd += ["--threads", str(args.memory_threads)] + (["--model", args.model] if args.model else [])
    cmd += (["--prompts", args.prompts] if args.prompts else []) + (["--probe"] if probe else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    result = last_result(proc.stdout)
    if proc.returncode or result is None:
        raise RuntimeError(f"{settings} failed:\n{proc.stderr[-3000:]}")
    return result


def timing_table(timing: dict) -> list[str]:
    lines = [f"Same batch ({timing['tokens_fixed']} response tokens); auto on this CPU: {timing['auto']}"]
    for n, rows in timing["times"].items():
        med = {p: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for p, runs in rows.items()}
        best = {p: {k: min(r[k] for r in runs) for k in runs[0]} for p, runs in rows.items()}
        lines += [
            "",
            f"{n} thread(s), {len(rows['fp32'])} alternating rounds: median (best) seconds",
            "",
            "| phase | fp32 (s) | bf16 (s) | fp32 / bf16: median (best) |",
            "|---|---:|---:|---:|",
        ]
        for key, name in (
            ("update_s", "update (rollout forwards + PPO epochs)"),
            ("forward_s", "rollout forwards (old, reference log-probs, values)"),
            ("training_s", "PPO epochs (forward + backward + AdamW)"),
            ("generation_s", "sampling 8 responses (same prompts and seed)"),
        ):
            f, b = med["fp32"][key], med["bf16"][key]
            fb, bb = best["fp32"][key], best["bf16"][key]
            lines.append(f"| {name} | {f:.2f} ({fb:.2f}) | {b:.2f} ({bb:.2f}) | {f / b:.2f}x ({fb / bb:.2f}x) |")
        lines.append(f"| tokens sampled | {med['fp32']['tokens']:.0f} | {med['bf16']['tokens']:.0f} | |")
        lines += ["", *achieved_table(med, timing["matmul_gflops"][n])]
    return lines


def achieved_table(med: dict[str, dict[str, float]], matmul: dict[str, list[float]]) -> list[str]:
    """Achieved GFLOP/s of each phase (its linear layers' FLOPs over its median time: 6N per trained token, 2N per
    forward token) against the median matmul rate measured beside it in the same precision."""
    lines = [
        "| phase | fp32 GFLOP/s | share of fp32 matmul | bf16 GFLOP/s | share of bf16 matmul |",
        "|---|---:|---:|---:|---:|",
    ]
    limit = {p: statistics.median(rates) for p, rates in matmul.items()}
    for flops_key, time_key, name in (
        ("forward_flops", "forward_s", "rollout forwards (2N per token)"),
        ("training_flops", "training_s", "PPO epochs (6N per trained token)"),
        ("generation_flops", "generation_s", "sampling (2N per token)"),
    ):
        rate = {p: med[p][flops_key] / med[p][time_key] / 1e9 for p in ("fp32", "bf16")}
        lines.append(
            f"| {name} | {rate['fp32']:.0f} | {rate['fp32'] / limit['fp32']:.0%} "
            f"| {rate['bf16']:.0f} | {rate['bf16'] / limit['bf16']:.0%} |"
        )
    lines.append(
        f"| matmul {'x'.join(map(str, MATMUL_SHAPE))} (the limit) | {limit['fp32']:.0f} | | {limit['bf16']:.0f} | |"
    )
    return lines


def memory_table(memory: dict[str, list[dict]]) -> list[str]:
    lines = ["| setting | peak RSS (GiB) | vs fp32 | update (s, not interleaved) |", "|---|---:|---:|---:|"]
    base = statistics.median(r["peak_rss"] for r in memory["fp32"]) if "fp32" in memory else None
    for name, runs in memory.items():
        rss = statistics.median(r["peak_rss"] for r in runs)
        ratio = f"{rss / base:.2f}" if base else "-"
        update = statistics.median(r["update_s"] for r in runs)
        lines.append(f"| {name} | {rss / GiB:.2f} | {ratio} | {update:.1f} |")
    return lines


def probe_table(probes: dict[str, dict]) -> list[str]:
    lines = [
        "| precision | first \\|ratio-1\\| | max \\|d log p\\|: all rows in one pass "
        "| max \\|d log p\\|: sampling pass's logits |",
        "|---|---:|---:|---:|",
    ]
    return lines + [
        f"| {p} | {r['first_ratio']:.1e} | {r['dlogp_other_grouping']:.1e} | {r['dlogp_sampling_pass']:.1e} |"
        for p, r in probes.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a plain model dir (default: random SmolLM2-135M-shaped Llama)")
    parser.add_argument("--prompts", default=None, help="a validated split (.jsonl with prompt_messages)")
    parser.add_argument("--threads", default="2", help="torch threads of the timed updates (comma-separated: each)")
    parser.add_argument("--rounds", type=int, default=4, help="timed fp32/bf16 updates each, alternating (0: none)")
    parser.add_argument("--memory-threads", type=int, default=2, help="torch threads of the memory runs")
    parser.add_argument("--memory-rounds", type=int, default=1, help="fresh-process runs of every memory setting")
    parser.add_argument("--settings", default=",".join(MEMORY_SETTINGS), help="memory settings, comma-separated")
    parser.add_argument("--no-probe", action="store_true", help="skip the first-ratio runs")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        memory_worker(args)
        return
    sections = []
    if args.rounds:
        sections.append(timing_table(time_precisions(args)))
    names = [n for n in args.settings.split(",") if n]
    memory: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(args.memory_rounds if names else 0):
        for name in names if round_ % 2 == 0 else list(reversed(names)):
            memory[name].append(subprocess_run(args, MEMORY_SETTINGS[name]))
            print(f"memory {name}: {memory[name][-1]}", file=sys.stderr, flush=True)
    if names:
        sections.append(memory_table(memory))
    if not args.no_probe:
        sections.append(probe_table({p: subprocess_run(args, {"precision": p}, probe=True) for p in ("fp32", "bf16")}))
    print("\n\n".join("\n".join(lines) for lines in sections))


if __name__ == "__main__":
    main()
