import subprocess
import sys

import pytest

from rlhflow.config import REPO_ROOT, Config, ConfigError, apply_overrides, load_config


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
            "data.preferences=/abs/path.jsonl",
        ]
    )
    assert cfg.ppo.kl_coef == 0.1 and isinstance(cfg.ppo.kl_coef, float)
    assert cfg.ppo.adaptive_kl.enabled is True
    assert cfg.ppo.stop_strings == ["\n\n"]
    assert cfg.data.preferences == "/abs/path.jsonl"


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
    from rlhflow.config import parse_config_args

    params = tmp_path / "params.yaml"
    params.write_text("seed: 3\n")
    cfg, _ = parse_config_args(["--params", str(params), "--set", "ppo.kl_coef=0.25"], "test")
    assert cfg.seed == 3 and cfg.ppo.kl_coef == 0.25
    with pytest.raises(SystemExit) as exit_:
        parse_config_args(["--set", "ppo.nope=1"], "test")
    assert exit_.value.code == 2


def test_importing_the_flows_reads_no_params_yaml():
    hook = "import sys; sys.addaudithook(lambda e, a: e == 'open' and 'params.yaml' in str(a[0]) and print(a[0]))"
    code = f"{hook}; import flows.pipeline, flows.stage_flows, flows.serve"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""


def test_the_served_parameter_form_has_the_params_as_defaults():
    """The deployments' form (flows/serve.py): the typed config with params.yaml's values as `config`'s default;
    the flows themselves default to None, which reads params.yaml as the run starts."""
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import rlhf_pipeline
    from flows.serve import with_form_defaults
    from flows.stage_flows import STAGE_FLOWS

    params = load_config(overrides=["ppo.kl_coef=0.123"])
    for flow in [rlhf_pipeline, STAGE_FLOWS["ppo"]]:
        schema = parameter_schema(with_form_defaults(flow, params)).model_dump()
        assert schema["properties"]["config"]["$ref"] == "#/definitions/Config"
        assert schema["properties"]["config"]["default"]["ppo"]["kl_coef"] == 0.123
        assert parameter_schema(flow).model_dump()["properties"]["config"]["default"] is None
