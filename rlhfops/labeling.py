"""The labeling tool: Label Studio, talked to over its REST API, and started on this machine by `make label`.

    python -m rlhfops.labeling serve [--root .label-studio] [--port 8080]   # `make label`; Ctrl-C stops it

Label Studio runs in its own venv (.venv-label: its Django stack pins versions the pipeline's packages do not
share), binds 127.0.0.1 only, has sign-up switched off, and has one admin whose password and API token are made on
the first start and kept in ROOT/secrets.json (mode 0600); clients read the token from $LABEL_STUDIO_API_KEY
(`source ROOT/label.env`). The project shows the prompt and two answers and asks which is better (A, B, a tie), or Skip.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from rlhflow.config import credentials
from rlhflow.config.credentials import readings
from rlhflow.config.params import REPO_ROOT
from rlhflow.data.errors import excerpt
from rlhflow.data.replies import PastBoundsError, read_within
from rlhflow.redaction import redact_url, redact_urls
from rlhfops.stack import http_ok, wait_until
from rlhfops.stack_access import PRIVATE_UMASK, private_dir, private_opener, write_private

HOST = "127.0.0.1"
LABEL_VENV = REPO_ROOT / ".venv-label"
ADMIN = "admin@rlhflow.local"  # Label Studio's users are e-mail addresses; no mail is ever sent
CHOICES = {"A is better": "a", "B is better": "b", "Tie": "tie"}  # and Label Studio's own Skip button: "skip"
# A light door: pandas, through rlhflow.data.feedback, is imported where an annotation is read, so `make label` and a
# feedback step's --help answer before it loads.

# The pairwise page: the conversation, then the two answers side by side (each under a line that says whether it ended,
# was cut at the answer limit or loops), one choice of three as radio buttons, and the pair's place in the round.
LABEL_CONFIG = """<View>
  <Header value="$progress" size="6"/>
  <Header value="Conversation" size="5"/>
  <Text name="prompt" value="$prompt_text"/>
  <View style="display: flex; gap: 2em; align-items: flex-start">
    <View style="flex: 1; min-width: 0">
      <Header value="Answer A" size="5"/>
      <Header value="$answer_a_state" size="6" underline="true"/>
      <Text name="answer_a" value="$answer_a"/>
    </View>
    <View style="flex: 1; min-width: 0">
      <Header value="Answer B" size="5"/>
      <Header value="$answer_b_state" size="6" underline="true"/>
      <Text name="answer_b" value="$answer_b"/>
    </View>
  </View>
  <Header value="Which answer is better?" size="5"/>
  <Choices name="preference" toName="prompt" choice="single-radio" showInline="true" required="true">
    <Choice value="A is better" hotkey="1"/>
    <Choice value="B is better" hotkey="2"/>
    <Choice value="Tie" hotkey="3"/>
  </Choices>
  <TextArea name="comment" toName="prompt" placeholder="Comment (optional)" maxSubmissions="1"/>
