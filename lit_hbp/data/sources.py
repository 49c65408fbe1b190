"""Training data sources: JSONL, parquet and Hugging Face datasets saved to disk.

A record is one of three shapes, checked here so a bad line is reported with its file and line:
chat ``{"messages": [{"role": ..., "content": ...}, ...]}``, ``{"prompt": ..., "response": ...}``,
or plain ``{"text": ...}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("auto", "jsonl", "parquet", "hf")


class DataError(ValueError):
    """Bad training data; the message names the file and line (or row) of the problem."""


@dataclass(frozen=True)
class Source:
    """One training data source.

    path: a .jsonl/.json file, a .parquet file, or a folder written by ``datasets.save_to_disk``.
    repeat: how many times the source enters an epoch (2.0 = twice, 0.5 = a seeded half).
    weight: alternatively, the source's share of the epoch's samples relative to the other
        sources' weights (the epoch keeps the total sample count of all sources).
    split: the split to read from a saved ``DatasetDict``.
    """

    path: str
    format: str = "auto"
    repeat: float | None = None
    weight: float | None = None
    split: str = "train"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"source {self.path}: format must be one of {FORMATS}, got {self.format!r}")
        if self.repeat is not None and self.weight is not None:
            raise ValueError(f"source {self.path}: give repeat or weight, not both")
        for name in ("repeat", "weight"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"source {self.path}: {name} must be >= 0, got {value}")

    @property
    def resolved_format(self) -> str:
        if self.format != "auto":
            return self.format
        p = Path(self.path)
        if p.is_dir():
            return "hf"
        if p.suffix in (".jsonl", ".json"):
            return "jsonl"
        if p.suffix == ".parquet":
            return "parquet"
        raise DataError(f"{self.path}: cannot tell the format from the name; set format: jsonl | parquet | hf")


@dataclass(frozen=True)
class Conversation:
    """A normalized record: chat messages, or plain text (``messages`` is None)."""

    messages: list[dict] | None
    text: str | None
    where: str


def iter_records(source: Source) -> Iterator[tuple[dict, str]]:
    """Yield (record, location) pairs; location is ``file:line`` or ``file:row N``."""
    path = Path(source.path)
    if not path.exists():
        raise DataError(f"data source not found: {path}")
    fmt = source.resolved_format
    if fmt == "jsonl":
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: malformed JSON: {e.msg} (column {e.colno})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
                yield record, f"{path}:{lineno}"
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for record in batch.to_pylist():
                yield record, f"{path}:row {row}"
                row += 1
    else:
        import datasets

        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if source.split not in data:
                raise DataError(f"{path}: split {source.split!r} not found; splits are {sorted(data)}")
            data = data[source.split]
        for row, record in enumerate(data):
            yield record, f"{path}:row {row}"


def _field(record: dict, name: str, where: str, kind: type = str):
    value = record[name]
    if not isinstance(value, kind):
        raise DataError(f"{where}: field '{name}' must be {kind.__name__}, got {type(value).__name__}")
    return value


def to_conversation(record: dict, where: str) -> Conversation:
    """Normalize a record to chat messages or plain text, or raise naming the field and location."""
    if "messages" in record:
        messages = _field(record, "messages", where, list)
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise DataError(f"{where}: messages[{i}] must be an object with role and content")
            for key in ("role", "content"):
                if key not in m:
                    raise DataError(f"{where}: messages[{i}] has no '{key}' field")
                if not isinstance(m[key], str):
                    raise DataError(f"{where}: messages[{i}].{key} must be str, got {type(m[key]).__name__}")
            out.append({"role": m["role"], "content": m["content"]})
        return Conversation(out, None, where)
    if "prompt" in record or "response" in record:
        for key in ("prompt", "response"):
            if key not in record:
                raise DataError(f"{where}: record has '{'response' if key == 'prompt' else 'prompt'}' but no '{key}'")
        prompt, response = _field(record, "prompt", where), _field(record, "response", where)
        return Conversation(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], None, where
        )
    if "text" in record:
        return Conversation(None, _field(record, "text", where), where)
    raise DataError(
        f"{where}: record has none of the fields 'messages', 'prompt'/'response', 'text' (it has {sorted(record)})"
    )
