"""The pictures of the MLflow UI and of Label Studio in docs/img, taken from this project's own runs (the default
models' after `make run`) in the browser the tests drive (rlhfops/browser.py):

    make docs-images                                   # python -m flows.docs_images
    python -m flows.docs_images --out /tmp/img --set tracking.tracking_uri=sqlite:///other/mlflow.db

MLflow: it starts `mlflow server` on the tracking store as `make ui` does (127.0.0.1, a free port), opens the
experiment's runs page as a run's link opens it (the model-training view) and the newest finished pipeline run's page,
and writes mlflow_runs.png (the parent run, expanded to its stage runs) and mlflow_parent_run.png (its description:
what the run showed, each stage's outcome; its metrics).

Label Studio: from the feedback round's pairs file (feedback.pairs_file, made by `python -m tasks.feedback sample`
after a run with a feedback split; docs/feedback.md), it starts a Label Studio of its own (a temporary directory,
127.0.0.1, a free port), sends it the pairs as `send` does, and writes feedback_labeling.png (the first pair's
labeling page, the empty side column folded) and feedback_labelled.png (the project's pairs, the first three
labelled, the others waiting).

Each picture is written whole or not at all. Exits 1 naming what is missing (no finished pipeline run, no pairs)
after making the pictures it can. The benchmark plots in docs/img are drawn by their benches (docs/benchmarks.md).
"""

from __future__ import annotations

# A light door: mlflow, playwright and the project's tracking load once the command line is parsed.
import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

from rlhflow.config.params import REPO_ROOT, parse_config_args

VIEWPORT = {"width": 1600, "height": 1000}
TIMEOUT_MS = 60_000  # the UI's first load on a busy 2-core machine takes ~10 s
PICTURES = ("mlflow_runs.png", "mlflow_parent_run.png")
FEEDBACK_PICTURES = ("feedback_labeling.png", "feedback_labelled.png")
PICTURED_LABELS = ("A is better", "B is better", "Tie")  # the first pairs' labels in feedback_labelled.png


def newest_pipeline_run(client, experiment_name: str):
    """The experiment and its newest finished top-level pipeline run (not a sweep's point), or (experiment, None)."""
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return None, None
    runs = client.search_runs(
        [experiment.experiment_id],
        "attributes.run_name = 'pipeline' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
    )
    top = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    return experiment, (top[0] if top else None)


def mlflow_pictures(page, ui_url: str, experiment_id: str, run, stages: list[str], out: Path) -> list[Path]:
    """The two pictures (PICTURES) of `run` in the MLflow UI at `ui_url`, written into `out`; their paths."""
    from playwright.sync_api import expect

    from flows.report import MODEL_TRAINING_VIEW
    from rlhfops.browser import close_mlflow_assistant, expand_mlflow_run

    runs = f"{ui_url}/#/experiments/{experiment_id}/runs"  # as a run's printed link opens them
    page.goto(f"{runs}{MODEL_TRAINING_VIEW}")
    parent = page.locator(f'a[href$="/runs/{run.info.run_id}"]')  # this run's name: the store may hold others
    expect(parent).to_be_visible()
    close_mlflow_assistant(page)
    expand_mlflow_run(page, parent, stages)
    runs_png = _write(out / PICTURES[0], page.screenshot())

    page.goto(f"{runs}/{run.info.run_id}{MODEL_TRAINING_VIEW}")
    expect(page.get_by_role("heading", name="pipeline", exact=True)).to_be_visible()
    close_mlflow_assistant(page)
    expect(page.get_by_text("Finished", exact=True)).to_be_visible()
    more = page.get_by_text("Show more", exact=True)  # the description opens folded after its first lines
    if more.count() == 1:
        more.click()
    return [runs_png, _write(out / PICTURES[1], page.screenshot(full_page=True))]


def _write(path: Path, png: bytes) -> Path:
    from rlhflow.fsutil import atomic_file

    with atomic_file(path, binary=True, output=False) as f:  # a picture of the docs, replaced on purpose
        f.write(png)
    return path


@contextlib.contextmanager
def mlflow_ui(store_uri: str):
    """`mlflow server` on `store_uri` as `make ui` starts it, on 127.0.0.1; yields its URL."""
    from flows.serve import launch_mlflow_server, stop, wait_for
    from rlhfops.stack import free_port  # on 127.0.0.1

    port = free_port()
    server = launch_mlflow_server(store_uri, "127.0.0.1", port, dict(os.environ))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(f"{url}/health", server, "the MLflow server", timeout=300)
        yield url
    finally:
        stop([server])


