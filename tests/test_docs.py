"""The documentation: the MkDocs site builds with --strict, README.md stays short, relative links resolve, and every
code reference `path::function Lstart-Lend` in docs/ppo.md names a function whose definition spans those lines.
The lists the docs keep stay whole: the page table (docs/index.md, the README links to it), the test files
(docs/testing.md), the served deployments (docs/prefect.md), the stages in `python -m flows.pipeline --help`.

Code changes move line numbers. A stale reference fails with the corrected one in the message; to rewrite them all
in place:

    UPDATE_DOCS_REFS=1 .venv/bin/python -m pytest -q tests/test_docs.py
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PPO_PAGE = DOCS / "ppo.md"
README = REPO / "README.md"
README_MAX_WORDS = 1200  # the front door: what it is, two commands, what a run shows, layout, running

# `rlhflow/ppo/core.py::gae L106-L126`, `rlhflow/models/policy.py::PolicyAndValue.forward L341-L353`
CODE_REF = re.compile(r"(?P<path>[\w./-]+\.py)::(?P<name>[A-Za-z_][\w.]*) L(?P<start>\d+)-L(?P<end>\d+)")
# [text](target) and ![alt](target), target up to whitespace or ')'
MD_LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def definition_span(path: Path, name: str) -> tuple[int, int] | None:
    """(first line, last line) of the function, class or `Class.method` called `name` in `path`, decorators
    included; None when there is no such definition."""
    node: ast.AST = ast.parse(path.read_text(), filename=str(path))
    for part in name.split("."):
        body = getattr(node, "body", [])
        found = [
            n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part
        ]
        if not found:
            return None
        node = found[0]
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return start, node.end_lineno


def code_refs(text: str) -> list[re.Match]:
    return list(CODE_REF.finditer(text))


def test_ppo_page_has_code_refs():
    refs = code_refs(PPO_PAGE.read_text())
    names = {m["name"] for m in refs}
    # the method's equations, each with a code location
    for name in (
        "policy_loss",
        "value_loss",
        "gae",
        "kl_per_token",
        "per_token_rewards",
        "masked_whiten",
        "AdaptiveKLController.update",
        "entropy_from_logits",
        "RunningMoments.update",
    ):
        assert name in names, f"docs/ppo.md has no code reference to {name}"


def test_ppo_page_code_refs_match_the_code():
    """Each `path::name Lstart-Lend` must name an existing definition spanning exactly those lines."""
    text = PPO_PAGE.read_text()
    update = os.environ.get("UPDATE_DOCS_REFS") == "1"
    missing, stale = [], []

    def fix(m: re.Match) -> str:
        path = REPO / m["path"]
        span = definition_span(path, m["name"]) if path.is_file() else None
        if span is None:
            missing.append(f"{m[0]}: no {m['name']} in {m['path']}")
            return m[0]
        start, end = span
        corrected = f"{m['path']}::{m['name']} L{start}-L{end}"
        if (int(m["start"]), int(m["end"])) != (start, end):
            stale.append(f"{m[0]}  ->  {corrected}")
        return corrected

    new_text = CODE_REF.sub(fix, text)
    assert not missing, "docs/ppo.md names code that does not exist:\n  " + "\n  ".join(missing)
    if update and new_text != text:
        PPO_PAGE.write_text(new_text)
        return
    assert not stale, (
        "docs/ppo.md has stale line ranges (run `UPDATE_DOCS_REFS=1 pytest tests/test_docs.py` to "
        "rewrite them):\n  " + "\n  ".join(stale)
    )


def test_readme_is_short():
    n = len(README.read_text().split())
    assert n <= README_MAX_WORDS, f"README.md has {n} words; keep it at {README_MAX_WORDS} at most (details: docs/)"


def _relative_links(md: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)  # links inside code blocks are not links
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = [m["target"] for m in MD_LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")]


@pytest.mark.parametrize(
    "md", [README, REPO / "bench" / "README.md", *sorted(DOCS.glob("*.md"))], ids=lambda p: str(p.relative_to(REPO))
)
def test_relative_links_resolve(md: Path):
    broken = []
    for target in _relative_links(md):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path and not (md.parent / path).exists():
            broken.append(target)
    assert not broken, f"{md.relative_to(REPO)} links to missing files: {broken}"


@pytest.mark.system
def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install mkdocs==1.6.1, as in requirements-dev.txt)")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(REPO / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "ppo" / "index.html").is_file()


def _section(md: Path, heading: str) -> str:
    """The text under `heading` (a `## ` line) up to the next `## ` heading."""
    text = md.read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_index_page_table_lists_every_page_and_the_readme_links_to_it():
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    table = _section(DOCS / "index.md", "## Pages")
    listed = {m["target"] for m in MD_LINK.finditer(table)}
    assert listed == pages, f"docs/index.md's page table: missing {pages - listed}, unknown {listed - pages}"
    # one page table: the README's section links to it and lists no page itself
    readme = _section(README, "## Documentation")
    assert [m["target"] for m in MD_LINK.finditer(readme)] == ["docs/index.md#pages"], readme


def test_testing_page_lists_every_test_file():
    files = {p.name for p in (REPO / "tests").glob("test_*.py")}
    listed = set(re.findall(r"`(test_\w+\.py)`", (DOCS / "testing.md").read_text()))
    assert files <= listed, f"docs/testing.md does not describe {sorted(files - listed)}"
    assert listed <= files, f"docs/testing.md describes missing files {sorted(listed - files)}"


def test_prefect_page_lists_every_served_deployment():
    from flows.serve import deployments

    served = {f"{d.flow_name}/{d.name}" for d in deployments()}
    section = _section(DOCS / "prefect.md", "## `make ui`: start runs from the Prefect UI, compare them in MLflow")
    first_cells = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]
    listed = {name for cell in first_cells for name in re.findall(r"`([\w-]+/\w+)`", cell)}
    assert served <= listed, f"docs/prefect.md's deployment table misses {sorted(served - listed)}"


def test_pipeline_help_names_every_stage_in_order(capsys):
    from flows.pipeline import main
    from rlhfops.stages import STAGE_NAMES

    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert " -> ".join(STAGE_NAMES) in help_text
    assert "--stages" in help_text and "--force" in help_text


def test_demo_data_runs_whatever_the_input():
    """docs/configuration.md and the README: demo_data runs in every pipeline run, as under `dvc repro`."""
    from flows.pipeline import selected_stages
    from rlhflow.config.params import load_config

    for preferences in ("data/hh-rlhf-harmless/harmless-base.jsonl.gz", "data/raw/demo/preferences.jsonl"):
        cfg = load_config(overrides=[f"data.preferences={preferences}"])
        assert selected_stages(cfg, None)[0] == "demo_data"


METRIC_KEY = re.compile(r"`((?:eval|dev|rm|judge|ppo|sft|align)/[a-z0-9_]+)`")
PAIR_STAGES = {"rm", "judge"}  # <stage>/<figure>: the same figures on held-out pairs, each stage under its own prefix


def _literal_in(key: str, sources: list[str]) -> bool:
    return any(f'"{key}"' in source for source in sources)


def test_every_documented_metric_is_named_where_it_is_computed():
    """Each metric key the README and docs/evaluation.md define is a string literal in the code, so a search for it
    lands where it is computed. An interval (<key>_ci_low, <key>_ci_high) is named by its figure's key; the
    reward-model and judge stages' pair figures by their name in rlhflow/evaluation/pairs.py or judges.py."""
    code = [p.read_text() for d in ("rlhflow", "rlhfops", "tasks", "flows") for p in (REPO / d).rglob("*.py")]
    pair_code = [(REPO / "rlhflow/evaluation" / f).read_text() for f in ("pairs.py", "judges.py")]
    keys = {k for md in ("README.md", "docs/evaluation.md") for k in METRIC_KEY.findall((REPO / md).read_text())}
    assert len(keys) > 30, keys  # the pages define the evaluation's figures
    missing = []
    for key in sorted(keys):
        figure = re.sub(r"_ci_(low|high)$", "", key)
        prefix, name = figure.split("/", 1)
        if not (_literal_in(figure, code) or prefix in PAIR_STAGES and _literal_in(name, pair_code)):
            missing.append(key)
    assert not missing, missing
