"""The deployments on a real Prefect server, as `make ui` serves them: a real `prefect server start` (its own
PREFECT_HOME and database in a temp dir) and `python -m flows.serve` in a subprocess, serving a git repo of the
project whose params.yaml is the tiny pipeline. Two pipeline runs at once: one started by a person in the UI
(headless Chromium, logged in with the auth string) through the short custom-run form with one setting changed, one
through the API. They complete, leave their report and MLflow link as artifacts, and never hold the accelerator at
the same time (the global concurrency limit); the UI run's report shows its plots, its log the stages' progress,
and its MLflow parent run its Prefect name. The server wants an auth string and CSRF tokens, as `make ui`'s does,
so the deployments and flow runs show Prefect's clients send both. And `make ui` itself
(`flows.serve --start-servers`): its server refuses a request without the auth string it keeps in
$PREFECT_HOME/ui.env (mode 0600), and a Ctrl-C stops it without a traceback."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import CHECKOUT, REPO, free_port, make_dvc_repo, tiny_pipeline_overrides

from flows.pipeline import TRAINING_LIMIT
from flows.report import LINK_KEY, MLFLOW_UI_URL_ENV, REPORT_KEY
from flows.serve import PREFECT_UI_PATH, stop, wait_for
from rlhfops.browser import launch_chromium
from rlhfops.stack_access import new_auth_string, prefect_server_security
from rlhfops.stages import STAGES

pytestmark = pytest.mark.system  # a real Prefect server and served deployments

MLFLOW_UI = "http://127.0.0.1:5999"
ACCELERATOR = {s.name for s in STAGES if s.accelerator}
AUTH_STRING = new_auth_string()  # the served server's, as `make ui` makes one
ARTIFACTS = CHECKOUT / "test-artifacts"
STAGES_OF_SECOND = ["demo_data", "validate", "sft"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    """A Prefect server and the deployments served from a git repo of the project whose params.yaml is the tiny
    pipeline (a run started from the UI with nothing but a changed setting runs on tiny models there), progress
    lines at every step; yields (API URL, Prefect home, repo). Both are stopped at the end."""
    home = tmp_path_factory.mktemp("prefect-home")
    repo = home / "repo"
    make_dvc_repo(repo, tiny_model_dir)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api,
        "PREFECT_API_AUTH_STRING": AUTH_STRING,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "RLHFLOW_PROGRESS_SECONDS": "0",
        MLFLOW_UI_URL_ENV: MLFLOW_UI,
    }
    env.pop("MLFLOW_TRACKING_URI", None)  # exported by mlflow.set_tracking_uri in earlier tests
    bin_dir = Path(sys.executable).parent
    logs = {name: open(home / f"{name}.log", "w") for name in ("server", "serve")}
    procs = [
        subprocess.Popen(
            [str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env={**env, **prefect_server_security(AUTH_STRING, api.removesuffix("/api"))},
            cwd=home,
            stdout=logs["server"],
            stderr=subprocess.STDOUT,
        )
    ]
    try:
        wait_for(f"{api}/health", procs[0], "the Prefect server")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "flows.serve"],
                env={**env, "PYTHONPATH": str(repo)},
                cwd=repo,
                stdout=logs["serve"],
                stderr=subprocess.STDOUT,
            )
        )
        yield api, home, repo
    finally:
        stop(list(reversed(procs)))
        for f in logs.values():
            f.close()


def _settings(api: str) -> dict:
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL

    return {PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: AUTH_STRING}


@contextlib.contextmanager
def _client(api: str):
    from prefect.client.orchestration import get_client
    from prefect.settings import temporary_settings

    with temporary_settings(_settings(api)), get_client(sync_client=True) as client:
        yield client


def _wait_for_deployment(client, name: str, serve_log: Path, timeout: float = 180):
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return client.read_deployment_by_name(name)
        except ObjectNotFound:
            time.sleep(1)
    raise TimeoutError(f"{name} was not served within {timeout} s:\n{serve_log.read_text()[-3000:]}")


def _overlaps(a, b) -> bool:
    return a.start_time < b.end_time and b.start_time < a.end_time


@pytest.fixture(scope="module")
def ui(served, chromium):
    """Headless Chromium on the served Prefect UI (V2, which its "/" opens), logged in with the auth string as a
    person logs in; yields (the UI's URL, the page)."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=60_000)  # the UI's first load on a busy 2-core machine takes seconds
    url = served[0].removesuffix("/api") + PREFECT_UI_PATH
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = launch_chromium(p, chromium)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(url)
            page.locator("input[type=password]").fill(AUTH_STRING)
            page.keyboard.press("Enter")
            expect(page.get_by_role("link", name="Deployments").first).to_be_visible()
            yield url, page
        finally:
            browser.close()


def start_from_the_form(ui, deployment_id) -> str:
    """Fill in the pipeline's custom-run form as a person does (PPO KL weight 0.2, nothing else) and submit it; the
    flow run's id. The form is the short one, each field a box to type in, not a type menu set to "None" first."""
    from playwright.sync_api import expect

    url, page = ui
    page.goto(f"{url}/deployments/deployment/{deployment_id}/run")
    for title in ("Seed (seed)", "PPO steps (ppo.steps)", "PPO KL weight (ppo.kl_coef)", "Other settings"):
        expect(page.get_by_text(title).first).to_be_visible()  # the UI adds "(Optional)"
    page.screenshot(path=str(ARTIFACTS / "prefect-ui-custom-run.png"), full_page=True)
    expect(page.get_by_text("Reward Model", exact=False)).to_have_count(0)  # not the whole config
    # only the fields past the short form (stages, remote) have a type menu
    assert page.get_by_text('Property is type "None"').count() == 2, page.locator("body").inner_text()
    page.get_by_role("spinbutton").nth(2).fill("0.2")  # seed, PPO steps, PPO KL weight
    with page.expect_response("**/create_flow_run") as created:
        page.get_by_role("button", name="Submit").click()
    return created.value.json()["id"]


@pytest.fixture(scope="module")
def started_runs(served, ui, tmp_path_factory, tiny_model_dir):
    """Two pipeline runs at once: the first from the UI's form (the served repo's tiny pipeline, PPO KL weight 0.2),
    the second through the API with three stages in an output root of its own (it would otherwise find everything
    up to date); both final. Returns (runs, the roots whose mlflow.db holds each)."""
    api, home, repo = served
    with _client(api) as client:
        deployment = _wait_for_deployment(client, "rlhf-pipeline/pipeline", home / "serve.log")
    from_ui = start_from_the_form(ui, deployment.id)
    second = tmp_path_factory.mktemp("b")
    # the sync client: Playwright's sync API keeps an event loop running here, where run_deployment would be async
    with _client(api) as client:
        from_api = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={"overrides": tiny_pipeline_overrides(second, tiny_model_dir), "stages": STAGES_OF_SECOND},
        )
        runs = [client.read_flow_run(from_ui), from_api]
        deadline = time.monotonic() + 480
        while time.monotonic() < deadline:
            runs = [client.read_flow_run(r.id) for r in runs]
            if all(r.state.is_final() for r in runs):
                break
            time.sleep(2)
    return runs, [repo, second]


