"""Smoke run of the PPO benchmark (bench/) on the tiny workload: our runner always; the A/B driver against TRL 1.12
when its venv (bench/.venv-trl, built by `make bench`) exists."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from bench.ppo_bench import roofline
from bench.workloads import BENCH_EOS, WORKLOADS, prepare
from rlhflow.config.output_paths import ALLOW_PATHS

TRL_PYTHON = REPO / "bench" / ".venv-trl" / "bin" / "python"
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# as a user starts a benchmark: no directory outside the project allowed (the suite allows its temporary one)
USER_ENV = {key: value for key, value in ENV.items() if key != ALLOW_PATHS}


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("bench")
    prepare(WORKLOADS["tiny"], work)
    return work


@pytest.mark.system
def test_tiny_workload_and_our_runner(work_dir):
    """EOS lies past the model's vocabulary, so every response runs to max_new_tokens; the runner reports each
    measured update with phases that fit inside its wall time, and a peak RSS."""
    spec = json.loads((work_dir / "tiny" / "workload.json").read_text())
    tokenizer_config = json.loads((work_dir / "tiny" / "policy" / "tokenizer_config.json").read_text())
    assert spec["eos_token_id"] == spec["vocab_size"] and tokenizer_config["eos_token"] == BENCH_EOS
    assert len(spec["prompts"]) == len(spec["prompt_ids"]) == spec["batch_size"]

    out = work_dir / "ours.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.ppo_worker_rlhflow",
            "--workload-dir",
            str(work_dir / "tiny"),
            "--out",
            str(out),
            "--threads",
            "1",
        ],
        cwd=REPO,
        env=ENV,
        check=True,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert len(result["updates"]) == spec["updates"] and len(result["warmup_updates"]) == spec["warmup"]
    for update in result["updates"]:
        assert update["response_tokens"] == spec["batch_size"] * spec["max_new_tokens"]
        phases = update["generation_s"] + update["scoring_s"] + update["training_s"]
        assert 0 < phases <= update["total_s"] * 1.001
        assert min(update["generation_s"], update["scoring_s"], update["training_s"]) > 0
    assert result["peak_memory_bytes"] > 100 * 2**20 and result["memory_kind"] == "peak RSS"


def test_roofline_fractions():
    """Decode: T steps each reading the weights plus every cached key/value; training: 6 x params per token."""
    shape = {
        "layers": 2,
        "kv_heads": 1,
        "head_dim": 4,
        "dtype_bytes": 2,
        "weight_bytes": 1000,
        "policy_matmul_params": 100,
        "critic_matmul_params": 50,
    }
    spec = {"shape": shape, "batch_size": 2, "max_new_tokens": 3, "prompt_length": 5, "ppo_epochs": 2}
    kv_bytes = 2 * 2 * 1 * 4 * 2  # K and V, 2 layers, 1 head of 4, bf16
    decode_bytes = 3 * 1000 + 2 * kv_bytes * (5 + 6 + 7)
    fractions = roofline(spec, {"generation_s": 1.0, "training_s": 2.0}, flops=1e6, bandwidth=1e4)
    assert fractions["decode_vs_bandwidth_bound"] == pytest.approx(decode_bytes / 1e4)
    assert fractions["training_mfu"] == pytest.approx(6 * 150 * 2 * 2 * (5 + 3) / 1e6 / 2.0)


@pytest.mark.skipif(not TRL_PYTHON.exists(), reason="no peer venv: `make bench` builds bench/.venv-trl")
def test_driver_against_trl(work_dir):
    """One A/B round on the tiny workload: both engines in the table, ratios, and the speedup as the last line."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.ppo_bench",
            "--workloads",
            "tiny",
            "--rounds",
            "1",
            "--threads",
            "1",
            "--work-dir",
            str(work_dir),
        ],
        cwd=REPO,
        env=ENV,
        check=True,
        capture_output=True,
        text=True,
    )
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"ppo_speedup_vs_trl=\d+\.\d\d", lines[-1]), lines[-1]
    table = proc.stdout
    assert re.search(r"^ours\s+\d", table, re.M) and re.search(r"^trl\s+\d", table, re.M)
    assert re.search(r"^ours/TRL time\s+\d", table, re.M)
    trl = json.loads((work_dir / "tiny" / "result-trl-0.json").read_text())
    assert trl["engine"] == "trl" and len(trl["updates"]) == WORKLOADS["tiny"].updates
    assert all(u["generation_s"] > 0 and u["training_s"] > 0 for u in trl["updates"])


