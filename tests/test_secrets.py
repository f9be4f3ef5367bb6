"""Secrets that stay secret: a URL is shown as its scheme, host, port and path; a key comes only from a variable of
its own service (the judge's, Label Studio's) and travels in clear text only to this host, unless the user opts in,
MLflow's to the tracking server alike;
the Docker build context leaves out what git ignores and the local secret files. A whole run with a password in the
tracking URI: tests/test_security.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

from rlhflow.config.params import ConfigError, load_config
from rlhflow.redaction import redact_url, redact_urls

# ---- URLs ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url,shown",
    [
        ("http://bob:hunter2@127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("https://TOKEN123@mlflow.example.com/", "https://mlflow.example.com/"),
        ("postgresql://bob:p@ss@db:5432/mlflow", "postgresql://db:5432/mlflow"),  # a raw @ in the password
        ("https://host/v1?api-version=2024-06-01&api-key=abc", "https://host/v1"),
        ("https://host/v1?k=sk-under-any-name#access_token=abc", "https://host/v1"),  # any name, in the fragment too
        ("https://b.s3.amazonaws.com/o?X-Amz-Signature=f00&X-Amz-Credential=AKIA", "https://b.s3.amazonaws.com/o"),
        ("http://u:p@[::1]:8000/v1?key=1", "http://[::1]:8000/v1"),
        ("http://127.0.0.1:5000/#/experiments/1/runs/abc", "http://127.0.0.1:5000/"),
        ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db"),
    ],
)
def test_a_url_is_shown_as_its_scheme_host_port_and_path(url, shown):
    assert redact_url(url) == shown


def test_urls_in_text_and_markdown_links_are_redacted(monkeypatch):
    from rlhfops.tracking import redact

    link = "http://u:pw123456@127.0.0.1:5000/runs/r?view=1"
    text = f"MLflow run: [{link}]({link}); judge `https://api.example.com/v1?k=sk-123` answered 500"
    expected = (
        "MLflow run: [http://127.0.0.1:5000/runs/r](http://127.0.0.1:5000/runs/r); "
        "judge `https://api.example.com/v1` answered 500"
    )
    assert redact_urls(text) == expected
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pw123456-and-more")
    assert redact(text + " pw123456-and-more") == expected + " ***"  # the environment's secrets too


def test_run_links_carry_no_credentials(monkeypatch):
    from flows.report import mlflow_experiment_url, mlflow_run_url

    monkeypatch.delenv("RLHF_MLFLOW_UI_URL", raising=False)
    uri = "https://team:s3cr3t-pw@mlflow.example.com:8443"
    view = "?workflowType=machine_learning"  # the UI's model-training view, not its GenAI one
    assert mlflow_run_url(uri, "1", "abc") == f"https://mlflow.example.com:8443/#/experiments/1/runs/abc{view}"
    assert mlflow_experiment_url(uri, "1") == f"https://mlflow.example.com:8443/#/experiments/1/runs{view}"
    monkeypatch.setenv("RLHF_MLFLOW_UI_URL", "http://viewer:pw@127.0.0.1:5000/")
    assert mlflow_run_url(uri, "1", "abc") == f"http://127.0.0.1:5000/#/experiments/1/runs/abc{view}"


def test_a_store_named_without_credentials_takes_this_machines_own(monkeypatch):
    """A team run's stage parameters name the store without user info; each worker adds the credentials its own
    $MLFLOW_TRACKING_URI holds for that store, and only for that store."""
    from rlhfops.tracking import tracking_uri

    cfg = load_config(overrides=["tracking.tracking_uri=http://127.0.0.1:5000"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://worker:pw@127.0.0.1:5000")
    assert tracking_uri(cfg) == "http://worker:pw@127.0.0.1:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://worker:pw@127.0.0.1:5001")  # another store: not its password
    assert tracking_uri(cfg) == "http://127.0.0.1:5000"


# ---- the judge's API key ------------------------------------------------------------------------------------

LLM = ["judge.kind=llm", "judge.model=judge-model"]


@pytest.mark.parametrize(
    "name",
    ["AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD", "HF_TOKEN", "PREFECT_API_KEY", "openai_api_key", "PATH"]
    + ["LABEL_STUDIO_API_KEY", "MLFLOW_TRACKING_TOKEN", "DVC_STUDIO_TOKEN", "ANTHROPIC_API_KEY", "GITHUB_TOKEN"],
)
def test_the_api_key_variable_must_be_a_judge_key(name):
    """Not a list of refused names: a pattern of the judge's own, so that another credential of the machine, the
    project's own among them (the Label Studio token, MLflow's), never goes to the judge's endpoint."""
    with pytest.raises(ConfigError, match=rf"judge.api_key_env='{name}' is not a variable for the judge's endpoint"):
        load_config(overrides=[f"judge.api_key_env={name}"])


