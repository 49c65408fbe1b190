"""Training data sources: JSONL, parquet, Arrow files and Hugging Face datasets saved to disk.

A record is one of four shapes, checked here (or, pre-tokenized, in ``lit_hbp.data.tokenize``) so a
bad line is reported with its file and line: chat ``{"messages": [{"role": ..., "content": ...}]}``,
``{"prompt": ..., "response": ...}``, plain ``{"text": ...}``, or pre-tokenized ``{"input_ids": [...]}``
with ``labels`` or ``assistant_masks``. Sources are read in chunks (``iter_chunks``), so no source is
ever held whole in memory.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from lit_hbp.errors import DataError  # noqa: F401  (re-exported: lit_hbp.data.sources.DataError)

FORMATS = ("auto", "jsonl", "parquet", "arrow", "hf")
# Chat roles a record may use. A role outside these is a typo far more often than a real role, and
# a misspelled "assistant" would silently lose every supervised token of the record.
KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer", "function", "ipython")
ROLE_TYPO_CUTOFF = 0.7  # assitant / assistant 0.94, usr / user 0.86; model / developer 0.43
_roles_said: set[str] = set()
# What ``datasets.save_to_disk`` writes into a folder: a DatasetDict, or a single Dataset.
HF_MARKERS = ("dataset_dict.json", "state.json")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
# A chunk: what a tokenizer worker takes at a time (a few hundred chats), and all the source the
# main process holds at once.
CHUNK_BYTES = 1 << 20
CHUNK_ROWS = 1024


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

    @classmethod
    def of(cls, entry: Source | dict | str, label: str) -> Source:
        """The source a config entry describes (a Source, a path, or a mapping of its fields); a
        misspelled field is an error naming the entry (``label``, e.g. ``sources[1]``), the field
        and the nearest valid one, instead of a TypeError from the constructor."""
        if isinstance(entry, Source):
            return entry
        if isinstance(entry, str):
            return cls(entry)
        if not isinstance(entry, dict):
            raise DataError(f"{label}: a source is a path or a mapping with a path, got {entry!r}")
        fields = [f.name for f in dataclasses.fields(cls)]
        for key in entry:
            if key not in fields:
                close = difflib.get_close_matches(str(key), fields, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise DataError(f"{label}: unknown source field {key!r}{hint}; a source takes {', '.join(fields)}")
        if "path" not in entry:
            raise DataError(f"{label}: the source has no path: {entry!r}")
        return cls(**entry)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise DataError(f"source {self.path}: format must be one of {FORMATS}, got {self.format!r}")
        if self.repeat is not None and self.weight is not None:
            raise DataError(f"source {self.path}: give repeat or weight, not both")
        for name in ("repeat", "weight"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise DataError(f"source {self.path}: {name} must be >= 0, got {value}")

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
        if p.suffix == ".arrow":
            return "arrow"
        raise DataError(f"{self.path}: cannot tell the format from the name; set format: jsonl | parquet | arrow | hf")


@dataclass(frozen=True)
class Conversation:
    """A normalized record: chat messages, or plain text (``messages`` is None)."""

    messages: list[dict] | None
    text: str | None
    where: str


def _near_names(path: Path) -> str:
    """A hint naming existing files of the folder whose names are close to ``path``'s."""
    parent = path.parent
    if not parent.is_dir():
        return f"; its folder {parent} does not exist either"
    try:
        names = sorted(p.name for p in parent.iterdir())
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=3, cutoff=0.75)
    return f"; did you mean {' or '.join(repr(str(parent / c)) for c in close)}?" if close else ""


def _data_files_in(folder: Path, limit: int = 5) -> str:
    """The data files directly inside ``folder``, to suggest as paths."""
    try:
        files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix in DATA_SUFFIXES)
    except OSError:
        return ""
    if not files:
        return ""
    more = f" and {len(files) - limit} more" if len(files) > limit else ""
    return f"; it holds {', '.join(files[:limit])}{more}"


def check_source(source: Source, label: str | None = None) -> None:
    """Raise a DataError naming the source (``label``, e.g. ``sources[1]``, and its path) when its
    path cannot be read as its format: missing (or a broken link), a folder where a file is
    expected or the reverse, not a regular file, or unreadable. Why: otherwise the first thing to
    touch the path (the cache key's ``stat``, ``open``, ``datasets``) fails with a raw OS error
    that names neither the source nor the fix."""
    path = Path(source.path)
    who = f"{label}: " if label else ""
    if not path.exists():
        if path.is_symlink():
            where = f" (a symbolic link to {os.readlink(path)}, which does not exist)"
        elif not path.is_absolute():
            where = f" (looked for {path.resolve()}, relative to the working directory)"
        else:
            where = ""
        raise DataError(f"{who}data source not found: {path}{where}{_near_names(path)}")
    if path.is_dir():
        if source.format in ("jsonl", "parquet", "arrow"):
            raise DataError(
                f"{who}data source {path} is a directory, but format {source.format} reads a file: "
                f"give the file's path{_data_files_in(path)}"
            )
        if not any((path / m).is_file() for m in HF_MARKERS):
            raise DataError(
                f"{who}data source {path} is a directory but not a data set saved with datasets.save_to_disk "
                f"(it has no {' or '.join(HF_MARKERS)}): give a .jsonl or .parquet file as the path"
                f"{_data_files_in(path)}"
            )
        if not os.access(path, os.R_OK | os.X_OK):
            raise DataError(f"{who}data source {path} is a directory that cannot be read (permission denied)")
        return
    if not path.is_file():
        raise DataError(f"{who}data source {path} is not a regular file (a device, pipe or socket)")
    if source.format == "hf":
        raise DataError(
            f"{who}data source {path} is a file, but format hf reads a folder written by datasets.save_to_disk"
        )
    if not os.access(path, os.R_OK):
        raise DataError(f"{who}data source {path} cannot be read (permission denied)")
    if path.stat().st_size == 0:
        raise DataError(f"{who}data source {path} is empty (0 bytes): remove it from the list or give the right file")


