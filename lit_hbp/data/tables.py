"""Table sources opened for reading: a Parquet file, an Arrow IPC file or stream, a ``datasets.save_to_disk``
folder, a Hub data set's snapshot; each a ``DataError`` naming it where it is not what it is said to be."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lit_hbp.errors import DataError


def open_parquet(path: Path):
    """A Parquet file opened, or a DataError naming it (a file cut short, another format named parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a Parquet file ({e}): a file cut short, or set the source's file_type") from None


def open_table(source: Any):
    """A memory-mapped table source: an Arrow IPC file or stream, a ``datasets.save_to_disk`` folder,
    or a Hub data set's snapshot read by ``datasets`` (offline: its files are on this machine)."""
    kind, path = source.resolved_file_type, source.local_path
    if kind == "arrow":
        import pyarrow as pa

        try:
            return pa.ipc.open_file(pa.memory_map(str(path))).read_all()
        except pa.ArrowInvalid:
            try:
                return pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
            except pa.ArrowInvalid as e:
                raise DataError(f"{path}: not an Arrow IPC file or stream ({e})") from None
    import datasets

    if kind == "hub":
        try:
            data = datasets.load_dataset(str(path), name=source.subset, split=source.split or "train")
            return data.with_format(None)
        except ValueError as e:  # an unknown split or subset: datasets names the ones there are
            raise DataError(f"data source {source.path!r} (the Hub data set in {path}): {e}") from None
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        split = source.split or "train"
        if split not in data:
            raise DataError(f"{path}: split {split!r} not found; splits are {sorted(data)}")
        data = data[split]
    elif source.split is not None:
        raise DataError(
            f"{path}: split {source.split!r}, but this folder holds one data set (save_to_disk of a Dataset, not a "
            "DatasetDict), which has no splits: drop split"
        )
    return data.with_format(None)  # rows as Python objects, whatever format save_to_disk kept (numpy, torch, ...)


# Fields a chat template writes out key by key (``tojson``): a tool's parameters, a tool call's arguments.
KEYED_FIELDS = ("arguments", "parameters")


def keyed_struct_fields(source: Any) -> list[str]:
    """The dotted names of a table source's struct columns (at any depth) that a chat template writes out as JSON
    (``KEYED_FIELDS``): Arrow keeps one field order and one type per column, the first rows' order and the
    union of the numbers' types, so a row whose record wrote other keys first, or 1 beside another row's 1.5
    (read 1.0), renders otherwise than the record did. A JSON string (OpenAI's ``arguments``) keeps each row's."""
    import pyarrow as pa

    kind = source.resolved_file_type
    if kind == "parquet":
        schema = open_parquet(source.local_path).schema_arrow
    else:
        table = open_table(source)
        schema = table.schema if isinstance(table, pa.Table) else table.data.schema
    found: list[str] = []

    def walk(name: str, t: pa.DataType) -> None:
        if pa.types.is_struct(t):
            parts = name.split(".")
            if parts[-1] in KEYED_FIELDS and {"tools", "tool_calls"} & set(parts):
                found.append(name)
            for f in t:
                walk(f"{name}.{f.name}", f.type)
        elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            walk(name, t.value_type)

    for f in schema:
        walk(f.name, f.type)
    return found
