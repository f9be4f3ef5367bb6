"""Serve the pipeline and each stage as Prefect deployments, triggerable from the Prefect UI or API.

    python -m flows.serve                  # serve against the Prefect server in $PREFECT_API_URL
    python -m flows.serve --start-servers  # what `make ui` runs: a Prefect server and an MLflow server, then serve

Deployments: `rlhf-pipeline/pipeline`, `rlhf-sweep/sweep`, `restore-run/restore` and one per stage; their parameter
forms come from the typed config with params.yaml's values as defaults. Flow runs execute in subprocesses of this
process, in the repository. With --start-servers the Prefect server wants an API auth string, checks CSRF tokens and
lets only its own UI's origin call it from a browser (docs/prefect.md, docs/security.md).
"""

from __future__ import annotations

# A light door: prefect, mlflow and the flows are imported inside the functions that use them, after --help answers.
import argparse
import inspect
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Annotated

from flows.report import MODEL_TRAINING_VIEW
from rlhflow.config.params import REPO_ROOT, Config, load_config
from rlhfops.stack_access import (
    MLFLOW_SERVER_ENV,
    mlflow_server_command,
    new_auth_string,
    prefect_server_security,
    write_private,
)

DEFAULT_HOST = "127.0.0.1"
UI_ENV_FILE = "ui.env"  # in $PREFECT_HOME: what a client of `make ui`'s Prefect server needs
PIPELINE_DEPLOYMENT = "rlhf-pipeline/pipeline"
PREFECT_UI_PATH = "/v2"  # Prefect 3.8's default UI (its "/" opens it; links to its pages without this open the old one)


def with_form_defaults(flow, params):
    """A copy of `flow` whose parameter form (the schema Prefect builds from the flow's signature, for the
    deployment) offers the typed config with `params`' values as the defaults of `config`. The flow itself
    defaults `config` to None: a run started without one reads params.yaml as it starts."""

    signature = inspect.signature(flow.fn, eval_str=True)
    form = flow.with_options()
    form.__signature__ = signature.replace(
        parameters=[
            p.replace(annotation=Config, default=params) if p.name == "config" else p
            for p in signature.parameters.values()
        ]
    )
    return form


def short_form(flow, **deployment):
    """The deployment of `flow` (the pipeline, a stage) with the form a person fills in: the settings of
    FORM_SETTINGS, each typed as params.yaml types it and titled by its section ("PPO steps (ppo.steps)"), then
    `overrides` for any other value; no `config` (the run reads params.yaml as it starts) and no `parent_run`."""
    from flows.pipeline_flow import FORM_SETTINGS

    types = {name: setting_type(key) | None for name, key, _ in FORM_SETTINGS}
    order = [*types, "overrides"]  # the form's fields first, then any other value, then how the run goes
    signature = inspect.signature(flow.fn, eval_str=True)
    kept = [p for p in signature.parameters.values() if p.name not in ("config", "parent_run")]
    kept.sort(key=lambda p: order.index(p.name) if p.name in order else len(order))
    form = flow.with_options()
    form.__signature__ = signature.replace(
        parameters=[p.replace(annotation=types.get(p.name, p.annotation)) for p in kept]
    )
    served = form.to_deployment(**deployment)
    fields = served._parameter_openapi_schema.properties  # Prefect titles a field by its name: "ppo_steps"
    for name, key, title in FORM_SETTINGS:
        fields[name]["title"] = f"{title} ({key})"
    fields["overrides"]["title"] = "Other settings (section.key=value)"
    for name in [*types, "overrides"]:
        fields[name] = fillable(fields[name])
    return served


def fillable(field: dict) -> dict:
    """An optional field (`anyOf` its type or null, default null) as its type alone, without a default: Prefect's UI
    shows it as an empty box of that type, where it showed a type menu set to "None" that a person had to switch
    before typing; left empty, the parameter is not sent and the run takes params.yaml's value."""
    types = [t for t in field.get("anyOf", []) if t.get("type") != "null"]
    if len(types) != 1 or field.get("default", None) is not None:
        return field
    return {**{k: v for k, v in field.items() if k not in ("anyOf", "default")}, **types[0]}


def setting_type(key: str):
    """The type params.yaml's model gives `key`, with its bounds (a Literal of its choices, a number >= 1)."""
    model = Config
    *sections, name = key.split(".")
    for section in sections:
        model = model.model_fields[section].annotation
    field = model.model_fields[name]
    return Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation


