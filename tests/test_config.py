import subprocess
import sys
import tempfile

import pytest
import yaml

from rlhflow.config.params import REPO_ROOT, Config, ConfigError, apply_overrides, load_config, write_params
from rlhfops.stages import STAGES


def test_params_yaml_matches_the_config_model():
    cfg = load_config()
    assert cfg.to_params().keys() == Config().to_params().keys()
    assert cfg.tracking.experiment == "rlhf"


def test_overrides_are_typed():
    cfg = load_config(
        overrides=[
            "ppo.kl_coef=0.1",
            "ppo.adaptive_kl.enabled=true",
            'ppo.stop_strings=["\\n\\n"]',
            f"data.preferences={tempfile.gettempdir()}/path.jsonl",  # a directory the suite allows
        ]
    )
    assert cfg.ppo.kl_coef == 0.1 and isinstance(cfg.ppo.kl_coef, float)
    assert cfg.ppo.adaptive_kl.enabled is True
    assert cfg.ppo.stop_strings == ["\n\n"]
    assert cfg.data.preferences == f"{tempfile.gettempdir()}/path.jsonl"


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("ppo.kl_coeff=0.1", "ppo.kl_coeff"),  # unknown key
        ("ppo.steps=many", "ppo.steps"),  # wrong type
        ("ppo.cliprange=-1", "ppo.cliprange"),  # out of range
        ("ppo.kl_estimator=k2", "ppo.kl_estimator"),  # not one of the choices
        ("nonsense.key=1", "nonsense"),
    ],
)
def test_bad_parameters_fail_with_the_key_named(override, named):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert named in str(err.value)


def test_minibatch_must_divide_batch():
    with pytest.raises(ConfigError, match="mini_batch_size"):
        load_config(overrides=["ppo.batch_size=10", "ppo.mini_batch_size=4"])


def test_override_without_equals_is_rejected():
    with pytest.raises(ConfigError, match="key.sub=value"):
        apply_overrides({}, ["ppo.kl_coef"])


def test_paths_resolve_against_the_repo_not_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config()
    assert cfg.path(cfg.sft.out_dir) == REPO_ROOT / "models" / "sft"
    assert cfg.path("/abs/x") == __import__("pathlib").Path("/abs/x")


def test_evaluation_temperature_follows_ppo_unless_set():
    cfg = load_config(overrides=["ppo.temperature=0.9"])
    assert cfg.evaluate.temperature is None and cfg.eval_temperature == 0.9  # params.yaml leaves it unset
    assert load_config(overrides=["ppo.temperature=0.9", "evaluate.temperature=0.5"]).eval_temperature == 0.5


def test_command_line_reads_params_and_overrides(tmp_path):
    from rlhflow.config.params import parse_config_args

    params = tmp_path / "params.yaml"
    params.write_text("seed: 3\n")
    cfg, _ = parse_config_args(["--params", str(params), "--set", "ppo.kl_coef=0.25"], "test")
    assert cfg.seed == 3 and cfg.ppo.kl_coef == 0.25
    with pytest.raises(SystemExit) as exit_:
        parse_config_args(["--set", "ppo.nope=1"], "test")
    assert exit_.value.code == 2


@pytest.mark.system
def test_importing_the_flows_reads_no_params_yaml():
    hook = "import sys; sys.addaudithook(lambda e, a: e == 'open' and 'params.yaml' in str(a[0]) and print(a[0]))"
    code = f"{hook}; import flows.pipeline, flows.stage_flows, flows.serve"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""


def test_the_served_parameter_form_has_the_params_as_defaults():
    """The sweep's and feedback round's forms (flows/serve.py): the typed config with params.yaml's values as
    `config`'s default; the flows themselves default to None, which reads params.yaml as the run starts. (The
    pipeline's and the stages' forms are the short one: tests/test_prefect_server.py.)"""
    from prefect.utilities.callables import parameter_schema

    from flows.feedback_flow import feedback_round
    from flows.serve import with_form_defaults
    from flows.sweep_flow import rlhf_sweep

    params = load_config(overrides=["ppo.kl_coef=0.123"])
    for flow in [rlhf_sweep, feedback_round]:
        schema = parameter_schema(with_form_defaults(flow, params)).model_dump()
        assert schema["properties"]["config"]["$ref"] == "#/definitions/Config"
        assert schema["properties"]["config"]["default"]["ppo"]["kl_coef"] == 0.123
        assert parameter_schema(flow).model_dump()["properties"]["config"]["default"] is None


# ---- inherited keys: judge from reward_model, sft.lora and ppo.lora from lora ----------------------------------

# the judge's keys that reward_model does not have (which judge it is): written always, never inherited
JUDGE_OWN = (
    "kind",
    "model",
    "endpoint",
    "api_key_env",
    "allow_plain_http",
    "template",
    "request_timeout",
    "max_retries",
    # reward_model has these too, but the judge never takes the proxy's: its length head is its own
    "length_head",
    "length_loss_weight",
    "orthogonality_weight",
)


