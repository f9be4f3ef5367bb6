"""The evaluate stage's user-facing side: the champion alias in a real MLflow registry, and in a real git+DVC repo
(one tiny `dvc repro`, then one `dvc exp run`): `dvc plots show`, `dvc exp show`, DVC metrics == MLflow metrics,
the report's registry decision."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from conftest import copy_repo

from rlhflow.data.readers import read_jsonl
from rlhflow.data.splits import conversation_keys
from rlhfops import promotion
from rlhfops.stages import STAGES

# ---- champion logic, real sqlite registry ---------------------------------------------------------------------


def _register(client, name: str, tmp_path, version: str) -> None:
    model_dir = tmp_path / f"model{version}"
    model_dir.mkdir()
    (model_dir / "weights.bin").write_text(version)
    client.create_model_version(name, source=model_dir.as_uri())
    client.set_registered_model_alias(name, "candidate", version)


def test_the_champion_is_challenged_only_on_the_same_splits_and_judge(tmp_path):
    import mlflow

    from rlhflow.evaluation.champion import HeadToHead, SignTest, alpha_spent

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    name = "rlhf-policy"
    client.create_registered_model(name)
    basis = {"train_split_md5": "a" * 32, "test_split_md5": "b" * 32, "judge_md5": "c" * 32}
    other_splits = basis | {"test_split_md5": "d" * 32}
    # each version's head-to-head result against whichever champion it meets: (win rate, low, high), sign test
    measured = {
        "2": ((0.58, 0.45, 0.70), SignTest(60, 50, 10, 0.19)),
        "5": ((0.66, 0.55, 0.77), SignTest(80, 40, 10, 0.0002)),
    }
    calls = []

    def challenge(version, version_basis, promote="auto"):
        _register(client, name, tmp_path, version)

        def head_to_head(champion, number):
            calls.append((version, str(champion.version), number))
            interval, test = measured[version]
            return HeadToHead("judge win rate over the champion", *interval, test, alpha_spent(0.05, number), number)

        decision = promotion.challenge_champion(client, name, version, version_basis, head_to_head, promote)
        promotion.apply_champion_decision(client, decision, run_id=f"run-{version}")
        return decision

    first = challenge("1", basis)
    assert first.promoted and first.verdict == "first champion" and "no champion yet" in first.reason
    # same splits and judge: head to head at the level of challenge 2; p = 0.19 does not promote
    close = challenge("2", basis)
    assert calls == [("2", "1", 2)] and not close.promoted and close.verdict == "head to head"
    assert "v2 does not beat champion v1 head to head: judge win rate over the champion 0.580" in close.reason
    # other splits: not comparable, nothing measured, nothing promoted
    other = challenge("3", other_splits)
    assert len(calls) == 1 and not other.promoted and other.verdict == "not comparable"
    assert "test_split_md5 bbbbbbbb vs dddddddd" in other.reason and "evaluate.promote=force" in other.reason
    # ... unless the user asks
    forced = challenge("4", other_splits, promote="force")
    assert forced.promoted and len(calls) == 1 and "promoted by evaluate.promote=force" in forced.reason
    assert str(client.get_model_version_by_alias(name, "champion").version) == "4"
    # same basis as the new champion, and p under the level of challenge 5 (0.05 * 6 / (pi^2 25) = 0.0012): promoted
    better = challenge("5", other_splits)
    assert calls[-1] == ("5", "4", 5) and better.promoted
    assert str(client.get_model_version_by_alias(name, "champion").version) == "5"

    tags = client.get_model_version(name, "2").tags  # the decision and its basis, kept on the version
    assert tags["champion.decision"] == "kept" and tags["champion.compared_with"] == "v1"
    assert float(tags["champion.value"]) == 0.58 and float(tags["champion.ci_low"]) == 0.45
    assert float(tags["champion.p_value"]) == 0.19 and tags["champion.challenge"] == "2"
    assert float(tags["champion.level"]) == pytest.approx(alpha_spent(0.05, 2), rel=1e-5)
    assert tags["champion.wins_losses_ties"] == "60/50/10" and tags["champion.guards_failed"] == "none"
    assert tags["champion.verdict"] == "head to head" and tags["champion.evaluation_run"] == "run-2"
    assert tags["basis.test_split_md5"] == "b" * 32 and tags["basis.judge_md5"] == "c" * 32
    assert client.get_model_version(name, "3").tags["champion.verdict"] == "not comparable"

    # the champion challenged by itself (evaluate re-run, model unchanged): nothing measured, nothing moves
    again = promotion.challenge_champion(
        client, name, "5", other_splits, lambda champion, k: pytest.fail("must not measure the champion itself")
    )
    assert not again.promoted and again.champion == "5"
    # never: no alias moves and nothing is measured
    _register(client, name, tmp_path, "6")
    never = promotion.challenge_champion(client, name, "6", other_splits, lambda c, k: pytest.fail(), promote="never")
    assert not never.promoted and never.champion == "5" and never.verdict == "never"


def test_a_champion_without_a_recorded_basis_is_not_comparable():
    from rlhflow.evaluation.champion import basis_difference

    assert basis_difference({"test_split_md5": "b"}, {}) == "the champion records no evaluation basis"
    assert basis_difference({"test_split_md5": "b"}, {"test_split_md5": "b"}) is None


def test_a_nan_comparison_never_promotes():
    from rlhflow.evaluation.champion import HeadToHead, SignTest, decide

    nan = HeadToHead("m", math.nan, math.nan, math.nan, SignTest(0, 0, 0, math.nan), level=0.03, challenge=1)
    assert not decide("m", "2", "1", not_comparable=None, comparison=nan).promoted


# ---- sampling settings ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("evaluate_temperature,expected", [(None, 0.9), (0.5, 0.5)])
def test_evaluation_samples_as_ppo_samples(monkeypatch, evaluate_temperature, expected):
    """top-k / top-p and stop strings are PPO's; the temperature is evaluate.temperature, by default the PPO
    temperature; the SFT stage's samples are drawn the same way (tasks/evaluation_setup.py, tasks/sft.py)."""
    import rlhflow.models.sampling
    from rlhflow.config.params import load_config
    from tasks.evaluation_setup import evaluation_sampling
    from tasks.sft import sample_settings

    calls = []
    monkeypatch.setattr(rlhflow.models.sampling, "sample_responses", lambda *args, **kwargs: calls.append(kwargs))
    cfg = load_config(
        overrides=[
            "ppo.temperature=0.9",
            "ppo.top_k=7",
            "ppo.top_p=0.8",
            "ppo.stop_strings=['###']",
            f"evaluate.temperature={'null' if evaluate_temperature is None else evaluate_temperature}",
        ]
    )
    evaluation_sampling(cfg).sample(None, None, [])  # as the evaluation samples
    sample_settings(cfg).sample(None, None, [])  # as the SFT stage samples
    assert len(calls) == 2
    for call in calls:
        assert call["temperature"] == expected and call["top_k"] == 7 and call["top_p"] == 0.8
        assert call["stop_strings"] == ["###"] and call["max_prompt_length"] == cfg.ppo.max_prompt_length


