"""Supervised fine-tuning (sft.train=true) on tiny models: the loss is on completion tokens only, training lowers
it (full and LoRA, the adapter merged into a plain model), demonstrations never come from held-out splits, bad
demonstrations fail before any training, and a killed run resumes from its last Trainer checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import flow_run_logs, kill_training_once, rerun_resumes, run_stage_cli, tiny_pipeline_overrides

from rlhflow.config.params import load_config
from rlhflow.data.formats import DataFormatError, load_demonstrations
from rlhflow.data.readers import write_jsonl
from rlhflow.data.validation import DataValidationError

ANSWER = "Thank you for asking! Here are three clear steps: first, second, and finally third."


def demo_rows(n: int, *, prefix: str = "question") -> list[dict]:
    return [
        {
            "prompt": f"{prefix} {i}: please explain water",
            "prompt_messages": [{"role": "user", "content": f"{prefix} {i}: please explain water"}],
            "completion": ANSWER,
            "source_row": i + 1,
        }
        for i in range(n)
    ]


def pair_rows(prompts: list[str]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "prompt": prompts,
            "prompt_messages": [[{"role": "user", "content": p}] for p in prompts],
            "chosen": [f"{ANSWER} ({p})" for p in prompts],
            "rejected": ["no."] * len(prompts),
            "source_row": range(1, len(prompts) + 1),
        }
    )


def write_lines(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def prompt_and_completion_ids(tok, messages: list[dict], answer: str = ANSWER) -> tuple[list[int], list[int]]:
    """The prompt as the policy is prompted (chat template, generation prompt), and the answer's tokens after it."""
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    full = tok.apply_chat_template(messages + [{"role": "assistant", "content": answer}], tokenize=True)["input_ids"]
    return prompt, list(full)[len(prompt) :]


def sft_settings(**changes):
    return load_config(overrides=[f"sft.{k}={v}" for k, v in changes.items()]).sft


def dataset_of(demos: pd.DataFrame, tok, cfg, max_prompt_length: int = 192):
    """The tokenized demonstrations the stage trains on (no demonstration may be left out here)."""
    from rlhflow.training.sft import demonstration_dataset

    dataset, dropped = demonstration_dataset(demos, tok, max_prompt_length=max_prompt_length, max_length=cfg.max_length)
    assert dropped == 0
    return dataset


def test_the_prefect_form_shows_the_sft_settings():
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import rlhf_pipeline
    from flows.serve import with_form_defaults
    from rlhflow.config.params import load_config

    schema = parameter_schema(with_form_defaults(rlhf_pipeline, load_config())).model_dump_for_openapi()
    fields = schema["definitions"]["SFTConfig"]["properties"]
    for key in ("train", "train_data", "epochs", "learning_rate", "max_length", "packing", "lora", "checkpoint_every"):
        assert fields[key]["description"], key
    assert schema["properties"]["config"]["default"]["sft"]["train"] is False


def test_trl_dataset_preparation_prints_to_stdout_not_to_a_run_log(tiny_model_dir, tok, tmp_path, monkeypatch):
    """dill, fingerprinting trl's dataset functions, prints their disassembly into a captured stdout; under a
    patched print (Prefect's log_prints) it would land in the run log. The stage prepares the data with the
    interpreter's print."""
    import builtins

    from rlhflow.models.loading import load_causal_lm
    from rlhflow.training.sft import sft_trainer
    from rlhfops.stage_runner import prints_to_stdout

    run_log: list[str] = []
    monkeypatch.setattr(builtins, "print", lambda *args, **kwargs: run_log.append(" ".join(map(str, args))))
    model = load_causal_lm(str(tiny_model_dir), pad_token_id=tok.pad_token_id)
    with prints_to_stdout():
        cfg = sft_settings(checkpoint_every=0)
        sft_trainer(cfg, model, tok, dataset_of(pd.DataFrame(demo_rows(2)), tok, cfg), work_dir=tmp_path, seed=0)
    assert not [line for line in run_log if "LOAD_" in line]  # dill captured its disassembly itself
    print("after the block")
    assert run_log == ["after the block"]  # the patch is back


