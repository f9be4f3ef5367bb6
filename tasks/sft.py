"""Stage sft: load the SFT model (Hub id, local dir, GGUF file or packaged default), keep a plain safetensors
copy as the stage output (the policy's starting point and the frozen reference), and record the baseline:
perplexity on held-out reference responses and a few sample generations."""

from __future__ import annotations

# Heavy imports (torch, transformers, mlflow, the library's model code) are deferred into the stage body, so
# that importing the module (the flow does, to get its task; so does `--help`) stays fast.
from rlhflow.config import Config
from tasks._common import StageContext, cli, stage_task

NAME = "sft"


def run(cfg: Config, ctx: StageContext) -> dict[str, float]:
    import mlflow
    import torch

    from rlhflow import tracking
    from rlhflow.data.formats import read_jsonl
    from rlhflow.fsutil import atomic_dir
    from rlhflow.metrics import perplexity
    from rlhflow.models import load_causal_lm, load_tokenizer, pick_device, save_plain
    from rlhflow.policy import sample_responses

    s = cfg.sft
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(s.model, trust_remote_code=s.trust_remote_code)
    model = load_causal_lm(s.model, trust_remote_code=s.trust_remote_code, pad_token_id=tokenizer.pad_token_id)
    out_dir = cfg.path(s.out_dir)
    with atomic_dir(out_dir) as tmp:
        save_plain(model, tokenizer, tmp)

    device = pick_device(cfg.device)
    model.to(device).eval()
    test = read_jsonl(cfg.path(cfg.validate_.out_dir) / "test.jsonl")
    held_out = test.drop_duplicates("prompt").head(s.perplexity_rows)
    ppl = perplexity(
        model, tokenizer, list(held_out["prompt_messages"]), list(held_out["chosen"]), batch_size=s.batch_size
    )
    metrics = {"sft/perplexity": ppl, "sft/parameters": float(sum(p.numel() for p in model.parameters()))}

    if s.n_samples:
        rows = held_out.head(s.n_samples)
        outs = sample_responses(
            model,
            tokenizer,
            list(rows["prompt_messages"]),
            batch_size=s.batch_size,
            max_prompt_length=cfg.ppo.max_prompt_length,
            max_new_tokens=s.max_new_tokens,
            temperature=cfg.eval_temperature,
            top_k=cfg.ppo.top_k,
            top_p=cfg.ppo.top_p,
            seed=cfg.seed,
        )
        responses = [t for o in outs for t in o.texts]
        mlflow.log_table({"prompt": list(rows["prompt"]), "response": responses}, artifact_file="sft_samples.json")
    ctx.log_metrics(metrics)
    tracking.log_model_dir(cfg, out_dir, name="sft_model", kind="policy")
    return metrics


task = stage_task(NAME, run)

if __name__ == "__main__":
    cli(NAME, run)
