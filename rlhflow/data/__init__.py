"""Preference data: readers for the formats users bring (`readers`, `formats`, `converters`), where data comes from
(`sources`), the splits by conversation (`splits`), the Great Expectations suite (`validation`) and the demo data."""

from rlhflow.data.formats import DataFormatError, load_preferences
from rlhflow.data.readers import read_jsonl, write_jsonl

__all__ = ["DataFormatError", "load_preferences", "read_jsonl", "write_jsonl"]
