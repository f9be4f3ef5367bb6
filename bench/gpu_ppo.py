"""PPO on one CUDA GPU: what the engine picks on the card, and peak GPU memory and update time per setting for
policies of SmolLM2-135M's, Llama-3.2-1B's and Llama-3.1-8B's shapes.

    python -m bench.gpu_ppo --cap-gib 79.6 --out results.jsonl          # every run in RUNS, on an 80 GB budget
    python -m bench.gpu_ppo --runs smollm2-135m:bf16,llama-1b:bf16

How it measures: docs/benchmark-methods.md#gpu_ppo.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import last_result, sync
from bench.ppo_precision import PROMPTS, SMOLLM2_SHAPE, first_ratio_recorded

# A light door: torch and transformers are imported inside the functions that use them, so --help answers at once.

GiB = 2**30
SHAPES: dict[str, dict] = {
    "tiny": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
    ),
    "smollm2-135m": SMOLLM2_SHAPE,
    "llama-1b": dict(  # Llama-3.2-1B
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "llama-8b": dict(  # Llama-3.1-8B
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
}
LORA = {"lora": {"enabled": True}, "learning_rate": 1e-4}
SETTINGS: dict[str, dict] = {
    "fp32": dict(precision="fp32"),
    "bf16": dict(precision="bf16"),
    "bf16+ckpt": dict(precision="bf16", gradient_checkpointing=True),
    "bf16+micro1": dict(precision="bf16", micro_batch_size=1),
    "bf16+separate": dict(precision="bf16", value_model="separate"),
    "bf16+lora": dict(precision="bf16", **LORA),
    "bf16+lora+ckpt": dict(precision="bf16", gradient_checkpointing=True, **LORA),
    "bf16+lora+ckpt+micro1": dict(precision="bf16", gradient_checkpointing=True, micro_batch_size=1, **LORA),
}
RUNS = [
    "smollm2-135m:fp32",
    "smollm2-135m:bf16",
    "smollm2-135m:bf16+ckpt",
    "smollm2-135m:bf16+separate",
    "smollm2-135m:bf16+lora",
    "llama-1b:fp32",
    "llama-1b:bf16",
    "llama-1b:bf16+separate",
    "llama-1b:bf16+lora",
    "llama-8b:bf16+lora+ckpt",
    "llama-8b:bf16",
]


def cuda_path(device: str) -> dict:
    """What the stages' set-up (rlhflow.models.loading) picks on this device."""
    import torch

    from rlhflow.models.loading import attn_implementation_for, bf16_is_native, enable_tf32, resolve_precision

    facts: dict = {"torch": torch.__version__, "device": device}
    if torch.device(device).type == "cuda":
        facts.update(
            name=torch.cuda.get_device_name(device),
            capability=".".join(map(str, torch.cuda.get_device_capability(device))),
            total_gib=round(torch.cuda.get_device_properties(device).total_memory / GiB, 1),
        )
    auto = resolve_precision("auto", device)
    facts.update(
        bf16_native=bf16_is_native(device),
        auto=str(auto).replace("torch.", ""),
        tf32_enabled=enable_tf32(device),
        tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        attention_bf16=attn_implementation_for(device, torch.bfloat16),
        attention_fp32=attn_implementation_for(device, torch.float32),
    )
    return facts