def test_the_judge_takes_the_reward_model_keys_it_does_not_set():
    cfg = load_config()
    written = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())["judge"]
    assert written.keys() == {"out_dir", "checkpoint_dir", "seed", *JUDGE_OWN}
    assert cfg.judge.max_length == cfg.reward_model.max_length == 256
    assert cfg.judge.backbone == cfg.reward_model.backbone
    assert (cfg.judge.out_dir, cfg.judge.checkpoint_dir, cfg.judge.seed) == ("models/judge", "checkpoints/judge", 1)

    both = load_config(overrides=["reward_model.max_length=128", "reward_model.out_dir=models/rm"])
    assert both.reward_model.max_length == both.judge.max_length == 128
    assert both.judge.out_dir == "models/judge"  # its own, never inherited

    judge_only = load_config(overrides=["judge.max_length=64"])
    assert judge_only.judge.max_length == 64 and judge_only.reward_model.max_length == 256

    explicit_wins = load_config(overrides=["judge.max_length=64", "reward_model.max_length=128"])
    assert explicit_wins.judge.max_length == 64 and explicit_wins.reward_model.max_length == 128


def test_a_judge_key_in_the_params_file_overrides_the_reward_model(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("reward_model:\n  epochs: 2.0\n  batch_size: 4\njudge:\n  batch_size: 8\n")
    cfg = load_config(params)
    assert (cfg.judge.epochs, cfg.judge.batch_size) == (2.0, 8)
    assert (cfg.reward_model.epochs, cfg.reward_model.batch_size) == (2.0, 4)


def test_sft_and_ppo_lora_take_the_lora_keys_they_do_not_set():
    cfg = load_config()
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    assert params["sft"]["lora"] == params["ppo"]["lora"] == {"enabled": False}
    assert cfg.sft.lora.r == cfg.ppo.lora.r == cfg.lora.r == 16
    assert cfg.sft.lora.target_modules == cfg.ppo.lora.target_modules == cfg.lora.target_modules

    shared = load_config(overrides=["lora.r=8", "lora.dropout=0.1"])
    assert shared.sft.lora.r == shared.ppo.lora.r == 8
    assert shared.sft.lora.dropout == shared.ppo.lora.dropout == 0.1

    own = load_config(overrides=["lora.r=8", "ppo.lora.r=4", "sft.lora.enabled=true"])
    assert (own.lora.r, own.sft.lora.r, own.ppo.lora.r) == (8, 8, 4)
    assert own.sft.lora.enabled and not own.ppo.lora.enabled
    with pytest.raises(ConfigError, match="lora.enabled"):  # each stage switches its own adapter on
        load_config(overrides=["lora.enabled=true"])


def test_inherited_keys_survive_a_write_and_a_reread(tmp_path):
    cfg = load_config(
        overrides=[
            "reward_model.epochs=2",
            "judge.max_length=64",
            "judge.epochs=1",  # the parent's value before the override above: now it differs
            "lora.dropout=0.1",
            "ppo.lora.alpha=8",
            "ppo.lora.r=16",  # the value it would inherit anyway
        ]
    )
    path = tmp_path / "params.yaml"
    write_params(cfg, path)
    written = yaml.safe_load(path.read_text())
    assert written["judge"] == {
        "out_dir": "models/judge",
        "max_length": 64,
        "epochs": 1.0,
        "checkpoint_dir": "checkpoints/judge",
        "seed": 1,
        **{key: getattr(cfg.judge, key) for key in JUDGE_OWN},
    }
    assert written["ppo"]["lora"] == {"alpha": 8, "enabled": False}  # r, equal to lora.r, is written once
    reread = load_config(path)
    assert reread == cfg and reread.to_params() == cfg.to_params() == written
    assert reread.judge.epochs == 1.0 and reread.judge.learning_rate == reread.reward_model.learning_rate
    # the Prefect form sends every key of every section: the same config, the same params
    from_form = Config.model_validate(cfg.model_dump(by_alias=True))
    assert from_form == cfg and from_form.to_params() == cfg.to_params()
    # the written file still inherits: a later change to the parent reaches the judge
    assert load_config(path, ["reward_model.learning_rate=0.5"]).judge.learning_rate == 0.5


def test_params_yaml_is_what_write_params_writes(tmp_path):
    """params.yaml holds the config as to_params gives it (inheriting sections compact), so the params the flow
    records for a stage are the ones DVC reads from params.yaml."""
    write_params(load_config(), tmp_path / "params.yaml")
    assert (tmp_path / "params.yaml").read_text() == (REPO_ROOT / "params.yaml").read_text()


def test_stages_declare_the_keys_they_inherit():
    """A change to an inherited key reruns the stages that inherit it (DVC params); an output path does not."""
    from rlhflow.config.params import JudgeConfig, RewardModelConfig
    from rlhflow.config.section import inherited_keys
    from rlhfops.stages import get_stage

    judge = get_stage("judge").params
    own = {child: own for child, _, own in Config.INHERITS}["judge"]
    inherited = {f"reward_model.{k}" for k in inherited_keys(JudgeConfig, RewardModelConfig, own)}
    assert set(judge) == {"judge", "launch.judge", "launch.accelerate_config"} | inherited
    assert "reward_model.max_length" in judge and "reward_model.out_dir" not in judge
    assert "lora" in get_stage("sft").params and "lora" in get_stage("ppo").params
    # a dotted key names a value params.yaml holds (DVC fails on a missing one), never one a section inherits
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    for stage in STAGES:
        for key in stage.params:
            node = params
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, f"{stage.name}: {key} is not in params.yaml"
                node = node[part]


def test_a_check_across_sections_names_its_keys_not_the_whole_config():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["ppo.checkpoint_dir=data"])
    message = str(err.value)
    assert "ppo.checkpoint_dir=data: resolves to" in message and "'seed'" not in message and "<root>" not in message
