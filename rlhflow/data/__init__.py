"""Preference data: readers for the formats users bring (`readers`, `formats`, `converters`), where data comes from
(`sources`), the splits by conversation (`splits`), the Great Expectations suite (`validation`) and the demo data.
Import from those modules; this package imports none of them (the demo data's writer loads no pandas)."""
