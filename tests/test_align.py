"""align.algorithm: trl's GRPO, RLOO and DPO as drop-in alternatives to the PPO engine in the ppo stage
(rlhflow/training/align.py, tasks/ppo.py). On tiny models: each trains a couple of steps through the stage's CLI,
writes a policy the evaluate stage reads, logs align/ metrics, a completions table and the algorithm tag; the reward
GRPO and RLOO train on is the proxy's normalised score; DPO raises the chosen response's log-ratio; bad settings fail
naming the key; switching the algorithm leaves the upstream stages up to date; a killed GRPO stage resumes from its
Trainer checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pandas as pd
import pytest
import torch
from conftest import kill_training_once, make_dvc_repo, rerun_resumes, tiny_pipeline_overrides

from rlhflow.config.params import ConfigError, load_config
from rlhflow.data.readers import read_jsonl, write_jsonl
from rlhflow.training import align
from rlhfops.dvc_yaml import stage_deps
from rlhfops.stage_runner import cli
from rlhfops.stages import get_stage

TRL_ALGORITHMS = ["grpo", "rloo", "dpo"]
UPSTREAM = ["validate", "sft", "reward_model", "judge", "sft_answers"]
# two optimisation steps of 4 completions (2 prompts x 2 generations) or 4 pairs
ALIGN_OVERRIDES = [
    "align.steps=2",
    "align.batch_size=4",
    "align.grpo.num_generations=2",
    "align.rloo.num_generations=2",
    "align.checkpoint_every=1",
    "align.dpo.max_response_length=32",
]


def run_cli(stage: str, overrides: list[str]) -> None:
    """A stage's CLI (`python -m tasks.<stage> --set ...`), in this process."""
    import importlib

    try:
        cli(stage, importlib.import_module(f"tasks.{stage}").run, [a for o in overrides for a in ("--set", o)])
    except SystemExit as exit_:
        raise AssertionError(f"{stage} exited with {exit_.code}") from None


def runs_of(root: Path, stage: str) -> list:
    client = mlflow.MlflowClient(f"sqlite:///{root}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id], order_by=["start_time DESC"])
    return [r for r in runs if r.data.tags.get("stage") == stage]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory, tiny_model_dir, one_thread):
    """validate, sft, reward_model and judge run once on tiny models; each test runs the ppo stage on them."""
    root = tmp_path_factory.mktemp("align")
    overrides = tiny_pipeline_overrides(root, tiny_model_dir)
    for stage in ["demo_data", *UPSTREAM]:
        run_cli(stage, overrides)
    return root, overrides


# ---- the stage, per algorithm -----------------------------------------------------------------------


def settings_of(cfg) -> align.AlignSettings:
    return align.AlignSettings(cfg.align, cfg.ppo, cfg.seed)