</View>"""

# what the page says above an answer, by its class (rlhflow.evaluation.answers); a pair sampled without classes: nothing
ANSWER_STATES = {
    "ended": "It ended.",
    "cut": "Cut at the answer limit: it did not end.",
    "degenerate": "It loops: it repeats itself.",
}


class LabelingError(RuntimeError):
    """The labeling tool is down, refuses the token, or answers what the pipeline cannot read."""


def prompt_text(messages: Sequence[dict]) -> str:
    """A conversation as the annotator reads it: one paragraph per turn, led by the speaker."""
    return "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages if m.get("role") != "system")


def same_origin(url: str, other: str) -> bool:
    """Whether two URLs name one scheme, host and port, as every client reads them (credentials.readings)."""
    try:
        here, there = readings(url), readings(other)
    except ValueError:
        return False
    return len(here) == 1 and here == there


class SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """urllib re-sends every header, the token's among them, to wherever a redirect points: follow one only to the
    same scheme, host and port (a trailing slash Label Studio adds), refuse any other with LabelingError."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not same_origin(req.full_url, newurl):
            raise LabelingError(
                f"Label Studio at {redact_url(req.full_url)} redirected {req.get_method()} (HTTP {code}) to "
                f"{redact_url(newurl)}, another host, port or scheme: the API token is sent nowhere but "
                "feedback.label_studio_url, so the request was not repeated there"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


OPENER = urllib.request.build_opener(SameOriginRedirects)
# A reply of Label Studio's, bounded before it is read whole: an export of every task of a feedback round is a few MB
MAX_REPLY_BYTES = 256 * 2**20
MAX_REPLY_SECONDS = 300.0


@dataclass
class LabelStudio:
    """One Label Studio server, as the pipeline uses it: a project, the pairs sent to it, the labels read back."""

    url: str
    token: str
    timeout: float = 30.0  # seconds per read
    allow_plain_http: bool = False  # feedback.allow_plain_http: the token may go to http elsewhere

    def __post_init__(self):
        """Built only for a URL the token may go to (rlhflow/config/credentials.py), whoever builds it."""
        what, lift = "the API token and every pair", "feedback.allow_plain_http"
        problem = credentials.transport_problem(
            "feedback.label_studio_url", self.url, what, lift, lifted=self.allow_plain_http
        )
        if not problem and credentials.scheme_and_host(self.url)[0] not in ("http", "https"):
            problem = f"feedback.label_studio_url {redact_url(self.url)!r} is not an http(s) URL"
        if problem:
            raise LabelingError(problem)
        self.shown = redact_url(self.url)  # what errors name: no user info, no query

    def request(self, method: str, path: str, body: object = None) -> object:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url.rstrip('/')}{path}", data=data, method=method)
        req.add_header("Authorization", f"Token {self.token}")
        req.add_header("Content-Type", "application/json")
        try:
            with OPENER.open(req, timeout=self.timeout) as response:
                answer = self._bounded_reply(response, f"{method} {path}")
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                raise LabelingError(f"Label Studio at {self.shown} refused the API token (HTTP {e.code})") from None
            detail = redact_urls(e.read(500).decode(errors="replace"))
            raise LabelingError(f"Label Studio at {self.shown}: {method} {path}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = redact_urls(str(getattr(e, "reason", e)))
            raise LabelingError(
                f"Label Studio at {self.shown} is not reachable ({reason}): start it with `make label`"
            ) from None
        try:
            return json.loads(answer or b"null")
        except (ValueError, RecursionError) as e:  # not JSON, or nested past Python's recursion limit
            raise LabelingError(
                f"Label Studio at {self.shown}: {method} {path}: answered what is no JSON to read ({type(e).__name__})"
            ) from None

    def _bounded_reply(self, response, what: str) -> bytes:
        """The reply's body, read as it arrives: at most MAX_REPLY_BYTES, within MAX_REPLY_SECONDS in all (a server
        that trickles a byte per read timeout is cut off too)."""
        try:
            return read_within(iter(lambda: response.read1(2**16), b""), MAX_REPLY_BYTES, MAX_REPLY_SECONDS)
        except PastBoundsError as err:
            raise LabelingError(f"Label Studio at {self.shown}: {what}: the reply {err}; not read") from None

    def project(self, title: str) -> int:
        """The id of the project called `title`, made with the pairwise interface if there is none."""
        listing = self.request("GET", f"/api/projects/?title={urllib.request.quote(title)}&page_size=100")
        for project in listing.get("results", []) if isinstance(listing, dict) else []:
            if project.get("title") == title:
                return int(project["id"])
        made = self.request("POST", "/api/projects/", {"title": title, "label_config": LABEL_CONFIG})
        return int(made["id"])

    def tasks(self, project: int) -> list[dict]:
        """Every task of the project with its annotations (Label Studio's JSON export)."""
        tasks = self.request("GET", f"/api/projects/{project}/export?exportType=JSON&download_all_tasks=true")
        if not isinstance(tasks, list):
            raise LabelingError(f"Label Studio at {self.shown}: the export of project {project} is not a list")
        return tasks

    def send(self, project: int, pairs: Sequence[dict]) -> int:
        """Import the pairs the project does not hold yet (by pair_id), each with its place among `pairs` ("Pair 3
        of 32") and what ended, was cut or loops; returns how many were sent."""
        held = {t.get("data", {}).get("pair_id") for t in self.tasks(project)}
        new = [
            {
                "data": {
                    "pair_id": p["pair_id"],
                    "progress": f"Pair {i} of {len(pairs)}",
                    "prompt_text": prompt_text(p["prompt_messages"]),
                    "answer_a": p["answer_a"],
                    "answer_b": p["answer_b"],
                    "answer_a_state": ANSWER_STATES.get(p.get("answer_a_class"), ""),
                    "answer_b_state": ANSWER_STATES.get(p.get("answer_b_class"), ""),
                }
            }
            for i, p in enumerate(pairs, start=1)
            if p["pair_id"] not in held
        ]
        if new:
            self.request("POST", f"/api/projects/{project}/import", new)
        return len(new)


class RefusedAnnotation(ValueError):
    """An annotation, or a task, of another shape than the pairwise page makes; the message says what is wrong."""


def _choice(value: dict) -> str:
    choices = value["choices"]
    if not (isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], str) and choices[0] in CHOICES):
        raise RefusedAnnotation(f"its choice {excerpt(choices)} is not one of {', '.join(map(repr, CHOICES))}")
    return CHOICES[choices[0]]