# ---- one tiny pipeline in a real git+DVC repo ------------------------------------------------------------------


@pytest.fixture(scope="module")
def dvc_repo(tmp_path_factory, reproduced_baseline):
    """A copy of the pytest run's tiny reproduced repo (conftest.reproduced_baseline: one `dvc repro`, its results
    committed as the baseline), for this module's experiments. Yields (repo, run, the first repro's output)."""
    repo = tmp_path_factory.mktemp("dvc") / "repo"
    run = copy_repo(reproduced_baseline, repo)
    return repo, run, (reproduced_baseline.parent / "repro.log").read_text()


@pytest.mark.system
def test_dvc_repro_runs_the_stages_then_nothing(dvc_repo):
    repo, run, first = dvc_repo
    for s in STAGES:
        assert f"Running stage '{s.name}'" in first
    second = run("dvc", "repro")
    assert second.returncode == 0 and "Running stage" not in second.stdout, second.stdout

    shown = run("dvc", "metrics", "show", "--json")
    assert shown.returncode == 0, shown.stderr
    files = next(iter(json.loads(shown.stdout).values()))["data"]
    for s in STAGES:
        for m in s.metrics:
            assert any(path.endswith(m.split("/")[-1]) for path in files), f"{m} missing from dvc metrics show"
    assert yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["ppo"]["outs"]
    # the stages logged to the default store at the repo root, whatever the cwd
    assert (repo / "mlflow.db").exists()


def _mlflow_client(repo: Path):
    import mlflow

    return mlflow.MlflowClient(f"sqlite:///{repo}/mlflow.db")


def _latest_stage_run(client, stage: str):
    exp = client.get_experiment_by_name("rlhf")
    return client.search_runs(
        [exp.experiment_id], f"tags.stage = '{stage}'", order_by=["attributes.start_time DESC"], max_results=1
    )[0]


