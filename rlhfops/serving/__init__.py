"""MLflow pyfunc wrappers, so the logged models load and predict anywhere with `mlflow.pyfunc.load_model`:

policy = mlflow.pyfunc.load_model("models:/rlhf-policy@candidate")
policy.predict(pd.DataFrame({"prompt": ["How do I boil an egg?"]}))           # -> list of responses
rm = mlflow.pyfunc.load_model("models:/rlhf-reward-model@candidate")
rm.predict(pd.DataFrame({"prompt": [...], "response": [...]}))                 # -> list of rewards

One module per wrapper (`serving.policy.PolicyPyfunc`, `serving.reward.RewardPyfunc`), each with its `SIGNATURE`
and `INPUT_EXAMPLE`; a stage hands its class to `rlhfops.registry.log_model_dir`. This package imports neither, so
logging a reward model does not load the policy code, nor the other way round.
"""

from __future__ import annotations


def chat_messages(prompt: str) -> list[dict[str, str]]:
    """A prompt as the one-turn conversation the models are prompted with."""
    return [{"role": "user", "content": prompt}]


# what the input examples send: MLflow runs each logged model on its example before registering it
EXAMPLE_PROMPT = "How do I boil an egg?"
EXAMPLE_RESPONSE = "Simmer it for nine minutes, then cool it in cold water."
