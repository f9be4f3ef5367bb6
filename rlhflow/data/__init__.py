"""Preference data: readers for the formats users bring, and the project's own demo data."""

from rlhflow.data.formats import DataFormatError, load_preferences
from rlhflow.data.readers import read_jsonl, write_jsonl

__all__ = ["DataFormatError", "load_preferences", "read_jsonl", "write_jsonl"]