# ---- the loss ---------------------------------------------------------------------------------------------


def test_loss_is_on_completion_tokens_only(tiny_model_dir, tok, tmp_path):
    from rlhflow.models.loading import load_causal_lm
    from rlhflow.training.sft import sft_trainer

    demos = pd.DataFrame(demo_rows(4))
    model = load_causal_lm(str(tiny_model_dir), pad_token_id=tok.pad_token_id)
    cfg = sft_settings(checkpoint_every=0)
    trainer = sft_trainer(cfg, model, tok, dataset_of(demos, tok, cfg), work_dir=tmp_path, seed=0)
    for example, messages in zip(trainer.train_dataset, demos["prompt_messages"]):
        prompt_ids, completion_ids = prompt_and_completion_ids(tok, messages)
        ids, labels = example["input_ids"], example["labels"]
        assert ids == prompt_ids + completion_ids  # the prompt exactly as the policy is prompted, then the answer
        assert labels[: len(prompt_ids)] == [-100] * len(prompt_ids)  # no loss on the prompt
        assert labels[len(prompt_ids) :] == completion_ids  # loss on every completion token, its end of turn too
        assert tok.convert_tokens_to_ids("<|im_end|>") in labels


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.filterwarnings("error:.*checkpointing.*:FutureWarning")  # no deprecated-name warning in the log
def test_training_lowers_the_loss_and_saves_a_plain_model(tiny_model_dir, tok, tmp_path, one_thread, lora):
    from transformers import LlamaForCausalLM

    from rlhflow.evaluation.metrics import perplexity
    from rlhflow.models.loading import load_causal_lm, save_plain
    from rlhflow.training.sft import sft_trainer, train_sft

    demos = pd.DataFrame(demo_rows(32))
    cfg = sft_settings(
        epochs=4,
        learning_rate=3e-2 if lora else 1e-2,
        train_batch_size=8,
        max_length=128,  # the demonstrations are 81 tokens: none is left out
        checkpoint_every=0,
        **{"lora.enabled": lora, "lora.r": 8, "lora.alpha": 16},
    )
    model = load_causal_lm(str(tiny_model_dir), pad_token_id=tok.pad_token_id)
    held_out = [[{"role": "user", "content": "question 99: please explain water"}]]
    before = perplexity(model, tok, held_out, [ANSWER])
    logged: list[tuple[dict, int]] = []

    def log_fn(metrics: dict, step: int) -> None:
        logged.append((metrics, step))

    trainer = sft_trainer(cfg, model, tok, dataset_of(demos, tok, cfg), work_dir=tmp_path, seed=0, log_fn=log_fn)
    trained = train_sft(trainer, log_fn=log_fn)

    # a random tiny model's logits are near uniform; a LoRA adapter on it moves them slowly, but steadily
    drop = 0.97 if lora else 0.8
    losses = [m["train_loss"] for m, _ in logged if "train_loss" in m]
    assert len(losses) >= 3 and losses == sorted(losses, reverse=True) and losses[-1] < drop * losses[0]
    assert perplexity(trained, tok, held_out, [ANSWER]) < drop * before  # and on a prompt it never saw
    assert type(trained) is LlamaForCausalLM  # the adapter merged in: downstream stages load it unchanged
    save_plain(trained, tok, tmp_path / "out")
    reloaded = load_causal_lm(str(tmp_path / "out"), pad_token_id=tok.pad_token_id)
    ids = torch.tensor([tok("please explain water")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trained(ids).logits)


def test_packing_keeps_the_completion_only_loss(tiny_model_dir, tok, tmp_path, one_thread):
    from rlhflow.models.loading import load_causal_lm
    from rlhflow.training.sft import sft_trainer

    demos = pd.DataFrame(demo_rows(8))
    model = load_causal_lm(str(tiny_model_dir), pad_token_id=tok.pad_token_id)
    cfg = sft_settings(packing=True, max_length=512, train_batch_size=2, checkpoint_every=0)
    trainer = sft_trainer(cfg, model, tok, dataset_of(demos, tok, cfg), work_dir=tmp_path, seed=0)
    assert len(trainer.train_dataset) < len(demos)  # several demonstrations per sequence
    labelled = sum(sum(label != -100 for label in ex["labels"]) for ex in trainer.train_dataset)
    completion_tokens = len(prompt_and_completion_ids(tok, demos["prompt_messages"][0])[1])
    assert labelled == len(demos) * completion_tokens
    trainer.train()
    assert trainer.state.global_step >= 1 and torch.isfinite(torch.tensor(trainer.state.log_history[-1]["train_loss"]))


def test_packed_and_unpacked_batches_have_the_same_loss(tiny_model_dir, tok, tmp_path, one_thread):
    """Packing changes how demonstrations share sequences, not the loss: one batch holding all demonstrations, packed
    (each attends only to itself) or padded, has the same completion-only loss."""
    from rlhflow.models.loading import load_causal_lm
    from rlhflow.training.sft import sft_trainer

    demos = pd.DataFrame(demo_rows(6))
    demos["completion"] = [ANSWER[: 20 + 10 * i] for i in range(6)]  # of different lengths
    model = load_causal_lm(str(tiny_model_dir), pad_token_id=tok.pad_token_id)
    losses = {}
    for packing in (False, True):
        cfg = sft_settings(packing=packing, max_length=512, train_batch_size=8, checkpoint_every=0)
        trainer = sft_trainer(cfg, model, tok, dataset_of(demos, tok, cfg), work_dir=tmp_path / str(packing), seed=0)
        (batch,) = list(trainer.get_train_dataloader())  # every demonstration in the one batch
        labelled = int((batch["labels"] != -100).sum())
        assert labelled == sum(
            len(prompt_and_completion_ids(tok, m, c)[1]) for m, c in zip(demos["prompt_messages"], demos["completion"])
        )
        with torch.no_grad():
            losses[packing] = float(trainer.compute_loss(model, batch))
    assert losses[True] == pytest.approx(losses[False], rel=1e-6)


def test_prompts_are_cut_as_ppo_cuts_them_and_completions_never(tok):
    """The prompt keeps its last ppo.max_prompt_length tokens (`policy.encode_prompts` gives PPO the same ones); a
    demonstration still longer than sft.max_length is left out and counted, not cut."""
    from rlhflow.models.policy import encode_prompts
    from rlhflow.training.sft import demonstration_dataset

    demos = pd.DataFrame(demo_rows(3))
    demos.at[0, "prompt_messages"] = [{"role": "user", "content": "a very long question " * 40}]
    demos.at[2, "completion"] = ANSWER * 4
    _, answer = prompt_and_completion_ids(tok, demos["prompt_messages"][1])
    dataset, dropped = demonstration_dataset(demos, tok, max_prompt_length=12, max_length=12 + len(answer))
    assert dropped == 1 and len(dataset) == 2  # the long completion would have lost its end
    for example, messages in zip(dataset, demos["prompt_messages"][:2]):
        ppo_prompt, mask = encode_prompts(tok, [messages], 12)
        prompt = ppo_prompt[0][mask[0].bool()].tolist()
        assert example["input_ids"] == prompt + answer  # the completion whole, its end of turn included
        assert example["completion_mask"] == [0] * len(prompt) + [1] * len(answer)
    assert len(dataset[0]["input_ids"]) == 12 + len(answer)  # the long prompt: cut to 12 tokens
    with pytest.raises(ValueError, match="none of the 3 demonstrations fits sft.max_length=8"):
        demonstration_dataset(demos, tok, max_prompt_length=12, max_length=8)


def test_the_checkpoint_fingerprint_follows_the_local_model_and_the_validate_settings(tmp_path):
    from tasks.sft import checkpoint_fingerprint
    from tests.fixtures import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "model")

    def fingerprint(*overrides: str) -> str:
        return checkpoint_fingerprint(load_config(overrides=[f"sft.model={model_dir}", *overrides]))

    before = fingerprint()
    assert fingerprint("sft.n_samples=9") == before  # what only the report uses
    assert fingerprint("validate.max_response_tokens=100") != before  # which demonstrations are kept
    assert fingerprint("ppo.max_prompt_length=16") != before  # how prompts are cut
    write_tiny_model(model_dir, seed=1)  # other weights under the same name
    assert fingerprint() != before