@pytest.mark.parametrize("algorithm", TRL_ALGORITHMS)
@pytest.mark.system
def test_each_algorithm_trains_and_evaluate_reads_its_policy(upstream, algorithm):
    from rlhflow.models.loading import load_causal_lm
    from rlhflow.training.reward_model import RewardModel
    from rlhfops.registry import POLICY as REGISTERED_NAME

    root, base = upstream
    overrides = [*base, *ALIGN_OVERRIDES, f"align.algorithm={algorithm}"]
    run_cli("ppo", overrides)

    # the policy: a plain model dir with its tokenizer, where evaluate reads it, trained away from the SFT model
    policy_dir = root / "models/policy"
    assert (policy_dir / "model.safetensors").is_file() and (policy_dir / "tokenizer_config.json").is_file()
    policy, sft = load_causal_lm(str(policy_dir)), load_causal_lm(str(root / "models/sft"))
    assert any(not torch.equal(a, b) for a, b in zip(policy.state_dict().values(), sft.state_dict().values()))
    assert not (root / "checkpoints/ppo").exists()  # finished: nothing left to resume

    # metrics/ppo.json and the per-step history, under align/
    metrics = json.loads((root / "metrics/ppo.json").read_text())
    assert metrics["align/steps"] == 2.0 and "align/loss_final" in metrics
    history = pd.read_csv(root / "metrics/ppo_history.csv")
    assert list(history["step"]) == [1, 2]
    expected = ["align/loss", "align/lr"]
    if algorithm == "dpo":
        expected += ["align/rewards/margins", "align/rewards/accuracies", "align/logps/chosen"]
    else:  # reward, KL (beta > 0), completion length, EOS share, the score before the missing-EOS penalty
        expected += ["align/reward", "align/kl", "align/completion_length", "align/eos_fraction", "align/score_mean"]
    assert set(expected) <= set(history.columns)

    # MLflow: the stage run's per-step curves, its tag, the registered version's tag, the completions table
    (run,) = runs_of(root, "ppo")[:1]
    client = mlflow.MlflowClient(f"sqlite:///{root}/mlflow.db")
    assert run.info.status == "FINISHED" and run.data.tags["algorithm"] == algorithm
    assert run.data.params["align.algorithm"] == algorithm
    assert [m.step for m in client.get_metric_history(run.info.run_id, "align/loss")] == [1, 2]
    version = client.get_model_version(REGISTERED_NAME, run.data.tags[f"registered/{REGISTERED_NAME}"])
    assert version.tags["algorithm"] == algorithm
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    if algorithm == "dpo":
        assert "align_completions.json" not in artifacts  # DPO samples nothing
    else:
        assert "align_completions.json" in artifacts
        table = pd.DataFrame(
            **json.loads(Path(client.download_artifacts(run.info.run_id, "align_completions.json")).read_text())
        )
        assert set(table["step"]) == {1, 2} and len(table) == 2 * 4
        # the reward trl trained on is the proxy's normalised score of the decoded text, minus the EOS penalty
        rm = RewardModel.load(root / "models/reward_model")
        train = read_jsonl(root / "data/validated/train.jsonl")
        messages = {align.render_messages(m): m for m in train["prompt_messages"]}
        proxy = rm.score([messages[p] for p in table["prompt"]], list(table["completion"]))
        assert table["score"].tolist() == pytest.approx(proxy.tolist(), abs=1e-5)
        penalty = 1.0 * ~table["ended"].astype(bool)  # ppo.missing_eos_penalty
        assert table["reward"].tolist() == pytest.approx((proxy.numpy() - penalty).tolist(), abs=1e-5)

    # evaluate reads that policy and says which algorithm made it
    run_cli("evaluate", overrides)
    evaluation = json.loads((root / "metrics/evaluate.json").read_text())
    assert {"eval/win_rate_vs_sft", "eval/kl", "eval/judge_reward_mean"} <= set(evaluation)
    assert runs_of(root, "evaluate")[0].data.tags["algorithm"] == algorithm
    assert (root / "reports/evaluate/plots/align_curves.png").is_file()


# ---- the reward -------------------------------------------------------------------------------------


class TokenCounter(torch.nn.Module):
    """A stand-in reward model whose raw score is the number of real tokens it reads: a known reward."""

    def forward(self, input_ids, attention_mask, **_):
        return SimpleNamespace(logits=attention_mask.sum(-1, keepdim=True).float())


def test_the_reward_is_the_proxys_normalised_score_minus_the_eos_penalty(tok):
    from rlhflow.training.reward_model import RewardModel, encode_pair

    rm = RewardModel(TokenCounter(), tok, max_length=64, mean=3.0, std=2.0)
    eos = tok.eos_token_id
    reward = align.ProxyReward(rm.score, eos_ids=[eos], missing_eos_penalty=0.5)
    prompts = [[{"role": "user", "content": "hello world"}], [{"role": "user", "content": "explain water please"}]]
    completions = [[{"role": "assistant", "content": "yes"}], [{"role": "assistant", "content": "thanks for asking"}]]
    logged = {}
    got = reward(prompts, completions, completion_ids=[[5, eos], [5, 6]], log_metric=logged.__setitem__)

    n_tokens = [len(encode_pair(tok, p, c[0]["content"], 64)) for p, c in zip(prompts, completions)]
    normalised = [(n - 3.0) / 2.0 for n in n_tokens]
    assert got == pytest.approx([normalised[0], normalised[1] - 0.5])  # the second never ended: penalised
    assert logged == pytest.approx({"score_mean": sum(normalised) / 2, "eos_fraction": 0.5})


def test_a_non_finite_reward_stops_training(tok):
    reward = align.ProxyReward(lambda p, r: [float("nan")] * len(r), eos_ids=[0], missing_eos_penalty=None)
    with pytest.raises(FloatingPointError, match="non-finite reward at step 1"):
        reward([[{"role": "user", "content": "a"}]], ["b"], completion_ids=[[0]])


