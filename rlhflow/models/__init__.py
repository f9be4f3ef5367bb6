"""Models: loading them and their tokenizers (`loading`), the policy and its critic (`policy`), per-token
quantities from logits (`logits`), decoding and sampling (`decoding`, `sampling`) and packed CPU weights
(`packed_linear`). Import from those modules; this package imports none of them."""
