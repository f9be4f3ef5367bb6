"""A policy against the SFT model on held-out prompts, reward models on held-out pairs, challengers against champions.

What the evaluate stage measures, and how (each figure computed here or in the one module named):
- prompts: one per held-out conversation (`evaluation_prompts`), all of them unless `evaluate.n_prompts` says
  fewer, of both held-out splits: test for every figure reported (eval/...), dev for the figures choices read
  (dev/...: the champion rule, a sweep's best point); the test split never chooses;
- answers: both models sample with the evaluation's settings (rlhflow.sampling.evaluation_sampling) up to
  `evaluate.max_new_tokens`; the SFT model's answers and their scores are the sft_answers stage's output
  (`sample_reference`), sampled once for every evaluate and sweep point; each answer is ended, cut or degenerate
  (rlhflow.evaluation.answers);
- win rates of the policy over the SFT model by the proxy and by the judge (rlhflow.evaluation.judges), overall and
  on the prompts where both answers ended, with 95% intervals from a bootstrap over conversations; the same
  resamples give the interval of the proxy-judge gap (rlhflow.evaluation.stats);
- length-controlled win rates (AlpacaEval 2.0 LC, rlhflow.evaluation.stats), flagged unsupported when the data do
  not cover equal lengths;
- reward-model accuracy on held-out pairs beside the length rule ("the shorter answer is chosen"), with intervals
  (rlhflow.reward_model.evaluate_pairs), calibration and ranking agreement (rlhflow.evaluation.metrics);
- drift: answer length, EOS share, distinct-n, repetition; KL to the SFT model and perplexity
  (rlhflow.evaluation.metrics);
- head-to-head comparisons on the dev split for the champion rule (rlhflow.evaluation.champion).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlhflow.config import Config
from rlhflow.evaluate_config import ChampionConfig
from rlhflow.evaluation import stats
from rlhflow.evaluation.answers import Answers
from rlhflow.evaluation.champion import HeadToHead, alpha_spent, guard_failures, sign_test
from rlhflow.evaluation.frontier import objective_scores
from rlhflow.evaluation.judges import verdicts_from_scores
from rlhflow.evaluation.metrics import (
    confidence_buckets,
    distinct_n,
    expected_calibration_error,
    mean_length,
    ranking_agreement,
    repetition_rate,
)

# the bootstrap's seed: fixed, so every run's intervals are drawn the same way whatever its training seed
BOOTSTRAP_SEED = 0
REFERENCE_FILE = "answers.json"


# ---- prompts and answers ----------------------------------------------------------------------------------------


def evaluation_prompts(test_file: Path, n_prompts: int | None):
    """One prompt per test conversation (its first row in the file: the conversation's shallowest branch there), in
    file order; the first `n_prompts` of them when set. Columns: prompt, prompt_messages, conversation."""
    from rlhflow.data.readers import read_jsonl
    from rlhflow.data.splits import conversation_keys

    test = read_jsonl(test_file)
    test = test.assign(conversation=conversation_keys(test).to_numpy())
    prompts = test.drop_duplicates("conversation")[["prompt", "prompt_messages", "conversation"]]
    return prompts.head(n_prompts) if n_prompts is not None else prompts


# the held-out splits answered: test for the report, dev for choosing (the champion rule, a sweep's best point)
HELD_OUT = ("test", "dev")


def held_out_files(cfg: Config) -> dict[str, Path]:
    """test.jsonl, and dev.jsonl where validate wrote one (validate.dev_fraction > 0)."""
    validated = cfg.path(cfg.validate_.out_dir)
    return {s: validated / f"{s}.jsonl" for s in HELD_OUT if s == "test" or (validated / f"{s}.jsonl").exists()}


@dataclass
class HeldOutPrompts:
    """The evaluation prompts of each held-out split, one row per answer (k samples per prompt in a row), and the
    order in which both models answer them all at once: test first, then dev."""

    prompts: dict[str, list]  # per split: prompt messages
    texts: dict[str, list[str]]  # per split: prompt texts
    conversations: dict[str, list[str]]  # per split: each row's conversation, the bootstrap's clusters
    counts: dict[str, int]  # per split: distinct prompts

    @classmethod
    def load(cls, cfg: Config) -> HeldOutPrompts:
        k = cfg.evaluate.samples_per_prompt
        frames = {split: evaluation_prompts(f, cfg.evaluate.n_prompts) for split, f in held_out_files(cfg).items()}
        return cls(
            {s: repeated(list(df["prompt_messages"]), k) for s, df in frames.items()},
            {s: repeated(list(df["prompt"]), k) for s, df in frames.items()},
            {s: repeated(list(df["conversation"]), k) for s, df in frames.items()},
            {s: len(df) for s, df in frames.items()},
        )

    def all(self) -> list:
        return [p for split in self.prompts for p in self.prompts[split]]

    def sizes(self) -> dict[str, int]:
        return {split: len(p) for split, p in self.prompts.items()}


def sample(model, tokenizer, prompt_messages, cfg: Config, *, max_new_tokens: int | None = None):
    """Answers to `prompt_messages` with the evaluation's sampling settings (`max_new_tokens`: another limit)."""
    import dataclasses

    from rlhflow.sampling import evaluation_sampling

    settings = evaluation_sampling(cfg)
    if max_new_tokens is not None:
        settings = dataclasses.replace(settings, max_new_tokens=max_new_tokens)
    return settings.sample(model, tokenizer, prompt_messages)


def texts_of(outputs) -> list[str]:
    return [t for o in outputs for t in o.texts]


def repeated(items: list, k: int) -> list:
    """Each item k times in a row: the rows of k samples per prompt."""
    return [x for x in items for _ in range(k)]


def as_precision(model, dtype):
    """The model in `dtype` for sampling and scoring (a copy when it differs: the fp32 weights stay for
    perplexity, which is compared with the sft stage's fp32 figure)."""
    import copy

    import torch

    return model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)