@pytest.mark.parametrize("name", ["OPENAI_API_KEY", "JUDGE_API_KEY", "MY_JUDGE_TOKEN", "VLLM_API_KEY", "LLM_TOKEN"])
def test_judge_key_variable_names_are_accepted(name):
    assert load_config(overrides=[f"judge.api_key_env={name}"]).judge.api_key_env == name


@pytest.mark.parametrize("name", ["OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_TOKEN", "HOME"])
def test_the_label_studio_token_variable_must_be_label_studios(name):
    with pytest.raises(ConfigError, match=rf"feedback.token_env='{name}' is not a variable for Label Studio's key"):
        load_config(overrides=[f"feedback.token_env={name}"])
    assert load_config(overrides=["feedback.token_env=LABEL_STUDIO_TEAM_TOKEN"]).feedback.token_env


@pytest.mark.parametrize("url", ["http://10.0.0.5:8080", "http://u:pw-SECRET-9@ls.example.com/?k=k-SECRET-9"])
def test_label_studio_elsewhere_must_be_https_unless_allowed(url):
    with pytest.raises(
        ConfigError, match=r"feedback.label_studio_url http://[^ ]+ is not https.*allow_plain_http"
    ) as e:
        load_config(overrides=[f"feedback.label_studio_url={url}"])
    assert "SECRET" not in str(e.value)
    assert load_config(overrides=[f"feedback.label_studio_url={url}", "feedback.allow_plain_http=true"])
    assert load_config(overrides=["feedback.label_studio_url=https://ls.example.com"])