# ---- where demonstrations come from ---------------------------------------------------------------------


@pytest.fixture
def validated(tmp_path) -> Path:
    """Validated splits with disjoint prompts; two train pairs share a prompt and a chosen response."""
    out = tmp_path / "validated"
    train = pair_rows([f"train prompt {i}" for i in range(6)])
    train = pd.concat([train, train.iloc[[0]].assign(rejected="nope.", source_row=7)], ignore_index=True)
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(pair_rows([f"judge prompt {i}" for i in range(3)]), out / "judge.jsonl")
    write_jsonl(pair_rows([f"test prompt {i}" for i in range(3)]), out / "test.jsonl")
    return out


def checked(validated: Path, *overrides: str):
    from rlhflow.models.loading import load_tokenizer
    from tasks.sft import checked_demonstrations

    cfg = load_config(
        overrides=[f"validate.out_dir={validated}", f"sft.train_data={validated / 'train.jsonl'}", *overrides]
    )
    return checked_demonstrations(cfg, load_tokenizer(cfg.sft.model), validated.parent / "report")


def test_default_demonstrations_are_the_train_splits_chosen_responses(validated, tiny_model_dir):
    demos, _ = checked(validated, f"sft.model={tiny_model_dir}")
    train = pd.read_json(validated / "train.jsonl", lines=True)
    assert sorted(demos["prompt"]) == sorted(set(train["prompt"]))  # one demonstration per (prompt, chosen)
    assert set(demos["completion"]) == set(train["chosen"])
    assert list(demos["prompt_messages"].iloc[0]) == [{"role": "user", "content": demos["prompt"].iloc[0]}]
    for split in ("test", "judge"):
        held_out = set(pd.read_json(validated / f"{split}.jsonl", lines=True)["prompt"])
        assert not held_out & set(demos["prompt"])