def sample_reference(cfg: Config, out_dir: Path) -> dict[str, float]:
    """The sft_answers stage: the SFT model's answers to the evaluation prompts of both held-out splits, classified,
    with the proxy's scores (and the judge's, for a judge that scores answers one at a time), written to `out_dir`
    with what they are keyed by (`reference_key`). Returns the answers' class shares per split."""
    from rlhflow.evaluation.judges import load_judge
    from rlhflow.fsutil import write_json_atomic
    from rlhflow.models import load_causal_lm, load_tokenizer, pick_device, resolve_precision
    from rlhflow.reward_model import RewardModel
    from rlhflow.sampling import evaluation_sampling

    e = cfg.evaluate
    device = pick_device(cfg.device)
    sft_dir = cfg.path(cfg.sft.out_dir)
    held_out = HeldOutPrompts.load(cfg)
    prompts = held_out.all()

    tokenizer = load_tokenizer(str(sft_dir))
    sft = load_causal_lm(str(sft_dir), pad_token_id=tokenizer.pad_token_id).to(device).eval()
    sft = as_precision(sft, resolve_precision(e.precision, device))
    answers = Answers.from_outputs(evaluation_sampling(cfg).sample(sft, tokenizer, prompts), e.degenerate_repetition)
    del sft

    rm = RewardModel.load(
        cfg.path(cfg.reward_model.out_dir), batch_size=cfg.reward_model.eval_batch_size, device=device
    )
    answers.extra["proxy"] = rm.score(prompts, answers.texts).tolist()
    judge = load_judge(cfg.judge, cfg.path(cfg.judge.out_dir), batch_size=cfg.judge.eval_batch_size, device=device)
    if judge.pointwise:
        answers.extra["judge"] = [float(x) for x in judge.score(prompts, answers.texts)]
    parts = answers.split(held_out.sizes())
    record = {
        "key": reference_key(cfg, prompts=held_out.counts),
        "answers": {split: part.to_json() for split, part in parts.items()},
    }
    write_json_atomic(Path(out_dir) / REFERENCE_FILE, record)
    metrics = {"sft_answers/answers": float(len(answers))}
    for split, part in parts.items():
        prefix = "sft_answers/" if split == "test" else f"sft_answers/{split}_"
        metrics.update({f"{prefix}{name}": share for name, share in part.shares().items()})
    return metrics


