"""A feedback round as a person does it: a real Label Studio (its own venv, .venv-label) on 127.0.0.1, labelled by
clicking in headless Chromium (Debian's, driven by Playwright), then ingested by the pipeline in a DVC repo on
tiny models: the labels become a new version of feedback.labels_file in dvc.lock, validate's suite runs on them,
the reward model trains on them (MLflow records the dataset with its md5), and the human win rate is logged.
Half-finished sessions, forged labels and a tool that is down are checked on the way.

Screenshots land in test-artifacts/feedback/. The docs' pictures of Label Studio (`make docs-images`,
flows/docs_images.py) are taken on the same server, in a project of their own.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from conftest import CHECKOUT, PYTHON, REPO, copy_repo, free_port, starts_a_flow, with_prefect_api
from test_lineage import succeeding
from test_mlflow_ui import TIMEOUT_MS

from rlhflow.config.params import load_config, write_params
from rlhflow.data.feedback import LABEL_FIELDS, PAIR_FIELDS, read_records
from rlhflow.fsutil import file_md5
from rlhfops import stage_lock
from rlhfops.browser import label_next, label_studio_page
from rlhfops.labeling import ADMIN, ANSWER_STATES, label_studio, load_secrets

# the stages the labels change under dvc repro, Label Studio's start and Chromium: minutes on 2 cores
pytestmark = [pytest.mark.slow, pytest.mark.system]

ARTIFACTS = CHECKOUT / "test-artifacts" / "feedback"
EMPTY_MD5 = "d41d8cd98f00b204e9800998ecf8427e"


def shoot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def set_params(repo: Path, overrides: list[str]) -> None:
    write_params(load_config(repo / "params.yaml", overrides), repo / "params.yaml")


def lock_md5(repo: Path, stage: str, path: str) -> str:
    lock = stage_lock.load_lock((repo / "dvc.lock").read_text())
    return next(d["md5"] for d in lock["stages"][stage]["deps"] if d["path"] == path)


def forge_label(server, project: int) -> int:
    """A task the pipeline never sent, labelled through the API: what a stray import into the project looks like."""
    server.request(
        "POST",
        f"/api/projects/{project}/import",
        [{"data": {"pair_id": "forged", "prompt_text": "x", "answer_a": "y", "answer_b": "z"}}],
    )
    task = next(t for t in server.tasks(project) if t["data"]["pair_id"] == "forged")
    choice = {"from_name": "preference", "to_name": "prompt", "type": "choices", "value": {"choices": ["A is better"]}}
    server.request("POST", f"/api/tasks/{task['id']}/annotations/", {"result": [choice]})
    return task["id"]


def test_labels_clicked_in_label_studio_retrain_the_reward_model(tmp_path, reproduced_baseline, chromium, monkeypatch):
    from playwright.sync_api import sync_playwright

    ls_root, port = tmp_path / "label-studio", free_port()
    made = load_secrets(ls_root)
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", made["token"])  # the clients' environment (make_dvc_repo copies it)
    repo = tmp_path / "repo"
    ok = succeeding(copy_repo(reproduced_baseline, repo))  # reproduced with a feedback split (FEEDBACK_ROUND)
    set_params(repo, [f"feedback.label_studio_url=http://127.0.0.1:{port}"])
    ok("git", "commit", "-qam", "this round's Label Studio")
    assert "Data and pipelines are up to date." in ok("dvc", "status")  # no stage reads where Label Studio is
    assert lock_md5(repo, "validate", "data/feedback/labels.jsonl") == EMPTY_MD5
    assert (repo / "data/validated/feedback.jsonl").exists()

    ok(sys.executable, "-m", "tasks.feedback", "sample")
    pairs = read_records(repo / "data/feedback/pairs.jsonl", PAIR_FIELDS)
    assert 2 <= len(pairs) <= 4, pairs
    with label_studio(ls_root, port, venv=REPO / ".venv-label") as server:
        assert f"feedback/pairs_sent                      {len(pairs)}.0000" in ok(
            sys.executable, "-m", "tasks.feedback", "send"
        )
        project = server.project("rlhf-feedback")
        assert {t["data"]["pair_id"] for t in server.tasks(project)} == {p["pair_id"] for p in pairs}
        assert "feedback/pairs_sent                      0.0000" in ok(sys.executable, "-m", "tasks.feedback", "send")
        clicks = ["A is better", "B is better", "Tie", None][: len(pairs)]
        with sync_playwright() as p:
            browser, page = label_studio_page(p, chromium, server.url, ADMIN, made["password"], TIMEOUT_MS)
            page.goto(f"{server.url}/projects/{project}/data?labeling=1")
            page.get_by_text("Which answer is better?").wait_for()
            shoot(page, "labeling")
            # the answers side by side, each under what became of it; one choice of three; the round's progress
            a, b = (page.get_by_text(f"Answer {side}", exact=True).bounding_box() for side in "AB")
            assert abs(a["y"] - b["y"]) < 5 and b["x"] > a["x"] + 200, (a, b)
            assert sum(page.get_by_text(state, exact=True).count() for state in ANSWER_STATES.values()) == 2
            assert page.locator("input[type=radio]").count() == 3
            assert page.get_by_text(re.compile(rf"^Pair \d of {len(pairs)}$")).count() == 1
            for choice in clicks[:-1]:  # a session left half-finished: the last pair waits
                label_next(page, choice, comment="clearer" if choice == "B is better" else "")
            half = ok(sys.executable, "-m", "tasks.feedback", "collect")
            assert "feedback/pairs_waiting                   1.0000" in half, half
            stopped = run_module(repo, "flows.feedback", "--no-sample", "--no-retrain")  # the round waits for all
            assert stopped.returncode == 1 and "1 pair(s) still wait for a label" in stopped.stderr, stopped.stderr

            forged = forge_label(server, project)  # a label for a pair the pipeline never sent: named, left out
            before = (repo / "data/feedback/labels.jsonl").read_text()
            res = run_module(repo, "tasks.feedback", "collect")
            assert res.returncode == 0 and "pair 'forged', which the pipeline never sent" in res.stdout, res.stdout
            assert (repo / "data/feedback/labels.jsonl").read_text() == before
            server.request("DELETE", f"/api/tasks/{forged}/")

            page.goto(f"{server.url}/projects/{project}/data?labeling=1")  # the session resumed
            label_next(page, clicks[-1])
            page.goto(f"{server.url}/projects/{project}/data")
            page.wait_for_timeout(3000)
            shoot(page, "labelled")
            check_docs_pictures(page, server, pairs, tmp_path / "img")
            browser.close()
        ok(sys.executable, "-m", "flows.feedback", "--no-sample", "--no-retrain")  # the round: every pair labelled
    down = run_module(repo, "tasks.feedback", "collect")  # the tool is down: a clear error, nothing written
    assert down.returncode == 1 and "is not reachable" in down.stderr, down.stderr[-2000:]

    labels = read_records(repo / "data/feedback/labels.jsonl", LABEL_FIELDS)
    as_label = {"A is better": "a", "B is better": "b", "Tie": "tie", None: "skip"}
    assert sorted(x["label"] for x in labels) == sorted(as_label[c] for c in clicks)
    assert len({(x["pair_id"], x["annotator"]) for x in labels}) == len(labels)  # nothing collected twice

    ok("git", "add", "data/feedback")
    ok("git", "commit", "-qm", "labels of round 1")
    repro = ok("dvc", "repro", "reward_model")  # validate and reward_model: what the labels change first
    assert "Running stage 'validate'" in repro and "Running stage 'reward_model'" in repro, repro[-3000:]
    labels_md5 = file_md5(repo / "data/feedback/labels.jsonl")
    assert lock_md5(repo, "validate", "data/feedback/labels.jsonl") == labels_md5 != EMPTY_MD5

    labelled = [json.loads(line) for line in (repo / "data/validated/labelled.jsonl").read_text().splitlines()]
    decided = {x["pair_id"]: x["label"] for x in labels if x["label"] in ("a", "b")}
    by_id = {p["pair_id"]: p for p in pairs}
    assert {r["pair_id"]: r["chosen"] for r in labelled} == {i: by_id[i][f"answer_{s}"] for i, s in decided.items()}
    report = json.loads(next((repo / "reports/validation").glob("*.json")).read_text())
    assert "labelled" in json.dumps(report)

    check_mlflow(repo, labelled_md5=file_md5(repo / "data/validated/labelled.jsonl"), decided=len(decided))

    # the judge labels the same pairs (RLAIF) through the same file, marked as such, each pair once
    assert f"feedback/ai_labels_added                 {len(pairs)}.0000" in ok(
        sys.executable, "-m", "tasks.feedback", "ai_label"
    )
    assert "feedback/ai_labels_added                 0.0000" in ok(sys.executable, "-m", "tasks.feedback", "ai_label")
    ai = [x for x in read_records(repo / "data/feedback/labels.jsonl", LABEL_FIELDS) if x["source"] == "ai"]
    assert {x["pair_id"] for x in ai} == set(by_id) and len({x["annotator"] for x in ai}) == 1
    assert ai[0]["annotator"].startswith("judge:trained:")


def check_docs_pictures(page, server, pairs: list[dict], out: Path) -> None:
    """`make docs-images`' Label Studio pictures, taken of the round's pairs in a project of their own: both written
    whole, the first pairs labelled and one at least waiting, the labeling page's empty side column folded as a
    person folds it (Label Studio keeps it folded for the next pair)."""
    from PIL import Image

    from flows import docs_images

    written = docs_images.feedback_pictures(page, server, "docs-pictures", pairs, out)
    assert [p.name for p in written] == list(docs_images.FEEDBACK_PICTURES)
    assert sorted(p.name for p in out.iterdir()) == sorted(docs_images.FEEDBACK_PICTURES)  # no temporary file left
    for path in written:
        with Image.open(path) as picture:
            assert picture.format == "PNG" and picture.width == page.viewport_size["width"]
    project = server.project("docs-pictures")
    labelled = [t for t in server.tasks(project) if t.get("annotations")]
    assert len(labelled) == min(len(pairs) - 1, len(docs_images.PICTURED_LABELS))
    page.goto(f"{server.url}/projects/{project}/data?labeling=1")
    page.get_by_text("Which answer is better?").wait_for()
    assert not page.get_by_text("Labeled regions will appear here").is_visible()


def run_module(repo: Path, module: str, *args: str):
    """`python -m <module> <args>` in the repo, whatever its exit status."""
    import subprocess

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(repo)}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [PYTHON, "-m", module, *args]
    env = with_prefect_api(env) if starts_a_flow(cmd) else env
    return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)


def check_mlflow(repo: Path, *, labelled_md5: str, decided: int) -> None:
    """The reward model's run took the labelled pairs (its dataset input carries their md5); collect logged the
    human win rate."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{repo}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    rm = next(r for r in runs if r.info.run_name == "reward_model" and r.data.metrics.get("rm/labelled_pairs"))
    assert rm.data.metrics["rm/labelled_pairs"] == decided
    digests = {d.dataset.name: d.dataset.digest for d in rm.inputs.dataset_inputs}
    assert digests["preferences-labelled"] == labelled_md5
    rounds = [r for r in runs if r.info.run_name == "feedback_round" and r.info.status == "FINISHED"]
    assert len(rounds) == 1, [r.info.run_name for r in runs]
    steps = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == rounds[0].info.run_id]
    assert sorted(r.info.run_name for r in steps) == ["feedback_collect", "feedback_send"]  # --no-sample
    collect = next(r for r in steps if r.info.run_name == "feedback_collect")
    assert collect.data.metrics["feedback/pairs_waiting"] == 0
    assert "feedback/human_win_rate_vs_sft" in collect.data.metrics