@pytest.mark.parametrize("split", ["test", "judge"])
def test_held_out_splits_are_refused(validated, tiny_model_dir, split):
    with pytest.raises(ValueError, match="is a held-out split"):
        checked(validated, f"sft.model={tiny_model_dir}", f"sft.train_data={validated / f'{split}.jsonl'}")
    # a file of its own that holds a conversation of a held-out split (here as a raw HH transcript that continues
    # it): refused, naming the rows
    continued = f"Human: {split} prompt 2\n\nAssistant: Sure.\n\nHuman: And then?\n\nAssistant:"
    mixed = write_lines(
        validated.parent / "mixed.jsonl",
        [{"prompt": "a new prompt", "completion": ANSWER}, {"prompt": continued, "completion": ANSWER}],
    )
    with pytest.raises(ValueError, match=rf"1 in a conversation of the {split} split \(rows \[2\]\)"):
        checked(validated, f"sft.model={tiny_model_dir}", f"sft.train_data={mixed}")


# ---- bad demonstrations -----------------------------------------------------------------------------------


def test_demonstration_formats(tmp_path):
    chat = write_lines(
        tmp_path / "chat.jsonl",
        [
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi?"},
                    {"role": "assistant", "content": "Hello."},
                ]
            }
        ],
    )
    (row,) = load_demonstrations(chat).to_dict("records")
    assert row["prompt_messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert row["completion"] == "Hello." and row["source_row"] == 1
    conversational = write_lines(
        tmp_path / "pc.jsonl",
        [{"prompt": [{"role": "user", "content": "Hi?"}], "completion": [{"role": "assistant", "content": "Hello."}]}],
    )
    (row,) = load_demonstrations(conversational).to_dict("records")
    assert row["prompt"] == "Hi?" and row["completion"] == "Hello."


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([], r"empty file: no rows to read"),
        ([{"prompt": "Hi?"}, {"prompt": "Yo?"}], r"missing column completion in all 2 rows \(columns found: prompt\)"),
        ([{"prompt": "Hi?", "completion": 3}], r"column completion: got int, expected text .*row 1"),
        (
            [{"messages": [{"role": "user", "content": "a"}]}, {"messages": [{"role": "user", "content": "b"}]}],
            r"column messages: .*ending in the assistant's \(rows 1, 2\)",
        ),
    ],
    ids=["empty", "missing-column", "wrong-type", "no-assistant-turn"],
)
def test_unreadable_demonstrations_name_the_problem(tmp_path, records, message):
    with pytest.raises(DataFormatError, match=message):
        load_demonstrations(write_lines(tmp_path / "demos.jsonl", records))


