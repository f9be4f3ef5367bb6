"""A finished pipeline run on tiny models, checked in its MLflow store and on disk, then its MLflow UI as a person sees
it: headless Chromium (Debian's `chromium`, driven by Playwright; `make browser` installs it, and no browser is ever
downloaded) against a real `mlflow server`.

The experiment's runs page must list the parent run and, once expanded, one child run per stage; the parent run's
page must show its stage runs and the evaluation metrics with the values MLflow stored. Screenshots land in
test-artifacts/ (their paths are printed) whether the checks pass or fail."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
from conftest import CHECKOUT, mlflow_server, tiny_pipeline_overrides

from flows.report import mlflow_experiment_url, mlflow_run_url
from rlhfops.browser import close_mlflow_assistant, expand_mlflow_run, launch_chromium
from rlhfops.hashing import file_md5
from rlhfops.stages import STAGE_NAMES, STAGES

# a whole tiny pipeline run, then an MLflow server and Chromium: about 2 min on 2 cores
pytestmark = [pytest.mark.slow, pytest.mark.system]

ARTIFACTS = CHECKOUT / "test-artifacts"
EVAL_METRICS = [
    "rm/accuracy",
    "eval/reward_mean",
    "eval/reward_mean_sft",
    "eval/win_rate_vs_sft",
    "eval/kl",
    "eval/perplexity",
    "eval/perplexity_sft",
]
TIMEOUT_MS = 60_000  # the SPA's first load on a busy 2-core machine takes ~10 s


@pytest.fixture(scope="module")
def finished_pipeline(prefect_server, tmp_path_factory, tiny_model_dir, one_thread) -> tuple[Path, dict]:
    """A whole pipeline run on tiny models, tracked to <root>/mlflow.db (artifacts in <root>/mlartifacts): its root
    and the flow's results."""
    from flows.pipeline import rlhf_pipeline

    root = tmp_path_factory.mktemp("ui_run")
    return root, rlhf_pipeline(overrides=tiny_pipeline_overrides(root, tiny_model_dir))


@pytest.fixture(scope="module")
def finished_run(finished_pipeline) -> Path:
    return finished_pipeline[0]