def test_grpo_and_rloo_see_prompts_as_ppo_does(tok):
    """Chat template and generation prompt, cut to the last ppo.max_prompt_length tokens:
    rlhflow.models.policy.encode_prompts (unpadded)."""
    from rlhflow.models.policy import encode_prompts

    prompts = [[{"role": "user", "content": "Please explain how photosynthesis works in simple terms."}]] * 2
    prompts[1] = [{"role": "user", "content": "hi"}]
    trainer = SimpleNamespace(processing_class=tok, max_prompt_length=12)
    ids, images, extra = align.PPOPrompts._tokenize_prompts(trainer, prompts)
    padded, mask = encode_prompts(tok, prompts, 12)
    assert ids == [row[m.bool()].tolist() for row, m in zip(padded, mask)]
    assert len(ids[0]) == 12 and images is None and extra == {}


def test_trainer_arguments_follow_the_ppo_sampling_settings_and_stay_fp32_on_cpu(tmp_path):
    cfg = load_config(
        overrides=[
            "align.algorithm=grpo",
            "ppo.temperature=0.9",
            "ppo.top_k=5",
            "ppo.top_p=0.8",
            "ppo.max_new_tokens=17",
            "align.precision=bf16",
            "align.grpo.loss_type=dr_grpo",
        ]
    )
    args = align.trainer_args(settings_of(cfg), torch.device("cpu"), tmp_path)
    assert (args.temperature, args.top_k, args.top_p, args.max_completion_length) == (0.9, 5, 0.8, 17)
    assert args.bf16 is False and args.fp16 is False and args.gradient_checkpointing is False
    assert (args.num_generations, args.beta, args.loss_type, args.max_steps) == (4, 0.04, "dr_grpo", 20)
    assert args.save_steps == 8 and args.logging_steps == 1
    assert (args.steps_per_generation, args.generation_batch_size) == (1, 8)  # one generation per step
    # steps_per_generation: one generation of 8 completions (2 prompts x 4) serves 2 steps of 4, as PPO's minibatches
    split = load_config(overrides=["align.algorithm=rloo", "align.batch_size=4", "align.steps_per_generation=2"])
    args = align.trainer_args(settings_of(split), torch.device("cpu"), tmp_path)
    assert (args.per_device_train_batch_size, args.steps_per_generation, args.generation_batch_size) == (4, 2, 8)
    dpo_cfg = load_config(overrides=["align.algorithm=dpo", "align.dpo.beta=0.3"])
    dpo = align.trainer_args(settings_of(dpo_cfg), torch.device("cpu"), tmp_path)
    assert dpo.beta == 0.3 and dpo.loss_type == ["sigmoid"] and dpo.bf16 is False


# ---- DPO on a hand-built pair -----------------------------------------------------------------------


def completion_logprob(model, batch) -> torch.Tensor:
    """Sum of log-probabilities of the completion tokens of each row of a preference collator's batch."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    logps = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return (logps * batch["completion_mask"][:, 1:]).sum(-1)


def tiny_policy_and_reference(model_dir):
    from rlhflow.models.loading import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    return tokenizer, *(load_causal_lm(str(model_dir), pad_token_id=tokenizer.pad_token_id) for _ in range(2))


def test_dpo_raises_the_chosen_log_ratio_on_a_hand_built_pair(tmp_path, tiny_model_dir, one_thread):
    tokenizer, policy, reference = tiny_policy_and_reference(tiny_model_dir)
    row = {
        "prompt": "Is water wet?",
        "prompt_messages": [{"role": "user", "content": "Is water wet?"}],
        "chosen": "Thank you for asking! Water is wet.",
        "rejected": "no",
    }
    cfg = load_config(
        overrides=["align.algorithm=dpo", "align.steps=8", "align.batch_size=1", "align.learning_rate=1e-3"]
    )
    trainer = align.build_trainer(
        settings_of(cfg),
        policy=policy,
        tokenizer=tokenizer,
        train_rows=[row],
        work_dir=tmp_path,
        device=torch.device("cpu"),
        ref_model=reference,
    )
    batch = trainer.data_collator([trainer.train_dataset[0]])  # chosen first, rejected second
    with torch.no_grad():
        before = completion_logprob(policy, batch)
        ref = completion_logprob(reference, batch)
    trainer.train()
    with torch.no_grad():
        after = completion_logprob(trainer.model, batch)
    chosen_ratio, rejected_ratio = (after - ref).tolist()
    assert torch.allclose(before, ref)  # the policy starts as the reference: log-ratios 0
    assert chosen_ratio > 0.05  # DPO pushed the chosen response up ...
    assert chosen_ratio - rejected_ratio > 0.1  # ... and away from the rejected one
    assert trainer.state.log_history[-2]["rewards/accuracies"] == 1.0


@pytest.mark.filterwarnings("error:.*checkpointing.*:FutureWarning")  # no deprecated-name warning in the log
def test_dpo_training_warns_nothing_about_checkpointing_names(tmp_path, tiny_model_dir, one_thread):
    """trl's configs turn activation checkpointing on by default; the stage sets it by transformers 5's name, and
    trl's own read of the deprecated alias is filtered by its message alone."""
    tokenizer, policy, reference = tiny_policy_and_reference(tiny_model_dir)
    row = {"prompt": "Hi?", "prompt_messages": [{"role": "user", "content": "Hi?"}], "chosen": "Hi.", "rejected": "no"}
    cfg = load_config(overrides=["align.algorithm=dpo", "align.steps=1", "align.batch_size=1"])
    device = torch.device("cpu")
    align.train_policy(
        settings_of(cfg),
        policy=policy,
        tokenizer=tokenizer,
        train_rows=[row],
        work_dir=tmp_path,
        device=device,
        ref_model=reference,
    )
    assert not policy.is_activation_checkpointing