def reference_key(cfg: Config, *, prompts: dict[str, int]) -> dict:
    """What the SFT answers depend on besides the code: the SFT model, the held-out split files, the number of
    evaluation prompts of each (`prompts`) and every sampling and classification setting. The sft_answers stage
    writes it with the answers; evaluate takes them only under the same key."""
    from rlhflow.fsutil import dir_md5, file_md5
    from rlhflow.sampling import evaluation_sampling

    e = cfg.evaluate
    return {
        "sft_md5": dir_md5(cfg.path(cfg.sft.out_dir)),
        "held_out_md5": {split: file_md5(path) for split, path in held_out_files(cfg).items()},
        "prompts": prompts,
        "samples_per_prompt": e.samples_per_prompt,
        "sampling": evaluation_sampling(cfg).key(),
        "degenerate_repetition": e.degenerate_repetition,
        "precision": e.precision,
    }


def load_reference(cfg: Config, *, prompts: dict[str, int]) -> dict[str, Answers]:
    """The sft_answers stage's output per held-out split, for `prompts` evaluation prompts of each; an error naming
    what differs when it was sampled for another SFT model, other prompts or other settings (the flow reruns that
    stage first; a stage run by hand may not have)."""
    path = cfg.path(cfg.evaluate.reference_dir) / REFERENCE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: the SFT model's evaluation answers are missing; run the sft_answers stage")
    record = json.loads(path.read_text())
    expected = reference_key(cfg, prompts=prompts)
    differs = sorted(k for k in expected if record["key"].get(k) != expected[k])
    if differs:
        raise ValueError(
            f"{path} was sampled with other {', '.join(differs)} than this evaluation's; rerun the sft_answers stage "
            "(the pipeline flow and `dvc repro` do)"
        )
    return {split: Answers.from_json(answers) for split, answers in record["answers"].items()}


# ---- figures ------------------------------------------------------------------------------------------------------


def text_metrics(answers: Answers, suffix: str = "") -> dict[str, float]:
    """Drift and reward-hacking signals of one model's answers (suffix "_sft" for the SFT model's): the share of
    each answer class, length, EOS share, distinct-n, repetition."""
    texts = answers.texts
    return {
        **{f"eval/answers_{name}{suffix}": share for name, share in answers.shares().items()},
        f"eval/eos_fraction{suffix}": float(np.mean(answers.ended)) if len(answers) else math.nan,
        f"eval/answer_tokens{suffix}": float(np.mean(answers.tokens)) if len(answers) else math.nan,
        f"eval/response_length{suffix}": mean_length(texts),
        f"eval/distinct_1{suffix}": distinct_n(texts, 1),
        f"eval/distinct_2{suffix}": distinct_n(texts, 2),
        f"eval/repetition_rate{suffix}": repetition_rate(texts),
    }


def _with_interval(name: str, value_low_high: tuple[float, float, float], interval: str = "") -> dict[str, float]:
    """`name` and its interval as `<interval or name>_ci_low` / `_ci_high`."""
    value, low, high = value_low_high
    return {name: value, f"{interval or name}_ci_low": low, f"{interval or name}_ci_high": high}


def win_metrics(name: str, verdicts, both_ended: np.ndarray, char_difference, weights, conversations):
    """`eval/<name>_vs_sft` and its interval, the same on prompts where both answers ended, and the length-controlled
    win rate with its support flag. `name`: win_rate (the proxy) or judge_win_rate."""
    win = np.asarray(verdicts.wins, dtype=float)
    metrics = _with_interval(f"eval/{name}_vs_sft", stats.mean_interval(win, weights), f"eval/{name}")
    if both_ended.any():
        idx = np.flatnonzero(both_ended)
        sub_weights = stats.resample_weights(len(idx), clusters=[conversations[i] for i in idx], seed=BOOTSTRAP_SEED)
        metrics.update(_with_interval(f"eval/{name}_both_ended", stats.mean_interval(win[idx], sub_weights)))
    lc = stats.length_controlled_win_rate(verdicts.preference, char_difference, weights, prompt_ids=conversations)
    metrics.update(_with_interval(f"eval/{name}_lc", (lc.value, lc.low, lc.high)))
    metrics[f"eval/{name}_lc_supported"] = float(lc.supported)
    return metrics


