"""params.yaml's `feedback` section: a round of labels on the policy's own answers (docs/feedback.md)."""

from __future__ import annotations

from pydantic import Field

from rlhflow.config.section import Section


class FeedbackConfig(Section):
    """Where the pairs sent for labelling and the labels read back live, how labelled pairs enter the reward model's
    training, and the labeling tool the pipeline talks to."""

    pairs_file: str = Field(
        "data/feedback/pairs.jsonl",
        description="the answer pairs sent for labelling (appended, never rewritten: every label names one of them)",
    )
    labels_file: str = Field(
        "data/feedback/labels.jsonl",
        description="the labels read back (appended; a DVC dependency of validate): one row per annotator and pair",
    )
    labelled_repeats: int = Field(
        1,
        ge=0,
        le=100,
        description="how many times each labelled pair enters the proxy reward model's training rows beside the "
        "shipped pairs; 0 leaves the labels out",
    )
    n_pairs: int = Field(32, ge=1, description="pairs sampled for one round of labelling (feedback split prompts)")
    max_new_tokens: int = Field(96, ge=1, description="answer length of the sampled pairs, in tokens")
    label_studio_url: str = Field(
        "http://127.0.0.1:8080", description="the Label Studio server (`make label` starts one on this machine)"
    )
    project: str = Field("rlhf-feedback", description="the Label Studio project the pairs go to")
    token_env: str = Field(
        "LABEL_STUDIO_API_KEY",
        description="the environment variable holding the Label Studio API token (read at run time, never logged)",
    )
