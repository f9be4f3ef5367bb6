"""One stage list drives both the Prefect flow and dvc.yaml."""

import yaml

from rlhflow.config import REPO_ROOT, load_config
from rlhflow.stages import STAGES, dvc_yaml

FLOW_ORDER = ["demo_data", "validate", "sft", "reward_model", "ppo", "evaluate"]


def test_dvc_yaml_is_generated_from_the_stage_list():
    committed = (REPO_ROOT / "dvc.yaml").read_text()
    assert committed == dvc_yaml(), "dvc.yaml is stale: run `make dvc-yaml`"


def test_stage_order_and_commands():
    assert [s.name for s in STAGES] == FLOW_ORDER
    stages = yaml.safe_load(dvc_yaml())["stages"]
    for s in STAGES:
        assert stages[s.name]["cmd"] == f"python -m tasks.{s.name}"
        assert (REPO_ROOT / "tasks" / f"{s.name}.py").exists()


def test_templates_resolve_to_the_configured_paths():
    cfg = load_config(overrides=["sft.out_dir=/x/sft"])
    sft = next(s for s in STAGES if s.name == "sft")
    assert sft.resolve(cfg, sft.outs[0]) == "/x/sft"
    ppo = next(s for s in STAGES if s.name == "ppo")
    assert ppo.resolve(cfg, ppo.metrics[0]) == "metrics/ppo.json"


def test_every_code_dependency_exists():
    for s in STAGES:
        for dep in s.deps:
            if "${" not in dep:
                assert (REPO_ROOT / dep).exists(), f"{s.name}: dependency {dep} does not exist"


def test_each_stage_reads_the_outputs_of_earlier_stages_only():
    cfg = load_config()
    produced: set[str] = {s.resolve(cfg, "${data.preferences}") for s in STAGES[:0]}
    for s in STAGES:
        for dep in s.deps:
            if dep.startswith("${") and dep != "${data.preferences}":
                assert s.resolve(cfg, dep) in produced, f"{s.name} reads {dep} before any stage writes it"
        produced.update(s.resolve(cfg, o) for o in s.outs + s.metrics + s.plots)  # DVC outputs, cached or not