def _report_artifacts(client, flow_run_id) -> dict:
    """The flow run's artifacts by key."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, TaskRunFilter
    from prefect.client.schemas.sorting import ArtifactSort

    artifacts = client.read_artifacts(  # the sync client sends no defaults: every argument is given
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])),
        flow_run_filter=FlowRunFilter(),
        task_run_filter=TaskRunFilter(),
        sort=ArtifactSort.KEY_ASC,
        limit=50,
        offset=0,
    )
    return {a.key: a for a in artifacts}


def test_runs_started_from_the_ui_and_the_api_complete_with_artifacts_and_never_train_together(served, started_runs):
    import mlflow
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    api, home, _ = served
    runs, roots = started_runs
    short = ["seed", "ppo_steps", "kl_coef", "algorithm", "judge_kind", "preferences", "overrides"]
    with _client(api) as client:
        deployment = _wait_for_deployment(client, "rlhf-pipeline/pipeline", home / "serve.log")
        for stage in ("validate", "ppo", "evaluate"):  # a stage's form is the pipeline's short one, with force
            served_stage = _wait_for_deployment(client, f"rlhf-{stage.replace('_', '-')}/{stage}", home / "serve.log")
            assert list(served_stage.parameter_openapi_schema["properties"]) == [*short, "force"]
        restore = _wait_for_deployment(client, "restore-run/restore", home / "serve.log")
        assert {"run_id", "remote"} <= set(restore.parameter_openapi_schema["properties"])
        sweep = _wait_for_deployment(client, "rlhf-sweep/sweep", home / "serve.log")
        assert {"grid", "overrides", "best_of_n", "config"} <= set(sweep.parameter_openapi_schema["properties"])
        # the UI's parameter form: the settings people change, typed and titled as params.yaml's, then any other
        # value as an override; not the whole config (the run reads params.yaml as it starts)
        fields = deployment.parameter_openapi_schema["properties"]
        assert list(fields)[:7] == short, list(fields)
        assert "config" not in fields and {"stages", "force"} <= set(fields)
        assert fields["ppo_steps"]["title"] == "PPO steps (ppo.steps)"
        assert (fields["ppo_steps"]["type"], fields["ppo_steps"]["minimum"]) == ("integer", 1)  # a box, no null
        assert fields["algorithm"]["enum"] == ["ppo", "grpo", "rloo", "dpo"]
        assert not [name for name in short if "anyOf" in fields[name] or "default" in fields[name]]
        assert client.read_global_concurrency_limit_by_name(TRAINING_LIMIT).limit == 1

        assert all(r.state.is_completed() for r in runs), (
            [r.state for r in runs],
            (home / "serve.log").read_text()[-5000:],
        )

        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in runs])),
            sort=TaskRunSort.EXPECTED_START_TIME_ASC,
            limit=200,
        )
        training = {
            r.id: [t for t in task_runs if t.flow_run_id == r.id and t.name.rsplit("-", 1)[0] in ACCELERATOR]
            for r in runs
        }
        first, second = (training[r.id] for r in runs)
        assert len(first) == 6 and len(second) == 1  # sft, reward_model, judge, sft_answers, ppo, evaluate; then one
        clashes = [(a.name, b.name) for a in first for b in second if _overlaps(a, b)]
        assert not clashes, f"training stages of the two runs ran at the same time: {clashes}"

        by_key = _report_artifacts(client, runs[0].id)
    report = by_key[REPORT_KEY]
    assert report.type == "markdown"
    for expected in ("## Stages", "| ppo | ran", "eval/win_rate_vs_sft", "## Validation", "**Prompt:**"):
        assert expected in report.data, report.data[:3000]
    # its plots travel inside it (the UI cannot load a path of the run's disk), and no figure is shown without data
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report.data)
    assert len(images) >= 2 and all(i.startswith("data:image/png;base64,") for i in images), [i[:60] for i in images]
    assert all(base64.b64decode(i.split(",", 1)[1]).startswith(b"\x89PNG\r\n\x1a\n") for i in images)
    assert "over 0 prompts" not in report.data
    link = re.fullmatch(r"\[MLflow run\]\((http[^)]+)\)", by_key[LINK_KEY].data)  # Prefect 3 stores links as markdown
    assert link, by_key[LINK_KEY].data
    url = link.group(1)
    assert url.startswith(f"{MLFLOW_UI}/#/experiments/")
    run_id = url.removesuffix("?workflowType=machine_learning").rsplit("/", 1)[-1]
    parent = mlflow.MlflowClient(f"sqlite:///{roots[0]}/mlflow.db").get_run(run_id)
    assert parent.info.status == "FINISHED" and "mlflow.parentRunId" not in parent.data.tags
    assert parent.data.tags["pipeline"] == "rlhf" and "eval/win_rate_vs_sft" in parent.data.metrics
    assert parent.data.params["ppo.kl_coef"] == "0.2"  # the form's field, applied as --set is


def test_the_run_started_from_the_ui_shows_its_plots_progress_and_name(served, ui, started_runs, capsys):
    """The run a person started from the form, followed in the UI: it ran with the one setting filled in (no other
    field sent), its report's plots load in the artifact page (embedded: the UI cannot read the run's disk), its log
    holds the stages' progress lines, and its MLflow parent run carries its Prefect name and id."""
    import mlflow
    from playwright.sync_api import expect
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    api, _, _ = served
    (from_ui, _), (repo, _) = started_runs
    short = {"seed", "ppo_steps", "kl_coef", "algorithm", "judge_kind", "preferences", "overrides"}
    assert {k: v for k, v in from_ui.parameters.items() if k in short} == {"kl_coef": 0.2}, from_ui.parameters
    with _client(api) as client:
        report = _report_artifacts(client, from_ui.id)[REPORT_KEY]
        of_the_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[from_ui.id]))
        logs = client.read_logs(log_filter=of_the_run, limit=200, sort=LogSort.TIMESTAMP_ASC)
    lines = [log.message for log in logs]
    for progress in ("ppo: update 1 of 2: reward", "evaluate: answers: batch 1 of"):
        assert any(line.startswith(progress) for line in lines), lines

    url, page = ui
    page.goto(f"{url}/artifacts/artifact/{report.id}")
    expect(page.get_by_role("heading", name="Stages").first).to_be_visible()
    plots = "Array.from(document.images).filter(i => i.src.startsWith('data:image/png'))"
    page.wait_for_function(f"() => {plots}.length >= 2 && {plots}.every(i => i.complete)")
    sizes = page.evaluate(f"() => {plots}.map(i => [i.naturalWidth, i.naturalHeight])")
    page.screenshot(path=str(ARTIFACTS / "prefect-ui-report.png"), full_page=True)
    assert sizes and all(w > 100 and h > 100 for w, h in sizes), sizes  # each plot decoded, none broken
    with capsys.disabled():
        print(f"\nPrefect UI screenshots: {ARTIFACTS}/prefect-ui-custom-run.png, prefect-ui-report.png")

    client = mlflow.MlflowClient(f"sqlite:///{repo}/mlflow.db")
    parent = client.search_runs(
        [client.get_experiment_by_name("rlhf").experiment_id], f"tags.`prefect.flow_run_id` = '{from_ui.id}'"
    )
    assert len(parent) == 1 and parent[0].data.tags["prefect.flow_run_name"] == from_ui.name
    assert parent[0].data.params["ppo.kl_coef"] == "0.2"


