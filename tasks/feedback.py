"""The steps of a feedback round around people (docs/feedback.md), each a Prefect task and an MLflow run:

    python -m tasks.feedback sample    # the policy's and the SFT model's answers to feedback-split prompts, as pairs
    python -m tasks.feedback send      # the pairs Label Studio does not hold yet, to its project
    python -m tasks.feedback collect   # the labels back into feedback.labels_file; what the people say
    python -m tasks.feedback ai_label  # or the judge labels the pairs (RLAIF), marked as such

Pairs and labels are appended, never rewritten, so every step can be rerun: sample adds only new pairs, send only
the pairs the project lacks, collect only new labels. After collect, validate turns the labels into preference pairs
(`dvc repro`, or flows.pipeline), and reward_model trains on them beside the shipped pairs.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from rlhflow.config.params import Config, parse_config_args
from rlhflow.fsutil import dir_md5
from rlhfops.labeling import LabelingError, LabelStudio, read_labels
from tasks.evaluation_setup import evaluation_inputs, evaluation_sampling, load_evaluation_judge

# A light door: torch, transformers, numpy, mlflow, pandas and prefect (the models and answers, the pairs and labels
# files, the tracking and registry, the steps' Prefect task) are imported inside the functions that use them, so
# `--help` and a step's checks answer before any of them loads.
if TYPE_CHECKING:
    from rlhflow.evaluation.answers import Answers
    from rlhflow.evaluation.held_out import HeldOutPrompts


def policy_run_id(cfg: Config) -> str:
    """The MLflow run that registered the policy in ppo.out_dir (by its weights' md5), else `unregistered:<md5>`."""
    from rlhfops import registry, tracking

    version = registry.version_of_model_dir(tracking.client(), registry.POLICY, cfg.path(cfg.ppo.out_dir))
    return version.run_id if version is not None else f"unregistered:{dir_md5(cfg.path(cfg.ppo.out_dir))}"


def answer(sampling, model_dir, prompts: HeldOutPrompts, device, *, stream: int, degenerate: float) -> Answers:
    """A model's answers on random stream `stream` (added to the sampling seed): on one shared stream a policy near
    the SFT model repeats its answers word for word, and such a pair tells nothing."""
    from rlhflow.evaluation.answers import Answers
    from rlhflow.models.loading import load_language_model

    tokenizer, model = load_language_model(model_dir, device)
    outputs = dataclasses.replace(sampling, seed=sampling.seed + stream).sample(model, tokenizer, prompts.all())
    return Answers.from_outputs(outputs, degenerate)


def sample(cfg: Config) -> dict[str, float]:
    """New pairs on the feedback split: the policy's answer and the SFT model's, sampled with the evaluation's
    settings at feedback.max_new_tokens, appended to feedback.pairs_file."""
    from rlhflow.data.feedback import FeedbackError, append_records, new_pairs
    from rlhflow.evaluation.held_out import HeldOutPrompts
    from rlhflow.models.loading import pick_device

    split_file = cfg.path(cfg.validate_.out_dir) / "feedback.jsonl"
    if not split_file.exists():
        raise FeedbackError(f"{split_file}: no feedback split; validate with validate.feedback_fraction > 0 first")
    sampling = dataclasses.replace(evaluation_sampling(cfg), max_new_tokens=cfg.feedback.max_new_tokens)
    prompts = HeldOutPrompts.load({"feedback": split_file}, cfg.feedback.n_pairs, 1)
    device, degenerate = pick_device(cfg.device), cfg.evaluate.degenerate_repetition
    policy = answer(sampling, cfg.path(cfg.ppo.out_dir), prompts, device, stream=0, degenerate=degenerate)
    sft = answer(sampling, cfg.path(cfg.sft.out_dir), prompts, device, stream=1, degenerate=degenerate)
    rows = [{"prompt": t, "prompt_messages": m} for t, m in zip(prompts.texts["feedback"], prompts.all())]
    pairs = new_pairs(
        rows,
        policy.texts,
        sft.texts,
        seed=cfg.evaluate.seed,
        policy_run_id=policy_run_id(cfg),
        classes=(policy.classes, sft.classes),
    )
    added = append_records(cfg.path(cfg.feedback.pairs_file), pairs, key=lambda p: p["pair_id"])
    return {"feedback/pairs_sampled": float(len(pairs)), "feedback/pairs_added": float(added)}


def label_studio(cfg: Config) -> LabelStudio:
    token = os.environ.get(cfg.feedback.token_env)
    if not token:
        raise LabelingError(
            f"${cfg.feedback.token_env} is not set: the Label Studio API token (`make label` says where)"
        )
    return LabelStudio(cfg.feedback.label_studio_url, token, allow_plain_http=cfg.feedback.allow_plain_http)


def send(cfg: Config) -> dict[str, float]:
    """The pairs of feedback.pairs_file that the Label Studio project does not hold yet."""
    from rlhflow.data.feedback import PAIR_FIELDS, read_records

    pairs = read_records(cfg.path(cfg.feedback.pairs_file), PAIR_FIELDS)
    server = label_studio(cfg)
    sent = server.send(server.project(cfg.feedback.project), pairs)
    return {"feedback/pairs_sent": float(sent), "feedback/pairs": float(len(pairs))}


def judge_pairs(judge, pairs: list[dict]):
    """The judge's verdicts on answer a against answer b of each pair."""
    return judge.compare(
        [p["prompt_messages"] for p in pairs], [p["answer_a"] for p in pairs], [p["answer_b"] for p in pairs]
    )


def load_feedback_judge(cfg: Config):
    """The judge section's judge on the configured device, loaded as the evaluation loads it, once it has passed
    its preflight (an LLM endpoint that cannot be used fails before any pair is sent)."""
    from rlhflow.evaluation.judging import preflight
    from rlhflow.models.loading import pick_device

    preflight(cfg.judge)
    inputs = evaluation_inputs(cfg)
    return load_evaluation_judge(inputs, pick_device(inputs.device))


def judge_prefers_a(cfg: Config, judged: list[tuple[dict, str]]):
    """The judge's preference for answer a on each judged pair (None without a judge to load)."""
    if not judged or (cfg.judge.kind == "trained" and not cfg.path(cfg.judge.out_dir).exists()):
        return None
    judge = load_feedback_judge(cfg)
    return judge_pairs(judge, [p for p, _ in judged]).preference


def collect(cfg: Config) -> dict[str, float]:
    """The project's labels appended to feedback.labels_file (each label once), and what all labels so far say: the
    policy's win rate over the SFT model by people, and how often the judge and the length rule agree with them.
    An annotation of another shape, with an overlong comment, or for a pair the pipeline never sent (a task someone
    made in Label Studio) is named and left out (rlhfops.labeling.read_labels); a label of the labels file for such
    a pair fails the step before anything is written."""
    from rlhflow.data.feedback import LABEL_FIELDS, PAIR_FIELDS, append_records, check_labels, label_key, read_records
    from rlhflow.evaluation.human import agreement_metrics, human_win_metrics, judged_pairs
    from rlhfops import tracking

    pairs = read_records(cfg.path(cfg.feedback.pairs_file), PAIR_FIELDS)
    server = label_studio(cfg)
    new, waiting, refused = read_labels(server.tasks(server.project(cfg.feedback.project)))
    sent = {p["pair_id"] for p in pairs}
    refused += [
        f"a label for pair {x['pair_id']!r}, which the pipeline never sent" for x in new if x["pair_id"] not in sent
    ]
    new = [x for x in new if x["pair_id"] in sent]
    for problem in refused:
        print(f"feedback collect: left out {problem}", flush=True)
    labels_file = cfg.path(cfg.feedback.labels_file)
    known = read_records(labels_file, LABEL_FIELDS)
    check_labels(known + new, pairs)
    added = append_records(labels_file, new, key=label_key, private=True)
    labels = read_records(labels_file, LABEL_FIELDS)
    judged = judged_pairs(pairs, labels)
    metrics = {
        "feedback/labels_added": float(added),
        "feedback/labels": float(len(labels)),
        "feedback/pairs_waiting": float(len(waiting)),
        "feedback/annotations_refused": float(len(refused)),
        **human_win_metrics(judged),
        **agreement_metrics(judged, judge_prefers_a(cfg, judged)),
    }
    if added:
        tracking.log_dataset(labels_file, name="feedback-labels", context="feedback")
    return metrics


def ai_label(cfg: Config) -> dict[str, float]:
    """The judge's labels on the pairs no AI label covers yet (RLAIF: the judge section's model, an LLM endpoint
    included), appended to feedback.labels_file marked source `ai`; validate takes them as it takes people's."""
    from rlhflow.data.feedback import LABEL_FIELDS, PAIR_FIELDS, append_records, label_key, read_records

    pairs = read_records(cfg.path(cfg.feedback.pairs_file), PAIR_FIELDS)
    labels_file = cfg.path(cfg.feedback.labels_file)
    done = {x["pair_id"] for x in read_records(labels_file, LABEL_FIELDS) if x["source"] == "ai"}
    todo = [p for p in pairs if p["pair_id"] not in done]
    if not todo:
        return {"feedback/ai_labels_added": 0.0}
    judge = load_feedback_judge(cfg)
    verdicts = judge_pairs(judge, todo)
    annotator = f"judge:{judge.kind}:{judge.basis_md5()[:12]}"  # the judge's kind and what it judges by
    now = datetime.now(timezone.utc).isoformat()
    side = {1.0: "a", 0.0: "b"}  # a split verdict (0.5) is a tie
    labels = [
        {"pair_id": p["pair_id"], "label": side.get(float(w), "tie"), "annotator": annotator, "labelled_at": now}
        | {"source": "ai"}
        for p, w in zip(todo, verdicts.wins)
    ]
    return {"feedback/ai_labels_added": float(append_records(labels_file, labels, key=label_key, private=True))}


BODIES = {"sample": sample, "send": send, "collect": collect, "ai_label": ai_label}
USAGE = f"usage: python -m tasks.feedback {{{','.join(BODIES)}}} [--set key=value ...]"


def run_step(step: str, cfg: Config, parent_run_id: str | None = None) -> dict[str, float]:
    """One step in its MLflow run (`feedback_<step>`), its metrics logged there, once the tracking store has passed
    the preflight (tracking.preflight: nothing reaches a server that cannot be used or must not get the password)."""
    from rlhfops import tracking

    tracking.preflight(cfg)
    name = f"feedback_{step}"
    params = {"feedback": cfg.section("feedback")}
    with tracking.start_run(cfg, name=name, params=params, tags={"stage": name}, parent_run_id=parent_run_id):
        metrics = BODIES[step](cfg)
        tracking.log_metrics(metrics)
    return metrics


def __getattr__(name: str):
    """`feedback_task`, the steps' Prefect task (`run_step`; no retries, no result caching), built when a flow first
    imports it: a step run from the command line loads no Prefect."""
    if name != "feedback_task":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    @task(name="feedback", retries=0, cache_policy=NO_CACHE)
    def feedback_task(step: str, cfg: Config, parent_run_id: str | None = None) -> dict[str, float]:
        return run_step(step, cfg, parent_run_id)

    globals()[name] = feedback_task  # built once
    return feedback_task


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{__doc__}")
        return
    if not argv or argv[0] not in BODIES:
        sys.exit(USAGE)
    cfg, _ = parse_config_args(argv[1:], f"feedback step {argv[0]}: {BODIES[argv[0]].__doc__.splitlines()[0]}")
    from rlhflow.data.feedback import FeedbackError  # pandas: once the command line is parsed
    from rlhfops.tracking import TrackingUnavailableError  # mlflow: likewise

    try:
        metrics = run_step(argv[0], cfg)
    except (FeedbackError, LabelingError, FileNotFoundError, TrackingUnavailableError) as err:
        sys.exit(f"\nfeedback {argv[0]} failed: {err}")
    for key, value in sorted(metrics.items()):
        print(f"{key:40s} {value:.4f}")


if __name__ == "__main__":
    main()