@pytest.mark.slow
@pytest.mark.system
def test_orchestration_overhead_on_tiny_models():
    """Both paths run every stage (the flow's times come from its metrics files, the direct loop's from its own
    clock); wall and CPU seconds for each; the flow's model logging is clocked inside its stage bodies; the last
    line is the attributed overhead over the flow's wall time."""
    from rlhfops.stages import STAGE_NAMES

    proc = subprocess.run(
        [sys.executable, "-m", "bench.orchestration", "--tiny"],
        cwd=REPO,
        env=USER_ENV,
        check=True,
        capture_output=True,
        text=True,
    )
    out = proc.stdout
    for name in STAGE_NAMES:
        assert re.search(rf"^{name}\s+\d+\.\d\s+\d+\.\d$", out, re.M), f"{name} missing or nan:\n{out}"
    walls = re.search(r"^process wall\s+(\d+\.\d)\s+(\d+\.\d)$", out, re.M)
    cpus = re.search(r"^process CPU\s+(\d+\.\d)\s+(\d+\.\d)$", out, re.M)
    assert walls and cpus, out
    assert min(*map(float, walls.groups()), *map(float, cpus.groups())) > 0
    model_logging = re.search(r"log_model_dir (\d+\.\d) s", out)
    assert model_logging and float(model_logging.group(1)) > 0, out  # three models logged, two registered
    attributed = re.search(r"= (-?\d+\.\d) s of the flow's (\d+\.\d) s$", out, re.M)
    assert attributed, out
    seconds, flow_wall = map(float, attributed.groups())
    assert flow_wall == float(walls.group(1)) and 0 < seconds < flow_wall
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"orchestration_overhead=-?\d\.\d{3}", last), last
    assert float(last.split("=")[1]) == pytest.approx(seconds / flow_wall, abs=2e-3)


@pytest.mark.slow
@pytest.mark.system
def test_stage_profile_on_tiny_models(tmp_path):
    """Every stage ran and has a row; in each row (and outside the stages, and in total) the categories are
    non-negative and with `other` add up to the wall time, in the JSON and in the printed table; generation in ppo
    and evaluate, training in reward_model and ppo, and MLflow logging in every stage (each has its own run)."""
    from bench.profile_run import CATEGORIES
    from rlhfops.stages import STAGE_NAMES

    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.profile_run", "--tiny", "--out", str(out)],
        cwd=REPO,
        env=USER_ENV,
        check=True,
        capture_output=True,
        text=True,
    )
    profile = json.loads(out.read_text())
    stages = profile["stages"]
    assert list(stages) == STAGE_NAMES and all(row["ran"] for row in stages.values())
    rows = {**stages, "outside stages": profile["outside_stages"], "total": profile["total"]}
    for name, row in rows.items():
        seconds = row["seconds"]
        assert list(seconds) == CATEGORIES and min(seconds.values()) >= 0, (name, seconds)
        # `other` is the wall time outside any timed call: this sum holds when no nested time is counted twice
        assert sum(seconds.values()) == pytest.approx(row["wall_s"], abs=1e-3), (name, seconds, row["wall_s"])
        line = re.search(rf"^\| {re.escape(name)} \|(.*)\|$", proc.stdout, re.M)
        assert line, f"no table row for {name}:\n{proc.stdout}"
        *cells, wall = map(float, line.group(1).split("|"))
        assert wall == pytest.approx(row["wall_s"], abs=0.005) and sum(cells) == pytest.approx(wall, abs=0.05)
    assert sum(row["wall_s"] for row in rows.values() if row is not profile["total"]) == pytest.approx(
        profile["total"]["wall_s"]
    )
    for name in ("ppo", "evaluate"):
        assert stages[name]["seconds"]["generation"] > 0 and stages[name]["calls"]["generation"] > 0, name
    for name in ("reward_model", "ppo"):
        assert stages[name]["seconds"]["training"] > 0 and stages[name]["calls"]["training"] > 0, name
    assert all(row["seconds"]["mlflow"] > 0 for row in stages.values())


