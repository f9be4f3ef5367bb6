"""The configuration: the model of params.yaml (`params`), one dataclass per section (`align`, `ppo`, `evaluate`,
`lora`, with `section`'s shared machinery), where outputs may go (`output_paths`) and --help's list of keys (`help`).
Import from those modules; this package imports none of them."""
