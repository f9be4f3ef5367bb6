"""The flow records into DVC (dvc.lock and the DVC cache, as `dvc repro` would), its skip decision is DVC's,
and every MLflow parent run can be restored from the DVC cache (rlhfops/stage_lock.py, flows/restore.py).

Real DVC in a real git repo, a real MLflow sqlite store, the pipeline on tiny models."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import make_dvc_repo

from rlhflow.config.params import load_config
from rlhfops import run_record, stage_lock
from rlhfops.hashing import file_md5
from rlhfops.stages import STAGES


def test_params_read_from_the_config_are_the_ones_dvc_reads_from_params_yaml():
    """Without overrides, the flow's DVC stages are DVC's own, params included (the only part the flow swaps)."""
    cfg = load_config()
    with stage_lock.dvc_repo() as repo:
        for stage in STAGES:
            ours = stage_lock.dvc_stage(repo, stage, cfg)
            assert ours is not None, f"{stage.name}: dvc.yaml's paths differ from the config's"
            dvcs = repo.stage.load_one(name=stage.name)
            assert [p.read_params() for p in ours.params] == [p.read_params() for p in dvcs.params], stage.name
            assert [p.get_hash() for p in ours.params] == [p.get_hash() for p in dvcs.params], stage.name


def test_an_override_that_moves_an_output_leaves_the_stage_to_the_flows_own_record(tmp_path):
    sft = next(s for s in STAGES if s.name == "sft")
    with stage_lock.dvc_repo() as repo:
        assert stage_lock.dvc_stage(repo, sft, load_config(overrides=[f"sft.out_dir={tmp_path}/sft"])) is None
        assert stage_lock.dvc_stage(repo, sft, load_config(overrides=["sft.n_samples=3"])) is not None


def succeeding(run):
    """`ok(*cmd)`: `run(*cmd)` that must exit 0; returns its output."""

    def ok(*cmd: str) -> str:
        res = run(*cmd)
        assert res.returncode == 0, f"{cmd}: {(res.stdout + res.stderr)[-4000:]}"
        return res.stdout + res.stderr

    return ok


def _parent_runs(db: Path) -> list:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("rlhf")
    runs = client.search_runs([exp.experiment_id], order_by=["start_time ASC"])
    return [r for r in runs if r.data.tags.get("pipeline") == "rlhf"]


def _dir_listing(repo: Path, md5: str) -> list[dict]:
    """The `.dir` object DVC keeps in its cache for a directory output: [{relpath, md5}, ...]."""
    h = md5.removesuffix(".dir")
    return json.loads((repo / ".dvc/cache/files/md5" / h[:2] / f"{h[2:]}.dir").read_text())


def _workspace_md5s(repo: Path, lock: dict) -> dict[str, str]:
    """Each cached output's md5 computed here from the files (a directory: its files against DVC's listing)."""
    found = {}
    for entry in lock["stages"].values():
        for out in entry["outs"]:
            path = repo / out["path"]
            if out["md5"].endswith(".dir"):
                listing = _dir_listing(repo, out["md5"])
                files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
                same = files == sorted(e["relpath"] for e in listing) and all(
                    file_md5(path / e["relpath"]) == e["md5"] for e in listing
                )
                found[os.path.normpath(out["path"])] = out["md5"] if same else "differs"
            else:
                found[os.path.normpath(out["path"])] = file_md5(path)
    return found


def _find_exp(node, name: str) -> dict:
    """The `data` of the experiment called `name` in `dvc exp show --json` output."""
    if isinstance(node, dict):
        if node.get("name") == name and "data" in node:
            return node["data"]
        node = list(node.values())
    if isinstance(node, list):
        for item in node:
            found = _find_exp(item, name)
            if found:
                return found
    return {}


# In the temporary repo: the flow's own record (the second implementation, used where DVC cannot stand for a
# run) and DVC's decision agree on every stage, now and after a param, a code file or an output changes.
AGREEMENT = textwrap.dedent("""
    import json, shutil
    from rlhfops import run_record, stage_lock
    from rlhflow.config.params import load_config
    from rlhfops.stages import STAGES
    out = {}
    def both(label, cfg):
        out[label] = {s.name: [stage_lock.why_stale(s, cfg), stage_lock.why_stale_flow_lock(s, cfg)] for s in STAGES}
    cfg = load_config()
    both("as run", cfg)
    both("param", load_config(overrides=["reward_model.learning_rate=0.5"]))
    with open("rlhflow/evaluation/metrics.py", "a") as f:
        f.write("# edited\\n")
    both("code", cfg)
    shutil.copy("metrics.py.orig", "rlhflow/evaluation/metrics.py")
    shutil.rmtree("reports/evaluate")
    both("output", cfg)
    print(json.dumps(out))