def comparison_metrics(
    policy: Answers,
    sft: Answers,
    proxy,
    judge,
    conversations: list[str],
    judge_scores=None,
    missing_eos_penalty: float | None = None,
) -> dict[str, float]:
    """The policy against the SFT model on the same prompts (row i of each: the same prompt and sample), by the proxy
    and the judge (`Verdicts`): mean rewards, win rates overall and where both answers ended, their
    length-controlled versions and the proxy-judge gap, each with a 95% interval from one set of resamples of the
    conversations. `judge_scores`: (policy, sft) scores of a pointwise judge, for its mean rewards.
    `eval/objective_mean` is the score PPO optimised: the proxy minus `missing_eos_penalty` for an answer that did
    not end (the frontier compares best-of-n with the policies on it)."""
    weights = stats.resample_weights(len(policy), clusters=conversations, seed=BOOTSTRAP_SEED)
    both_ended = policy.is_class("ended") & sft.is_class("ended")
    char_difference = np.array([len(p) - len(s) for p, s in zip(policy.texts, sft.texts)], dtype=float)
    policy_proxy, sft_proxy = (np.asarray(x.extra["proxy"], dtype=float) for x in (policy, sft))
    metrics = {
        "eval/prompts": float(len(set(conversations))),
        "eval/answers": float(len(policy)),
        "eval/expected_half_width": stats.expected_half_width(len(set(conversations))),
        "eval/both_ended_prompts": float(both_ended.sum()),
        **_with_interval("eval/reward_mean", stats.mean_with_interval(policy_proxy, weights)),
        "eval/reward_mean_sft": float(sft_proxy.mean()),
        **win_metrics("win_rate", proxy, both_ended, char_difference, weights, conversations),
        **win_metrics("judge_win_rate", judge, both_ended, char_difference, weights, conversations),
        # reward hacking shows as a proxy win rate above the judge's
        **_with_interval("eval/proxy_judge_gap", stats.difference_interval(proxy.wins, judge.wins, weights)),
    }
    if missing_eos_penalty is not None:
        objective = objective_scores(policy_proxy, np.asarray(policy.ended), missing_eos_penalty)
        metrics.update(_with_interval("eval/objective_mean", stats.mean_with_interval(objective, weights)))
        sft_objective = objective_scores(sft_proxy, np.asarray(sft.ended), missing_eos_penalty)
        metrics["eval/objective_mean_sft"] = float(sft_objective.mean())
    if judge_scores is not None:
        policy_judged, sft_judged = (np.asarray(x, dtype=float) for x in judge_scores)
        metrics.update(_with_interval("eval/judge_reward_mean", stats.mean_with_interval(policy_judged, weights)))
        metrics["eval/judge_reward_mean_sft"] = float(sft_judged.mean())
    if judge.malformed:
        metrics["eval/judge_malformed"] = float(judge.malformed)
    return metrics


def reward_model_metrics(pairs, rows: list[dict]) -> tuple[dict[str, float], list]:
    """The proxy on the held-out pairs (`rlhflow.reward_model.evaluate_pairs` of `rows`) as `rm/` metrics:
    accuracy and the length rule beside it, calibration, and agreement of its scores with the human ranking of
    each prompt's responses; and the confidence buckets (rlhflow.evaluation.metrics.ConfidenceBucket) behind the
    calibration."""
    from rlhflow.reward_model import LENGTH_AWARE_METRICS

    buckets = confidence_buckets(pairs.chosen - pairs.rejected)  # raw scores: the Bradley-Terry probability
    scores = {}
    for row, c, r in zip(rows, pairs.chosen.tolist(), pairs.rejected.tolist()):
        scores.setdefault((row["prompt"], row["chosen"]), c)
        scores.setdefault((row["prompt"], row["rejected"]), r)
    tau, ranked_prompts = ranking_agreement(rows, scores)
    metrics = {
        "rm/accuracy": pairs.metrics["accuracy"],
        **{f"rm/{key}": pairs.metrics[key] for key in LENGTH_AWARE_METRICS},
        "rm/ece": expected_calibration_error(buckets),
        "rm/kendall_tau": tau,
        "rm/ranked_prompts": float(ranked_prompts),
    }
    metrics.update({f"rm/accuracy_conf_{b.label}": b.accuracy for b in buckets})
    return metrics, buckets


# ---- the dev split's figures, for choosing ------------------------------------------------------------------------

# what the dev split reports (as dev/...): what a choice reads, not the whole evaluation
DEV_KEYS = (
    "eval/prompts",
    "eval/expected_half_width",
    "eval/both_ended_prompts",
    "eval/win_rate",
    "eval/judge_win_rate",
    "eval/objective_mean",
    "eval/answers_",
    "eval/answer_tokens",
    "eval/eos_fraction",
)