def test_blank_and_overlong_demonstrations_follow_the_validate_policy(validated, tiny_model_dir):
    records = [{"prompt": f"new prompt {i}", "completion": ANSWER} for i in range(40)]
    records[4]["completion"] = "   "
    records[9]["prompt"] = "word " * 600
    demos_file = write_lines(validated.parent / "demos.jsonl", records)
    base = [f"sft.model={tiny_model_dir}", f"sft.train_data={demos_file}"]
    with pytest.raises(DataValidationError, match=r"1 row with a blank completion .*demonstrations row 5"):
        checked(validated, *base, "validate.blank=fail")
    with pytest.raises(DataValidationError, match=r"1 row with an over-long prompt .*demonstrations row 10"):
        checked(validated, *base, "validate.overlong=fail")
    demos, result = checked(validated, *base)  # the default policy: drop them, up to validate.max_dropped_fraction
    assert len(demos) == 38 and result.dropped_per_reason == {"blank_completion": 1, "overlong_prompt": 1}


# ---- the stage ---------------------------------------------------------------------------------------------


def stage_overrides(root: Path, model_dir: Path, train_data: Path, *extra: str) -> list[str]:
    return [
        f"validate.out_dir={root / 'validated'}",
        f"sft.model={model_dir}",
        f"sft.out_dir={root / 'sft'}",
        f"sft.checkpoint_dir={root / 'ckpt'}",
        f"sft.train_data={train_data}",
        "sft.train=true",
        "sft.n_samples=0",
        "sft.perplexity_rows=4",
        "sft.max_length=128",
        f"metrics_dir={root / 'metrics'}",
        f"tracking.tracking_uri=sqlite:///{root}/mlflow.db",
        *extra,
    ]


@pytest.mark.system
def test_bad_demonstrations_fail_the_stage_before_training(validated, tiny_model_dir):
    root = validated.parent
    empty = root / "empty.jsonl"
    empty.write_text("")
    run = run_stage_cli("tasks.sft", stage_overrides(root, tiny_model_dir, empty), timeout=300)
    assert run.returncode == 1, run.stderr[-2000:]
    assert f"sft failed: {empty}: empty file: no rows to read" in run.stderr
    assert not (root / "sft").exists() and not list(root.glob(".sft.*"))  # no output, not even half of one
    assert not (root / "ckpt").exists()  # no training started
    assert not (root / "metrics").exists()


def test_training_refuses_a_multi_process_launch(monkeypatch):
    from rlhflow.training import distributed
    from tasks.sft import run

    monkeypatch.setattr(distributed, "world_size", lambda: 2)  # only rank 0 runs the stage: a Trainer would wait
    with pytest.raises(ValueError, match="sft.train trains in one process"):
        run(load_config(overrides=["sft.train=true"]), ctx=None)


SFT_ROWS, SFT_BATCH, SFT_CHECKPOINT_EVERY = 96, 2, 4