def _comment(value: dict) -> str:
    text = value["text"]
    if not (isinstance(text, list) and all(isinstance(part, str) for part in text)):
        raise RefusedAnnotation(f"its comment {excerpt(text)} is not a list of texts")
    return " ".join(text)


def _annotator(annotation: dict) -> str:
    """Label Studio's user id (an export may give the user as an object: only its id is kept, never a name or
    e-mail)."""
    user = annotation.get("completed_by")
    user = user.get("id") if isinstance(user, dict) else user
    if not isinstance(user, int) or isinstance(user, bool):
        kind = type(annotation.get("completed_by")).__name__  # not the value: it may hold a name or an e-mail
        raise RefusedAnnotation(f"its user (a {kind}) is not a Label Studio user id with an integer id")
    return f"label-studio-user-{user}"


def annotation_label(pair: str, annotation: dict) -> dict | None:
    """One Label Studio annotation as a label record (None for a draft without a choice). A cancelled (skipped)
    annotation is a skip; the annotator is Label Studio's user id, nothing more about the person. An annotation of
    another shape raises RefusedAnnotation, and so does a label rlhflow.data.feedback.label_problem refuses (an
    overlong comment)."""
    from rlhflow.data.feedback import label_problem  # pandas: not for `make label` or a step's --help

    results = (annotation.get("result") or []) if isinstance(annotation, dict) else None
    if not isinstance(results, list) or not all(
        isinstance(r, dict) and isinstance(r.get("value"), dict) for r in results
    ):
        raise RefusedAnnotation("its result is not a list of objects, each with a value object")
    choice, comment = None, ""
    for result in results:
        if result.get("from_name") == "preference" and result["value"].get("choices"):
            choice = _choice(result["value"])
        elif result.get("from_name") == "comment" and result["value"].get("text"):
            comment = _comment(result["value"])
    if annotation.get("was_cancelled"):
        choice = "skip"
    if choice is None:
        return None
    label = {
        "pair_id": pair,
        "label": choice,
        "annotator": _annotator(annotation),
        "labelled_at": annotation.get("updated_at") or annotation.get("created_at"),
        "source": "human",
        "comment": comment,
    }
    problem = label_problem(label)
    if problem:
        raise RefusedAnnotation(problem)
    return label


def _task_pair(task: object) -> tuple[str, list]:
    """A task's pair id and annotations; RefusedAnnotation for a task of another shape."""
    data = task.get("data") if isinstance(task, dict) else None
    pair = data.get("pair_id") if isinstance(data, dict) else None
    if not isinstance(pair, str):
        raise RefusedAnnotation(f"its pair_id {excerpt(pair)} is not a text")
    annotations = task.get("annotations") or []
    if not isinstance(annotations, list):
        raise RefusedAnnotation("its annotations are not a list")
    return pair, annotations