def test_the_tracking_server_gets_mlflows_credentials_only_over_https_or_here(monkeypatch, tmp_path):
    """MLflow sends $MLFLOW_TRACKING_TOKEN, a password, ~/.mlflow/credentials' or ~/.netrc's by itself: to an http
    server elsewhere the preflight refuses before any request, naming what it found and nothing of its value, and
    refuses with nothing found too (a credentials file may appear before the next request)."""
    from rlhfops.tracking import TrackingUnavailableError, preflight

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("NETRC", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-SECRET-123456")
    cfg = load_config(overrides=["tracking.tracking_uri=http://10.0.0.5:5000"])
    with pytest.raises(
        TrackingUnavailableError,
        match=r"the tracking URI http://10.0.0.5:5000 is not https: MLFLOW_TRACKING_TOKEN and every run",
    ) as err:
        preflight(cfg)
    assert "SECRET" not in str(err.value)
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN")
    cfg = load_config(overrides=["tracking.tracking_uri=http://bob:pw-SECRET@10.0.0.5:5000"])
    with pytest.raises(TrackingUnavailableError, match="the password in the tracking URI and every run") as err:
        preflight(cfg)
    assert "SECRET" not in str(err.value)
    cfg = load_config(overrides=["tracking.tracking_uri=http://10.0.0.5:5000"])
    with pytest.raises(TrackingUnavailableError, match=r"is not https: every run's params, metrics and models would"):
        preflight(cfg)  # no credential anywhere: still not over plain http to another host
    (tmp_path / ".mlflow").mkdir()
    (tmp_path / ".mlflow" / "credentials").write_text("[mlflow]\nmlflow_tracking_password = pw-SECRET\n")
    (tmp_path / ".netrc").write_text("machine 10.0.0.5 login bob password pw-SECRET\n")
    with pytest.raises(TrackingUnavailableError, match=r"~/.mlflow/credentials and ~/.netrc and every run") as err:
        preflight(cfg)
    assert "SECRET" not in str(err.value)


def test_a_params_file_password_is_no_prefect_parameter(monkeypatch):
    """Prefect stores and shows a flow run's parameters and a deployment's form: the commands hand the flows the config
    with the tracking URI's user info moved to the process's environment, where the run finds it again."""
    import flows.pipeline
    import flows.pipeline_flow
    from rlhfops import tracking

    uri = "http://bob:pw-SECRET@127.0.0.1:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    given = {}
    monkeypatch.setattr(flows.pipeline_flow, "rlhf_pipeline", lambda config, **kwargs: given.update(config=config))
    monkeypatch.setattr(flows.pipeline, "start_temporary_server", lambda: None)
    flows.pipeline.main(["--set", f"tracking.tracking_uri={uri}"])
    assert given["config"].tracking.tracking_uri == "http://127.0.0.1:5000"
    assert "SECRET" not in given["config"].model_dump_json()
    assert tracking.tracking_uri(given["config"]) == uri  # the run's own store, with its credentials


@pytest.mark.parametrize(
    ("uri", "refused"),
    [
        ("postgresql://bob@db.example.com/mlflow", "PostgreSQL at db.example.com without sslmode"),
        ("postgresql+psycopg://bob@10.0.0.5:5432/mlflow?sslmode=prefer", "PostgreSQL at 10.0.0.5 without sslmode"),
        ("postgresql:///mlflow?host=db.example.com", "PostgreSQL at db.example.com without sslmode"),
        ("postgresql:///mlflow?service=prod", "PostgreSQL at a host of a libpq service file without"),
        ("mysql+pymysql://bob@db.example.com/mlflow", "a mysql database at db.example.com"),
        ("postgresql://bob@db.example.com/mlflow?sslmode=verify-full", None),
        ("postgresql+psycopg://bob:pw@127.0.0.1:5432/mlflow", None),
        ("postgresql:///mlflow", None),  # libpq's local socket
        ("postgresql:///mlflow?host=/var/run/postgresql", None),
        ("mysql://bob@localhost/mlflow", None),
    ],
)
def test_a_database_store_elsewhere_is_reached_only_encrypted(uri, refused, monkeypatch):
    """libpq sends the URI's password, $PGPASSWORD or ~/.pgpass to the host it names: a database store on another
    host must ask for an encrypted connection, whatever credentials are present."""
    from rlhfops.tracking import TrackingUnavailableError, check_transport

    for name in ("PGHOST", "PGHOSTADDR", "PGSSLMODE", "PGSERVICE"):
        monkeypatch.delenv(name, raising=False)
    if refused is None:
        check_transport(uri)
    else:
        with pytest.raises(TrackingUnavailableError, match=refused):
            check_transport(uri)
    if uri == "postgresql:///mlflow":  # libpq's variables name the host where the URI does not
        monkeypatch.setenv("PGHOST", "db.example.com")
        with pytest.raises(TrackingUnavailableError, match="PostgreSQL at db.example.com without sslmode"):
            check_transport(uri)
        monkeypatch.setenv("PGSSLMODE", "require")
        check_transport(uri)


@pytest.mark.parametrize(
    ("store", "location", "refused"),
    [
        ("https://mlflow.example.com", "mlflow-artifacts:/1/abc/artifacts", None),
        ("https://mlflow.example.com", "mlflow-artifacts://mlflow.example.com/1/abc", None),
        ("https://mlflow.example.com", "mlflow-artifacts://evil.example.net/1/abc", "on another host"),
        ("https://mlflow.example.com", "https://evil.example.net/artifacts", "on another host"),
        ("https://mlflow.example.com", "http://mlflow.example.com/artifacts", "is not https"),
        ("https://mlflow.example.com", "/home/me/.config/autostart", "a path on this machine"),
        ("https://mlflow.example.com", "file:///home/me/.config", "a path on this machine"),
        ("https://mlflow.example.com", "s3://bucket/artifacts", None),
        ("https://mlflow.example.com", "gs://bucket/artifacts", None),
        ("http://127.0.0.1:5000", "file:///srv/mlartifacts/1/abc", None),  # a server on this machine
        ("sqlite:////srv/mlflow.db", "/srv/mlartifacts/1/abc", None),
    ],
)
def test_the_artifact_location_a_store_hands_back_follows_the_rule(store, location, refused, monkeypatch):
    """A tracking server names where each run's files go: another host would get the store's credentials, a path
    here would let a server elsewhere choose where the pipeline writes; S3 goes only through an endpoint that follows
    the rule."""
    from rlhfops.tracking import TrackingUnavailableError, check_artifact_location

    for name in ("MLFLOW_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    if refused is None:
        assert check_artifact_location(location, store) == location
    else:
        with pytest.raises(TrackingUnavailableError, match=refused):
            check_artifact_location(location, store)
    if location.startswith("s3:"):
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://minio.example.com:9000")
        with pytest.raises(TrackingUnavailableError, match=r"\$AWS_ENDPOINT_URL_S3 http://minio.example.com:9000"):
            check_artifact_location(location, store)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9000")
        check_artifact_location(location, store)


def test_a_run_whose_store_names_another_host_for_its_files_logs_nothing_there(tmp_path):
    """An experiment whose artifact location is another host's (a store can be made to hand back any): the stage run
    fails before a param or file is logged, and the client downloads nothing from it."""
    import mlflow

    from rlhfops import tracking

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(overrides=[f"tracking.tracking_uri={uri}", "tracking.experiment=elsewhere"])
    tracking.client(uri).create_experiment("elsewhere", artifact_location="https://evil.example.net/artifacts")
    with pytest.raises(tracking.TrackingUnavailableError, match="evil.example.net.*on another host"):
        with tracking.stage_run(cfg, "validate", ["validate"]):
            pytest.fail("the stage ran")
    (run,) = mlflow.search_runs(experiment_names=["elsewhere"], output_format="list")
    assert run.info.status == "FAILED" and run.data.params == {}
    with pytest.raises(tracking.TrackingUnavailableError, match="on another host"):
        tracking.client(uri).download_artifacts(run.info.run_id, "outputs", str(tmp_path))


@pytest.mark.parametrize(
    "endpoint",
    ["http://127.0.0.1:8000/v1", "http://127.5.6.7/v1", "http://localhost:8000/v1", "http://[::1]:8000/v1"]
    + ["https://api.example.com/v1", "https://10.0.0.5/v1"],
)
def test_https_or_loopback_endpoints_are_accepted(endpoint):
    assert load_config(overrides=[*LLM, f"judge.endpoint={endpoint}"]).judge.endpoint == endpoint


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://10.0.0.5:8000/v1",
        "http://judge.internal/v1",
        "http://user:pw-SECRET-9@127.0.0.1.evil.com/v1?key=k-SECRET-9",
    ],
)
def test_a_plain_http_endpoint_elsewhere_fails_at_load_unless_allowed(endpoint):
    with pytest.raises(
        ConfigError, match=r"judge.endpoint http://[^ ]+ is not https.*judge.allow_plain_http=true"
    ) as err:
        load_config(overrides=[*LLM, f"judge.endpoint={endpoint}"])
    assert "SECRET" not in str(err.value)  # the endpoint named without its credentials
    cfg = load_config(overrides=[*LLM, f"judge.endpoint={endpoint}", "judge.allow_plain_http=true"])
    assert cfg.judge.allow_plain_http