def deployments() -> list:
    """The served deployments: the pipeline, the sweep, the feedback round, the restore, the head to head of two runs
    and one per stage."""
    from prefect.types.entrypoint import EntrypointType

    from flows.compare_flow import compare_runs
    from flows.feedback_flow import feedback_round
    from flows.pipeline_flow import rlhf_pipeline
    from flows.restore_flow import restore_run
    from flows.stage_flows import STAGE_FLOWS
    from flows.sweep_flow import rlhf_sweep
    from rlhfops.tracking import stored_config

    params = stored_config(load_config())  # params.yaml now: the defaults of every deployment's parameter form
    # flow runs import the flows by module (flows.pipeline_flow.rlhf_pipeline), whatever the current directory
    common = dict(tags=["rlhf"], entrypoint_type=EntrypointType.MODULE_PATH)
    served = [
        short_form(
            rlhf_pipeline,
            name="pipeline",
            **common,
            description="The whole RLHF pipeline on params.yaml, with the settings of this form and `overrides` "
            "changed; up-to-date stages are skipped.",
        )
    ]
    served.append(
        with_form_defaults(rlhf_sweep, params).to_deployment(
            name="sweep",
            **common,
            description="A grid of pipeline runs and the reward-KL frontier against best-of-n from the SFT model.",
        )
    )
    served.append(
        with_form_defaults(feedback_round, params).to_deployment(
            name="feedback",
            **common,
            description="A round of human feedback: sample pairs, send them to Label Studio, wait for and collect "
            "the labels, retrain on them (docs/feedback.md; $LABEL_STUDIO_API_KEY in the worker's environment).",
        )
    )
    served.append(
        restore_run.to_deployment(
            name="restore", **common, description="Put a pipeline run's data, models and metrics back (DVC cache)."
        )
    )
    served.append(
        with_form_defaults(compare_runs, params).to_deployment(
            name="compare",
            **common,
            description="Two finished pipeline runs' policies head to head on the test prompts, by the same judge.",
        )
    )
    for stage, stage_flow in STAGE_FLOWS.items():
        served.append(
            short_form(
                stage_flow, name=stage, **common, description=f"The {stage} stage alone, on earlier stages' outputs."
            )
        )
    return served


def serve_deployments(limit: int | None = None) -> None:
    """Register the deployments and run their flow runs until interrupted (blocks)."""
    from prefect import serve

    from flows.pipeline_flow import ensure_training_limit

    os.chdir(REPO_ROOT)  # flow runs start in the repository, as `make run` does
    print(f"training concurrency limit 'rlhf-training': {ensure_training_limit.fn()} slot(s)")
    serve(*deployments(), limit=limit)