""")


LOCK_PROBE = textwrap.dedent("""
    from pathlib import Path

    from dvc.lock import LockError
    from dvc.repo import Repo

    from tests.fixtures import prompt_length_reward

    def reward(prompts, responses, **kwargs):
        repo = Repo(str(Path(__file__).parent))
        try:
            repo.lock.lock()
            repo.lock.unlock()
            state = "free"
        except LockError:
            state = "held"
        finally:
            repo.close()
        with open(Path(__file__).parent / "lock-probe.txt", "a") as f:
            f.write(state + "\\n")
        return prompt_length_reward(prompts, responses)
""")


@pytest.mark.system
def test_flow_run_is_dvcs_record_and_its_parent_run_restores(tmp_path, tiny_model_dir, allow_test_reward):
    repo = tmp_path / "repo"
    run = make_dvc_repo(repo, tiny_model_dir, timeout=900)
    ok = succeeding(run)

    out = ok(sys.executable, "-m", "flows.pipeline")
    names = [s.name for s in STAGES]
    assert all(f"{n}: running" in out for n in names), out[-3000:]
    assert not (repo / "metrics/.flow/flow.lock").exists()  # DVC recorded everything

    # DVC sees the flow's run as its own
    assert "Data and pipelines are up to date." in ok("dvc", "status")
    repro = ok("dvc", "repro")
    assert "Running stage" not in repro and all(f"Stage '{n}' didn't change, skipping" in repro for n in names), repro
    lock1 = stage_lock.load_lock((repo / "dvc.lock").read_text())
    assert set(lock1["stages"]) == set(names)
    cached = [o for e in lock1["stages"].values() for o in e["outs"] if not o["path"].endswith((".json", ".csv"))]
    for o in cached:  # every cached output is in the cache
        h = o["md5"]
        assert (repo / ".dvc/cache/files/md5" / h[:2] / h[2:]).exists(), o
    md5s1 = _workspace_md5s(repo, lock1)
    assert md5s1 == {os.path.normpath(o["path"]): o["md5"] for e in lock1["stages"].values() for o in e["outs"]}

    # the two implementations agree
    # the backup sits outside every stage's deps (rlhflow/evaluation is one of evaluate's, as a directory)
    (repo / "metrics.py.orig").write_bytes((repo / "rlhflow/evaluation/metrics.py").read_bytes())
    reasons = json.loads(ok(sys.executable, "-c", AGREEMENT).strip().splitlines()[-1])
    (repo / "metrics.py.orig").unlink()
    agree = {label: {n: (not dvc, not own) for n, (dvc, own) in stages.items()} for label, stages in reasons.items()}
    for label, stages in agree.items():
        assert all(dvc == own for dvc, own in stages.values()), json.dumps(reasons[label])
    assert all(up for up, _ in agree["as run"].values())
    # a reward_model key the judge inherits (it sets no learning rate of its own): both reward models rerun
    assert [n for n, (up, _) in agree["param"].items() if not up] == ["reward_model", "judge"]
    assert {n for n, (up, _) in agree["code"].items() if not up} == {"sft", "evaluate"}  # metrics.py (not sft_answers)
    assert [n for n, (up, _) in agree["output"].items() if not up] == ["evaluate"]
    ok("dvc", "checkout", "evaluate")  # the deleted output back from the cache

    # a run with an override: ppo and evaluate run again, dvc.lock records the values they ran with. The override
    # is a reward function that, called while PPO trains, checks that DVC's repository lock is free then.
    (repo / "lockprobe.py").write_text(LOCK_PROBE)
    override = ["--set", "ppo.reward_fn=lockprobe:reward"]
    out = ok(sys.executable, "-m", "flows.pipeline", *override)
    assert "sft: skipped" in out and "ppo: running" in out and "evaluate: running" in out, out[-3000:]
    assert "could not save the run as a DVC experiment" not in out, out[-3000:]
    probes = (repo / "lock-probe.txt").read_text().split()
    assert probes and set(probes) == {"free"}, probes  # no flow holds DVC's lock while a stage trains
    lock2 = stage_lock.load_lock((repo / "dvc.lock").read_text())
    ppo_metrics2 = json.loads((repo / "metrics/ppo.json").read_text())
    assert lock2["stages"]["ppo"]["params"]["params.yaml"]["ppo"]["reward_fn"] == "lockprobe:reward"
    status = ok("dvc", "status")
    assert "ppo" in status and "modified" in status and "sft:" not in status, status
    md5s2 = _workspace_md5s(repo, lock2)
    assert md5s2 != md5s1 and md5s2["models/policy"] != md5s1["models/policy"]
    out = ok(sys.executable, "-m", "flows.pipeline", *override)
    assert "ppo: skipped" in out and "evaluate: skipped" in out, out[-3000:]  # same override: up to date

    # both parent runs are restorable: their lineage is on MLflow
    import mlflow

    first, second = _parent_runs(repo / "mlflow.db")[:2]
    client = mlflow.MlflowClient(f"sqlite:///{repo}/mlflow.db")
    head = ok("git", "rev-parse", "HEAD").strip()
    for parent in (first, second):
        assert parent.data.tags["mlflow.source.git.commit"] == head == parent.data.tags["git_commit"]
        children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        assert children and all(c.data.tags["mlflow.source.git.commit"] == head for c in children)
    exp = client.get_experiment(first.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development" and exp.tags["mlflow.note.content"]
    assert second.data.params["ppo.reward_fn"] == "lockprobe:reward"

    # the run with an override is a DVC experiment, with its params and metrics (the first run is the baseline)
    assert run_record.EXP_TAG not in first.data.tags
    dvc_exp = _find_exp(json.loads(ok("dvc", "exp", "show", "--json")), second.data.tags[run_record.EXP_TAG])
    assert dvc_exp["params"]["params.yaml"]["data"]["ppo"]["reward_fn"] == "lockprobe:reward"
    ppo_metrics = next(v["data"] for k, v in dvc_exp["metrics"].items() if os.path.normpath(k) == "metrics/ppo.json")
    assert ppo_metrics == ppo_metrics2
    logged = stage_lock.load_lock(
        Path(
            mlflow.artifacts.download_artifacts(
                run_id=first.info.run_id,
                artifact_path="dvc.lock",
                dst_path=str(tmp_path / "a"),
                tracking_uri=f"sqlite:///{repo}/mlflow.db",
            )
        ).read_text()
    )
    assert logged["stages"] == lock1["stages"]
    validate = client.search_runs([exp.experiment_id], "tags.stage = 'validate'")[0]
    digests = {i.dataset.name: i.dataset.digest for i in validate.inputs.dataset_inputs}
    split_md5 = next(o["md5"] for o in lock1["stages"]["validate"]["outs"] if o["md5"].endswith(".dir"))
    listed = {e["relpath"]: e["md5"] for e in _dir_listing(repo, split_md5)}
    assert digests["preferences-train"] == listed["train.jsonl"] and digests["preferences-test"] == listed["test.jsonl"]

    # restore the first run: every output as its record says, and DVC agrees (dvc.lock holds its entries again)
    out = ok(sys.executable, "-m", "flows.restore", first.info.run_id)
    assert "MISMATCH" not in out and "restored" in out, out
    assert _workspace_md5s(repo, lock1) == md5s1
    assert stage_lock.load_lock((repo / "dvc.lock").read_text())["stages"] == lock1["stages"]
    assert "Data and pipelines are up to date." in ok("dvc", "status")

    # and the second one back
    out = ok(sys.executable, "-m", "flows.restore", second.info.run_id)
    assert _workspace_md5s(repo, lock2) == md5s2


def _user_rows(seed: int) -> str:
    from rlhflow.data.demo import generate_demo

    return "".join(json.dumps(r) + "\n" for r in generate_demo(n_prompts=60, pairs_per_prompt=1, seed=seed))


@pytest.mark.system
def test_user_data_and_a_remote_keep_a_run_restorable(tmp_path, tiny_model_dir):
    """A preference file outside the repository goes into the DVC cache; `--push` sends the run to a remote;
    with the local cache gone and the file changed, restore pulls the run back, the file's old content too (where
    the restore's config names the file, as the run's did)."""
    import shutil

    import mlflow

    repo = tmp_path / "repo"
    run = make_dvc_repo(repo, tiny_model_dir, timeout=600)
    ok = succeeding(run)

    user = tmp_path / "mine" / "prefs.jsonl"  # the user's own data, outside the repository
    user.parent.mkdir()
    user.write_text(first_rows := _user_rows(seed=1))
    flow = [sys.executable, "-m", "flows.pipeline", "--stages", "validate", "--set", f"data.preferences={user}"]

    res = run(*flow, "--push", "--remote", "nowhere")  # a push with no such remote fails before any stage runs
    assert res.returncode != 0 and "no DVC remote named 'nowhere'" in res.stdout + res.stderr
    assert not (repo / "data/validated").exists()

    ok("dvc", "remote", "add", "-d", "store", str(tmp_path / "remote"))
    ok(*flow, "--push")
    first = _parent_runs(repo / "mlflow.db")[-1]
    lock1 = stage_lock.load_lock((repo / "metrics/.flow/flow.lock").read_text())  # DVC cannot stand for a moved dep
    validated1 = _workspace_md5s(repo, {"stages": {"validate": lock1["stages"]["validate"]}})
    assert first.data.tags["dvc.remote"] == "default"

    user.write_text(_user_rows(seed=2))  # the file changes, and a second run validates the new content
    ok(*flow)
    assert _workspace_md5s(repo, {"stages": {"validate": lock1["stages"]["validate"]}}) != validated1

    shutil.rmtree(repo / ".dvc/cache")  # as on another machine: only the remote has the first run
    # a file outside the workspace is put back only where the restore's own config names it, not the record
    res = run(sys.executable, "-m", "flows.restore", first.info.run_id)
    assert res.returncode == 1 and f"user data {user} is not a path" in res.stdout + res.stderr, res.stderr[-3000:]
    assert user.read_text() == _user_rows(seed=2) and not (user.parent / "prefs.jsonl.before-restore").exists()
    out = ok(sys.executable, "-m", "flows.restore", first.info.run_id, "--set", f"data.preferences={user}")
    assert "MISMATCH" not in out and "restored" in out, out
    assert user.read_text() == first_rows
    assert (user.parent / "prefs.jsonl.before-restore").read_text() == _user_rows(seed=2)  # nothing is lost
    assert _workspace_md5s(repo, {"stages": {"validate": lock1["stages"]["validate"]}}) == validated1

    # the parent run lists its stage's datasets
    parent = mlflow.MlflowClient(f"sqlite:///{repo}/mlflow.db").get_run(first.info.run_id)
    names = {i.dataset.name for i in parent.inputs.dataset_inputs}
    assert {"preferences-train", "preferences-test"} <= names