def feedback_pictures(page, server, project_title: str, pairs: list[dict], out: Path) -> list[Path]:
    """The two pictures (FEEDBACK_PICTURES) of a feedback round of `pairs` in Label Studio `server` (a
    rlhfops.labeling.LabelStudio that `page` is logged in to), the pairs sent to its project `project_title`, written
    into `out`; their paths."""
    from rlhfops.browser import fold_label_studio_side_column, label_next

    project = server.project(project_title)
    server.send(project, pairs)
    page.goto(f"{server.url}/projects/{project}/data?labeling=1")
    page.get_by_text("Which answer is better?").wait_for()
    fold_label_studio_side_column(page)
    labeling = _write(out / FEEDBACK_PICTURES[0], page.screenshot())
    for choice in PICTURED_LABELS[: len(pairs) - 1]:  # a round under way: a pair at least still waits
        label_next(page, choice)
    page.goto(f"{server.url}/projects/{project}/data")
    page.get_by_role("button", name="Label All Tasks").wait_for()
    page.wait_for_load_state("networkidle")
    return [labeling, _write(out / FEEDBACK_PICTURES[1], page.screenshot())]


@contextlib.contextmanager
def label_studio_session(playwright, chromium: str):
    """A Label Studio of its own (a temporary directory, 127.0.0.1, a free port) and a browser page logged in to it:
    (server, page)."""
    from rlhfops.browser import label_studio_page
    from rlhfops.labeling import ADMIN, label_studio, load_secrets
    from rlhfops.stack import free_port

    with tempfile.TemporaryDirectory(prefix="rlhflow-docs-label-studio-") as tmp:
        root = Path(tmp) / "label-studio"
        with label_studio(root, free_port()) as server:
            password = load_secrets(root)["password"]
            browser, page = label_studio_page(playwright, chromium, server.url, ADMIN, password, TIMEOUT_MS)
            try:
                yield server, page
            finally:
                browser.close()


def mlflow_part(cfg, playwright, chromium: str, out: Path) -> list[Path] | str:
    """The MLflow pictures of the store's newest finished pipeline run, or why there are none."""
    from rlhfops import tracking
    from rlhfops.browser import launch_chromium
    from rlhfops.stages import STAGE_NAMES

    store = tracking.tracking_uri(cfg)
    experiment, run = newest_pipeline_run(tracking.client(store), cfg.tracking.experiment)
    if run is None:
        return f"no finished pipeline run in experiment {cfg.tracking.experiment!r} of {store}: `make run` first"
    children = tracking.client(store).search_runs(
        [experiment.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'"
    )
    stages = [
        name for name in STAGE_NAMES if name in {c.info.run_name for c in children}
    ]  # a stage up to date has none
    with mlflow_ui(store) as url:
        browser = launch_chromium(playwright, chromium)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(TIMEOUT_MS)
            return mlflow_pictures(page, url, experiment.experiment_id, run, stages, out)
        finally:
            browser.close()


def feedback_part(cfg, playwright, chromium: str, out: Path) -> list[Path] | str:
    """Label Studio's pictures of the feedback pairs file, or why there are none."""
    from rlhflow.data.feedback import PAIR_FIELDS, read_records

    pairs_file = cfg.path(cfg.feedback.pairs_file)
    pairs = read_records(pairs_file, PAIR_FIELDS)
    if not pairs:
        return (
            f'no feedback pairs in {pairs_file}: `make run ARGS="--set validate.feedback_fraction=0.05"`, then '
            "`python -m tasks.feedback sample --set validate.feedback_fraction=0.05` (docs/feedback.md)"
        )
    with label_studio_session(playwright, chromium) as (server, page):
        return feedback_pictures(page, server, cfg.feedback.project, pairs, out)


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--out", type=Path, default=REPO_ROOT / "docs/img", help="where the pictures go (docs/img)")
    cfg, args = parse_config_args(argv, __doc__.split("\n\n")[0], parents=(own,))

    from playwright.sync_api import expect, sync_playwright

    from rlhfops.browser import MISSING_CHROMIUM, chromium_path

    chromium = chromium_path()
    if chromium is None:
        print(MISSING_CHROMIUM)
        return 1
    expect.set_options(timeout=TIMEOUT_MS)
    missing = []
    with sync_playwright() as p:
        for part in (mlflow_part, feedback_part):
            made = part(cfg, p, chromium, args.out)
            if isinstance(made, str):
                missing.append(made)
            else:
                print(", ".join(str(path) for path in made))
    for why in missing:
        print(why)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
