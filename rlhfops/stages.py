"""The one stage list. It drives the Prefect flow (flows/pipeline.py runs these in order) and dvc.yaml
(generated from it by rlhfops/dvc_yaml.py: `python -m rlhfops.dvc_yaml > dvc.yaml`; a test checks the two agree).
A stage's `deps` here are the ones it names; dvc.yaml adds the project code it runs (`stage_deps`).

Paths are written as DVC templates (`${sft.out_dir}`) that DVC fills from params.yaml, and that
`Stage.resolve` fills from the typed config for the flow, so both read the same values.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Any

from rlhflow.config.params import Config
from rlhflow.config.section import inherited_keys

VALIDATED = "${validate.out_dir}"

FLOW_ENV = "RLHFOPS_FLOW_RUN"  # set by the flow for the processes of a stage it launches


def parent_run_option() -> argparse.ArgumentParser:
    """The stage CLI's own option (an argparse parent): the MLflow run a flow nests the stage's run under."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--parent-run-id", default=None, help="the MLflow run to nest this stage's run under")
    return own


@dataclass(frozen=True)
class Stage:
    name: str
    description: str
    params: list[str]  # params.yaml sections (or dotted keys) the stage reads
    deps: list[str]  # data, upstream outputs and its main code (templated paths); dvc_yaml.stage_deps adds the rest
    outs: list[str]  # what it writes, DVC-cached
    metrics: list[str] = field(default_factory=list)  # small JSON files, kept in git
    plots: list[str] = field(default_factory=list)  # data files behind the plots in PLOTS
    persist: list[str] = field(default_factory=list)  # outputs kept between runs (checkpoints)
    # loads models on the accelerator: holds a slot of the Prefect concurrency limit while it runs (flows/pipeline.py)
    accelerator: bool = False
    # trains data parallel under `accelerate launch`; otherwise rank 0 works alone (rlhfops/stage_runner.py)
    data_parallel: bool = False

    @property
    def module(self) -> str:
        return f"tasks.{self.name}"

    @property
    def command(self) -> str:
        """dvc.yaml's cmd: a data-parallel stage goes through the launcher, which starts `launch.<stage>` processes."""
        return f"python -m rlhfops.launch {self.name}" if self.data_parallel else f"python -m {self.module}"

    def resolve(self, cfg: Config, template: str) -> str:
        """Fill `${a.b}` from the typed config, as DVC fills it from params.yaml."""
        params = cfg.to_params()

        def lookup(match: re.Match) -> str:
            node: Any = params
            for part in match.group(1).split("."):
                node = node[part]
            return str(node)

        return re.sub(r"\$\{([^}]+)\}", lookup, template)


def inherited_params(section: str) -> list[str]:
    """The parent's keys a section takes when it does not set them (Config.INHERITS), as params a stage reads: a
    change to one of them reruns the stage."""
    _, parent, own = next(entry for entry in Config.INHERITS if entry[0] == section)
    child_type, parent_type = (Config.model_fields[name].annotation for name in (section, parent))
    return [f"{parent}.{key}" for key in inherited_keys(child_type, parent_type, own)]


def launch_params(stage: str) -> list[str]:
    """The launch settings a data-parallel stage reads: its process count and the accelerate config."""
    return [f"launch.{stage}", "launch.accelerate_config"]


def _metrics(stage: str) -> str:
    return "${metrics_dir}/" + f"{stage}.json"