# ---- bad settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["align.grpo.num_generations=1"], "align.grpo.num_generations"),
        (["align.rloo.num_generations=1"], "align.rloo.num_generations"),
        (["align.algorithm=grpo", "align.batch_size=6"], "align.batch_size"),
        (["align.algorithm=sgd"], "align.algorithm"),
        (["align.grpo.loss_type=ppo"], "align.grpo.loss_type"),
        (["align.grpo.scale_rewards=maybe"], "align.grpo.scale_rewards"),
        (["align.dpo.loss_type=exo_pair"], "align.dpo.label_smoothing"),
        (["align.dpo.beta=0"], "align.dpo.beta"),
        (["align.steps=0"], "align.steps"),
        (["align.algorithm=dpo", "ppo.lora.enabled=true"], "ppo.lora.enabled"),
    ],
)
def test_bad_settings_fail_naming_the_key(overrides, named):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert named in str(err.value)


@pytest.mark.parametrize(
    ("algorithm", "extra", "named"),
    [
        ("dpo", [], "align.algorithm=dpo needs preference pairs"),
        ("grpo", ['ppo.stop_strings=["\\n\\nUser:"]'], "ppo.stop_strings"),
    ],
)
def test_settings_the_data_rules_out_fail_before_any_model_loads(
    tmp_path, tiny_model_dir, monkeypatch, algorithm, extra, named
):
    from rlhfops.stage_runner import run_stage
    from tasks import ppo

    rows = [
        {"prompt": "hi", "prompt_messages": [{"role": "user", "content": "hi"}], "chosen": "yes", "rejected": "yes"}
    ]
    write_jsonl(pd.DataFrame(rows), tmp_path / "validated/train.jsonl")

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("rlhflow.models.loading.load_causal_lm", no_model)  # the stage imports it when it runs
    cfg = load_config(
        overrides=[
            f"align.algorithm={algorithm}",
            *extra,
            f"sft.out_dir={tiny_model_dir}",
            f"validate.out_dir={tmp_path}/validated",
            f"ppo.checkpoint_dir={tmp_path}/ckpt",
            f"metrics_dir={tmp_path}/metrics",
            f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        ]
    )
    with pytest.raises(ValueError, match=named.replace("[", r"\[")):
        run_stage("ppo", ppo.run, cfg)
    assert not (tmp_path / "ckpt").exists()


# ---- the stage list, DVC and the Prefect form -------------------------------------------------------


def test_switching_the_algorithm_reruns_only_ppo_and_evaluate_by_the_stage_list():
    """By the stage list dvc.yaml is generated from: only ppo reads the align section (evaluate its algorithm, for the
    tag), and only ppo's code includes rlhflow/training/align.py."""

    def reads(stage: str, key: str) -> bool:
        return any(key == p or key.startswith(p + ".") for p in get_stage(stage).params)

    for stage in UPSTREAM:
        assert not reads(stage, "align.algorithm") and not reads(stage, "align.grpo.beta"), stage
        assert "rlhflow/training/align.py" not in stage_deps(get_stage(stage)), stage
    assert reads("ppo", "align.algorithm") and reads("ppo", "align.dpo.beta")
    assert "rlhflow/training/align.py" in stage_deps(get_stage("ppo"))
    assert reads("evaluate", "align.algorithm") and "${ppo.out_dir}" in get_stage("evaluate").deps


