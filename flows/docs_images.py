"""The pictures of the MLflow UI in docs/img, taken from this project's newest finished pipeline run (after `make run`:
the default model's run) in the browser the tests drive (rlhfops/browser.py):

    make docs-images                                   # python -m flows.docs_images
    python -m flows.docs_images --out /tmp/img --set tracking.tracking_uri=sqlite:///other/mlflow.db

It starts `mlflow server` on the tracking store as `make ui` does (127.0.0.1, a free port), opens the experiment's
runs page as a run's link opens it (the model-training view) and the parent run's page, and writes, each whole or
not at all: mlflow_runs.png (the parent run, expanded to its stage runs) and mlflow_parent_run.png (its
description: what the run showed, each stage's outcome; its metrics). Exits 1 naming the store when it holds no
finished pipeline run. The benchmark plots in docs/img are drawn by their benches (docs/benchmarks.md).
"""

from __future__ import annotations

# A light door: mlflow, playwright and the project's tracking load once the command line is parsed.
import argparse
import contextlib
import os
import sys
from pathlib import Path

from rlhflow.config.params import REPO_ROOT, parse_config_args

VIEWPORT = {"width": 1600, "height": 1000}
TIMEOUT_MS = 60_000  # the UI's first load on a busy 2-core machine takes ~10 s
PICTURES = ("mlflow_runs.png", "mlflow_parent_run.png")


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
    parent = page.get_by_role("link", name="pipeline", exact=True).first
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


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--out", type=Path, default=REPO_ROOT / "docs/img", help="where the pictures go (docs/img)")
    cfg, args = parse_config_args(argv, __doc__.split("\n\n")[0], parents=(own,))

    from playwright.sync_api import expect, sync_playwright

    from rlhfops import tracking
    from rlhfops.browser import MISSING_CHROMIUM, chromium_path, launch_chromium
    from rlhfops.stages import STAGE_NAMES

    store = tracking.tracking_uri(cfg)
    experiment, run = newest_pipeline_run(tracking.client(store), cfg.tracking.experiment)
    if run is None:
        print(f"no finished pipeline run in experiment {cfg.tracking.experiment!r} of {store}: `make run` first")
        return 1
    chromium = chromium_path()
    if chromium is None:
        print(MISSING_CHROMIUM)
        return 1
    expect.set_options(timeout=TIMEOUT_MS)
    with mlflow_ui(store) as url, sync_playwright() as p:
        browser = launch_chromium(p, chromium)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(TIMEOUT_MS)
            written = mlflow_pictures(page, url, experiment.experiment_id, run, STAGE_NAMES, args.out)
        finally:
            browser.close()
    print(f"run {run.info.run_id}: {', '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