def test_flow_runs_every_stage_and_tracks_them(finished_pipeline):
    """The flow run that the UI shows: every stage a child run of one parent run, with its params, metrics, datasets,
    models and registered versions, and the stages' outputs and metrics files on disk."""
    import mlflow

    tmp_path, results = finished_pipeline
    for key in EVAL_METRICS:
        assert key in results

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("rlhf")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    parent = parents[0]
    children = {r.data.tags["stage"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert set(children) == {s.name for s in STAGES}
    assert all(r.info.status == "FINISHED" for r in runs)
    for key in EVAL_METRICS:  # evaluation metrics on the parent run too
        assert parent.data.metrics[key] == pytest.approx(results[key])
    assert parent.data.params["ppo.kl_coef"] == "0.05"
    assert children["ppo"].data.params["ppo.steps"] == "2"
    assert "ppo/kl" in children["ppo"].data.metrics and "ppo/score_mean" in children["ppo"].data.metrics
    assert len(client.get_metric_history(children["ppo"].info.run_id, "ppo/kl")) == 2
    # the SFT model's perplexity on the same rows: measured once, by the sft stage, and taken by evaluate
    assert children["evaluate"].data.metrics["eval/perplexity_sft"] == children["sft"].data.metrics["sft/perplexity"]

    # datasets are run inputs whose digest is the DVC md5 of the validated files
    digests = {d.dataset.name: d.dataset.digest for d in children["validate"].inputs.dataset_inputs}
    assert digests["preferences-train"] == file_md5(tmp_path / "data/validated/train.jsonl")
    assert digests["preferences-test"] == file_md5(tmp_path / "data/validated/test.jsonl")

    # models registered from the successful run, alias `candidate`
    for name, stage in [("rlhf-reward-model", "reward_model"), ("rlhf-policy", "ppo")]:
        version = client.get_model_version_by_alias(name, "candidate")
        assert version.run_id == children[stage].info.run_id

    # the parent run lists its stages' datasets, logged models and registered versions
    assert {"preferences-train", "preferences-test"} <= {d.dataset.name for d in parent.inputs.dataset_inputs}
    stage_models = {m.model_id for c in children.values() for m in c.outputs.model_outputs}
    assert stage_models and {m.model_id for m in parent.outputs.model_outputs} == stage_models
    # its description (the run page's Markdown note): the figures with their intervals, then every stage and its time
    description = parent.data.tags["mlflow.note.content"]
    assert "| judge win rate vs SFT | " in description and " to " in description, description
    table_rows = [line for line in description.splitlines() if line.startswith("|")]
    cells = {line: len(re.split(r"(?<!\\)\|", line)) - 2 for line in table_rows}  # a `\|` inside a cell is text
    assert set(cells.values()) == {3}, cells  # figure, value, interval; stage, outcome, time: KL(policy \|\| SFT)
    assert f"| evaluation prompts (test conversations) | {results['eval/prompts']:.0f} |" in description  # a count
    # the Prefect flow run that made it, named as Prefect's UI names it, in its tags and its description
    flow_run_name = parent.data.tags["prefect.flow_run_name"]
    assert parent.data.tags["prefect.flow_run_id"] and description.startswith(f"Prefect flow run [{flow_run_name}]("), (
        description
    )
    assert all(f"| {s.name} | ran" in description for s in STAGES), description
    registered = parent.data.tags["registered_models"].split(", ")
    assert {"rlhf-reward-model/1", "rlhf-policy/1"} <= set(registered)

    # stage outputs and metrics files on disk
    for s in STAGES:
        if s.metrics:
            assert (tmp_path / "metrics" / f"{s.name}.json").exists()
    assert json.loads((tmp_path / "metrics/evaluate.json").read_text())["eval/kl"] == pytest.approx(results["eval/kl"])
    assert (tmp_path / "models/policy/model.safetensors").exists()
    assert (tmp_path / "reports/validation/validation.html").exists()
    assert (tmp_path / "metrics/ppo_history.csv").read_text().startswith("step,")


@pytest.fixture(scope="module")
def mlflow_ui(finished_run):
    """`mlflow server` on the finished run's store, as `make ui` starts it; yields its URL."""
    with mlflow_server(finished_run) as url:
        yield url


@pytest.fixture(scope="module")
def page(chromium):
    """A page of headless Chromium, driven by Playwright (the system browser: Playwright's own is never fetched)."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=TIMEOUT_MS)
    with sync_playwright() as p:
        browser = launch_chromium(p, chromium)
        try:
            pg = browser.new_page(viewport={"width": 1600, "height": 1000})
            pg.set_default_timeout(TIMEOUT_MS)
            yield pg
        finally:
            browser.close()


@contextlib.contextmanager
def screenshots(page, capsys):
    """Yields `take(name)`, which saves a full-page screenshot in test-artifacts/; on failure one more is taken, and
    the paths are printed whether the checks pass or fail."""
    ARTIFACTS.mkdir(exist_ok=True)
    shots: list[Path] = []

    def take(name: str) -> None:
        path = ARTIFACTS / f"mlflow-ui-{name}.png"
        page.screenshot(path=str(path), full_page=True)
        shots.append(path)

    try:
        yield take
    except BaseException:
        try:
            take("failure")
        except Exception as err:  # a dead page must not hide the failure itself
            print(f"no failure screenshot: {err}")
        raise
    finally:
        with capsys.disabled():
            print(f"\nMLflow UI screenshots: {', '.join(str(p) for p in shots)}")


def _in_the_model_training_view(pg) -> None:
    """The UI in its model-training view (experiment sidebar: Runs, Models, Traces), not its GenAI one (Overview,
    Training runs, Evaluation runs, Judges...), which MLflow opens unless the link asks."""
    from playwright.sync_api import expect

    expect(pg.get_by_role("link", name="Models", exact=True)).to_be_visible()
    for genai in ("Evaluation runs", "Training runs", "Judges"):
        expect(pg.get_by_text(genai, exact=True)).to_have_count(0)


def test_mlflow_ui_shows_the_parent_run_its_stage_runs_and_the_eval_metrics(
    chromium, finished_run, mlflow_ui, page, capsys
):
    import mlflow
    from playwright.sync_api import expect

    client = mlflow.MlflowClient(f"sqlite:///{finished_run}/mlflow.db")
    exp = client.get_experiment_by_name("rlhf")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if r.info.run_name == "pipeline" and "mlflow.parentRunId" not in r.data.tags)
    children = {r.data.tags["stage"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert sorted(children) == sorted(STAGE_NAMES)  # the store itself is right; the rest checks what the UI shows

    with screenshots(page, capsys) as screenshot:
        # the experiment's runs page, by the link a run prints: the parent run, its stage runs nested under it
        page.goto(mlflow_experiment_url(mlflow_ui, exp.experiment_id))
        parent_link = page.get_by_role("link", name="pipeline", exact=True)
        expect(parent_link).to_be_visible()
        expect(parent_link).to_have_attribute("href", f"#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}")
        expect(page.get_by_text(f"{len(runs)} matching runs", exact=True)).to_be_visible()
        _in_the_model_training_view(page)
        close_mlflow_assistant(page)
        for stage in STAGE_NAMES:  # collapsed: the stage runs are hidden under the parent
            expect(page.get_by_role("link", name=stage, exact=True)).to_have_count(0)
        expand_mlflow_run(page, parent_link, STAGE_NAMES)  # the row's expand (+) button
        for stage in STAGE_NAMES:
            link = page.get_by_role("link", name=stage, exact=True)
            expect(link).to_be_visible()
            expect(link).to_have_attribute(
                "href", f"#/experiments/{exp.experiment_id}/runs/{children[stage].info.run_id}"
            )
        screenshot("runs")

        # the parent run's page: finished, its child runs, the evaluation metrics and their values
        page.goto(mlflow_run_url(mlflow_ui, exp.experiment_id, parent.info.run_id))
        expect(page.get_by_role("heading", name="pipeline", exact=True)).to_be_visible()
        _in_the_model_training_view(page)
        expect(page.get_by_text(f"Metrics ({len(parent.data.metrics)})", exact=True)).to_be_visible()
        expect(page.get_by_text("Finished", exact=True)).to_be_visible()
        close_mlflow_assistant(page)
        child_runs = page.get_by_test_id("key-value-Child runs")  # in "About this run"
        for stage in STAGE_NAMES:
            link = child_runs.get_by_role("link", name=stage, exact=True)
            expect(link).to_be_visible()
            expect(link).to_have_attribute(
                "href", f"#/experiments/{exp.experiment_id}/runs/{children[stage].info.run_id}"
            )
        # the datasets and the registered models of its stages (the parent run lists them)
        expect(page.get_by_text("preferences-train", exact=False).first).to_be_visible()
        expect(page.get_by_role("link", name="rlhf-policy", exact=True).first).to_be_visible()
        rows = {}
        for key in EVAL_METRICS:
            row = page.get_by_role("row").filter(has=page.get_by_role("link", name=key, exact=True))
            expect(row).to_have_count(1)
            rows[key] = row
            name, shown = row.get_by_role("cell").all_inner_texts()[:2]  # then the "Models" column
            value = parent.data.metrics[key]
            as_js = page.evaluate("v => String(v)", value)  # the UI prints the number as JavaScript does, unrounded
            assert (name, shown) == (key, as_js), f"{key}: MLflow stored {value!r}, the UI shows {shown!r}"
        screenshot("parent-run")
        rows["rm/accuracy"].scroll_into_view_if_needed()  # the metrics table scrolls: show the RM accuracy too
        expect(rows["rm/accuracy"]).to_be_in_viewport()
        screenshot("parent-run-rm-accuracy")


def test_docs_images_pictures_the_newest_pipeline_run(finished_run, mlflow_ui, page, tmp_path):
    """`make docs-images` (flows/docs_images.py) finds the store's newest finished pipeline run and writes its two
    pictures whole, each the browser's view of its page: the runs with the stage runs shown, the run's own page."""
    import mlflow
    from PIL import Image

    from flows import docs_images

    client = mlflow.MlflowClient(f"sqlite:///{finished_run}/mlflow.db")
    experiment, run = docs_images.newest_pipeline_run(client, "rlhf")
    assert run.info.run_name == "pipeline" and "mlflow.parentRunId" not in run.data.tags
    written = docs_images.mlflow_pictures(page, mlflow_ui, experiment.experiment_id, run, STAGE_NAMES, tmp_path)
    assert [p.name for p in written] == list(docs_images.PICTURES)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(docs_images.PICTURES)  # no temporary file left
    for path in written:
        with Image.open(path) as picture:
            assert picture.format == "PNG" and picture.width == page.viewport_size["width"]


@pytest.fixture(scope="module")
def sweep_points(finished_run, tiny_model_dir, one_thread):
    """A two-point sweep over ppo.kl_coef in the same store as the finished run; (sweep run, point runs)."""
    import mlflow

    from flows.sweep import rlhf_sweep

    rlhf_sweep(
        grid={"ppo.kl_coef": ["0.01", "0.5"]},
        overrides=tiny_pipeline_overrides(finished_run, tiny_model_dir),
        best_of_n=[1, 2],
    )
    client = mlflow.MlflowClient(f"sqlite:///{finished_run}/mlflow.db")
    exp = client.get_experiment_by_name("rlhf").experiment_id
    sweep = client.search_runs([exp], "tags.sweep = 'rlhf'")[0]
    # the sweep's child runs: its points and the run that brought the upstream stages back before best-of-n
    points = client.search_runs(
        [exp], f"tags.mlflow.parentRunId = '{sweep.info.run_id}' and attributes.run_name = 'pipeline'"
    )
    return sweep, sorted(points, key=lambda r: float(r.data.params["ppo.kl_coef"]))


def test_mlflow_compare_view_shows_the_sweep_points_params_and_eval_metrics(
    chromium, finished_run, sweep_points, mlflow_ui, page, capsys
):
    import json

    from playwright.sync_api import expect

    sweep, points = sweep_points
    assert [p.data.params["ppo.kl_coef"] for p in points] == ["0.01", "0.5"]
    exp_id = sweep.info.experiment_id
    with screenshots(page, capsys) as screenshot:
        # the sweep run's page links its points (its child runs) and carries the frontier table as its description
        page.goto(f"{mlflow_ui}/#/experiments/{exp_id}/runs/{sweep.info.run_id}")
        expect(page.get_by_role("heading", name="sweep", exact=True)).to_be_visible()
        close_mlflow_assistant(page)
        child_runs = page.get_by_test_id("key-value-Child runs")
        for point in points:
            expect(child_runs.get_by_role("link", name=point.info.run_name, exact=True).first).to_be_visible()
        expect(page.get_by_text("best-of-n", exact=False).first).to_be_visible()
        screenshot("sweep-run")

        # the compare view of the points: their params side by side, the swept one differing, and the eval metrics
        runs, experiments = json.dumps([p.info.run_id for p in points]), json.dumps([exp_id])
        page.goto(f"{mlflow_ui}/#/compare-runs?runs={runs}&experiments={experiments}")
        expect(page.get_by_text("ppo.kl_coef", exact=True).first).to_be_visible()
        close_mlflow_assistant(page)
        # the parameters table: one row per param, a cell per run
        kl_row = page.get_by_role("row", name=f"ppo.kl_coef {' '.join(p.data.params['ppo.kl_coef'] for p in points)}")
        expect(kl_row).to_be_visible()
        # the metrics table: the keys (a pinned column of links) and the runs' values, rounded to 3 decimals; the
        # table draws only the rows near its top, so these are the keys that sort first: the dev split's figures
        for key in ("dev/answer_tokens", "dev/answers_cut", "dev/answers_degenerate"):
            expect(page.get_by_role("link", name=key, exact=True).first).to_be_visible()
        shown = page.locator("body").inner_text()
        for point in points:
            value = f"{round(point.data.metrics['dev/answer_tokens'], 3):g}"
            assert value in shown, f"dev/answer_tokens {value} of {point.info.run_id} is not shown"
        screenshot("compare-points")
