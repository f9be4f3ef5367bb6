"""The held-out prompts of an evaluation (one per test or dev conversation) and the SFT model's answers to them: the
sft_answers stage samples and scores those once (`sample_reference`), for every evaluate and sweep point to read
(`load_reference`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlhflow.evaluation.answers import Answers
from rlhflow.evaluation.setup import EvaluationSetup
from rlhflow.models.sampling import Sampling

REFERENCE_FILE = "answers.json"


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

    @classmethod
    def of(cls, setup: EvaluationSetup) -> HeldOutPrompts:
        return cls.load(held_out_files(setup.validated_dir), setup.n_prompts, setup.samples_per_prompt)

    def all(self) -> list:
        return [p for split in self.prompts for p in self.prompts[split]]

    def sizes(self) -> dict[str, int]:
        return {split: len(p) for split, p in self.prompts.items()}


def sample(model, tokenizer, prompt_messages, sampling: Sampling, *, max_new_tokens: int | None = None):
    """Answers to `prompt_messages` with `sampling` (the evaluation's settings; `max_new_tokens`: another limit)."""
    import dataclasses

    if max_new_tokens is not None:
        sampling = dataclasses.replace(sampling, max_new_tokens=max_new_tokens)
    return sampling.sample(model, tokenizer, prompt_messages)


def repeated(items: list, k: int) -> list:
    """Each item k times in a row: the rows of k samples per prompt."""
    return [x for x in items for _ in range(k)]


def as_precision(model, dtype):
    """The model in `dtype` for sampling and scoring (a copy when it differs: the fp32 weights stay for
    perplexity, which is compared with the sft stage's fp32 figure)."""
    import copy

    import torch

    return model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)


def sample_reference(setup: EvaluationSetup, out_dir: Path) -> dict[str, float]:
    """The sft_answers stage: the SFT model's answers to the evaluation prompts of both held-out splits, classified,
    with the proxy's scores (and the judge's, for a judge that scores answers one at a time), written to `out_dir`
    with what they are keyed by (`reference_key`). Returns the answers' class shares per split."""
    from rlhflow.evaluation.judges import load_judge
    from rlhflow.fsutil import write_json_atomic
    from rlhflow.models.loading import load_causal_lm, load_tokenizer, pick_device, resolve_precision
    from rlhflow.training.reward_model import RewardModel

    device = pick_device(setup.device)
    held_out = HeldOutPrompts.of(setup)
    prompts = held_out.all()

    tokenizer = load_tokenizer(str(setup.sft_dir))
    sft = load_causal_lm(str(setup.sft_dir), pad_token_id=tokenizer.pad_token_id).to(device).eval()
    sft = as_precision(sft, resolve_precision(setup.precision, device))
    answers = Answers.from_outputs(setup.sampling.sample(sft, tokenizer, prompts), setup.degenerate_repetition)
    del sft

    rm = RewardModel.load(setup.reward_model_dir, batch_size=setup.reward_model_batch_size, device=device)
    answers.extra["proxy"] = rm.score(prompts, answers.texts).tolist()
    judge = load_judge(setup.judge, setup.judge_dir, batch_size=setup.judge_batch_size, device=device)
    if judge.pointwise:
        answers.extra["judge"] = [float(x) for x in judge.score(prompts, answers.texts)]
    parts = answers.split(held_out.sizes())
    record = {
        "key": reference_key(setup, prompts=held_out.counts),
        "answers": {split: part.to_json() for split, part in parts.items()},
    }
    write_json_atomic(Path(out_dir) / REFERENCE_FILE, record)
    metrics = {"sft_answers/answers": float(len(answers))}
    for split, part in parts.items():
        prefix = "sft_answers/" if split == "test" else f"sft_answers/{split}_"
        metrics.update({f"{prefix}{name}": share for name, share in part.shares().items()})
    return metrics


def reference_key(setup: EvaluationSetup, *, prompts: dict[str, int]) -> dict:
    """What the SFT answers depend on besides the code: the SFT model, the held-out split files, the number of
    evaluation prompts of each (`prompts`) and every sampling and classification setting. The sft_answers stage
    writes it with the answers; evaluate takes them only under the same key."""
    from rlhflow.fsutil import dir_md5, file_md5

    return {
        "sft_md5": dir_md5(setup.sft_dir),
        "held_out_md5": {split: file_md5(path) for split, path in held_out_files(setup.validated_dir).items()},
        "prompts": prompts,
        "samples_per_prompt": setup.samples_per_prompt,
        "sampling": setup.sampling.key(),
        "degenerate_repetition": setup.degenerate_repetition,
        "precision": setup.precision,
    }


def load_reference(setup: EvaluationSetup, *, prompts: dict[str, int]) -> dict[str, Answers]:
    """The sft_answers stage's output per held-out split, for `prompts` evaluation prompts of each; an error naming
    what differs when it was sampled for another SFT model, other prompts or other settings (the flow reruns that
    stage first; a stage run by hand may not have)."""
    path = setup.reference_dir / REFERENCE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: the SFT model's evaluation answers are missing; run the sft_answers stage")
    record = json.loads(path.read_text())
    expected = reference_key(setup, prompts=prompts)
    differs = sorted(k for k in expected if record["key"].get(k) != expected[k])
    if differs:
        raise ValueError(
            f"{path} was sampled with other {', '.join(differs)} than this evaluation's; rerun the sft_answers stage "
            "(the pipeline flow and `dvc repro` do)"
        )
    return {split: Answers.from_json(answers) for split, answers in record["answers"].items()}
