"""The policy's MLflow pyfunc wrapper (rlhfops/serving/__init__.py): generates a response per prompt."""

from __future__ import annotations

# The model code (torch, transformers) is imported when MLflow loads a logged model (load_context, predict):
# logging one imports this module and needs none of it.
import mlflow.pyfunc
import pandas as pd
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

from rlhflow.models.loading import load_causal_lm, load_tokenizer
from rlhflow.models.sampling import sample_responses
from rlhfops.serving import EXAMPLE_PROMPT, chat_messages


class PolicyPyfunc(mlflow.pyfunc.PythonModel):
    """Generates a response per prompt (params: max_new_tokens, temperature, ...: `PARAMS`)."""

    # predict's params and their defaults: MLflow passes on only the params a signature declares
    PARAMS = ParamSchema(
        [
            ParamSpec("batch_size", "long", 16),
            ParamSpec("max_prompt_length", "long", 512),
            ParamSpec("max_new_tokens", "long", 64),
            ParamSpec("temperature", "double", 0.7),
            ParamSpec("seed", "long", None),
        ]
    )
    SIGNATURE = ModelSignature(
        inputs=Schema([ColSpec("string", "prompt")]), outputs=Schema([ColSpec("string", "response")]), params=PARAMS
    )
    # MLflow runs the logged model on its example before registering it: a few tokens keep that short
    INPUT_EXAMPLE = (pd.DataFrame({"prompt": [EXAMPLE_PROMPT]}), {"max_new_tokens": 4})

    def load_context(self, context):
        self.tokenizer = load_tokenizer(context.artifacts["model_dir"])
        self.model = load_causal_lm(context.artifacts["model_dir"], pad_token_id=self.tokenizer.pad_token_id).eval()

    # a DataFrame hint: MLflow neither warns (no hint) nor infers a schema from it (the signature is SIGNATURE)
    def predict(self, context, model_input: pd.DataFrame, params=None):
        params = {**{p.name: p.default for p in self.PARAMS.params}, **(params or {})}
        prompts = [chat_messages(p) for p in model_input["prompt"]]
        outs = sample_responses(
            self.model,
            self.tokenizer,
            prompts,
            batch_size=int(params["batch_size"]),
            max_prompt_length=int(params["max_prompt_length"]),
            max_new_tokens=int(params["max_new_tokens"]),
            temperature=float(params["temperature"]),
            seed=None if params["seed"] is None else int(params["seed"]),
        )
        return [t for o in outs for t in o.texts]
