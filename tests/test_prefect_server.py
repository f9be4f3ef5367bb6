"""The deployments on a real Prefect server, as `make ui` serves them: a real `prefect server start` (its own
PREFECT_HOME and database in a temp dir), `python -m flows.serve` in a subprocess, two pipeline runs
triggered at once through the API on tiny models. They complete, leave their report and MLflow link as
artifacts, and never hold the accelerator at the same time (the global concurrency limit). The server wants an
auth string and CSRF tokens, as `make ui`'s does, so the deployments and flow runs show Prefect's clients send
both. The UI a person opens (headless Chromium) shows the report's plots, loaded, and the short custom-run form. And
`make ui` itself (`flows.serve --start-servers`): its server refuses a request without the auth string
it keeps in $PREFECT_HOME/ui.env (mode 0600), and a Ctrl-C stops it without a traceback."""

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
from conftest import CHECKOUT, REPO, free_port, launch_chromium, tiny_pipeline_overrides

from flows.pipeline import TRAINING_LIMIT
from flows.report import LINK_KEY, MLFLOW_UI_URL_ENV, REPORT_KEY
from flows.serve import PREFECT_UI_PATH, stop, wait_for
from rlhfops.stack_access import new_auth_string, prefect_server_security
from rlhfops.stages import STAGES

pytestmark = pytest.mark.system  # a real Prefect server and served deployments

MLFLOW_UI = "http://127.0.0.1:5999"
ACCELERATOR = {s.name for s in STAGES if s.accelerator}
AUTH_STRING = new_auth_string()  # the served server's, as `make ui` makes one
ARTIFACTS = CHECKOUT / "test-artifacts"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A Prefect server and the served deployments; yields the API URL. Both are stopped at the end."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api,
        "PREFECT_API_AUTH_STRING": AUTH_STRING,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
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
                [sys.executable, "-m", "flows.serve"], env=env, cwd=home, stdout=logs["serve"], stderr=subprocess.STDOUT
            )
        )
        yield api, home
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
def api_runs(served, tmp_path_factory, tiny_model_dir):
    """Two pipeline runs started at once through the API, as the UI's form starts them, in separate output roots
    (the second would otherwise find everything up to date), the second with three stages; both final. Returns
    (runs, roots)."""
    from prefect.deployments import run_deployment
    from prefect.settings import temporary_settings

    api, home = served
    with _client(api) as client:
        _wait_for_deployment(client, "rlhf-pipeline/pipeline", home / "serve.log")
    roots = [tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")]
    stages = [None, ["demo_data", "validate", "sft"]]
    with temporary_settings(_settings(api)):
        runs = [
            run_deployment(
                "rlhf-pipeline/pipeline",
                timeout=0,
                parameters={"overrides": tiny_pipeline_overrides(root, tiny_model_dir), "stages": only, "kl_coef": 0.2},
            )
            for root, only in zip(roots, stages)
        ]
    with _client(api) as client:
        deadline = time.monotonic() + 480
        while time.monotonic() < deadline:
            runs = [client.read_flow_run(r.id) for r in runs]
            if all(r.state.is_final() for r in runs):
                break
            time.sleep(2)
    return runs, roots


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


def test_runs_triggered_through_the_api_complete_with_artifacts_and_never_train_together(served, api_runs):
    import mlflow
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    api, home = served
    runs, roots = api_runs
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


def test_the_prefect_ui_shows_the_reports_plots_and_the_short_form(served, api_runs, chromium, capsys):
    """What a person sees in the Prefect UI `make ui` serves (V2, which its "/" opens), logged in with the auth
    string: the first run's report artifact with every plot loaded (embedded in it: the UI cannot read the run's
    disk), and the pipeline deployment's custom-run form, the short form titled by each field's setting."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=60_000)  # the UI's first load on a busy 2-core machine takes seconds
    api, _ = served
    ui = api.removesuffix("/api") + PREFECT_UI_PATH
    with _client(api) as client:
        report = _report_artifacts(client, api_runs[0][0].id)[REPORT_KEY]
        deployment = client.read_deployment_by_name("rlhf-pipeline/pipeline")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = launch_chromium(p, chromium)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(ui)
            page.locator("input[type=password]").fill(AUTH_STRING)
            page.keyboard.press("Enter")
            expect(page.get_by_role("link", name="Deployments").first).to_be_visible()

            page.goto(f"{ui}/artifacts/artifact/{report.id}")
            expect(page.get_by_role("heading", name="Stages").first).to_be_visible()
            plots = "Array.from(document.images).filter(i => i.src.startsWith('data:image/png'))"
            page.wait_for_function(f"() => {plots}.length >= 2 && {plots}.every(i => i.complete)")
            sizes = page.evaluate(f"() => {plots}.map(i => [i.naturalWidth, i.naturalHeight])")
            page.screenshot(path=str(ARTIFACTS / "prefect-ui-report.png"), full_page=True)
            assert sizes and all(w > 100 and h > 100 for w, h in sizes), sizes  # each plot decoded, none broken

            page.goto(f"{ui}/deployments/deployment/{deployment.id}/run")
            page.wait_for_load_state("networkidle")
            page.screenshot(path=str(ARTIFACTS / "prefect-ui-custom-run.png"), full_page=True)
            (ARTIFACTS / "prefect-ui-custom-run.txt").write_text(page.locator("body").inner_text())
            for title in ("Seed (seed)", "PPO steps (ppo.steps)", "PPO KL weight (ppo.kl_coef)", "Other settings"):
                expect(page.get_by_text(title).first).to_be_visible()  # the UI adds "(Optional)"
            # each a box to type in, not a type menu set to "None" first; only the fields past the form have one
            assert page.get_by_text('Property is type "None"').count() == 2, page.locator("body").inner_text()
            # what Submit sends with PPO steps alone filled in (caught before it reaches the server: nothing runs)
            sent = []
            page.route("**/create_flow_run", lambda route: (sent.append(route.request.post_data_json), route.abort()))
            page.get_by_role("spinbutton").nth(1).fill("3")  # seed, PPO steps, KL weight
            page.get_by_role("button", name="Submit").click()
            deadline = time.monotonic() + 60
            while not sent and time.monotonic() < deadline:
                page.wait_for_timeout(200)
            short = ("seed", "ppo_steps", "kl_coef", "algorithm", "judge_kind", "preferences", "overrides")
            parameters = sent[0]["parameters"]
            assert {k: v for k, v in parameters.items() if k in short} == {"ppo_steps": 3}, parameters
            expect(page.get_by_text("Reward Model", exact=False)).to_have_count(0)  # not the whole config
        finally:
            browser.close()
    with capsys.disabled():
        print(f"\nPrefect UI screenshots: {ARTIFACTS}/prefect-ui-report.png, prefect-ui-custom-run.png")


def test_a_server_slot_left_taken_is_announced_and_can_be_freed(served):
    """A server slot a run holds past its death stays taken until its lease expires. A waiting stage says so,
    naming the reset command; the command frees the slot and the stage goes on. The stage waits in its own
    process: Prefect's slot service is a per-process singleton bound to one server."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate
    from prefect.settings import temporary_settings

    from rlhfops.training_slot import reset_server_limit

    api, _ = served
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
