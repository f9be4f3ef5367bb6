"""The held-out prompts of an evaluation (one per test or dev conversation), what else it reads from disk
(`HeldOutData`), and the SFT model's answers to the prompts: the sft_answers stage samples and scores those once
(`sample_answers`, `reference_record`), for every evaluate and sweep point to read (`load_reference`)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhflow.data.readers import read_jsonl
from rlhflow.data.splits import conversation_keys
from rlhflow.evaluation.answers import Answers
from rlhflow.evaluation.settings import EvaluationSettings

REFERENCE_FILE = "answers.json"


def evaluation_prompts(test_file: Path, n_prompts: int | None):
    """One prompt per test conversation (its first row in the file: the conversation's shallowest branch there), in
    file order; the first `n_prompts` of them when set. Columns: prompt, prompt_messages, conversation."""
    test = read_jsonl(test_file)
    test = test.assign(conversation=conversation_keys(test).to_numpy())
    prompts = test.drop_duplicates("conversation")[["prompt", "prompt_messages", "conversation"]]
    return prompts.head(n_prompts) if n_prompts is not None else prompts


# the held-out splits answered: test for the report, dev for choosing (the champion rule, a sweep's best point)
HELD_OUT = ("test", "dev")


def held_out_files(validated_dir: Path) -> dict[str, Path]:
    """test.jsonl, and dev.jsonl where validate wrote one (validate.dev_fraction > 0)."""
    return {s: validated_dir / f"{s}.jsonl" for s in HELD_OUT if s == "test" or (validated_dir / f"{s}.jsonl").exists()}


@dataclass
class HeldOutPrompts:
    """The evaluation prompts of each held-out split, one row per answer (k samples per prompt in a row), and the
    order in which both models answer them all at once: test first, then dev."""

    prompts: dict[str, list]  # per split: prompt messages
    texts: dict[str, list[str]]  # per split: prompt texts
    conversations: dict[str, list[str]]  # per split: each row's conversation, the bootstrap's clusters
    counts: dict[str, int]  # per split: distinct prompts

    @classmethod
    def load(cls, files: dict[str, Path], n_prompts: int | None, samples_per_prompt: int) -> HeldOutPrompts:
        k = samples_per_prompt
        frames = {split: evaluation_prompts(f, n_prompts) for split, f in files.items()}
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

    def answered(self, dev: bool) -> dict[str, int]:
        """The rows of the splits answered up front: the test split's, and the dev split's with `dev` (where there
        is one). They lead `all()`, so sampling the first sum(rows) prompts answers them."""
        return {split: n for split, n in self.sizes().items() if split == "test" or dev}


def repeated(items: list, k: int) -> list:
    """Each item k times in a row: the rows of k samples per prompt."""
    return [x for x in items for _ in range(k)]


def as_precision(model, dtype):
    """The model in `dtype` for sampling and scoring (a copy when it differs: the fp32 weights stay for
    perplexity, which is compared with the sft stage's fp32 figure)."""
    return model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)


@dataclass
class HeldOutData:
    """What an evaluation reads besides the models, read by its stage."""

    prompts: HeldOutPrompts
    reference: dict[str, Answers]  # the SFT model's answers per split (the sft_answers stage, `load_reference`)
    test_rows: Any  # the test split's pairs (a DataFrame)
    dev_rows: list[dict] | None  # the dev split's pairs; None: no dev split
    sft_perplexity: float | None  # the sft stage's perplexity on the same test rows; None: it measured none
    test_pair_scores: Any  # the reward model stage's scores of the test pairs; None: it saved none for them


def sample_answers(settings: EvaluationSettings, model, tokenizer, held_out: HeldOutPrompts, lines=None):
    """A model's answers (in the sampling precision) to the splits answered up front (`HeldOutPrompts.answered`):
    each the answer sampling both splits' prompts gives, on the same random streams for every model. Returns the
    sampled outputs and the classified answers per split. `lines` writes progress lines (rlhflow.progress)."""
    sizes = held_out.answered(settings.dev_figures)
    outputs = settings.sampling.sample(model, tokenizer, held_out.all(), rows=sum(sizes.values()), lines=lines)
    return outputs, Answers.from_outputs(outputs, settings.degenerate_repetition).split(sizes)


def score_answers(parts: dict[str, Answers], held_out: HeldOutPrompts, rm, judge) -> None:
    """The proxy's scores (and the judge's, for a judge that scores answers one at a time) of each split's answers,
    into their `extra`; each split scored apart, so a split's scores do not depend on whether another was answered."""
    for split, part in parts.items():
        prompts = held_out.prompts[split]
        part.extra["proxy"] = rm.score(prompts, part.texts).tolist()
        if judge.pointwise:
            part.extra["judge"] = [float(x) for x in judge.score(prompts, part.texts)]


def reference_record(parts: dict[str, Answers], rm, judge, held_out: HeldOutPrompts, key: dict) -> tuple[dict, dict]:
    """The sft_answers stage's record: the SFT model's answers per split with the proxy's and a pointwise judge's
    scores (`score_answers`), under what they are keyed by (`reference_key`); and the answers' class shares per
    split as metrics."""
    score_answers(parts, held_out, rm, judge)
    answers = sum(len(part) for part in parts.values())
    record = {"key": key, "answers": {split: part.to_json() for split, part in parts.items()}}
    metrics = {"sft_answers/answers": float(answers)}
    for split, part in parts.items():
        prefix = "sft_answers/" if split == "test" else f"sft_answers/{split}_"
        metrics.update({f"{prefix}{name}": share for name, share in part.shares().items()})
    return record, metrics


def reference_key(
    settings: EvaluationSettings, *, sft_md5: str, held_out_md5: dict, prompts: dict[str, int], splits: list[str]
) -> dict:
    """What the SFT answers depend on besides the code: the SFT model, the held-out split files, the number of
    evaluation prompts of each (`prompts`), the splits answered (`splits`) and every sampling and classification
    setting. The sft_answers stage writes it with the answers; evaluate takes them only under the same key."""
    return {
        "sft_md5": sft_md5,
        "held_out_md5": held_out_md5,
        "prompts": prompts,
        "splits": splits,
        "samples_per_prompt": settings.samples_per_prompt,
        "sampling": settings.sampling.key(),
        "degenerate_repetition": settings.degenerate_repetition,
        "precision": settings.precision,
    }


def load_reference(path: Path, expected_key: dict) -> dict[str, Answers]:
    """The sft_answers stage's output (`path`) per held-out split; an error naming what differs when it was sampled
    under another key (another SFT model, other prompts or other settings: the flow reruns that stage first; a stage
    run by hand may not have)."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: the SFT model's evaluation answers are missing; run the sft_answers stage")
    record = json.loads(path.read_text())
    differs = sorted(k for k in expected_key if record["key"].get(k) != expected_key[k])
    if differs:
        raise ValueError(
            f"{path} was sampled with other {', '.join(differs)} than this evaluation's; rerun the sft_answers stage "
            "(the pipeline flow and `dvc repro` do)"
        )
    return {split: Answers.from_json(answers) for split, answers in record["answers"].items()}