def read_labels(tasks: Sequence[dict]) -> tuple[list[dict], list[str], list[str]]:
    """The labels in an export, the pair ids still waiting for one, and what was refused: each task or annotation
    of another shape, named by its id (task 12, annotation 40) and what is wrong, left out and the rest read."""
    labels, waiting, refused = [], [], []
    for number, task in enumerate(tasks, start=1):
        where = f"task {excerpt(task.get('id') if isinstance(task, dict) else None)} (export entry {number})"
        try:
            pair, annotations = _task_pair(task)
        except RefusedAnnotation as why:
            refused.append(f"{where}: {why}")
            continue
        own = []
        for annotation in annotations:
            try:
                label = annotation_label(pair, annotation)
            except RefusedAnnotation as why:
                ident = annotation.get("id") if isinstance(annotation, dict) else None
                refused.append(f"{where}, annotation {excerpt(ident)}: {why}")
                continue
            own += [label] if label is not None else []
        labels += own
        if not own:
            waiting.append(pair)
    return labels, waiting, refused


# ---- the server --------------------------------------------------------------------------------------------------


def load_secrets(root: Path) -> dict[str, str]:
    """ROOT/secrets.json: the admin's password and API token, made on the first start."""
    path = root / "secrets.json"
    if path.exists():
        return json.loads(path.read_text())
    made = {"password": secrets.token_urlsafe(18), "token": secrets.token_hex(20)}
    write_private(private_dir(root) / path.name, json.dumps(made))  # its directory the owner's alone, as at start
    return made


def server_env(root: Path, made: dict[str, str]) -> dict[str, str]:
    """Label Studio's settings: its data in ROOT, no sign-up, the admin and token of ROOT/secrets.json (in the
    environment, not on the command line, where `ps` would show them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LABEL_STUDIO_", "DJANGO_"))}
    return env | {
        "LABEL_STUDIO_BASE_DATA_DIR": str(root),
        "LABEL_STUDIO_USERNAME": ADMIN,
        "LABEL_STUDIO_PASSWORD": made["password"],
        "LABEL_STUDIO_USER_TOKEN": made["token"],
        "LABEL_STUDIO_DISABLE_SIGNUP_WITHOUT_LINK": "true",
    }


@contextlib.contextmanager
def label_studio(root: Path, port: int, venv: Path = LABEL_VENV, timeout: float = 300) -> Iterator[LabelStudio]:
    """A Label Studio server on 127.0.0.1:`port` with its data in `root`, stopped on exit. Its database holds the
    API token and every label: `root` and its data directory are mode 0700 (an existing one narrowed), and Label
    Studio runs with umask 077, so each file it makes is its owner's alone from the start."""
    executable = venv / "bin" / "label-studio"
    if not executable.exists():
        raise LabelingError(f"{executable} is missing: `make label` builds the labeling venv")
    root = root.resolve()
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = private_dir(private_dir(root) / "data")
    except PermissionError as err:
        raise LabelingError(str(err)) from None
    made = load_secrets(root)
    log = root / "label-studio.log"
    cmd = [str(executable), "start", "--no-browser", "--internal-host", HOST, "--port", str(port)]
    cmd += ["--data-dir", str(data), "--enable-legacy-api-token"]
    with open(log, "ab", opener=private_opener) as out:
        proc = subprocess.Popen(
            cmd, env=server_env(root, made), stdout=out, stderr=subprocess.STDOUT, umask=PRIVATE_UMASK
        )
    url = f"http://{HOST}:{port}"
    try:
        wait_until("Label Studio", lambda: http_ok(f"{url}/health"), timeout, proc, log, error=LabelingError)
        yield LabelStudio(url, made["token"])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhfops.labeling serve", description=__doc__)
    parser.add_argument("--root", type=Path, default=REPO_ROOT / ".label-studio")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    with label_studio(args.root, args.port) as server:
        env_file = write_private(args.root / "label.env", f"export LABEL_STUDIO_API_KEY={server.token}\n")
        print(f"Label Studio at {server.url} (user {ADMIN}, password in {args.root / 'secrets.json'})", flush=True)
        print(f"clients: source {env_file}; Ctrl-C stops it", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):  # `serve --help` lists serve's options
        print(__doc__.strip())
        return
    if argv[:1] != ["serve"]:
        sys.exit("usage: python -m rlhfops.labeling serve [--root DIR] [--port PORT]")
    serve(argv[1:])


if __name__ == "__main__":
    main()
