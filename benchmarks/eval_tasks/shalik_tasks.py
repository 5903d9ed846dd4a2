"""Datasets for the lm-evaluation-harness task YAMLs in this folder (``custom_dataset: !function
shalik_tasks.NAME``).

lm-eval resolves ``!function`` relative to the YAML file, so these loaders — and the JSON Lines they read from
beside this file — are found whatever the working directory (a ``dataset_kwargs: {data_files: ...}`` path would be
resolved against the working directory instead). lm-eval calls a loader with the task's metadata as keyword
arguments; ``items_file`` (set through ``TaskManager(metadata={"items_file": PATH})``) reads another JSON Lines
file of the same shape instead, e.g. a subset that fits a tiny test model's context.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def read_items(path: str | Path) -> list[dict]:
    """The items of a JSON Lines task file (one object a line)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _dataset(default: str, items_file: str | None):
    import datasets

    rows = read_items(items_file or HERE / default)
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def bn_next_sentence(items_file: str | None = None, **_metadata):
    """bn-next-sentence (also the bn-continuation generation task's items)."""
    return _dataset("bn_next_sentence.jsonl", items_file)


def en_next_sentence(items_file: str | None = None, **_metadata):
    """en-next-sentence."""
    return _dataset("en_next_sentence.jsonl", items_file)
