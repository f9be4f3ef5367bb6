"""TRL 1.12's PPOTrainer (trl.experimental.ppo) on a prepared workload; runs in the peer venv bench/.venv-trl.

    bench/.venv-trl/bin/python -m bench.ppo_worker_trl --workload-dir bench/.work/tiny --out trl.json --threads 2

How it measures: docs/benchmark-methods.md#ppo_worker_trl.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from bench.common import (  # noqa: E402
    PhaseClock,
    open_workload,
    reset_peak_memory,
    write_result,
)


def instrument(ppo_module, clock: PhaseClock) -> None:
    """Wrap TRL's rollout helpers so that `clock` sees the phase boundaries."""
    import torch

    batch_generation, forward = ppo_module.batch_generation, ppo_module.forward

    def timed_generation(*args, **kwargs):
        clock.mark("generation_s")
        out = batch_generation(*args, **kwargs)
        clock.mark("scoring_s")
        return out

    def timed_forward(*args, **kwargs):
        if torch.is_grad_enabled() and clock._phase != "training_s":
            clock.mark("training_s")
        return forward(*args, **kwargs)

    ppo_module.batch_generation, ppo_module.forward = timed_generation, timed_forward


def main() -> None:
    args, spec, torch, root, device, dtype = open_workload(__doc__.splitlines()[0])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_module

    tokenizer = AutoTokenizer.from_pretrained(root / "policy")
    tokenizer.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(root / "policy", dtype=dtype, use_safetensors=True)
    value = AutoModelForSequenceClassification.from_pretrained(
        root / "policy", num_labels=1, dtype=dtype, use_safetensors=True
    )
    reward = AutoModelForSequenceClassification.from_pretrained(root / "reward", dtype=dtype, use_safetensors=True)
    dataset = Dataset.from_dict({"input_ids": spec["prompt_ids"]})
    clock = PhaseClock(device)
    instrument(ppo_module, clock)

    class UpdateClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            clock.start_update()

        def on_step_end(self, *a, **k):
            clock.end_update()
            clock.start_update()

    n_updates = spec["warmup"] + spec["updates"]
    reset_peak_memory(device)
    with tempfile.TemporaryDirectory() as tmp:
        config = PPOConfig(
            output_dir=tmp,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=1,
            use_cpu=device == "cpu",
            bf16=spec["dtype"] == "bfloat16",
            fp16=False,
            gradient_checkpointing=False,
            per_device_train_batch_size=spec["batch_size"],
            gradient_accumulation_steps=1,
            num_mini_batches=spec["batch_size"] // spec["mini_batch_size"],
            num_ppo_epochs=spec["ppo_epochs"],
            local_rollout_forward_batch_size=spec["batch_size"],
            total_episodes=spec["batch_size"] * n_updates,
            response_length=spec["max_new_tokens"],
            temperature=spec["temperature"],
            learning_rate=spec["learning_rate"],
            lr_scheduler_type="constant",
            adam_epsilon=1e-5,
            weight_decay=0.0,
            kl_coef=spec["kl_coef"],
            gamma=1.0,
            lam=1.0,
            stop_token="eos",
            missing_eos_penalty=1.0,
            num_sample_generations=0,
            seed=spec["seed"],
            dataloader_num_workers=0,
        )
        trainer = PPOTrainer(
            args=config,
            processing_class=tokenizer,
            model=policy,
            ref_model=None,
            reward_model=reward,
            train_dataset=dataset,
            eval_dataset=dataset,
            value_model=value,
            callbacks=[UpdateClock()],
        )
        profiler = None
        if args.profile:  # the whole run: TRL's loop cannot be entered between updates
            profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]
                + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
            )
            profiler.__enter__()
        trainer.train()
        if profiler is not None:
            profiler.__exit__(None, None, None)
            Path(args.profile).write_text(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    if len(clock.updates) != n_updates:
        raise RuntimeError(f"TRL ran {len(clock.updates)} updates, expected {n_updates}")
    for u in clock.updates:
        u["response_tokens"] = spec["batch_size"] * spec["max_new_tokens"]
    write_result(
        args.out,
        engine="trl",
        spec=spec,
        updates=clock.updates,
        device=device,
        extra={
            "value_model": "separate",
            "lora": False,
            "threads": args.threads,
            "trained_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        },
    )


if __name__ == "__main__":
    sys.exit(main())