def test_profile_compare_reports_ratios_and_every_figure_that_moved():
    """bench.profile_compare's arithmetic: per stage the median of each side and after / before (a stage only one
    side ran has no ratio); figures that differ are listed with their relative difference, timings and equal
    values (NaN included) are not."""
    from bench.profile_compare import compared, differing_metrics

    def run(sft: float, ppo: float) -> dict:
        return {"stages": {"sft": {"wall_s": sft}, "ppo": {"wall_s": ppo}}, "total": {"wall_s": sft + ppo}}

    rows = compared([run(60, 400), run(62, 380), run(70, 390)], [run(30, 400), run(40, 360), run(35, 370)])
    assert rows["sft"] == {"before_s": 62, "after_s": 35, "ratio": pytest.approx(35 / 62)}
    assert rows["ppo"]["ratio"] == pytest.approx(370 / 390)
    assert rows["total"] == {"before_s": 460, "after_s": 405, "ratio": pytest.approx(405 / 460)}
    one_sided = compared([run(60, 400)], [{"stages": {"sft": {"wall_s": 30}}, "total": {"wall_s": 30}}])
    assert one_sided["ppo"] == {"before_s": 400, "after_s": None, "ratio": None}

    before = {"sft": {"sft/perplexity": 16.0, "time/sft_s": 60.0}, "evaluate": {"eval/kl": 7.0, "eval/x": math.nan}}
    after = {"sft": {"sft/perplexity": 16.0, "time/sft_s": 30.0}, "evaluate": {"eval/kl": 7.07, "eval/x": math.nan}}
    after["evaluate"]["eval/new"] = 1.0
    moved = differing_metrics(before, after)
    assert set(moved) == {"evaluate:eval/kl", "evaluate:eval/new"}
    assert moved["evaluate:eval/kl"]["relative"] == pytest.approx(0.01)
    assert moved["evaluate:eval/new"] == {"before": None, "after": 1.0, "relative": None}


def test_ppo_settings_seed_table_gives_each_settings_mean_and_t_interval():
    from bench.ppo_settings import SEED_FIGURES, seed_table

    rows = [
        {"setting": name, **{f: base + seed for f in SEED_FIGURES}}
        for name, base in (("shared", 0.0), ("separate", 10.0))
        for seed in range(3)
    ]
    lines = seed_table(rows, ["shared", "separate"]).splitlines()
    # values base, base+1, base+2: mean base+1, sd 1, t(0.975, 2) = 4.303: half-width 4.303 / sqrt(3) = 2.484
    assert lines[2].startswith("| `shared` | 3 | 1.000 (-1.484 to 3.484) |")
    assert lines[3].startswith("| `separate` | 3 | 11.000 (8.516 to 13.484) |")
    assert len(lines) == 4 and lines[2].count("(") == len(SEED_FIGURES)


def test_linear_flops_count_2n_per_forward_token_and_6n_per_trained_token():
    """bench.flops: a token through linear layers of N weights costs 2N FLOPs without autograd and 6N when trained
    (forward, input and weight gradients); the matmul rate is a positive figure."""
    import torch
    from torch import nn

    from bench.flops import LinearFlops, matmul_gflops

    net = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    n_weights = 8 * 16 + 16 * 4
    tokens = torch.randint(0, 10, (3, 5))  # 15 tokens
    with LinearFlops() as flops:
        with torch.no_grad():
            net(tokens)
    assert flops.forward == 2 * n_weights * 15 and flops.trained == 0
    with LinearFlops() as flops:
        net(tokens).sum().backward()
    assert flops.trained == 6 * n_weights * 15 and flops.forward == 0
    net(tokens)  # outside the context: not counted
    assert flops.total == 6 * n_weights * 15
    assert matmul_gflops(torch.float32, repeats=2) > 0


def test_ppo_precision_achieved_table_sets_each_phase_against_its_matmul_rate():
    from bench.ppo_precision import achieved_table

    med = {
        p: {"forward_flops": 4e9, "forward_s": 2.0, "training_flops": 12e9, "training_s": 3.0}
        | {"generation_flops": 1e9, "generation_s": 1.0}
        for p in ("fp32", "bf16")
    }
    lines = achieved_table(med, {"fp32": [10.0, 20.0, 40.0], "bf16": [100.0]})
    assert lines[2] == "| rollout forwards (2N per token) | 2 | 10% | 2 | 2% |"
    assert lines[3] == "| PPO epochs (6N per trained token) | 4 | 20% | 4 | 4% |"
    assert lines[4] == "| sampling (2N per token) | 1 | 5% | 1 | 1% |"
    assert lines[5].endswith("| 20 | | 100 | |")


