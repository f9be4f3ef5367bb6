"""A feedback round's data (rlhflow/data/feedback.py), what people's labels say (rlhflow/evaluation/human.py), the
Label Studio client's reading of an export and its errors (rlhfops/labeling.py), and how labelled pairs enter
validate and the reward model's training. The round in a real Label Studio and browser: test_feedback_browser.py."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
from conftest import free_port

from rlhflow.config.params import load_config
from rlhflow.data.feedback import (
    LABEL_FIELDS,
    PAIR_FIELDS,
    FeedbackError,
    append_records,
    check_labels,
    label_key,
    labelled_preferences,
    new_pairs,
    read_records,
    settled,
)
from rlhflow.data.splits import assign_splits
from rlhflow.evaluation.human import agreement_metrics, human_win_metrics, judged_pairs
from rlhfops.labeling import LabelingError, LabelStudio, read_labels
from tasks.pairwise_training import training_rows


def prompts(n: int) -> list[dict]:
    return [
        {"prompt": f"question {i}?", "prompt_messages": [{"role": "user", "content": f"question {i}?"}]}
        for i in range(n)
    ]


def pairs_of(n: int, seed: int = 0) -> list[dict]:
    policy = [f"a short answer {i}" for i in range(n)]
    sft = [f"a much longer answer, with many more words in it, {i}" for i in range(n)]
    return new_pairs(prompts(n), policy, sft, seed=seed, policy_run_id="run1", classes=(["ended"] * n, ["ended"] * n))


def label(pair: str, side: str, who: str = "ann1", at: str = "2026-01-01T00:00:00", source: str = "human") -> dict:
    return {"pair_id": pair, "label": side, "annotator": who, "labelled_at": at, "source": source}


def test_pairs_hide_the_policys_side_and_leave_out_equal_answers():
    pairs = pairs_of(40)
    assert {p["policy_side"] for p in pairs} == {"a", "b"}  # both orders occur
    for p in pairs:
        assert p[f"answer_{p['policy_side']}"].startswith("a short answer")
    assert [p["pair_id"] for p in pairs] == [p["pair_id"] for p in pairs_of(40)]  # ids from the texts alone
    assert [p["policy_side"] for p in pairs] == [p["policy_side"] for p in pairs_of(40)]  # order from the seed
    same = new_pairs(prompts(2), ["x", "y"], ["x", "z"], seed=0, policy_run_id="r")
    assert [p["prompt"] for p in same] == ["question 1?"]
    # each answer's class stays with its side (the labeling page says it above the answer)
    classes = (["ended", "cut"] * 20, ["degenerate", "ended"] * 20)
    answers = [f"answer {i}" for i in range(40)]
    marked = new_pairs(prompts(40), answers, ["other"] * 40, seed=1, policy_run_id="r", classes=classes)
    for i, p in enumerate(marked):
        policy, reference = classes[0][i], classes[1][i]
        assert (p["answer_a_class"], p["answer_b_class"]) == (
            (policy, reference) if p["policy_side"] == "a" else (reference, policy)
        )
        assert p["both_ended"] is False


def test_appending_keeps_every_row_adds_each_once_and_survives_a_restart(tmp_path):
    path = tmp_path / "pairs.jsonl"
    first = pairs_of(3)
    assert append_records(path, first, key=lambda p: p["pair_id"]) == 3
    assert append_records(path, pairs_of(5), key=lambda p: p["pair_id"]) == 2  # a rerun resends nothing
    assert [p["pair_id"] for p in read_records(path, PAIR_FIELDS)] == [p["pair_id"] for p in pairs_of(5)]
    labels = tmp_path / "labels.jsonl"
    append_records(labels, [label(first[0]["pair_id"], "a")], key=label_key)
    assert append_records(labels, [label(first[0]["pair_id"], "a")], key=label_key) == 0
    assert append_records(labels, [label(first[0]["pair_id"], "b", at="2026-01-02")], key=label_key) == 1
    assert len(read_records(labels, LABEL_FIELDS)) == 2


def _append_one_by_one(path: str, start: int, together) -> None:
    together.wait()  # both processes start appending at once
    for i in range(start, start + 150):
        append_records(path, [label(f"p{i}", "a")], key=label_key)


def test_two_processes_appending_at_once_lose_nothing(tmp_path):
    import multiprocessing

    path, ctx = str(tmp_path / "labels.jsonl"), multiprocessing.get_context("spawn")
    together = ctx.Barrier(2)
    procs = [ctx.Process(target=_append_one_by_one, args=(path, s, together)) for s in (0, 150)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert sorted(x["pair_id"] for x in read_records(path, LABEL_FIELDS)) == sorted(f"p{i}" for i in range(300))


def test_unreadable_rows_and_foreign_labels_are_named(tmp_path):
    path = tmp_path / "labels.jsonl"
    path.write_text(json.dumps(label("p", "a")) + "\nnot json\n" + json.dumps({"pair_id": "p"}) + "\n")
    unreadable = r"line 2: not JSON \(Expecting value\); line 3: no label, annotator, labelled_at, source"
    with pytest.raises(FeedbackError, match=unreadable):
        read_records(path, LABEL_FIELDS)
    assert read_records(tmp_path / "missing.jsonl", LABEL_FIELDS) == []
    pairs = pairs_of(2)
    with pytest.raises(FeedbackError, match=r"row 2: pair 'forged' was never sent"):
        check_labels([label(pairs[0]["pair_id"], "a"), label("forged", "a")], pairs)
    with pytest.raises(FeedbackError, match=r"row 1: label 'better' is not one of a, b, tie, skip"):
        check_labels([label(pairs[0]["pair_id"], "better")], pairs)


def test_what_labels_settle_ties_skips_conflicts_and_relabelling():
    labels = [
        label("p1", "a"),
        label("p1", "tie", who="ann2"),  # a tie does not oppose a side
        label("p2", "a"),
        label("p2", "b", who="ann2"),  # two annotators, two sides: a conflict
        label("p3", "tie"),
        label("p3", "skip", who="ann2"),
        label("p4", "skip"),
        label("p5", "a", at="2026-01-01"),
        label("p5", "b", at="2026-01-02"),  # the same annotator changed their mind: the latest counts
    ]
    assert settled(labels) == {"p1": "a", "p2": "conflict", "p3": "tie", "p4": "skip", "p5": "b"}


def test_labelled_pairs_become_preferences_with_their_provenance():
    pairs = pairs_of(4)
    ids = [p["pair_id"] for p in pairs]
    labels = [label(ids[0], "a"), label(ids[1], "b", source="ai"), label(ids[2], "tie")]
    rows, counts = labelled_preferences(pairs, labels)
    assert list(rows["pair_id"]) == ids[:2]
    assert list(rows["chosen"]) == [pairs[0]["answer_a"], pairs[1]["answer_b"]]
    assert list(rows["rejected"]) == [pairs[0]["answer_b"], pairs[1]["answer_a"]]
    assert list(rows["source_row"]) == [1, 2] and list(rows["label_source"]) == ["human", "ai"]
    assert counts == {
        "tie": 1.0,
        "skip": 0.0,
        "conflict": 0.0,
        "pairs_sent": 4.0,
        "labels": 3.0,
        "labelled_pairs": 2.0,
        "unlabelled": 1.0,
    }


def test_people_as_the_judge_win_rate_and_the_instruments_agreement():
    pairs = pairs_of(60)
    # people prefer the policy's (shorter) answer on 45 pairs, the SFT model's on 10, and call 5 a tie
    verdicts = ["policy"] * 45 + ["sft"] * 10 + ["tie"] * 5
    labels = []
    for p, v in zip(pairs, verdicts):
        other = "b" if p["policy_side"] == "a" else "a"
        labels.append(label(p["pair_id"], {"policy": p["policy_side"], "sft": other, "tie": "tie"}[v]))
    sft_side = {p["pair_id"]: "b" if p["policy_side"] == "a" else "a" for p in pairs}
    ai = [label(i, side, who="judge:llm:0", source="ai") for i, side in sft_side.items()]  # not the people's
    judged = judged_pairs(pairs, labels + ai)
    metrics = human_win_metrics(judged)
    assert metrics["feedback/human_win_rate_vs_sft"] == pytest.approx((45 + 2.5) / 60)
    assert metrics["feedback/human_win_rate_ci_low"] < metrics["feedback/human_win_rate_vs_sft"]
    assert metrics["feedback/human_win_rate_both_ended"] == pytest.approx((45 + 2.5) / 60)
    assert metrics["feedback/human_judged_pairs"] == 60 and metrics["feedback/human_ties"] == 5
    assert "feedback/human_win_rate_lc" in metrics
    # the shorter answer is the policy's every time: the length rule agrees with people on the 45 of 55 decided
    judge_prefers_a = np.array([1.0 if p["policy_side"] == "a" else 0.0 for p, _ in judged])  # the policy, always
    agree = agreement_metrics(judged, judge_prefers_a)
    assert agree["feedback/decided_pairs"] == 55
    assert agree["feedback/length_rule_agreement"] == pytest.approx(45 / 55)
    assert agree["feedback/judge_agreement"] == pytest.approx(45 / 55)
    assert agree["feedback/judge_minus_length_rule"] == pytest.approx(0.0)
    assert "feedback/judge_agreement" not in agreement_metrics(judged, None)


EXPORT = [
    {
        "data": {"pair_id": "p1"},
        "annotations": [
            {
                "completed_by": 3,
                "updated_at": "t1",
                "result": [
                    {"from_name": "preference", "value": {"choices": ["B is better"]}},
                    {"from_name": "comment", "value": {"text": ["clearer"]}},
                ],
            }
        ],
    },
    {
        "data": {"pair_id": "p2"},
        "annotations": [{"completed_by": 3, "updated_at": "t2", "was_cancelled": True, "result": []}],
    },
    {"data": {"pair_id": "p3"}, "annotations": []},  # not labelled yet (a draft is not an annotation)
]


def test_a_label_studio_export_reads_as_labels_and_pairs_waiting():
    labels, waiting, refused = read_labels(EXPORT)
    assert [(x["pair_id"], x["label"], x["comment"]) for x in labels] == [("p1", "b", "clearer"), ("p2", "skip", "")]
    assert {x["annotator"] for x in labels} == {"label-studio-user-3"}  # an id, no name or e-mail
    assert waiting == ["p3"] and refused == []


def test_a_labeling_tool_that_is_down_is_named():
    with pytest.raises(LabelingError, match=r"is not reachable .*make label"):
        LabelStudio(f"http://127.0.0.1:{free_port()}", "token", timeout=5).tasks(1)


def test_the_feedback_split_is_cut_from_training_conversations_only():
    df = pd.DataFrame({"prompt": [f"q{i}" for i in range(400)], "chosen": ["c"] * 400, "rejected": ["r"] * 400})
    without = assign_splits(df, test_fraction=0.1, dev_fraction=0.1, judge_fraction=0.25, seed=0)
    with_feedback = assign_splits(
        df, test_fraction=0.1, dev_fraction=0.1, judge_fraction=0.25, feedback_fraction=0.1, seed=0
    )
    for split in ("judge", "dev", "test"):  # the held-out splits do not move
        assert with_feedback[split].equals(without[split])
    train, feedback = set(with_feedback["train"]["prompt"]), set(with_feedback["feedback"]["prompt"])
    assert train | feedback == set(without["train"]["prompt"]) and not train & feedback
    assert 20 <= len(feedback) <= 60  # about 10% of 400


def test_labelled_pairs_join_the_reward_models_training_rows_as_set(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": "c", "rejected": "r"}) + "\n" for i in range(5)))
    rows, files, labelled = training_rows(train, labelled_repeats=3, main_process=False)
    assert (len(rows), files, labelled) == (5, [train], 0)  # no labels yet
    (tmp_path / "labelled.jsonl").write_text(json.dumps({"prompt": "x", "chosen": "c2", "rejected": "r2"}) + "\n")
    rows, files, labelled = training_rows(train, labelled_repeats=3, main_process=False)
    assert (len(rows), labelled, files[-1].name) == (8, 1, "labelled.jsonl")
    assert len(training_rows(train, labelled_repeats=0, main_process=False)[0]) == 5


def test_labels_on_a_held_out_conversation_are_refused_by_validate(tmp_path):
    from tasks.validate import read_labelled

    pairs, labels = tmp_path / "pairs.jsonl", tmp_path / "labels.jsonl"
    sent = pairs_of(3)
    append_records(pairs, sent, key=lambda p: p["pair_id"])
    append_records(labels, [label(p["pair_id"], "a") for p in sent], key=label_key)
    cfg = load_config(overrides=[f"feedback.pairs_file={pairs}", f"feedback.labels_file={labels}"])
    train = pd.DataFrame({"prompt": ["question 0?"], "chosen": ["c"], "rejected": ["r"]})
    rows, counts = read_labelled(cfg, {"train": train, "test": train.assign(prompt="other")})
    assert len(rows) == 3 and counts["labelled_pairs"] == 3
    with pytest.raises(FeedbackError, match=r"2 labelled pair\(s\) from a held-out conversation .* rows \[2, 3\]"):
        read_labelled(
            cfg,
            {"train": train, "dev": train.assign(prompt=["question 1?"]), "test": train.assign(prompt=["question 2?"])},
        )


def test_the_feedback_fraction_leaves_training_data():
    with pytest.raises(ValueError, match="validate.feedback_fraction"):
        load_config(overrides=["validate.judge_fraction=0.5", "validate.feedback_fraction=0.4"])


def test_a_pair_changed_after_it_was_sampled_keeps_no_label():
    """A pair's id is recomputed from its texts: a prompt edited in the pairs file (into a held-out conversation,
    say) no longer matches the pair that was labelled, and nothing is read."""
    pairs = pairs_of(3)
    labels = [label(p["pair_id"], "a") for p in pairs]
    assert len(labelled_preferences(pairs, labels)[0]) == 3
    pairs[1]["prompt"] += " (edited)"
    with pytest.raises(FeedbackError, match=r"1 pair\(s\) whose id is not their texts' .*: row 2: pair"):
        labelled_preferences(pairs, labels)


def hostile_export(sent: list[dict]) -> list[dict]:
    """What anyone who can label can make Label Studio export: a comment with line separators, one of many
    megabytes, choices and comments of other shapes, a user given as an object with an e-mail; and tasks of other
    shapes. The first annotation is a good one."""

    def annotation(ident: int, choices: object = ("A is better",), text: object = ("fine",), user: object = 3) -> dict:
        result = [
            {"from_name": "preference", "value": {"choices": list(choices) if isinstance(choices, tuple) else choices}}
        ]
        return {
            "id": ident,
            "completed_by": user,
            "updated_at": f"t{ident}",
            "result": result
            + [{"from_name": "comment", "value": {"text": list(text) if isinstance(text, tuple) else text}}],
        }

    pair = sent[0]["pair_id"]
    annotations = [
        annotation(1, text=("one\u2028two\u2029three\x85four\x1cfive",)),
        annotation(2, text=("x" * (8 << 20),)),  # 8 million characters
        annotation(3, choices="A is better"),
        annotation(4, choices=["Best"]),
        annotation(5, text="not a list"),
        annotation(6, user={"email": "someone@example.org"}),
        {"id": 7, "result": {"from_name": "preference"}},
        "not an annotation",
    ]
    return [
        {"id": 10, "data": {"pair_id": pair}, "annotations": annotations},
        {"id": 11, "data": {"pair_id": ["a", "list"]}, "annotations": []},
        {"id": 12, "data": "no object"},
        "not a task",
    ]


def test_hostile_annotations_are_named_and_left_out_and_the_rest_read():
    labels, waiting, refused = read_labels(hostile_export(pairs_of(1)))
    assert [x["comment"] for x in labels] == ["one\u2028two\u2029three\x85four\x1cfive"]
    assert waiting == []
    expected = [
        r"task 10 \(export entry 1\), annotation 2: its comment \(8388608 characters\) is not a text of at most 10000",
        r"task 10 .*, annotation 3: its choice 'A is better' is not one of 'A is better', 'B is better', 'Tie'",
        r"task 10 .*, annotation 4: its choice \['Best'\] is not one of",
        r"task 10 .*, annotation 5: its comment 'not a list' is not a list of texts",
        r"task 10 .*, annotation 6: its user \(a dict\) is not a Label Studio user id",
        r"task 10 .*, annotation 7: its result is not a list of objects",
        r"task 10 .*, annotation None: its result is not a list of objects",
        r"task 11 \(export entry 2\): its pair_id \['a', 'list'\] is not a text",
        r"task 12 \(export entry 3\): its pair_id None is not a text",
        r"task None \(export entry 4\): its pair_id None is not a text",
    ]
    assert len(refused) == len(expected)
    for problem, pattern in zip(refused, expected):
        assert re.match(pattern, problem), problem
    assert max(len(p) for p in refused) < 300  # a hostile value is named by an excerpt, never whole
    assert not any("someone@example.org" in p for p in refused)  # nor a person's e-mail


def test_collect_keeps_the_good_labels_of_a_hostile_export_private_and_readable_and_collects_again(
    tmp_path, monkeypatch
):
    import os
    import stat

    from rlhfops import tracking
    from tasks import feedback

    pairs = pairs_of(2)
    pairs_file, labels_file = tmp_path / "pairs.jsonl", tmp_path / "labels.jsonl"
    append_records(pairs_file, pairs, key=lambda p: p["pair_id"])
    cfg = load_config(None, [f"feedback.pairs_file={pairs_file}", f"feedback.labels_file={labels_file}"])
    export = hostile_export(pairs)
    # a task the pipeline never sent (made in Label Studio): left out, not a failure of every collect
    export.append(
        {
            "id": 14,
            "data": {"pair_id": "made-in-label-studio"},
            "annotations": [
                {
                    "id": 21,
                    "completed_by": 4,
                    "updated_at": "t21",
                    "result": [
                        {"from_name": "preference", "value": {"choices": ["A is better"]}},
                    ],
                }
            ],
        }
    )

    class Server:
        def project(self, title):
            return 1

        def tasks(self, project):
            return export

    monkeypatch.setattr(feedback, "label_studio", lambda cfg: Server())
    monkeypatch.setattr(tracking, "log_dataset", lambda *a, **k: None)
    monkeypatch.setattr(feedback, "judge_prefers_a", lambda cfg, judged: None)
    before = os.umask(0o022)
    try:
        first = feedback.collect(cfg)
        assert stat.S_IMODE(labels_file.stat().st_mode) == 0o600  # people's labels: the owner's alone
        export.append({"id": 13, "data": {"pair_id": pairs[1]["pair_id"]}, "annotations": [
            {"id": 20, "completed_by": 4, "updated_at": "t20", "result": [
                {"from_name": "preference", "value": {"choices": ["Tie"]}},
            ]}
        ]})  # fmt: skip
        second = feedback.collect(cfg)  # the file the first wrote reads back: a later collect still works
    finally:
        os.umask(before)
    assert (first["feedback/labels_added"], first["feedback/annotations_refused"]) == (1, 11)
    assert (second["feedback/labels_added"], second["feedback/labels"]) == (1, 2)
    lines = labels_file.read_text(encoding="utf-8").splitlines()  # every line break Python knows
    assert len(lines) == 2 and all(json.loads(line) for line in lines)
    assert read_records(labels_file, LABEL_FIELDS)[0]["comment"] == "one\u2028two\u2029three\x85four\x1cfive"
    assert stat.S_IMODE(labels_file.stat().st_mode) == 0o600


def test_a_record_past_the_readers_line_bound_is_refused_before_anything_is_written(tmp_path):
    from rlhflow.data.readers import MAX_LINE_BYTES

    path = tmp_path / "labels.jsonl"
    append_records(path, [label("p1", "a")], key=label_key)
    before = path.read_bytes()
    huge = label("p2", "a") | {"comment": "x" * MAX_LINE_BYTES}
    with pytest.raises(
        FeedbackError, match=r"labels.jsonl: the record \('p2', .* is longer than the readers' MAX_LINE_BYTES"
    ):
        append_records(path, [label("p3", "b"), huge], key=label_key)
    assert path.read_bytes() == before
    assert append_records(path, [label("p3", "b")], key=label_key) == 1
    assert [x["pair_id"] for x in read_records(path, LABEL_FIELDS)] == ["p1", "p3"]


def test_a_step_whose_tracking_store_cannot_be_reached_fails_with_a_line_not_a_traceback(capsys):
    """`python -m tasks.feedback collect` with the tracking server down: one paragraph naming the store, exit 1."""
    from tasks.feedback import main

    with pytest.raises(SystemExit) as failed:
        main(["collect", "--set", "tracking.tracking_uri=http://127.0.0.1:9"])  # the discard port: nothing listens
    assert str(failed.value).startswith("\nfeedback collect failed: ") and "127.0.0.1:9" in str(failed.value)