def test_a_server_slot_left_taken_is_announced_and_can_be_freed(served):
    """A server slot a run holds past its death stays taken until its lease expires. A waiting stage says so,
    naming the reset command; the command frees the slot and the stage goes on. The stage waits in its own
    process: Prefect's slot service is a per-process singleton bound to one server."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate
    from prefect.settings import temporary_settings

    from rlhfops.training_slot import reset_server_limit

    api = served[0]
    with _client(api) as client:  # the leak: a slot taken, no run holding it
        client.update_global_concurrency_limit(TRAINING_LIMIT, GlobalConcurrencyLimitUpdate(active_slots=1))
    code = (
        "import rlhfops.training_slot as s; s.NOTICE_S = 1.0\n"
        f"with s.training_slot('ppo', {TRAINING_LIMIT!r}, 1):\n    print('stage entered', flush=True)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-u", "-c", code],
        env={**os.environ, "PREFECT_API_URL": api, "PREFECT_API_AUTH_STRING": AUTH_STRING},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    while proc.poll() is None and not any("waited" in line for line in lines):
        lines.append(proc.stdout.readline())  # the waiting stage prints a notice every second
    assert proc.poll() is None, "".join(lines)  # still waiting
    with temporary_settings(_settings(api)):  # what the command does, against this server
        assert reset_server_limit(TRAINING_LIMIT) == (1, 0)
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and "stage entered" in out, out
    assert "ppo: waited" in out and f"{TRAINING_LIMIT!r}" in out and "--reset-training-limit" in out
    with _client(api) as client:
        assert client.read_global_concurrency_limit_by_name(TRAINING_LIMIT).active_slots == 0


def _status(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def _make_ui_wants_its_auth_string(home: Path, prefect_port: int) -> None:
    """`make ui`'s Prefect server refuses a request without the auth string ui.env holds, and with it hands out
    CSRF tokens (protection on: 422 when off)."""
    import base64

    ui_env = home / "ui.env"
    assert ui_env.stat().st_mode & 0o777 == 0o600
    values = dict(line.removeprefix("export ").split("=", 1) for line in ui_env.read_text().splitlines())
    api = f"http://127.0.0.1:{prefect_port}/api"
    assert values["PREFECT_API_URL"] == api and values["PREFECT_API_AUTH_STRING"].startswith("rlhf:")
    basic = {"Authorization": "Basic " + base64.b64encode(values["PREFECT_API_AUTH_STRING"].encode()).decode()}
    assert _status(f"{api}/admin/version") == 401
    assert _status(f"{api}/csrf-token?client=guest") == 401
    assert _status(f"{api}/csrf-token?client=guest", basic) == 200


@pytest.mark.slow
def test_make_ui_wants_its_auth_string_and_stops_on_ctrl_c_without_a_traceback(tmp_path):
    """`flows.serve --start-servers` (what `make ui` runs) in its own process group with SIGINT as a terminal
    leaves it; once it serves (so the deployments got in with the auth string), its Prefect server refuses a
    request without it; a Ctrl-C (SIGINT to the whole group) ends it with code 0, prints no traceback (the serve
    loop stops before the Prefect server), and leaves neither port open."""
    ports = {"prefect": free_port(), "mlflow": free_port()}
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_UI_ENABLED": "false",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db",
    }
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_API_AUTH_STRING", None)
    cmd = [sys.executable, "-m", "flows.serve", "--start-servers"]
    cmd += ["--prefect-port", str(ports["prefect"]), "--mlflow-port", str(ports["mlflow"])]
    log = tmp_path / "ui.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's foreground job
        )
        try:
            deadline = time.monotonic() + 240
            while "deployments are being served" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-5000:]
                time.sleep(1)
            _make_ui_wants_its_auth_string(tmp_path / "prefect-home", ports["prefect"])
            served = len(log.read_text())
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
            assert proc.wait(timeout=120) == 0, log.read_text()[-5000:]
        finally:
            if proc.poll() is None:  # SIGTERM: it stops its servers as on Ctrl-C
                proc.terminate()
                proc.wait(timeout=120)
    after = log.read_text()[served:]
    assert "Stopping the deployments" in after and "Traceback" not in after, after
    for name, port in ports.items():
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, f"the {name} server still listens on {port}"