def matmul_tflops(device: str, dtype, n: int = 8192, repeats: int = 10) -> float:
    """TFLOP/s of an n x n @ n x n matmul in `dtype` on `device` (after warm-ups): the limit the PPO epochs' rate
    is set against."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    rate = 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12
    del a, b
    return rate


def _allocated(device: str, peak: bool = False) -> float:
    import torch

    if torch.device(device).type != "cuda":
        return 0.0
    return (torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)) / GiB


def long_prompts(n: int = 8) -> list[list[dict]]:
    """n distinct prompts, each long enough to fill any --prompt-tokens (the engine keeps the last tokens)."""
    filler = " ".join(PROMPTS) + " "
    return [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + " " + filler * 60}] for i in range(n)]


def worker(shape_name: str, setting_name: str, args: argparse.Namespace) -> dict:
    """Two PPO updates of one setting in this process: memory, time, achieved rate and the first ratio."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.flops import LinearFlops
    from rlhflow.config.params import PPOConfig
    from rlhflow.models.loading import attn_implementation_for, enable_tf32, resolve_precision
    from rlhflow.ppo.trainer import PPOTrainer
    from tests.fixtures import tiny_tokenizer

    device = args.device
    cuda = torch.device(device).type == "cuda"
    if cuda and args.cap_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        index = torch.device(device).index
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, args.cap_gib * GiB / total), torch.cuda.current_device() if index is None else index
        )
    enable_tf32(device)
    settings = SETTINGS[setting_name]
    dtype = resolve_precision(settings.get("precision", "fp32"), device)
    result: dict = {"run": f"{shape_name}:{setting_name}", "fits": False}
    phase = "matmul"
    with first_ratio_recorded() as ratios:
        try:
            result["matmul_tflops"] = matmul_tflops(device, torch.bfloat16) if cuda else None
            phase = "model"
            tok = tiny_tokenizer()
            shape = {"vocab_size": len(tok), **SHAPES[shape_name]}
            config = LlamaConfig(
                **shape,
                max_position_embeddings=4096,
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
            config._attn_implementation = attn_implementation_for(device, dtype)
            torch.manual_seed(0)
            with torch.device(device):
                policy = LlamaForCausalLM(config).eval()
            result["params_b"] = sum(p.numel() for p in policy.parameters()) / 1e9
            result["attention"] = policy.config._attn_implementation
            phase = "trainer"
            cfg = PPOConfig(
                **settings,
                steps=100,
                max_prompt_length=args.prompt_tokens,
                max_new_tokens=args.new_tokens,
                checkpoint_every=0,
                checkpoint_dir="/tmp/gpu_ppo_bench",
            )
            trainer = PPOTrainer(
                cfg,
                policy=policy,
                tokenizer=tok,
                score_fn=lambda p, texts: torch.tensor([min(len(t), 200) / 100 for t in texts]),
                prompts=long_prompts(),
                device=device,
                seed=0,
            )
            del policy
            result["models_gib"] = _allocated(device)  # policy, reference, sampling copy, critic
            phase = "update 1"
            trainer.update()
            phase = "update 2"
            sync(device)
            with LinearFlops() as flops:
                start = time.perf_counter()
                stats = trainer.update()
                sync(device)
                result["update_s"] = time.perf_counter() - start
            result.update(
                fits=True,
                first_ratio=ratios[0],
                response_tokens=stats["ppo/response_length"] * cfg.batch_size,
                generation_s=stats["time/generation_s"],
                forward_s=stats["time/forward_s"],
                training_s=stats["time/training_s"],
                training_tflops=flops.trained / stats["time/training_s"] / 1e12,
                after_gib=_allocated(device),  # the models plus AdamW's state
            )
        except torch.OutOfMemoryError as exc:
            result["error"] = f"out of memory in {phase}: {str(exc).splitlines()[0][:200]}"
    result["peak_gib"] = _allocated(device, peak=True)
    result["reserved_gib"] = torch.cuda.max_memory_reserved(device) / GiB if cuda else 0.0
    return result


def run_in_subprocess(run: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "bench.gpu_ppo", "--worker", run, "--device", args.device]
    cmd += ["--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
    cmd += ["--cap-gib", str(args.cap_gib)] if args.cap_gib else []
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    result = last_result(proc.stdout)
    if result is None:
        return {"run": run, "fits": False, "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    return result


def table(rows: list[dict]) -> str:
    lines = [
        "| run | params (B) | peak GiB (reserved) | models GiB | after GiB | update s (generation / forward / "
        "training) | PPO epochs TFLOP/s (of matmul) | first max \\|ratio-1\\| |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        if not r.get("fits"):
            why = r.get("error", "").strip().splitlines()[-1:] or [""]
            why = why[0]
            verdict = "does not fit" if "out of memory" in why else "failed"
            lines.append(f"| {r['run']} | {r.get('params_b', 0):.2f} | {verdict}: {why[:120]} | | | | | |")
            continue
        settings = SETTINGS.get(r["run"].split(":")[1], {})
        if settings.get("gradient_checkpointing") or settings.get("lora"):
            # LinearFlops would count the recomputed forward and a frozen weight's backward as trained work
            rate_cell = "n/a"
        else:
            rate = r["training_tflops"]
            rate_cell = f"{rate:.1f}" + (f" ({rate / r['matmul_tflops']:.0%})" if r.get("matmul_tflops") else "")
        lines.append(
            f"| {r['run']} | {r['params_b']:.2f} | {r['peak_gib']:.1f} ({r['reserved_gib']:.1f}) "
            f"| {r['models_gib']:.1f} | {r['after_gib']:.1f} | {r['update_s']:.1f} ({r['generation_s']:.1f} / "
            f"{r['forward_s']:.1f} / {r['training_s']:.1f}) | {rate_cell} | {r['first_ratio']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=",".join(RUNS), help="shape:setting, comma-separated")
    parser.add_argument("--device", default="cuda", help="torch device (cpu for a smoke run)")
    parser.add_argument("--cap-gib", type=float, default=None, help="GPU memory cap per process, GiB")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt length (ppo.max_prompt_length)")
    parser.add_argument("--new-tokens", type=int, default=512, help="response length (ppo.max_new_tokens)")
    parser.add_argument("--out", default=None, help="append each run's result as a JSON line here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        shape, setting = args.worker.split(":")
        print("RESULT " + json.dumps(worker(shape, setting, args)), flush=True)
        return
    facts = cuda_path(args.device)
    print("CUDA path: " + json.dumps(facts), flush=True)
    rows = []
    for run in args.runs.split(","):
        start = time.perf_counter()
        rows.append(run_in_subprocess(run, args))
        rows[-1]["wall_s"] = time.perf_counter() - start
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({**rows[-1], "cuda_path": facts}) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