def test_allowing_plain_http_leaves_earlier_runs_digests_as_they_were():
    """Off, the setting is left out of the params digest (tests/test_tracking.py checks every DIGEST_NEUTRAL key);
    on, it is a different configuration."""
    from rlhfops.tracking import DIGEST_NEUTRAL, params_digest

    assert DIGEST_NEUTRAL["judge.allow_plain_http"] is False
    assert params_digest(load_config(overrides=["judge.allow_plain_http=true"])) != params_digest(load_config())


# ---- the Docker build context -------------------------------------------------------------------------------

SECRET_FILES = [".env", ".env.local", "configs/.env.prod", ".dvc/config.local", ".stack/stack.env", "stack.env"]
SECRET_FILES += ["certs/server.pem", "deploy/tls.key", ".netrc", ".git-credentials"]


def ignore_lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def as_docker_pattern(git_pattern: str) -> str:
    """A .gitignore pattern as .dockerignore writes it: Docker matches from the context's root, so a pattern that git
    matches at any depth (no leading or inner `/`) takes `**/`."""
    anchored = "/" in git_pattern.rstrip("/")
    pattern = git_pattern.strip("/")
    return pattern if anchored else f"**/{pattern}"


DOCKER_GLOB = {"**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}


def docker_excludes(rules: list[str], path: str) -> bool:
    """Whether Docker leaves `path` out of the build context: the last rule that matches it or a folder above it
    decides (`!` re-includes); `**` spans folders, `*` and `?` stay within one."""
    excluded = False
    for rule in rules:
        negated, pattern = rule.startswith("!"), rule.lstrip("!")
        parts = re.split(r"(\*\*/|\*\*|\*|\?)", pattern)
        regex = "".join(DOCKER_GLOB.get(part, re.escape(part)) for part in parts)
        if re.fullmatch(rf"{regex}(/.*)?", path):
            excluded = not negated
    return excluded


def test_the_docker_context_leaves_out_what_git_ignores_and_local_secrets():
    docker = ignore_lines(REPO / ".dockerignore")
    missing = [p for p in ignore_lines(REPO / ".gitignore") if as_docker_pattern(p) not in docker]
    assert not missing, f".gitignore patterns .dockerignore lacks: {missing}"
    assert not [f for f in SECRET_FILES if not docker_excludes(docker, f)], docker
    kept = ["params.yaml", ".env.example", "rlhflow/config/params.py", "data/hh-rlhf-harmless/harmless-base.jsonl.gz"]
    assert not [f for f in kept if docker_excludes(docker, f)]
    assert docker_excludes(docker, "rlhflow/__pycache__/config.cpython-311.pyc")


# ---- the team stack's private state (rlhfops/stack_access.py; the stack itself: tests/test_team_stack.py) --------


@pytest.mark.parametrize(
    "text",
    [
        "local all all trust",
        "host all all 127.0.0.1/32 trust  # the old default",
        "host all all 127.0.0.1 255.255.255.255 TRUST",
        'host all all ::1/128 "trust"',
        "host all all 127.0.0.1/32 \\\n    trust",
        "hostssl all all samenet trust clientcert=verify-full",
        "include_dir conf.d",
        "  local   all all trust#no space before the comment",
        # quotes and separators that PostgreSQL reads otherwise than a shell: only double quotes quote, a backslash
        # is part of its field, and only "\\n" ends a line
        "host 'all all' 127.0.0.1/32 trust",
        "host all all\\ 127.0.0.1/32 trust",
        "host all all\v 127.0.0.1/32 trust",
        "host all all\x85 127.0.0.1/32 trust",
    ],
)
def test_a_pg_hba_line_that_trusts_is_found_however_it_is_written(text):
    from rlhfops.stack_access import hba_trust_lines

    hba = f"# TYPE DATABASE USER ADDRESS METHOD\nlocal all all scram-sha-256\n{text}\n"
    assert hba_trust_lines(hba) == [3]


def test_a_database_or_user_called_trust_is_no_trust_rule():
    from rlhfops.stack_access import hba_trust_lines

    hba = "local trust trust scram-sha-256\nhost trust all 127.0.0.1/32 scram-sha-256 # trust no one\n"
    assert hba_trust_lines(hba) == []


def test_a_private_directory_is_made_0700_and_never_adopted_from_someone_else(tmp_path):
    import os

    from rlhfops.stack_access import private_dir

    made = private_dir(tmp_path / "new")
    assert made.stat().st_mode & 0o777 == 0o700
    old = tmp_path / "an-older-stack"
    old.mkdir()
    old.chmod(0o755)
    assert private_dir(old).stat().st_mode & 0o777 == 0o700  # the owner's own: narrowed
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(PermissionError, match="is not a directory owned by"):
        private_dir(tmp_path / "link")  # a symlink planted at the path: not followed
    if os.geteuid() == 0:
        planted = tmp_path / "planted"
        planted.mkdir()
        planted.chmod(0o777)
        os.chown(planted, 65534, 65534)  # made first by another user (nobody)
        with pytest.raises(PermissionError, match="owned by uid 65534"):
            private_dir(planted)
        assert planted.stat().st_mode & 0o777 == 0o777  # refused, left as it was


def started_label_studio(root: Path, monkeypatch) -> dict:
    """`rlhfops.labeling.label_studio` run on `root` up to the start of Label Studio, which is only recorded: the
    keyword arguments it was started with. Stands in for it by making its database as it would, under the umask
    handed to it."""
    import os
    import subprocess

    from rlhfops import labeling

    started: dict = {}

    class Started:
        def __init__(self, cmd, **kwargs):
            started.update(kwargs, data_dir=Path(cmd[cmd.index("--data-dir") + 1]))
            before = os.umask(kwargs.get("umask", 0o022))  # a umask not handed on: the usual one
            try:
                started["data_dir"].mkdir(parents=True, exist_ok=True)
                (started["data_dir"] / "label_studio.sqlite3").write_text("the API token, every label")
            finally:
                os.umask(before)

        def terminate(self):
            pass

        def wait(self, timeout=None):
            return 0

    venv = root.parent / "venv-label"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "label-studio").touch()
    with monkeypatch.context() as patched:
        patched.setattr(subprocess, "Popen", Started)
        patched.setattr(labeling, "wait_until", lambda *args, **kwargs: None)
        with labeling.label_studio(root, 8080, venv=venv):
            pass
    return started