@pytest.mark.system
def test_dvc_metrics_equal_the_mlflow_metrics(dvc_repo):
    repo, _, _ = dvc_repo
    client = _mlflow_client(repo)
    for stage in ["reward_model", "ppo", "evaluate"]:
        on_disk = json.loads((repo / "metrics" / f"{stage}.json").read_text())
        logged = _latest_stage_run(client, stage).data.metrics
        assert on_disk and not any(math.isnan(v) for v in on_disk.values()), stage  # NaN is no value: left out
        for key, value in on_disk.items():
            assert logged[key] == pytest.approx(value, rel=1e-6), f"{stage}: {key}"
    evaluate = json.loads((repo / "metrics/evaluate.json").read_text())
    for key in [
        "eval/distinct_1",
        "eval/distinct_2_sft",
        "eval/repetition_rate",
        "eval/response_length_sft",
        "rm/ece",
        "rm/accuracy",
        "eval/win_rate_vs_sft",
    ]:
        assert key in evaluate
    assert any(key.startswith("rm/accuracy_conf_") for key in evaluate)
    assert evaluate["eval/kl_ci_low"] <= evaluate["eval/kl"] <= evaluate["eval/kl_ci_high"]
    assert evaluate["eval/kl_ci_low"] < evaluate["eval/kl_ci_high"]


@pytest.mark.system
def test_first_run_becomes_champion_and_the_report_says_so(dvc_repo):
    repo, _, _ = dvc_repo
    client = _mlflow_client(repo)
    report = (repo / "reports/evaluate/report.md").read_text()
    assert "## Model registry" in report and report.count("no champion yet") == 2
    # no decision read the dev split (a first champion is not compared): neither model answered it
    answers = json.loads((repo / "data/sft_answers/answers.json").read_text())
    assert list(answers["answers"]) == ["test"] and answers["key"]["splits"] == ["test"]
    metrics = json.loads((repo / "metrics/evaluate.json").read_text())
    assert "eval/judge_win_rate_vs_sft" in metrics and not [k for k in metrics if k.startswith("dev/")]
    for name, stage in [("rlhf-reward-model", "reward_model"), ("rlhf-policy", "ppo")]:
        champion = client.get_model_version_by_alias(name, "champion")
        assert champion.version == client.get_model_version_by_alias(name, "candidate").version
        assert champion.run_id == _latest_stage_run(client, stage).info.run_id
        assert champion.tags["champion.decision"] == "promoted"
    run = _latest_stage_run(client, "evaluate")
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "evaluation/plots")}
    assert artifacts == {
        f"evaluation/plots/{p}.png" for p in ["ppo_curves", "reward_vs_kl", "reward_distributions", "rm_calibration"]
    }
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "samples.json", str(repo.parent))).read_text())
    assert {"prompt", "sft_response", "ppo_response", "sft_reward", "ppo_reward"} <= set(table["columns"])


@pytest.mark.system
def test_dvc_plots_show_renders_the_ppo_and_evaluation_plots(dvc_repo):
    repo, run, _ = dvc_repo
    shown = run("dvc", "plots", "show", "-o", "plots_html")
    assert shown.returncode == 0, shown.stderr[-3000:]
    html = (repo / "plots_html/index.html").read_text()
    for title in [
        "PPO: reward-model score per update",
        "PPO: KL to the reference per update",
        "PPO: reward against KL",
        "Reward of held-out samples, SFT vs PPO",
        "Reward-model calibration: confidence vs observed accuracy",
    ]:
        assert title in html, title
    assert "ppo_reward" in html and "perfect_calibration" in html