def wait_for(url: str, proc: subprocess.Popen, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before answering at {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} did not answer at {url} within {timeout:.0f} s")


def launch(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A child in its own session: a Ctrl-C in the terminal reaches only this process, which then stops the
    children one by one (`stop`). Were they in the terminal's process group, all would get it at once and the
    Prefect server could exit while the serve loop still talks to it (tracebacks on the way out)."""
    return subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, start_new_session=True)


def launch_mlflow_server(store_uri: str, host: str, port: int, env: dict[str, str]) -> subprocess.Popen:
    """`mlflow server` over the tracking store `store_uri` (a sqlite store's artifacts served from beside it), with
    `env` and MLflow's job runner off unless `env` says otherwise, in its own session (`launch`)."""
    from rlhfops import tracking

    artifacts = tracking.sqlite_artifact_root(store_uri) if tracking.is_sqlite_uri(store_uri) else None
    return launch(mlflow_server_command(store_uri, host, port, artifacts), {**MLFLOW_SERVER_ENV, **env})


def stop(procs: list[subprocess.Popen], timeout: float = 15.0) -> None:
    """Interrupt each process in turn (as Ctrl-C would) and wait for it to exit before the next, killing it if
    it has not exited within `timeout`. Only the process itself is interrupted: the MLflow server passes the
    signal on to its web server, and its job runner exits when that does (interrupted too, it would print a
    traceback)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ui_client_env(prefect_url: str) -> tuple[dict[str, str], Path]:
    """The variables a client of `make ui`'s Prefect server needs (its API URL and auth string), and the file that
    holds them ($PREFECT_HOME/ui.env, mode 0600). The auth string: $PREFECT_API_AUTH_STRING, else the file's from an
    earlier start (a browser logged in stays so), else a new one."""
    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = home / UI_ENV_FILE
    kept = {}
    if path.exists():
        lines = [line.removeprefix("export ").split("=", 1) for line in path.read_text().splitlines() if "=" in line]
        kept = dict(lines)
    auth = os.environ.get("PREFECT_API_AUTH_STRING") or kept.get("PREFECT_API_AUTH_STRING") or new_auth_string()
    env = {"PREFECT_API_URL": f"{prefect_url}/api", "PREFECT_API_AUTH_STRING": auth}
    write_private(path, "".join(f"export {k}={v}\n" for k, v in env.items()))
    return env, path


def mlflow_ui_link(mlflow_url: str, tracking_uri: str, experiment: str) -> str:
    """The experiment's runs in the UI's model-training view once the store has the experiment; before, the
    experiment list in that view."""
    from rlhfops import tracking

    found = tracking.client(tracking_uri).get_experiment_by_name(experiment)
    where = f"/{found.experiment_id}/runs" if found else ""
    return f"{mlflow_url}/#/experiments{where}{MODEL_TRAINING_VIEW}"


def start_servers_and_serve(host: str, prefect_port: int, mlflow_port: int) -> int:
    """A Prefect server and an MLflow server (the project's tracking store, its artifacts served), both on
    `host`; then the deployments, in a child process pointed at them. Returns when any of them exits or on
    Ctrl-C, having stopped the others."""
    from rlhfops import tracking

    cfg = load_config()
    uri = tracking.tracking_uri(cfg)
    prefect_url, mlflow_url = f"http://{host}:{prefect_port}", f"http://{host}:{mlflow_port}"
    client_env, env_file = ui_client_env(prefect_url)
    # links to runs ("View at" in the log, the MLflow run's prefect.flow_run_url) open the UI Prefect shows at "/"
    env = {
        **os.environ,
        **client_env,
        "PREFECT_UI_URL": f"{prefect_url}{PREFECT_UI_PATH}",
        "RLHF_MLFLOW_UI_URL": mlflow_url,
    }
    bin_dir = Path(sys.executable).parent
    # the children are in their own sessions (launch): a terminal that closes (SIGHUP) or a `kill` (SIGTERM)
    # reaches only this process, which then stops them as it does on Ctrl-C
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    procs: list[subprocess.Popen] = []
    try:
        server_env = {**env, **prefect_server_security(client_env["PREFECT_API_AUTH_STRING"], prefect_url)}
        procs.append(
            launch(
                [str(bin_dir / "prefect"), "server", "start", "--host", host, "--port", str(prefect_port)], server_env
            )
        )
        procs.append(launch_mlflow_server(uri, host, mlflow_port, env))
        wait_for(f"{prefect_url}/api/health", procs[0], "the Prefect server")
        wait_for(f"{mlflow_url}/health", procs[1], "the MLflow server")
        procs.append(launch([sys.executable, "-m", "flows.serve"], env))
        mlflow_link = mlflow_ui_link(mlflow_url, uri, cfg.tracking.experiment)
        print(f"\nPrefect UI: {prefect_url}   MLflow UI: {mlflow_link}   (Ctrl-C stops both)", flush=True)
        print(
            f"The Prefect UI asks for a password: paste the value of PREFECT_API_AUTH_STRING in {env_file} (rlhf:..., "
            "without `export` and the name; other clients: source the file)\n",
            flush=True,
        )
        while all(p.poll() is None for p in procs):
            time.sleep(1)
        return next(p.returncode for p in procs if p.returncode is not None)
    except KeyboardInterrupt:
        return 0
    finally:
        # a second Ctrl-C must not cut the shutdown short: the children would outlive this process
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if any(p.poll() is None for p in procs):
            print("\nStopping the deployments, then the servers ...", flush=True)
        stop(list(reversed(procs)))  # the deployments first, while the Prefect server can still answer them


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--start-servers",
        action="store_true",
        help="start a Prefect server and an MLflow server first (what `make ui` does)",
    )
    parser.add_argument(
        "--host",
        default=os.environ.get("UI_HOST", DEFAULT_HOST),
        help="address both servers bind to (default: $UI_HOST, else 127.0.0.1)",
    )
    parser.add_argument("--prefect-port", type=int, default=int(os.environ.get("PREFECT_PORT", 4200)))
    parser.add_argument("--mlflow-port", type=int, default=int(os.environ.get("MLFLOW_PORT", 5000)))
    args = parser.parse_args(argv)
    if args.start_servers:
        sys.exit(start_servers_and_serve(args.host, args.prefect_port, args.mlflow_port))
    serve_deployments()


if __name__ == "__main__":
    main(sys.argv[1:])