def dev_metrics(metrics: dict[str, float], kl: float) -> dict[str, float]:
    """The choosing figures of a comparison on the dev split (`comparison_metrics` and `text_metrics` of its
    answers), renamed dev/...: the policy's, not the SFT side's (..._sft); NaN ones left out."""
    chosen = {
        "dev/" + k.removeprefix("eval/"): v
        for k, v in metrics.items()
        if k.startswith(DEV_KEYS) and (k.endswith("_vs_sft") or not k.endswith("_sft")) and not math.isnan(v)
    }
    return chosen | ({"dev/kl": kl} if not math.isnan(kl) else {})


@dataclass
class DevAnswers:
    """The evaluated policy on the dev split: what the champion rule compares and guards."""

    prompts: list
    conversations: list[str]
    answers: Answers
    kl: float  # mean KL to the SFT model on these answers
    pair_rows: list[dict]  # the dev split's pairs
    pairs: Any  # the proxy's verdict on each of them


# ---- head to head, for the champion rule ------------------------------------------------------------------------


def policy_head_to_head(
    verdicts, conversations: list[str], rule: ChampionConfig, challenge: int, guards_failed: tuple[str, ...] = ()
) -> HeadToHead:
    """The challenger's win rate over the champion by the judge on the pairs given (both answers ended), with the
    sign test over their conversations at the level of this challenge."""
    weights = stats.resample_weights(len(verdicts.wins), clusters=conversations, seed=BOOTSTRAP_SEED)
    return HeadToHead(
        "judge win rate over the champion, both ended",
        *stats.mean_interval(verdicts.wins, weights),
        test=sign_test(verdicts.wins, conversations, tie=0.5),
        level=alpha_spent(rule.alpha, challenge),
        challenge=challenge,
        guards_failed=guards_failed,
    )


def reward_model_head_to_head(
    challenger_correct, champion_correct, conversations: list[str], rule: ChampionConfig, challenge: int
) -> HeadToHead:
    """The challenger's accuracy minus the champion's on the same pairs, with the sign test over their
    conversations (pairs both rank alike are ties) at the level of this challenge."""
    weights = stats.resample_weights(len(challenger_correct), clusters=conversations, seed=BOOTSTRAP_SEED)
    value = stats.difference_interval(challenger_correct, champion_correct, weights)
    difference = np.asarray(challenger_correct, dtype=float) - np.asarray(champion_correct, dtype=float)
    return HeadToHead(
        "accuracy minus the champion's",
        *value,
        test=sign_test(difference, conversations, tie=0.0),
        level=alpha_spent(rule.alpha, challenge),
        challenge=challenge,
    )


# ---- the evaluate stage's measurements ---------------------------------------------------------------------------


@dataclass
class PolicyEvaluation:
    """What `evaluate` measured, with what the champion comparisons need to measure more on the same items."""

    metrics: dict[str, float]
    samples: dict[str, list]  # per answer: the prompt, both answers, their classes, proxy and judge figures, the KL
    buckets: list  # the reward model's confidence buckets (calibration)
    pairs: Any  # the proxy's verdict on each test pair (rlhflow.reward_model.evaluate_pairs)
    dev: DevAnswers | None  # the policy on the dev split (None: no dev split)
    judge: Any  # the loaded judge (rlhflow.evaluation.judges.Judge)
    device: Any


def _verdicts(judge, prompts, policy: Answers, sft: Answers):
    """The judge's verdicts of policy against SFT (row by row) and, for a pointwise judge, both sides' scores."""
    if judge.pointwise:
        scores = (policy.extra["judge"], sft.extra["judge"])
        return verdicts_from_scores(*scores), scores
    return judge.compare(prompts, policy.texts, sft.texts), None


