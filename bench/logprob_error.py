"""How far PPO's bf16 log-probabilities are from fp32's, per response token, with the output layer in bf16 and in
fp32 (`ppo.fp32_lm_head`), printed as a Markdown table.

    .venv/bin/python -m bench.logprob_error --model models/sft --prompts data/validated/train.jsonl --prompts-n 64

How it measures: docs/benchmark-methods.md#logprob_error.
"""

from __future__ import annotations

import argparse
import copy
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# A light door: torch and rlhflow.models are imported inside the functions that use them, so --help answers at once.

SETTINGS = {"bf16": False, "bf16, fp32 output layer": True}


def differences(
    policy, tokenizer, prompts, *, fp32_head: bool, max_prompt_length: int, args
) -> dict[str, torch.Tensor]:
    """Per response token (flattened): the sampled log-probs as decoded, from a bf16 full pass and from fp32."""
    import torch

    from rlhflow.models.generation import generate
    from rlhflow.models.loading import linear_weights_to, output_layer_in_fp32
    from rlhflow.models.logits import logprobs_from_logits
    from rlhflow.models.policy import encode_prompts, sequence_logprobs

    bf16 = torch.bfloat16
    trained = output_layer_in_fp32(copy.deepcopy(policy)) if fp32_head else policy  # what training computes with
    sampler = linear_weights_to(copy.deepcopy(trained), bf16).eval()  # what PPO samples from
    rows = {"decode": [], "full": [], "fp32": [], "eos": []}
    for start in range(0, len(prompts), args.batch_size):
        ids, mask = encode_prompts(tokenizer, prompts[start : start + args.batch_size], max_prompt_length)
        t = args.temperature
        out = generate(
            sampler,
            tokenizer,
            ids,
            mask,
            max_new_tokens=args.max_new_tokens,
            temperature=t,
            generator_seed=args.seed + start,
            return_logits=True,
            compute_dtype=bf16,
        )
        real = out.response_mask.bool()
        decoded = logprobs_from_logits(out.logits.float() / t, out.response)
        ctx = out.context_length
        full = sequence_logprobs(trained, out.query_response, out.attention_mask, ctx, t, compute_dtype=bf16)
        exact = sequence_logprobs(policy, out.query_response, out.attention_mask, ctx, t)
        eos = torch.zeros_like(real)
        eos[torch.arange(len(real)), real.sum(1) - 1] = out.ended
        for name, values in (("decode", decoded), ("full", full), ("fp32", exact), ("eos", eos)):
            rows[name].append(values[real])
    return {name: torch.cat(values) for name, values in rows.items()}


def table(results: dict[str, dict[str, torch.Tensor]]) -> str:
    lines = [
        "| setting | tokens (EOS) | decode - full: mean, mean abs | full - fp32: mean, mean abs | "
        "full - fp32 at EOS: mean, mean abs |",
        "|---|---|---|---|---|",
    ]
    for setting, r in results.items():

        def cell(d: torch.Tensor) -> str:
            return f"{d.mean():+.4f}, {d.abs().mean():.4f}" if len(d) else "-"

        eos = r["eos"]
        lines.append(
            f"| {setting} | {len(eos)} ({int(eos.sum())}) | {cell(r['decode'] - r['full'])} | "
            f"{cell(r['full'] - r['fp32'])} | {cell((r['full'] - r['fp32'])[eos])} |"
        )
    return "\n".join(lines)


def main() -> None:
    from rlhflow.config.params import load_config

    ppo = load_config().ppo  # PPO's sampling settings as params.yaml sets them
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a plain model dir, e.g. the sft stage's models/sft")
    parser.add_argument("--prompts", required=True, help="a validated split (.jsonl with prompt_messages)")
    parser.add_argument("--prompts-n", type=int, default=64, help="distinct prompts (default 64)")
    parser.add_argument("--batch-size", type=int, default=ppo.batch_size, help="prompts per sampling batch")
    parser.add_argument("--max-new-tokens", type=int, default=ppo.max_new_tokens)
    parser.add_argument("--temperature", type=float, default=ppo.temperature)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from bench.ppo_precision import load_prompts
    from rlhflow.models.loading import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(args.model)
    policy = load_causal_lm(args.model, pad_token_id=tokenizer.pad_token_id).eval()
    prompts = load_prompts(args.prompts, args.prompts_n)
    with torch.no_grad():
        results = {
            name: differences(
                policy, tokenizer, prompts, fp32_head=head, max_prompt_length=ppo.max_prompt_length, args=args
            )
            for name, head in SETTINGS.items()
        }
    print(table(results))


if __name__ == "__main__":
    main()