@pytest.mark.system
def test_switching_the_algorithm_leaves_the_upstream_stages_up_to_date_in_dvc(tmp_path, tiny_model_dir):
    """In a real git+DVC repo: every stage's outputs stand in place (no training), `dvc commit` records them in
    dvc.lock; after align.algorithm changes in params.yaml, `dvc status` names ppo alone (evaluate follows once
    ppo's output changes; it also reads align.algorithm)."""
    import yaml

    run = make_dvc_repo(tmp_path / "repo", tiny_model_dir, timeout=300)
    repo = tmp_path / "repo"
    for path in [
        "data/raw/demo/preferences.jsonl",
        "data/validated/train.jsonl",
        "reports/validation/validation.json",
        "models/sft/model.safetensors",
        "models/reward_model/model.safetensors",
        "models/judge/model.safetensors",
        "models/policy/model.safetensors",
        "reports/evaluate/report.md",
        "data/sft_answers/answers.json",
        *[
            f"metrics/{s}.json"
            for s in ["demo_data", "validate", "sft", "reward_model", "judge", "sft_answers", "ppo", "evaluate"]
        ],
        "metrics/ppo_history.csv",
        "metrics/eval_reward_quantiles.csv",
        "metrics/eval_calibration.csv",
    ]:
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text("{}\n" if path.endswith(".json") else "x\n")
    committed = run("dvc", "commit", "-f", "-q")
    assert committed.returncode == 0, committed.stdout + committed.stderr
    status = run("dvc", "status", "--json")
    assert status.returncode == 0 and json.loads(status.stdout) == {}, status.stdout + status.stderr

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["align"]["algorithm"] = "grpo"
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    status = run("dvc", "status", "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    assert sorted(json.loads(status.stdout)) == ["evaluate", "ppo"]


def test_the_parameter_form_offers_the_algorithm_as_a_choice():
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import rlhf_pipeline
    from flows.serve import with_form_defaults

    schema = parameter_schema(with_form_defaults(rlhf_pipeline, load_config())).model_dump_for_openapi()
    fields = schema["definitions"]["AlignConfig"]["properties"]
    assert fields["algorithm"]["enum"] == ["ppo", "grpo", "rloo", "dpo"]
    assert fields["algorithm"]["default"] == "ppo"
    assert schema["definitions"]["GRPOSettings"]["properties"]["loss_type"]["enum"][:3] == ["grpo", "dr_grpo", "dapo"]
    assert schema["properties"]["config"]["default"]["align"]["algorithm"] == "ppo"


# ---- resume -----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.system
def test_killed_grpo_stage_resumes_from_its_trainer_checkpoint(tmp_path, tiny_model_dir):
    """SIGKILL once the second Trainer checkpoint is complete; the rerun resumes from the last complete one, logs every
    step in its own MLflow run, and writes the policy."""
    from rlhflow.data.readers import write_jsonl as write

    prompts = ["hello world", "explain water", "thanks", "say yes", "fox dog", "steps one two", "help me", "boils"]
    rows = [
        {"prompt": p, "prompt_messages": [{"role": "user", "content": p}], "chosen": "yes", "rejected": "no"}
        for p in prompts
    ]
    write(pd.DataFrame(rows), tmp_path / "validated/train.jsonl")
    steps, every = 12, 2
    overrides = [
        "align.algorithm=grpo",
        f"align.steps={steps}",
        "align.batch_size=4",
        "align.grpo.num_generations=2",
        f"align.checkpoint_every={every}",
        "ppo.reward_fn=rlhflow.ppo.reward_functions:vowel_fraction",
        "ppo.max_new_tokens=8",
        f"sft.out_dir={tiny_model_dir}",
        f"validate.out_dir={tmp_path}/validated",
        f"ppo.out_dir={tmp_path}/policy",
        f"ppo.checkpoint_dir={tmp_path}/ckpt",
        f"metrics_dir={tmp_path}/metrics",
        f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        "tracking.log_models=false",
    ]
    killed_at = kill_training_once("tasks.ppo", overrides, tmp_path / "ckpt", every)
    assert every <= killed_at < steps  # the kill may cut the second checkpoint's state mid-write
    rerun_resumes(
        "tasks.ppo",
        overrides,
        what="grpo",
        killed_at=killed_at,
        out_dir=tmp_path / "policy",
        checkpoint_dir=tmp_path / "ckpt",
    )
    resumed = pd.read_csv(tmp_path / "metrics/ppo_history.csv")
    assert list(resumed["step"]) == list(range(1, steps + 1))
    (run,) = [r for r in runs_of(tmp_path, "ppo") if r.info.status == "FINISHED"]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "align/score_mean")] == list(range(1, steps + 1))
    assert run.data.metrics["align/resumed_from_step"] == killed_at