def evaluate(cfg: Config) -> PolicyEvaluation:
    """The policy (`ppo.out_dir`) against the SFT model's answers (the sft_answers stage) on one prompt per held-out
    conversation, scored by the proxy and the judge: every figure on the test split (eval/...), the choosing figures
    on the dev split (dev/...); the proxy's accuracy on every test pair; perplexities on the chosen responses of the
    first `evaluate.perplexity_rows` test prompts. Figures that are NaN (no value) are left out."""
    from rlhflow.data.readers import read_jsonl
    from rlhflow.evaluation.judges import load_judge
    from rlhflow.evaluation.metrics import perplexity, sampled_kl, saved_held_out_perplexity
    from rlhflow.models import load_causal_lm, load_tokenizer, pick_device, resolve_precision
    from rlhflow.reward_model import RewardModel, evaluate_pairs, saved_pair_scores
    from rlhflow.sampling import evaluation_sampling

    e = cfg.evaluate
    device = pick_device(cfg.device)
    dtype = resolve_precision(e.precision, device)
    sft_dir, policy_dir = str(cfg.path(cfg.sft.out_dir)), str(cfg.path(cfg.ppo.out_dir))
    tokenizer = load_tokenizer(sft_dir)
    sft = load_causal_lm(sft_dir, pad_token_id=tokenizer.pad_token_id).to(device).eval()
    policy = load_causal_lm(policy_dir, pad_token_id=tokenizer.pad_token_id).to(device).eval()
    rm_dir = cfg.path(cfg.reward_model.out_dir)
    rm = RewardModel.load(rm_dir, batch_size=cfg.reward_model.eval_batch_size, device=device)
    judge = load_judge(cfg.judge, cfg.path(cfg.judge.out_dir), batch_size=cfg.judge.eval_batch_size, device=device)

    files = held_out_files(cfg)
    held_out = HeldOutPrompts.load(cfg)
    references = load_reference(cfg, prompts=held_out.counts)
    everything = held_out.all()  # both splits at once: full batches, and the SFT model's random streams
    policy_low = as_precision(policy, dtype)
    policy_out = evaluation_sampling(cfg).sample(policy_low, tokenizer, everything)
    answers = Answers.from_outputs(policy_out, e.degenerate_repetition)
    answers.extra["proxy"] = rm.score(everything, answers.texts).tolist()
    if judge.pointwise:
        answers.extra["judge"] = [float(x) for x in judge.score(everything, answers.texts)]
    # per answer, as sampled, in the sampling precision (both models alike)
    kl_all = sampled_kl(
        policy_low,
        as_precision(sft, dtype),
        policy_out,
        cfg.eval_temperature,
        pad_token_id=tokenizer.pad_token_id,
        batch_size=e.score_batch_size,
    )
    del policy_low
    parts = answers.split(held_out.sizes())
    kl = dict(zip(parts, np.split(np.asarray(kl_all), np.cumsum(list(held_out.sizes().values()))[:-1])))

    figures = {}
    for split, policy_answers in parts.items():
        sft_answers = references[split]
        proxy = verdicts_from_scores(policy_answers.extra["proxy"], sft_answers.extra["proxy"])
        judged, judge_scores = _verdicts(judge, held_out.prompts[split], policy_answers, sft_answers)
        figures[split] = (
            comparison_metrics(
                policy_answers,
                sft_answers,
                proxy,
                judged,
                held_out.conversations[split],
                judge_scores,
                cfg.ppo.missing_eos_penalty,
            )
            | text_metrics(policy_answers)
            | text_metrics(sft_answers, "_sft"),
            judged,
            judge_scores,
        )

    test_file = files["test"]
    test = read_jsonl(test_file)
    ref_rows = test.drop_duplicates("prompt").head(e.perplexity_rows)
    ppl_args = (list(ref_rows["prompt_messages"]), list(ref_rows["chosen"]))
    # the SFT model's figure as the sft stage measured it on the same rows; measured here when it has none for them
    sft_perplexity = saved_held_out_perplexity(sft_dir, rows=e.perplexity_rows, data_file=test_file)
    if sft_perplexity is None:
        sft_perplexity = perplexity(sft, tokenizer, *ppl_args, batch_size=e.score_batch_size)
    pair_rows = test.to_dict("records")
    # the proxy's scores of these pairs as its stage saved them (the same model, loaded the same way)
    pairs = evaluate_pairs(rm, pair_rows, scores=saved_pair_scores(rm_dir, data_file=test_file))
    rm_metrics, buckets = reward_model_metrics(pairs, pair_rows)
    test_figures, judged, judge_scores = figures["test"]
    kl_weights = stats.resample_weights(len(kl["test"]), clusters=held_out.conversations["test"], seed=BOOTSTRAP_SEED)
    metrics = {
        **test_figures,
        **_with_interval("eval/kl", stats.mean_with_interval(kl["test"], kl_weights)),  # by conversation
        "eval/perplexity": perplexity(policy, tokenizer, *ppl_args, batch_size=e.score_batch_size),
        "eval/perplexity_sft": sft_perplexity,
        **rm_metrics,
    }
    dev = None
    if "dev" in parts:
        metrics.update(dev_metrics(figures["dev"][0], float(kl["dev"].mean())))
        dev_rows = read_jsonl(files["dev"]).to_dict("records")
        dev = DevAnswers(
            held_out.prompts["dev"],
            held_out.conversations["dev"],
            parts["dev"],
            float(kl["dev"].mean()),
            dev_rows,
            evaluate_pairs(rm, dev_rows),
        )
    policy_answers, sft_answers = parts["test"], references["test"]
    samples = {
        "prompt": held_out.texts["test"],
        "sft_response": sft_answers.texts,
        "ppo_response": policy_answers.texts,
        "sft_class": sft_answers.classes,
        "ppo_class": policy_answers.classes,
        "sft_reward": [float(x) for x in sft_answers.extra["proxy"]],
        "ppo_reward": [float(x) for x in policy_answers.extra["proxy"]],
        "judge_preference": [float(x) for x in judged.preference],
        "kl": [float(x) for x in kl["test"]],
    }
    if judge_scores is not None:
        samples["sft_judge"], samples["ppo_judge"] = judge_scores[1], judge_scores[0]
    return PolicyEvaluation(
        metrics={k: v for k, v in metrics.items() if not math.isnan(v)},  # NaN: "no value", in MLflow and DVC alike
        samples=samples,
        buckets=buckets,
        pairs=pairs,
        dev=dev,
        judge=judge,
        device=device,
    )


