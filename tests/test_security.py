"""Security: model code from a model dir runs only when params turn `trust_remote_code` on and the environment
allows it, as any setting that runs code (rlhflow/config/code_settings.py); weights load only
from safetensors; every torch.load in the project uses weights_only; the Prefect server a run starts listens on
127.0.0.1 only; secrets from the environment and the user and password of the tracking URI are never printed, and
never reach MLflow (params, tags, artifacts, the store itself), Prefect (parameters, artifacts, logs) or a file of the
run. URL redaction, the judge's key and the Docker build context: tests/test_secrets.py."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO, flow_run_logs, mlflow_server, tiny_pipeline_overrides

from rlhfops.stages import STAGES

MARKER_ENV = "RLHFLOW_TEST_REMOTE_CODE_MARKER"

CUSTOM_CONFIG = """
import os
from pathlib import Path
from transformers import LlamaConfig

Path(os.environ["{marker}"]).write_text("remote code ran")


class EvilConfig(LlamaConfig):
    model_type = "evil-llama"
"""
CUSTOM_MODELING = """
from transformers import LlamaForCausalLM, LlamaForSequenceClassification
from .configuration_evil import EvilConfig


class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig


class EvilForSequenceClassification(LlamaForSequenceClassification):
    config_class = EvilConfig
