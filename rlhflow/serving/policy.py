"""The policy's MLflow pyfunc wrapper (rlhflow/serving/__init__.py): generates a response per prompt."""

from __future__ import annotations

# The model code (torch, transformers) is imported when MLflow loads a logged model (load_context, predict):
# logging one imports this module and needs none of it.
import mlflow.pyfunc

from rlhflow.serving import chat_messages


class PolicyPyfunc(mlflow.pyfunc.PythonModel):
    """Generates a response per prompt (params: max_new_tokens, temperature)."""

    def load_context(self, context):
        from rlhflow.models import load_causal_lm, load_tokenizer

        self.tokenizer = load_tokenizer(context.artifacts["model_dir"])
        self.model = load_causal_lm(context.artifacts["model_dir"], pad_token_id=self.tokenizer.pad_token_id).eval()

    def predict(self, context, model_input, params=None):
        from rlhflow.policy import sample_responses

        params = params or {}
        prompts = [chat_messages(p) for p in model_input["prompt"]]
        outs = sample_responses(
            self.model,
            self.tokenizer,
            prompts,
            batch_size=int(params.get("batch_size", 16)),
            max_prompt_length=int(params.get("max_prompt_length", 512)),
            max_new_tokens=int(params.get("max_new_tokens", 64)),
            temperature=float(params.get("temperature", 0.7)),
            seed=params.get("seed"),
        )
        return [t for o in outs for t in o.texts]