@pytest.mark.system
def test_dvc_exp_run_with_another_kl_coef_is_compared_and_challenges_the_champion(dvc_repo):
    repo, run, _ = dvc_repo
    client = _mlflow_client(repo)
    champion_before = str(client.get_model_version_by_alias("rlhf-policy", "champion").version)
    answers = repo / "data/sft_answers/answers.json"
    answers_before = answers.read_bytes()
    exp = run("dvc", "exp", "run", "-S", "ppo.kl_coef=0.2")
    assert exp.returncode == 0, exp.stdout[-3000:] + exp.stderr[-3000:]
    assert "Running stage 'ppo'" in exp.stdout and "Running stage 'reward_model'" not in exp.stdout
    # the second evaluate compared the new policy with the same SFT answers: they were not sampled again
    assert "Running stage 'evaluate'" in exp.stdout and "Running stage 'sft_answers'" not in exp.stdout
    assert answers.read_bytes() == answers_before

    shown = run("dvc", "exp", "show", "--json")
    assert shown.returncode == 0, shown.stderr[-3000:]
    rows = json.loads(shown.stdout)
    found = {}  # kl_coef -> eval metrics, over the baseline and its experiments
    for row in rows:
        for entry in [row] + [e for exp_ in row.get("experiments") or [] for e in exp_.get("revs") or []]:
            data = entry.get("data") or {}
            params = data.get("params", {}).get("params.yaml", {}).get("data", {})
            metrics = data.get("metrics", {}).get("metrics/evaluate.json", {}).get("data", {})
            if params and metrics:
                found[params["ppo"]["kl_coef"]] = metrics
    assert 0.2 in found and len(found) >= 2, found.keys()
    assert all("eval/win_rate_vs_sft" in m and "eval/kl" in m for m in found.values())

    # the new policy version challenged the champion head to head (same splits, same judge); the reward model was
    # unchanged
    candidate = client.get_model_version_by_alias("rlhf-policy", "candidate")
    assert str(candidate.version) != champion_before
    assert candidate.tags["champion.compared_with"] == f"v{champion_before}"
    assert candidate.tags["champion.verdict"] == "head to head"
    # the judge decides, on the dev split, where both answers ended, at the level of this challenge
    assert candidate.tags["champion.metric"] == "judge win rate over the champion, both ended"
    assert candidate.tags["champion.challenge"] == str(candidate.version)
    wins, losses, ties = map(int, candidate.tags["champion.wins_losses_ties"].split("/"))
    dev_conversations = conversation_keys(read_jsonl(repo / "data/validated/dev.jsonl"))
    assert wins + losses + ties <= dev_conversations.nunique()  # compared on dev prompts only
    p_value, level = float(candidate.tags["champion.p_value"]), float(candidate.tags["champion.level"])
    promoted = p_value <= level and candidate.tags["champion.guards_failed"] == "none"
    assert candidate.tags["champion.decision"] == ("promoted" if promoted else "kept")
    assert str(client.get_model_version_by_alias("rlhf-policy", "champion").version) == (
        str(candidate.version) if promoted else champion_before
    )
    champion = client.get_model_version(  # the basis it was compared on is the champion's
        "rlhf-policy", champion_before
    ).tags
    for key in ("train_split_md5", "dev_split_md5", "test_split_md5", "judge_md5"):
        assert candidate.tags[f"basis.{key}"] == champion[f"basis.{key}"]
    report = (repo / "reports/evaluate/report.md").read_text()
    assert f"champion v{champion_before} head to head: judge win rate over the champion" in report
    assert "is already the champion" in report  # the reward model


@pytest.mark.system
def test_a_temporary_experiment_on_other_splits_logs_to_the_project_and_promotes_nothing(dvc_repo):
    """One `dvc exp run --temp` (as queued experiments run) on another split seed, for two claims. It works in a copy
    under .dvc/tmp/exps that DVC deletes after: its MLflow runs land in the project's store, not the copy's. And a
    run on other splits is not comparable with the champion: candidates registered, champions kept, the report (the
    evaluate run's artifact: the workspace's own report stays the baseline's) says why."""
    repo, run, _ = dvc_repo
    client = _mlflow_client(repo)
    experiment = client.get_experiment_by_name("rlhf").experiment_id
    before = {r.info.run_id for r in client.search_runs([experiment])}
    champions = {
        n: client.get_model_version_by_alias(n, "champion").version for n in ("rlhf-policy", "rlhf-reward-model")
    }
    exp = run("dvc", "exp", "run", "--temp", "-S", "validate.split_seed=1")
    assert exp.returncode == 0, exp.stdout[-3000:] + exp.stderr[-3000:]
    new = {r.data.tags.get("stage"): r for r in client.search_runs([experiment]) if r.info.run_id not in before}
    assert {"validate", "ppo", "evaluate"} <= set(new), sorted(new)
    assert new["validate"].data.params["validate.split_seed"] == "1"
    assert "eval/judge_win_rate_vs_sft" in new["evaluate"].data.metrics
    assert not list((repo / ".dvc/tmp/exps").glob("*/mlflow.db"))
    for name, champion in champions.items():
        candidate = client.get_model_version_by_alias(name, "candidate")
        assert candidate.version != champion
        assert candidate.tags["champion.verdict"] == "not comparable", candidate.tags
        assert candidate.tags["champion.decision"] == "kept" and "champion.value" not in candidate.tags
        assert client.get_model_version_by_alias(name, "champion").version == champion
    report_file = client.download_artifacts(new["evaluate"].info.run_id, "evaluation/report.md", str(repo.parent))
    report = Path(report_file).read_text()
    assert report.count("not comparable (") == 2 and "test_split_md5" in report
