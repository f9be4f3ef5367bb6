"""The reward models' MLflow pyfunc wrapper (rlhfops/serving/__init__.py): scores (prompt, response) rows."""

from __future__ import annotations

# The model code (torch, transformers) is imported when MLflow loads a logged model (load_context, predict):
# logging one imports this module and needs none of it.
import mlflow.pyfunc
import pandas as pd
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, Schema

from rlhflow.training.reward_model import RewardModel
from rlhfops.serving import EXAMPLE_PROMPT, EXAMPLE_RESPONSE, chat_messages


class RewardPyfunc(mlflow.pyfunc.PythonModel):
    """Normalised reward of each (prompt, response) row."""

    SIGNATURE = ModelSignature(
        inputs=Schema([ColSpec("string", "prompt"), ColSpec("string", "response")]),
        outputs=Schema([ColSpec("double", "score")]),
    )
    INPUT_EXAMPLE = pd.DataFrame({"prompt": [EXAMPLE_PROMPT], "response": [EXAMPLE_RESPONSE]})

    def load_context(self, context):
        self.rm = RewardModel.load(context.artifacts["model_dir"])

    # a DataFrame hint: MLflow neither warns (no hint) nor infers a schema from it (the signature is SIGNATURE)
    def predict(self, context, model_input: pd.DataFrame, params=None):
        prompts = [chat_messages(p) for p in model_input["prompt"]]
        return [float(x) for x in self.rm.score(prompts, list(model_input["response"]))]