"""


@pytest.fixture()
def remote_code_model(tmp_path, tiny_model_dir, monkeypatch):
    """The tiny model, declared as a custom architecture whose code (shipped in the dir) writes a marker file."""
    model = tmp_path / "evil_model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.update(
        model_type="evil-llama",
        architectures=["EvilForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_evil.EvilConfig",
            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
            "AutoModelForSequenceClassification": "modeling_evil.EvilForSequenceClassification",
        },
    )
    (model / "config.json").write_text(json.dumps(config))
    (model / "configuration_evil.py").write_text(CUSTOM_CONFIG.format(marker=MARKER_ENV))
    (model / "modeling_evil.py").write_text(CUSTOM_MODELING)
    marker = tmp_path / "marker"
    monkeypatch.setenv(MARKER_ENV, str(marker))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    return model, marker


def test_model_code_runs_only_when_params_turn_trust_remote_code_on(remote_code_model, monkeypatch):
    from rlhflow.config.params import load_config
    from rlhflow.models.loading import load_causal_lm
    from rlhflow.training.reward_model import load_backbone

    model, marker = remote_code_model
    cfg = load_config()
    assert cfg.sft.trust_remote_code is False  # the default in params.yaml
    for load in (load_causal_lm, load_backbone):
        with pytest.raises(ValueError, match="trust_remote_code"):
            load(str(model), trust_remote_code=cfg.sft.trust_remote_code)
        assert not marker.exists(), f"{load.__name__} ran the model's own code"

    monkeypatch.setenv("RLHFLOW_ALLOW_CODE", "sft.trust_remote_code")  # the environment allows what params turn on
    on = load_config(None, ["sft.trust_remote_code=true"])
    loaded = load_causal_lm(str(model), trust_remote_code=on.sft.trust_remote_code)
    assert type(loaded).__name__ == "EvilForCausalLM" and marker.read_text() == "remote code ran"


@pytest.mark.parametrize(
    "setting, override",
    [
        ("sft.trust_remote_code", "sft.trust_remote_code=true"),
        ("ppo.reward_fn", "ppo.reward_fn=tests.fixtures:prompt_length_reward"),
        ("launch.accelerate_config", "launch.accelerate_config=/tmp/rendezvous.yaml"),
    ],
)
def test_a_setting_that_runs_code_needs_the_environment_to_allow_it(setting, override, monkeypatch):
    """params.yaml and --set may come from a pull request or a Prefect parameter: they alone cannot run code."""
    from rlhflow.config.params import ConfigError, load_config

    monkeypatch.delenv("RLHFLOW_ALLOW_CODE", raising=False)
    with pytest.raises(ConfigError, match=rf"{setting} runs .*RLHFLOW_ALLOW_CODE={setting} ") as refused:
        load_config(None, [override])
    assert "cannot turn on code" in str(refused.value)

    monkeypatch.setenv("RLHFLOW_ALLOW_CODE", f" {setting} , ")
    assert load_config(None, [override])
    monkeypatch.setenv("RLHFLOW_ALLOW_CODE", f"{setting}_typo")
    with pytest.raises(ConfigError, match=rf"names '{setting}_typo', which is no setting that runs code"):
        load_config(None, [override])


def test_an_accelerate_config_runs_no_code_only_from_the_shipped_folder(tmp_path, monkeypatch):
    """accelerate copies its config's sections onto torchrun's arguments (a rendezvous backend that unpickles a
    file): a config other than the shipped configs/accelerate/ ones, links resolved, needs the environment's
    allowance."""
    from rlhflow.config.params import REPO_ROOT, ConfigError, load_config

    monkeypatch.delenv("RLHFLOW_ALLOW_CODE", raising=False)
    for named in ("configs/accelerate/cpu_2proc.yaml", str(REPO_ROOT / "configs/accelerate/ddp.yaml")):
        assert load_config(None, [f"launch.accelerate_config={named}"]).launch.accelerate_config == named
    with pytest.raises(ConfigError, match="launch.accelerate_config runs .* outside the shipped"):
        load_config(None, ["launch.accelerate_config=configs/accelerate/../../rendezvous.yaml"])
    # links are resolved: a link in the shipped folder to a file outside it is outside (a folder of the test's own
    # stands for configs/accelerate/, so that nothing is written into the project)
    from rlhflow.config import code_settings

    shipped, outside = tmp_path / "shipped", tmp_path / "rendezvous.yaml"
    shipped.mkdir()
    outside.write_text("rdzv_backend: static\n")
    (shipped / "cpu.yaml").symlink_to(outside)
    (shipped / "own.yaml").write_text("num_processes: 2\n")
    monkeypatch.setattr(code_settings, "SHIPPED_ACCELERATE_CONFIGS", str(shipped))
    assert load_config(None, [f"launch.accelerate_config={shipped / 'own.yaml'}"])
    with pytest.raises(ConfigError, match="launch.accelerate_config runs .* outside the shipped"):
        load_config(None, [f"launch.accelerate_config={shipped / 'cpu.yaml'}"])


def test_weights_load_only_from_safetensors(tmp_path, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from rlhflow.models.loading import load_causal_lm
    from rlhflow.training.reward_model import NORM_FILE, RewardModel, load_backbone

    pickled = tmp_path / "pickled_model"
    shutil.copytree(tiny_model_dir, pickled)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    (pickled / "model.safetensors").unlink()
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")  # a pickle: loading it could run code
    (pickled / NORM_FILE).write_text(json.dumps({"mean": 0.0, "std": 1.0, "max_length": 32}))
    for load in (load_causal_lm, load_backbone, RewardModel.load):
        with pytest.raises(OSError, match="safetensors"):
            load(str(pickled))
    assert load_causal_lm(str(tiny_model_dir)) is not None  # the same model as safetensors loads


def test_every_torch_load_in_the_project_uses_weights_only():
    calls = []
    for path in sorted(p for d in ("rlhflow", "tasks", "flows") for p in (REPO / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                weights_only = [k for k in node.keywords if k.arg == "weights_only"]
                ok = (
                    bool(weights_only)
                    and isinstance(weights_only[0].value, ast.Constant)
                    and weights_only[0].value.value is True
                )
                calls.append((f"{path.relative_to(REPO)}:{node.lineno}", ok))
    assert calls, "expected the PPO checkpoint loader's torch.load calls"
    assert all(ok for _, ok in calls), [where for where, ok in calls if not ok]


# The one place each client that carries a credential is built, and what builds it there: (file, function)
CLIENT_BUILDERS = {
    "MlflowClient": ("rlhfops/tracking.py", "client"),  # and CheckedClient, its subclass
    "httpx.Client": ("rlhflow/evaluation/judging.py", "client"),  # LLMJudge.client, built from a checked LLMJudge
    "httpx.AsyncClient": None,
    "OpenAI": None,
}


def calls_by_function(tree: ast.AST):
    """(dotted name of the called thing, the innermost function around the call) for every call in `tree`."""

    def dotted(node) -> str:
        return f"{dotted(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) else getattr(node, "id", "?")

    def walk(node, function: str | None):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                yield dotted(child.func), function
            yield from walk(child, inner)

    return walk(tree, None)


def test_every_client_that_carries_a_credential_is_built_where_it_is_checked():
    """An MLflow client comes from tracking.client (the store's transport, then each run's artifact location checked),
    the judge's http client from LLMJudge.client (its endpoint checked when the judge is built), a Label Studio
    client from LabelStudio, whose constructor checks: code that builds one another way fails here."""
    from rlhflow.config.params import JudgeConfig
    from rlhflow.evaluation import judges
    from rlhfops import tracking
    from rlhfops.labeling import LabelingError, LabelStudio

    elsewhere = []
    for path in sorted(p for d in ("rlhflow", "rlhfops", "tasks", "flows", "bench") for p in (REPO / d).rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        for name, function in calls_by_function(ast.parse(path.read_text(encoding="utf-8"))):
            kind = next((k for k in CLIENT_BUILDERS if name == k or name.endswith(f".{k}")), None)
            if kind and CLIENT_BUILDERS[kind] != (rel, function):
                elsewhere.append(f"{rel}: {name}() in {function}")
    assert elsewhere == [], elsewhere
    with pytest.raises(LabelingError, match="is not https"):
        LabelStudio("http://10.0.0.5:8080", "token")
    assert LabelStudio("http://10.0.0.5:8080", "token", allow_plain_http=True).shown == "http://10.0.0.5:8080"
    settings = {**JudgeConfig().model_dump(), "kind": "llm", "model": "m", "endpoint": "http://10.0.0.5:8000/v1"}
    unchecked = JudgeConfig.model_construct(**settings)  # settings that skipped the check at load
    with pytest.raises(judges.JudgeUnavailableError, match="is not https"):
        judges.LLMJudge(unchecked)
    with pytest.raises(tracking.TrackingUnavailableError, match="is not https"):
        tracking.client("http://10.0.0.5:5000")


def test_redact_masks_url_credentials_and_secret_environment_values(monkeypatch):
    from rlhfops.tracking import redact

    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-123456789")
    assert redact("postgresql://bob:hunter2pw@db:5432/mlflow") == "postgresql://db:5432/mlflow"
    assert redact("https://user:p%40ss@mlflow.example.com") == "https://mlflow.example.com"
    assert redact("https://api.example.com/v1?api-version=2&k=k1#t=2") == "https://api.example.com/v1"
    assert redact("header Bearer tok-123456789 sent") == "header Bearer *** sent"
    assert redact("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"


# ---- a whole tiny run with secrets in the environment ------------------------------------------------------

SECRETS = {
    "HF_TOKEN": "hf_SECRETxHFxTOKENx0123456789",
    "MLFLOW_TRACKING_PASSWORD": "SECRETxMLFLOWxPASSWORDx42",
    "AWS_SECRET_ACCESS_KEY": "SECRETxAWSxKEYx+/abcdefghij",
    "RLHFLOW_WEBHOOK_TOKEN": "SECRETxCUSTOMxTOKENx777",
}
URI_USER_INFO = "rlhf-team:SECRETxURIxPASSWORDx31"


def listening_addresses(port: int) -> set[str]:
    """Local IPv4/IPv6 addresses with a socket listening on `port` (from /proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


@pytest.mark.system
def test_the_prefect_server_listens_on_loopback_only(prefect_server):
    from urllib.parse import urlparse

    from prefect.settings import PREFECT_API_URL

    port = urlparse(PREFECT_API_URL.value()).port
    addresses = listening_addresses(port)
    assert addresses == {"0100007F"}, addresses  # 127.0.0.1, not 0.0.0.0 (00000000) or an IPv6 wildcard


@pytest.mark.system
def test_environment_secrets_never_reach_mlflow_or_prefect_logs(
    prefect_server, tmp_path, tiny_model_dir, monkeypatch, capfd
):
    """A whole tiny run with secrets in the environment and a user and password in $MLFLOW_TRACKING_URI, which points
    at a real MLflow server (it ignores them): none of them is printed, logged, or stored in MLflow (params, tags,
    artifacts, the store itself), in Prefect (the flow run's parameters, artifacts, logs) or in any file of the run."""
    import mlflow

    from flows.pipeline import rlhf_pipeline

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)  # the run sets it: unset after
    secrets = {**SECRETS, "the tracking URI's user and password": URI_USER_INFO}
    with mlflow_server(tmp_path) as url:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url.replace("http://", f"http://{URI_USER_INFO}@"))
        overrides = tiny_pipeline_overrides(tmp_path, tiny_model_dir, tracking=False)
        state = rlhf_pipeline(overrides=overrides, return_state=True)
        assert state.is_completed(), state
        client = mlflow.MlflowClient(url)
        runs = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id])

    def leaks(text: str) -> list[str]:
        return [name for name, value in secrets.items() if value in text]

    printed = capfd.readouterr()
    assert not leaks(printed.out + printed.err)
    assert len(runs) == 1 + len(STAGES)  # the parent and one run per stage
    for run in runs:
        assert not leaks(json.dumps(run.data.params)), run.data.tags.get("stage")
        assert not leaks(json.dumps(run.data.tags)), run.data.tags.get("stage")
    written = [p for p in tmp_path.rglob("*") if p.is_file()]  # the store, the artifacts, the flow's lock, outputs
    assert any(p.name == "MLmodel" for p in written) and any(p.name == "mlflow.db" for p in written)
    lock = REPO / "dvc.lock"
    for path in written + ([lock] if lock.exists() else []):
        assert not leaks(path.read_bytes().decode("utf-8", errors="replace")), path

    messages = flow_run_logs(state.state_details.flow_run_id)
    # the run's own log lines are there (its prints go to Prefect's log), its link printed without credentials
    assert any("MLflow parent run" in m and f"{url}/#/experiments/" in m for m in messages), messages
    assert not leaks("\n".join(messages))
    published = prefect_records(state.state_details.flow_run_id)
    assert f"{url}/#/experiments/" in published  # the report and the link artifact
    assert not leaks(published)


def prefect_records(flow_run_id) -> str:
    """What the Prefect API holds of a flow run besides its logs: its parameters and its artifacts, as text."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async def read() -> str:
        async with get_client() as prefect:
            run = await prefect.read_flow_run(flow_run_id)
            artifacts = await prefect.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
            )
        assert artifacts, "the run published no artifact"
        shown = [json.dumps(run.parameters, default=str)]
        return "\n".join(shown + [f"{a.key} {a.description} {a.data}" for a in artifacts])

    return asyncio.run(read())