def check_sources(sources: Sequence[Source], field: str = "sources") -> None:
    """``check_source`` of every source, named by its place in the list (``sources[i]``): lets a
    data module reject a bad path when it is configured, before any tokenizer loads."""
    for i, source in enumerate(sources):
        check_source(source, f"{field}[{i}]")


@dataclass(frozen=True)
class Chunk:
    """A piece of a source that a worker process tokenizes on its own: the raw bytes of whole JSONL
    lines (``first``: the first one's line number) or a list of table records (``first``: the first
    one's row). ``size`` is its share of ``source_units`` (bytes or rows), for progress."""

    first: int
    lines: bytes | None = None
    records: list[dict] | None = None
    size: int = 0


def source_units(source: Source) -> tuple[int, str]:
    """How much there is to read: (bytes, "B") of a JSONL file, (rows, " rows") of a table."""
    fmt, path = source.resolved_format, Path(source.path)
    if fmt == "jsonl":
        return path.stat().st_size, "B"
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows, " rows"
    return len(_table(source)), " rows"


def _table(source: Source):
    """A memory-mapped table source: an Arrow IPC file or stream, or a ``datasets.save_to_disk`` folder."""
    path = Path(source.path)
    if source.resolved_format == "arrow":
        import pyarrow as pa

        try:
            return pa.ipc.open_file(pa.memory_map(str(path))).read_all()
        except pa.ArrowInvalid:
            try:
                return pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
            except pa.ArrowInvalid as e:
                raise DataError(f"{path}: not an Arrow IPC file or stream ({e})") from None
    import datasets

    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if source.split not in data:
            raise DataError(f"{path}: split {source.split!r} not found; splits are {sorted(data)}")
        data = data[source.split]
    return data


def iter_chunks(source: Source, chunk_bytes: int | None = None, chunk_rows: int | None = None) -> Iterator[Chunk]:
    """The source in order, a chunk at a time, never holding more than a chunk: JSONL cut at line ends
    (about ``chunk_bytes`` each, a longer line whole), tables in ``chunk_rows`` records."""
    chunk_bytes, chunk_rows = chunk_bytes or CHUNK_BYTES, chunk_rows or CHUNK_ROWS
    path = Path(source.path)
    check_source(source)
    fmt = source.resolved_format
    if fmt == "jsonl":
        with path.open("rb") as f:
            line, rest = 1, b""
            while True:
                block = f.read(chunk_bytes)
                data = rest + block
                if not block:
                    if data:  # a last line without its newline
                        yield Chunk(first=line, lines=data, size=len(data))
                    return
                cut = data.rfind(b"\n") + 1
                rest = data[cut:]
                if cut:  # else one line longer than the block so far: read on
                    yield Chunk(first=line, lines=data[:cut], size=cut)
                    line += data.count(b"\n", 0, cut)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=chunk_rows):
            yield Chunk(first=row, records=batch.to_pylist(), size=batch.num_rows)
            row += batch.num_rows
    else:
        table = _table(source)
        for row in range(0, len(table), chunk_rows):
            part = table.slice(row, chunk_rows) if fmt == "arrow" else table[row : row + chunk_rows]
            records = part.to_pylist() if fmt == "arrow" else [dict(zip(part, v)) for v in zip(*part.values())]
            yield Chunk(first=row, records=records, size=len(records))


def chunk_records(source: Source, chunk: Chunk) -> Iterator[tuple[dict, str, int]]:
    """(record, location, row) of each record of a chunk; location is ``file:line`` or ``file:row N``,
    row the line number or the row."""
    path = source.path
    if chunk.records is not None:
        for i, record in enumerate(chunk.records):
            yield record, f"{path}:row {chunk.first + i}", chunk.first + i
        return
    for i, raw in enumerate(chunk.lines.split(b"\n")):
        lineno = chunk.first + i
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
        yield record, f"{path}:{lineno}", lineno


def iter_records(source: Source) -> Iterator[tuple[dict, str]]:
    """Yield (record, location) pairs; location is ``file:line`` or ``file:row N``."""
    for chunk in iter_chunks(source):
        for record, where, _ in chunk_records(source, chunk):
            yield record, where


def _field(record: dict, name: str, where: str, kind: type = str):
    value = record[name]
    if not isinstance(value, kind):
        raise DataError(f"{where}: field '{name}' must be {kind.__name__}, got {type(value).__name__}")
    return value


def check_role(role: str, where: str) -> None:
    """Raise for a role that looks like a misspelled known one (``assitant``, ``Usr``), naming the known
    roles and the closest: only ``assistant`` turns are supervised, so a misspelled one would silently
    train on nothing. Any other role (``model``, ``observation``: some chat templates use their own) is
    passed to the template as it is, and said once per role."""
    if role in KNOWN_ROLES:
        return
    close = difflib.get_close_matches(role.lower(), KNOWN_ROLES, n=1, cutoff=ROLE_TYPO_CUTOFF)
    known = ", ".join(KNOWN_ROLES)
    if close:
        raise DataError(f"{where} has unknown role {role!r}: known roles are {known}; did you mean {close[0]!r}?")
    if role not in _roles_said:
        _roles_said.add(role)
        warnings.warn(
            f"{where}: role {role!r} is none of {known}; it goes to the chat template as it is and is not "
            "supervised (only assistant turns are, unless train_on: all)",
            stacklevel=2,
        )


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
            check_role(m["role"], f"{where}: messages[{i}]")
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