@pytest.mark.system
def test_killed_sft_training_resumes_from_its_last_checkpoint(validated, tiny_model_dir):
    import mlflow

    root = validated.parent
    records = [{"prompt": r["prompt"], "completion": r["completion"]} for r in demo_rows(SFT_ROWS)]
    # two more that do not fit sft.max_length=128: left out, not cut, so the number of steps stays
    records += [{"prompt": f"long answer {i}", "completion": ANSWER * 4} for i in range(2)]
    demos_file = write_lines(root / "demos.jsonl", records)
    overrides = stage_overrides(
        root,
        tiny_model_dir,
        demos_file,
        f"sft.train_batch_size={SFT_BATCH}",
        f"sft.checkpoint_every={SFT_CHECKPOINT_EVERY}",
        "sft.learning_rate=0.001",
    )
    total_steps = SFT_ROWS // SFT_BATCH
    killed_at = kill_training_once("tasks.sft", overrides, root / "ckpt", SFT_CHECKPOINT_EVERY)
    assert not (root / "sft").exists()
    assert SFT_CHECKPOINT_EVERY <= killed_at < total_steps  # the kill may cut the second checkpoint mid-write
    client = mlflow.MlflowClient(f"sqlite:///{root}/mlflow.db")
    assert not client.search_registered_models()  # the killed run registered nothing

    rerun_resumes(
        "tasks.sft", overrides, what="sft", killed_at=killed_at, out_dir=root / "sft", checkpoint_dir=root / "ckpt"
    )

    runs = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id])
    (finished,) = [r for r in runs if r.info.status == "FINISHED"]
    metrics = finished.data.metrics
    assert metrics["sft/resumed_from_step"] == killed_at
    assert metrics["sft/train_steps"] == total_steps  # the same length as an uninterrupted run
    assert metrics["sft/demonstrations"] == SFT_ROWS + 2 and metrics["sft/dropped_overlong"] == 2
    assert metrics["sft/perplexity"] < metrics["sft/perplexity_before"]
    logged_steps = [m.step for m in client.get_metric_history(finished.info.run_id, "sft/train_loss")]
    assert logged_steps and min(logged_steps) > killed_at  # it trained on from the checkpoint, not from step 0
    (version,) = client.search_model_versions("name='rlhf-sft'")
    assert version.run_id == finished.info.run_id


@pytest.mark.system
def test_the_flow_trains_the_sft_model_and_every_later_stage_loads_it(prefect_server, tmp_path, tiny_model_dir):
    import mlflow
    from safetensors.torch import load_file

    from flows.pipeline import rlhf_pipeline
    from rlhfops.stages import STAGES

    overrides = tiny_pipeline_overrides(tmp_path, tiny_model_dir) + [
        "sft.train=true",
        f"sft.train_data={tmp_path}/data/validated/train.jsonl",
        f"sft.checkpoint_dir={tmp_path}/checkpoints/sft",
        "sft.lora.enabled=true",
        "sft.learning_rate=0.01",
        "sft.max_length=256",  # the demo data's demonstrations are 171-257 tiny-tokenizer tokens
    ]
    state = rlhf_pipeline(overrides=overrides, return_state=True)
    assert state.is_completed(), state

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id])
    children = {r.data.tags["stage"]: r for r in runs if "stage" in r.data.tags}
    assert set(children) == {s.name for s in STAGES} and all(r.info.status == "FINISHED" for r in runs)
    assert client.get_model_version_by_alias("rlhf-sft", "candidate").run_id == children["sft"].info.run_id
    assert {"sft/perplexity_before", "sft/perplexity", "sft/train_steps"} <= set(children["sft"].data.metrics)
    # a plain model with the LoRA update merged in: the weights moved, and no adapter tensors were saved
    trained = load_file(tmp_path / "models/sft/model.safetensors")
    loaded = load_file(tiny_model_dir / "model.safetensors")
    assert set(trained) == set(loaded)
    assert any(not torch.equal(trained[k], loaded[k]) for k in loaded)
    logs = flow_run_logs(state.state_details.flow_run_id)
    assert any("sft" in m for m in logs) and not [m for m in logs if "Disassembly of" in m]
