"""params.yaml's `lora` section and the per-stage LoRA switch (`sft.lora`, `ppo.lora`)."""

from __future__ import annotations

# peft is imported only to build an adapter's config: heavy, and optional (lora.enabled).
from pydantic import Field

from rlhflow.config.section import Section


class LoraSettings(Section):
    """The LoRA adapter's shape: params.yaml's top-level `lora` section, which `sft.lora` and `ppo.lora` inherit."""

    r: int = Field(16, ge=1, description="rank of the adapter matrices")
    alpha: int = Field(32, ge=1, description="scaling numerator: the update is scaled by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="the linear layers that get an adapter",
    )

    def peft_config(self, **extra):
        """This shape as peft's LoraConfig (peft is imported here, so only runs with LoRA load it)."""
        from peft import LoraConfig as PeftLoraConfig

        return PeftLoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            **extra,
        )


class LoraConfig(LoraSettings):
    """A stage's LoRA: whether it trains an adapter; every other key it does not set comes from `lora`."""

    enabled: bool = False
