"""Our engine (rlhflow.ppo.trainer.PPOTrainer) on a prepared workload; runs in the project venv.

    .venv/bin/python -m bench.ppo_worker_rlhflow --workload-dir bench/.work/tiny --out ours.json --threads 2

The phase split comes from the trainer's own timers: generation = time/generation_s; scoring =
time/forward_s (old log-probs and values, reference log-probs) + time/scoring_s (the reward model);
training = time/training_s. `total_s` is the wall time of `PPOTrainer.update()`.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from bench.common import open_workload, reset_peak_memory, sync, write_result


def main() -> None:
    args, spec, torch, root, device, dtype = open_workload(__doc__.splitlines()[0])
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhflow.config.params import PPOConfig
    from rlhflow.models.loading import load_causal_lm
    from rlhflow.ppo.trainer import PPOTrainer
    from rlhflow.training.reward_model import RewardModel

    tokenizer = AutoTokenizer.from_pretrained(root / "policy")
    policy = load_causal_lm(str(root / "policy"), dtype=dtype, pad_token_id=tokenizer.pad_token_id)
    reward = AutoModelForSequenceClassification.from_pretrained(root / "reward", dtype=dtype, use_safetensors=True)
    reward_model = RewardModel(
        reward,
        AutoTokenizer.from_pretrained(root / "reward"),
        max_length=4096,
        batch_size=spec["batch_size"],
        device=device,
    )
    reset_peak_memory(device)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = PPOConfig(
            steps=spec["warmup"] + spec["updates"],
            batch_size=spec["batch_size"],
            mini_batch_size=spec["mini_batch_size"],
            ppo_epochs=spec["ppo_epochs"],
            max_new_tokens=spec["max_new_tokens"],
            temperature=spec["temperature"],
            learning_rate=spec["learning_rate"],
            kl_coef=spec["kl_coef"],
            gamma=1.0,
            lam=1.0,
            value_model=args.value_model,
            lora={"enabled": args.lora},
            checkpoint_every=0,
            checkpoint_dir=f"{tmp}/ckpt",
            out_dir=f"{tmp}/policy",
        )
        trainer = PPOTrainer(
            cfg,
            policy=policy,
            tokenizer=tokenizer,
            score_fn=reward_model.score,
            prompts=spec["prompts"],
            device=device,
            seed=spec["seed"],
        )
        updates = []
        profiler = None
        for i in range(cfg.steps):
            if args.profile and i == spec["warmup"]:
                profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU]
                    + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
                )
                profiler.__enter__()
            sync(device)
            start = time.perf_counter()
            stats = trainer.update()
            sync(device)
            total = time.perf_counter() - start
            updates.append(
                {
                    "total_s": total,
                    "generation_s": stats["time/generation_s"],
                    "scoring_s": stats["time/forward_s"] + stats["time/scoring_s"],
                    "training_s": stats["time/training_s"],
                    "response_tokens": stats["ppo/response_length"] * spec["batch_size"],
                }
            )
        if profiler is not None:
            profiler.__exit__(None, None, None)
            Path(args.profile).write_text(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    write_result(
        args.out,
        engine="ours",
        spec=spec,
        updates=updates,
        device=device,
        extra={
            "value_model": args.value_model,
            "lora": args.lora,
            "threads": args.threads,
            "trained_params": sum(p.numel() for p in trainer.params),
        },
    )


if __name__ == "__main__":
    sys.exit(main())