def test_label_studio_keeps_its_token_and_labels_to_its_owner(tmp_path, monkeypatch):
    import os

    root = tmp_path / ".label-studio"
    (root / "data").mkdir(parents=True)  # as an earlier start left them
    root.chmod(0o755)
    (root / "data").chmod(0o755)
    before = os.umask(0o022)
    try:
        started = started_label_studio(root, monkeypatch)
    finally:
        os.umask(before)
    assert started["umask"] == 0o077  # each file Label Studio makes: 0600, each directory 0700
    for private in (root, root / "data"):
        assert private.stat().st_mode & 0o777 == 0o700, private
    for private in ("secrets.json", "label-studio.log", "data/label_studio.sqlite3"):
        assert (root / private).stat().st_mode & 0o777 == 0o600, private


@pytest.mark.system
def test_another_user_reads_neither_label_studios_files_nor_the_labels(monkeypatch):
    """As the user nobody (setpriv: a process of its own), from a directory anyone may enter."""
    import os
    import shutil
    import subprocess
    import tempfile

    from rlhflow.data.feedback import append_records, label_key

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to read as another user")
    shared = Path(tempfile.mkdtemp(prefix="rlhflow-shared-"))
    try:
        shared.chmod(0o755)
        before = os.umask(0o022)
        try:
            started_label_studio(shared / ".label-studio", monkeypatch)
            labels = shared / "feedback" / "labels.jsonl"
            append_records(labels, [{"pair_id": "p", "annotator": "u", "source": "human", "labelled_at": "t"}],
                           key=label_key, private=True)  # fmt: skip
            (shared / "feedback").chmod(0o755)
            (shared / "open.txt").write_text("anyone")
        finally:
            os.umask(before)
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat"]
        assert subprocess.run([*as_nobody, shared / "open.txt"], capture_output=True).returncode == 0  # it can read
        for private in (
            ".label-studio/secrets.json",
            ".label-studio/data/label_studio.sqlite3",
            "feedback/labels.jsonl",
        ):
            read = subprocess.run([*as_nobody, shared / private], capture_output=True)
            assert read.returncode != 0 and not read.stdout, private
    finally:
        shutil.rmtree(shared)