STAGES: list[Stage] = [
    Stage(
        name="demo_data",
        description="generate the deterministic demo preference data",
        params=["data.demo"],
        deps=["rlhflow/data/demo.py", "rlhflow/data/demo_text.json", "tasks/demo_data.py"],
        outs=["${data.demo.out_dir}/preferences.jsonl"],
        metrics=[_metrics("demo_data")],
    ),
    Stage(
        name="validate",
        description="read preference data, run the Great Expectations suite, write train/judge/test splits",
        params=["data", "validate", "sft.model"],
        deps=[
            "${data.preferences}",
            "${feedback.pairs_file}",
            "${feedback.labels_file}",
            "rlhflow/data/feedback.py",
            "rlhflow/data/formats.py",
            "rlhflow/data/splits.py",
            "rlhflow/data/validation.py",
            "tasks/validate.py",
        ],
        outs=[VALIDATED, "${validate.report_dir}"],
        metrics=[_metrics("validate")],
    ),
    Stage(
        name="sft",
        description="load the SFT model, optionally fine-tune it on demonstrations (trl's SFTTrainer), keep a plain "
        "safetensors copy, baseline perplexity and samples",
        params=[
            "seed",
            "sft",
            "lora",  # the keys sft.lora does not set
            "ppo.max_prompt_length",
            "ppo.temperature",
            "ppo.top_k",
            "ppo.top_p",
            "ppo.stop_strings",
            "ppo.kv_cache",
            "evaluate.temperature",
        ],
        # the demonstrations: by default the validated train split (inside VALIDATED), else the user's file
        deps=[
            VALIDATED,
            "${sft.train_data}",
            "rlhflow/models/loading.py",
            "rlhflow/models/policy.py",
            "rlhflow/training/sft.py",
            "tasks/sft.py",
        ],
        outs=["${sft.out_dir}"],
        metrics=[_metrics("sft")],
        accelerator=True,
    ),
    Stage(
        name="reward_model",
        description="train the Bradley-Terry reward model with trl's RewardTrainer",
        params=["seed", "reward_model", "feedback.labelled_repeats", *launch_params("reward_model")],
        deps=[VALIDATED, "${sft.out_dir}", "rlhflow/training/reward_model.py", "tasks/reward_model.py"],
        outs=["${reward_model.out_dir}"],
        metrics=[_metrics("reward_model")],
        accelerator=True,
        data_parallel=True,
    ),
    Stage(
        name="judge",
        description="train the judge reward model on the judge split (prompts PPO and the proxy never see)",
        # the judge section holds only what differs from reward_model; every other key is reward_model's
        params=["judge", *inherited_params("judge"), *launch_params("judge")],
        # the LLM judge's prompt template is read, not imported: named here so an edit to it reruns the stages
        deps=[
            VALIDATED,
            "${sft.out_dir}",
            "rlhflow/training/reward_model.py",
            "rlhflow/evaluation/judge_template.txt",
            "tasks/judge.py",
        ],
        outs=["${judge.out_dir}"],
        metrics=[_metrics("judge")],
        accelerator=True,
        data_parallel=True,
    ),
    # The SFT model's side of every evaluation, sampled once: evaluate and each sweep point reuse it.
    Stage(
        name="sft_answers",
        description="the SFT model's answers to the evaluation prompts (one per test conversation), classified and "
        "scored by the proxy and the judge, sampled once for every evaluate",
        params=[
            "evaluate.n_prompts",
            "evaluate.samples_per_prompt",
            "evaluate.seed",
            "evaluate.max_new_tokens",
            "evaluate.temperature",
            "evaluate.top_p",
            "evaluate.repetition_penalty",
            "evaluate.degenerate_repetition",
            "evaluate.dev_figures",
            "evaluate.precision",
            "evaluate.batch_size",
            "evaluate.reference_dir",
            "ppo.max_prompt_length",
            "ppo.stop_strings",
            "ppo.kv_cache",
            "ppo.temperature",
            "ppo.top_k",
            "ppo.top_p",
            "reward_model.eval_batch_size",
            "judge",
        ],
        deps=[
            VALIDATED,
            "${sft.out_dir}",
            "${reward_model.out_dir}",
            "${judge.out_dir}",
            "rlhflow/evaluation/held_out.py",
            "rlhflow/evaluation/judge_template.txt",
            "tasks/sft_answers.py",
        ],
        outs=["${evaluate.reference_dir}"],
        metrics=[_metrics("sft_answers")],
        accelerator=True,
    ),
    # The policy-optimisation stage: align.algorithm picks PPO (the project's engine, rlhflow/ppo/) or trl's GRPO,
    # RLOO or DPO (rlhflow/training/align.py). One stage whatever the algorithm: the policy always lands in
    # ppo.out_dir, where evaluate reads it, and switching the algorithm (a param of this stage only) reruns this stage
    # and evaluate.
    Stage(
        name="ppo",
        description="policy optimisation of the SFT policy (align.algorithm: PPO against the reward model by default, "
        "or trl's GRPO, RLOO or DPO)",
        params=["seed", "ppo", "lora", "align", "reward_model.eval_batch_size", *launch_params("ppo")],
        deps=[
            VALIDATED,
            "${sft.out_dir}",
            "${reward_model.out_dir}",
            "rlhflow/ppo",
            "rlhflow/training/align.py",
            "rlhflow/models/policy.py",
            "tasks/ppo.py",
        ],
        outs=["${ppo.out_dir}"],
        metrics=[_metrics("ppo")],
        plots=["${metrics_dir}/ppo_history.csv"],
        accelerator=True,
        data_parallel=True,
    ),
    Stage(
        name="evaluate",
        description="the policy against the SFT model's answers on one prompt per test conversation, judged by the "
        "proxy and the judge (win rates overall and where both answers ended, length-controlled, with intervals over "
        "conversations; ended / cut / degenerate shares; KL, perplexity, drift), RM calibration",
        params=[
            "evaluate",
            "align.algorithm",
            "ppo.max_prompt_length",
            "ppo.stop_strings",
            "ppo.kv_cache",
            "ppo.temperature",
            "ppo.top_k",
            "ppo.top_p",
            "reward_model.eval_batch_size",
            "judge",  # judge.eval_batch_size when set, else reward_model's
        ],
        deps=[
            VALIDATED,
            "${sft.out_dir}",
            "${reward_model.out_dir}",
            "${judge.out_dir}",
            "${ppo.out_dir}",
            "${evaluate.reference_dir}",
            "${metrics_dir}/ppo_history.csv",
            "${metrics_dir}/judge.json",
            "rlhflow/evaluation",
            "rlhflow/training/reward_model.py",
            "tasks/evaluate.py",
        ],
        outs=["${evaluate.report_dir}"],
        metrics=[_metrics("evaluate")],
        plots=["${metrics_dir}/eval_reward_quantiles.csv", "${metrics_dir}/eval_calibration.csv"],
        accelerator=True,
    ),
]