def test_precision_stages_sets_every_stages_precision_key():
    """bench.precision_stages puts every `precision` key params.yaml has at the side's precision (the judge's
    inherits reward_model's), so a stage that gains one is not left out of the comparison."""
    from bench.precision_stages import PRECISION_KEYS, precision_overrides
    from rlhflow.config.params import load_config

    def keys(section: dict, prefix: str = "") -> set[str]:
        found = set()
        for name, value in section.items():
            if isinstance(value, dict):
                found |= keys(value, f"{prefix}{name}.")
            elif name == "precision":
                found.add(f"{prefix}{name}")
        return found

    assert keys(load_config().to_params()) - {"judge.precision"} == set(PRECISION_KEYS)
    args = precision_overrides("bf16")
    assert args[::2] == ["--set"] * len(PRECISION_KEYS) and set(args[1::2]) == {f"{k}=bf16" for k in PRECISION_KEYS}


@pytest.mark.system
def test_gpu_ppo_runs_its_settings_and_reports_what_does_not_fit(tmp_path):
    """bench.gpu_ppo on the CPU with the tiny shape: every run reports its update, and the table shows a run that
    failed (here an unknown setting) with its error's last line."""
    out = tmp_path / "runs.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_ppo", "--device", "cpu", "--runs", "tiny:bf16+lora+ckpt,tiny:nonesuch"]
        + ["--prompt-tokens", "16", "--new-tokens", "8", "--out", str(out)],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"auto": "bfloat16"' in proc.stdout or '"auto": "float32"' in proc.stdout  # the CUDA path line
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["run"] for r in runs] == ["tiny:bf16+lora+ckpt", "tiny:nonesuch"]
    lora = runs[0]
    assert lora["fits"] and lora["first_ratio"] == 0.0 and 0 < lora["response_tokens"] <= 8 * 8
    assert lora["generation_s"] + lora["forward_s"] + lora["training_s"] <= lora["update_s"]
    assert not runs[1]["fits"] and "| failed: KeyError: 'nonesuch' |" in proc.stdout


def test_decode_roofline_prints_a_row_per_cache_and_rows(tiny_model_dir, capsys):
    """bench.decode_roofline on the tiny model: one table row per KV cache and row count, then the limits; a step's
    FLOPs and bytes as counted by hand (2 per linear weight and row, attention 4 * layers * heads * head_dim per row
    and context token; the weights once, keys and values per row and context token)."""
    import torch

    from bench.decode_roofline import Shape, main
    from rlhflow.models.loading import load_causal_lm

    settings = [
        "--settings",
        "dynamic,preallocated",
        "--context",
        "8",
        "--steps",
        "2",
        "--precisions",
        "fp32",
        "--rounds",
        "2",
    ]
    main(["--model", str(tiny_model_dir), "--rows", "1,2", "--threads", "1", *settings])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[:3] for r in rows[1:5]] == [
        ["| dynamic", "fp32", "1"],
        ["| preallocated", "fp32", "1"],
        ["| dynamic", "fp32", "2"],
        ["| preallocated", "fp32", "2"],
    ]
    assert rows[5].startswith("| fp32 limits: matmul ") and len(rows) == 6
    model = load_causal_lm(str(tiny_model_dir))
    shape = Shape.of(model)
    c = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = c.hidden_size // c.num_attention_heads
    assert shape.flops(3, 10) == 3 * (2 * linear + 4 * c.num_hidden_layers * c.num_attention_heads * head_dim * 10)
    kv = 3 * c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 10 * 4
    assert shape.bytes_read(3, 10, 4) == (linear * 4, kv)


