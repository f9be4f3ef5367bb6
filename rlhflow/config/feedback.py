"""params.yaml's `feedback` section: a round of labels on the policy's own answers (docs/feedback.md)."""

from __future__ import annotations

from pydantic import Field, model_validator

from rlhflow.config import credentials
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
        "http://127.0.0.1:8080",
        description="the Label Studio server (`make label` starts one on this machine): https, or http on this "
        "machine, unless feedback.allow_plain_http",
    )
    project: str = Field("rlhf-feedback", description="the Label Studio project the pairs go to")
    token_env: str = Field(
        "LABEL_STUDIO_API_KEY",
        description="the environment variable holding the Label Studio API token (read at run time, never logged): "
        "LABEL_STUDIO_..._API_KEY or LABEL_STUDIO_..._TOKEN, no other credential (rlhflow/config/credentials.py)",
    )
    allow_plain_http: bool = Field(
        False,
        description="let an http:// label_studio_url on another host than this one receive the token, the pairs "
        "and the labels unencrypted; off: such a URL fails at config load",
    )

    @model_validator(mode="after")
    def _the_token_goes_only_where_it_belongs(self) -> FeedbackConfig:
        problem = credentials.variable_problem("feedback.token_env", self.token_env, credentials.LABEL_STUDIO)
        if not problem:
            what = f"the API token (${self.token_env}), the pairs and the labels"
            problem = credentials.transport_problem(
                "feedback.label_studio_url",
                self.label_studio_url,
                what,
                "feedback.allow_plain_http",
                lifted=self.allow_plain_http,
            )
        if problem:
            raise ValueError(problem)
        return self