STAGE_NAMES = [s.name for s in STAGES]

# Top-level dvc.yaml plots (`dvc plots show`): several curves per figure, drawn from the stages' plot files.
PLOTS: list[dict[str, Any]] = [
    {
        "ppo_reward": {
            "title": "PPO: reward-model score per update",
            "x": "step",
            "y": {"${metrics_dir}/ppo_history.csv": ["ppo/score_mean", "ppo/reward_total_mean"]},
        }
    },
    {
        "ppo_kl": {
            "title": "PPO: KL to the reference per update",
            "x": "step",
            "y": {"${metrics_dir}/ppo_history.csv": ["ppo/kl"]},
        }
    },
    {
        "ppo_reward_vs_kl": {
            "title": "PPO: reward against KL (one point per update)",
            "template": "scatter",
            "x": "ppo/kl",
            "y": {"${metrics_dir}/ppo_history.csv": ["ppo/score_mean"]},
        }
    },
    {
        "align_score": {
            "title": "Policy optimisation: reward-model score per step (any align.algorithm but dpo)",
            "x": "step",
            "y": {"${metrics_dir}/ppo_history.csv": ["align/score_mean"]},
        }
    },
    {
        "eval_reward_distribution": {
            "title": "Reward of held-out samples, SFT vs PPO (sorted: quantile plot)",
            "x": "quantile",
            "y": {"${metrics_dir}/eval_reward_quantiles.csv": ["sft_reward", "ppo_reward"]},
        }
    },
    {  # written by a sweep (flows/sweep.py), not by a stage: absent until the first sweep
        "sweep_frontier": {
            "title": "Sweep: proxy and judge reward against sqrt(KL to SFT), policies and best-of-n",
            "template": "scatter",
            "x": "sqrt_kl",
            "y": {"${metrics_dir}/sweep_frontier.csv": ["proxy_reward", "judge_reward"]},
        }
    },
    {
        "eval_rm_calibration": {
            "title": "Reward-model calibration: confidence vs observed accuracy",
            "x": "confidence",
            "y": {"${metrics_dir}/eval_calibration.csv": ["accuracy", "perfect_calibration"]},
        }
    },
]


def get_stage(name: str) -> Stage:
    for stage in STAGES:
        if stage.name == name:
            return stage
    raise KeyError(f"unknown stage {name!r}; stages: {', '.join(STAGE_NAMES)}")