def test_decode_roofline_times_the_whole_decoder_per_cache(tiny_model_dir, tmp_path, capsys):
    """--answers: the evaluation's decoder on the prompts, per KV cache, greedy: the same answers with either eager
    cache, and a row per cache with both calls' seconds."""
    import json

    from bench.decode_roofline import main

    prompts = tmp_path / "test.jsonl"
    rows = [{"prompt_messages": [{"role": "user", "content": text}]} for text in ("hi", "name three colours")]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["--model", str(tiny_model_dir), "--answers", "2", "--prompts", str(prompts), "--precisions", "fp32",
          "--settings", "preallocated,dynamic", "--threads", "1"])  # fmt: skip
    table = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r[:3] for r in table[1:]] == [["| preallocated", "fp32", "2"], ["| dynamic", "fp32", "2"]]
    assert [r[-1] for r in table[1:]] == ["yes |", "yes |"] and all(float(r[3]) > 0 for r in table[1:])


def test_precision_frontier_compares_pairs_by_seed_and_at_equal_kl():
    """bench.precision_frontier's table from finished runs: each setting's seeds and mean, bf16 - fp32 paired by
    seed, and the difference at equal KL (here bf16 moves less and scores exactly what its KL predicts: 0)."""
    from bench.precision_frontier import FIGURES, Point, table

    runs = []
    for precision, kls in (("fp32", (6.0, 6.5, 7.0)), ("bf16", (5.0, 5.5, 6.5))):
        for seed, kl in enumerate(kls):
            metrics = {"eval/kl": kl, "eval/objective_mean": 0.1 * kl, "eval/answer_tokens": 40.0}
            runs.append(Point(precision, "0.05", seed, cfg=None, metrics=metrics))
    runs.append(Point("bf16", "0.025", 0, cfg=None))  # not run yet
    lines = table(runs).splitlines()
    assert lines[0].split(" | ")[1:] == [
        "fp32, beta 0.05", "bf16, beta 0.05", "bf16 - fp32, beta 0.05, paired by seed", "bf16 - fp32 at equal KL |"
    ]  # fmt: skip
    objective = next(line for line in lines if line.startswith("| test: proxy reward less"))
    cells = objective.split(" | ")
    assert cells[1].startswith("0.600, 0.650, 0.700; mean 0.650") and cells[3].startswith("-0.083")
    assert cells[4].startswith("0.000") or cells[4].startswith("-0.000")
    logged = [row for row, metric, _ in FIGURES if metric in metrics]  # a figure no run logged has no row
    assert [line.split(" | ")[0] for line in lines[2:-2]] == [f"| {row}" for row in logged] and len(logged) == 3
    assert lines[-1] == "No finished run yet: bf16 beta 0.025 seed 0."
    assert table(runs[-1:]) == "No finished run yet: bf16 beta 0.025 seed 0."  # no empty table before any run


def test_headline_table_shows_each_seed_and_concludes_only_where_every_seed_agrees():
    """bench.headline: a row per figure with each seed's value and interval and the range over seeds; a conclusion
    against 0.5 only as far as every seed's figure (and interval) agrees."""
    from bench.headline import table

    def seed(win, low, high, lc):
        return {
            "machine": {"cpu": "AMD EPYC", "cores": "2", "torch_cpu_capability": "AVX512"},
            "figures": {
                "eval/judge_win_rate_vs_sft": win,
                "eval/judge_win_rate_ci_low": low,
                "eval/judge_win_rate_ci_high": high,
                "eval/judge_win_rate_lc": lc,
                "eval/judge_win_rate_lc_ci_low": lc - 0.1,
                "eval/judge_win_rate_lc_ci_high": lc + 0.1,
                "eval/kl": 5.0,
            },
        }

    markdown = table({0: seed(0.77, 0.70, 0.84, 0.48), 1: seed(0.71, 0.63, 0.79, 0.62), 2: seed(0.74, 0.52, 0.9, 0.55)})
    assert "AMD EPYC (2 cores, torch kernels AVX512)" in markdown
    row = next(line for line in markdown.splitlines() if "`eval/judge_win_rate_vs_sft`" in line)
    assert "| 0.770 (0.700 to 0.840) | 0.710 (0.630 to 0.790) |" in row and row.endswith("| 0.710 to 0.770 |")
    assert "judge win rate vs SFT: above 0.5 at every seed, each interval above it." in markdown
    assert "length-controlled: the seeds disagree (above 0.5 at seed(s) [1, 2] alone): no conclusion." in markdown
    assert "KL to SFT" in markdown and "proxy accuracy" not in markdown  # no seed logged it: no row