def policy_against(result: PolicyEvaluation, cfg: Config, model_dir: str, challenge: int) -> HeadToHead:
    """The evaluated policy head to head with another one (the champion's model dir) on the dev prompts, judged by
    the same judge on the pairs where both answers ended, after the guards (evaluate.champion); the other policy
    samples with its own tokenizer (its chat template and special tokens), as it would be served, with the
    evaluation's settings."""
    from rlhflow.models import load_causal_lm, load_tokenizer, resolve_precision
    from rlhflow.sampling import evaluation_sampling

    dev, e = result.dev, cfg.evaluate
    tokenizer = load_tokenizer(model_dir)
    other = load_causal_lm(model_dir, pad_token_id=tokenizer.pad_token_id).to(result.device).eval()
    other = as_precision(other, resolve_precision(e.precision, result.device))
    other_answers = Answers.from_outputs(
        evaluation_sampling(cfg).sample(other, tokenizer, dev.prompts), e.degenerate_repetition
    )
    mine = dev.answers
    both = np.flatnonzero(mine.is_class("ended") & other_answers.is_class("ended"))
    prompts = [dev.prompts[i] for i in both]
    texts, other_texts = [mine.texts[i] for i in both], [other_answers.texts[i] for i in both]
    if result.judge.pointwise:
        verdicts = verdicts_from_scores(result.judge.score(prompts, texts), result.judge.score(prompts, other_texts))
    else:
        verdicts = result.judge.compare(prompts, texts, other_texts)
    rule = e.champion
    guards = guard_failures(
        rule,
        kl=dev.kl,
        ended=mine.shares()["ended"],
        length_ratio=float(np.mean(mine.tokens)) / max(float(np.mean(other_answers.tokens)), 1e-9),
    )
    return policy_head_to_head(verdicts, [dev.conversations[i] for i in both], rule, challenge, guards)


def reward_model_against(result: PolicyEvaluation, cfg: Config, model_dir, challenge: int) -> HeadToHead:
    """The proxy head to head with another reward model (the champion's model dir) on the dev split's pairs."""
    import pandas as pd

    from rlhflow.data.splits import conversation_keys
    from rlhflow.reward_model import RewardModel, evaluate_pairs

    dev = result.dev
    other = RewardModel.load(model_dir, batch_size=cfg.reward_model.eval_batch_size, device=result.device)
    other_pairs = evaluate_pairs(other, dev.pair_rows)
    conversations = list(conversation_keys(pd.DataFrame(dev.pair_rows)))
    return reward_model_head_to_head(
        dev.pairs.correct.tolist(), other_pairs.correct.tolist(), conversations, cfg.evaluate.champion, challenge
    )
