"""Training data sources: where records come from and how the files are read.

A source is a JSONL file, a ``.json`` file holding an array of records, a parquet or Arrow file, a
``datasets.save_to_disk`` folder, or a Hugging Face Hub data set in the local cache (``org/name``,
read offline). What a record says is the business of ``lit_hbp.data.records`` (its ``format``).
Sources are read in chunks (``iter_chunks``), so no source is ever held whole in memory; every
record keeps its location, ``file:line`` (JSONL) or ``file:row N`` (rows count from 1, like lines).
"""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from lit_hbp.data.records import RECORD_FORMATS, RecordReader
from lit_hbp.data.tables import open_parquet, open_table
from lit_hbp.errors import ConfigError, DataError

FILE_TYPES = ("auto", "jsonl", "json", "parquet", "arrow", "hf", "hub")
# What ``datasets.save_to_disk`` writes into a folder: a DatasetDict, or a single Dataset.
HF_MARKERS = ("dataset_dict.json", "state.json")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
# A Hub data set's name: ``org/name`` (letters, digits, ``-``, ``_``, ``.``).
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# A chunk: what a tokenizer worker takes at a time (a few hundred chats), and all the source the
# main process holds at once.
CHUNK_BYTES = 1 << 20
CHUNK_ROWS = 1024


def _is_path(text: str) -> bool:
    """Whether ``text`` names something on disk (a record's JSON is longer than a file name may be)."""
    try:
        return Path(text).exists()
    except OSError:
        return False


@dataclass(frozen=True)
class Source:
    """One training data source.

    Args:
        path: a .jsonl file, a .json file (a JSON array of records, or JSON Lines), a .parquet or .arrow
            file, a folder written by ``datasets.save_to_disk``, or ``org/name`` of a Hugging Face Hub data
            set in the local cache (as ``hf download --repo-type dataset`` or ``datasets.load_dataset``
            left it; read offline).
        format: the records' format: ``auto`` (by each record's fields), ``openai``, ``sharegpt``,
            ``alpaca``, ``prompt_response``, ``text`` or ``tokens`` (``lit_hbp.data.records``).
        file_type: how the file is read: ``auto`` (by its name), ``jsonl``, ``json``, ``parquet``,
            ``arrow``, ``hf`` (a ``save_to_disk`` folder) or ``hub``.
        repeat: how many times the source enters an epoch (2.0 = twice, 0.5 = a half drawn once by the data seed,
            not the epoch: every epoch trains the same half).
        weight: alternatively, the source's share of the epoch's samples relative to the other
            sources' weights (the epoch keeps the total sample count of all sources; a fraction drawn as repeat's).
        split: the split to read from a saved ``DatasetDict`` or a Hub data set (default: train).
        subset: the configuration (subset) of a Hub data set that has several.
        fields: the data set's names of the format's fields, e.g. ``{messages: dialog, role: speaker,
            content: text}`` (needs a format other than ``auto``).
        roles: the data set's role names mapped onto chat roles, e.g. ``{bot: assistant, customer: user}``;
            each name must occur in some record (one that occurs nowhere is refused after tokenizing).
    """

    path: str
    format: str = "auto"
    file_type: str = "auto"
    repeat: float | None = None
    weight: float | None = None
    split: str | None = None
    subset: str | None = None
    fields: dict[str, str] | None = None
    roles: dict[str, str] | None = None

    @classmethod
    def of(cls, entry: Source | dict | str, label: str) -> Source:
        """The source a config entry describes (a Source, a path, or a mapping of its fields); a
        misspelled field is an error naming the entry (``label``, e.g. ``sources[1]``), the field
        and the nearest valid one, instead of a TypeError from the constructor."""
        if isinstance(entry, Source):
            return entry
        if isinstance(entry, str):
            if entry.lstrip()[:1] in ("{", "[") and not _is_path(entry):
                raise DataError(
                    f"{label}: {entry[:60]!r}... is a record, not a path: a file given to a list option on the "
                    "command line is read as the list itself; write --data.sources '[chats.jsonl]'"
                )
            return cls(entry)
        if not isinstance(entry, dict):
            raise DataError(f"{label}: a source is a path or a mapping with a path, got {entry!r}")
        fields = [f.name for f in dataclasses.fields(cls)]
        for key in entry:
            if key not in fields:
                close = difflib.get_close_matches(str(key), fields, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                field, colon, _ = str(key).partition(":")
                if colon and field in fields:  # YAML reads {path:x.jsonl} as one key: its colon wants a space
                    hint = f" (YAML needs a space after the colon: {field}: {str(key)[len(field) + 1 :]})"
                raise DataError(f"{label}: unknown source field {key!r}{hint}; a source takes {', '.join(fields)}")
        if "path" not in entry:
            raise DataError(f"{label}: the source has no path: {entry!r}")
        try:
            return cls(**entry)
        except ConfigError as e:
            raise ConfigError(f"{label}: {e}") from None

    def __post_init__(self) -> None:
        if self.format in FILE_TYPES[1:] and self.format not in RECORD_FORMATS:
            raise ConfigError(
                f"source {self.path}: format {self.format!r} is a file type: write file_type: {self.format} "
                f"(format names the records' shape: {', '.join(RECORD_FORMATS)})"
            )
        self.reader()  # checks format, fields and roles
        if self.file_type not in FILE_TYPES:
            raise ConfigError(
                f"source {self.path}: file_type must be one of {', '.join(FILE_TYPES)}, got {self.file_type!r}"
            )
        if self.repeat is not None and self.weight is not None:
            raise ConfigError(f"source {self.path}: give repeat or weight, not both")
        for name in ("repeat", "weight"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if value is not None and not (number and math.isfinite(value) and value >= 0):
                raise ConfigError(f"source {self.path}: {name} must be a finite number >= 0, got {value!r}")

    def __hash__(self) -> int:
        return hash((self.path, self.format, self.file_type, self.split, self.subset))

    def reader(self) -> RecordReader:
        """The reader of this source's records (its format, fields and roles; image paths relative to
        the data file's folder, or to the source's folder)."""
        path = Path(self.path).absolute()  # the token cache keeps the paths: not relative to the run's folder
        root = str(path if path.is_dir() else path.parent)
        return RecordReader(self.format, self.fields, self.roles, label=f"source {self.path}", root=root)

    @cached_property
    def resolved_file_type(self) -> str:
        if self.file_type != "auto":
            return self.file_type
        p = Path(self.path)
        if p.is_dir():
            return "hf"
        suffix = p.suffix.lower()  # d.JSONL as d.jsonl
        if suffix in (".jsonl", ".parquet", ".arrow"):
            return suffix[1:]
        if suffix == ".json":
            return "json" if _first_char(p) == "[" else "jsonl"
        if is_hub_name(self.path):
            return "hub"
        raise DataError(
            f"{self.path}: cannot tell the file type from the name; set file_type: {' | '.join(FILE_TYPES[1:])}"
        )

    @cached_property
    def local_path(self) -> Path:
        """Where the data lie on this machine: the path, or a Hub data set's snapshot in the cache."""
        if self.resolved_file_type == "hub":
            folder = hub_dataset(self.path)
            if folder is None:
                raise DataError(f"data source {self.path!r}: no Hugging Face Hub data set of that name in the cache")
            return folder
        return Path(self.path)

    @property
    def is_table(self) -> bool:
        """Read as rows (every file type but JSON Lines)."""
        return self.resolved_file_type != "jsonl"


def is_hub_name(path: str) -> bool:
    """Whether ``path`` reads as a Hub data set's ``org/name``: two parts, no data file's suffix, and
    nothing of that name here."""
    return bool(HUB_NAME.match(path)) and Path(path).suffix.lower() not in DATA_SUFFIXES and not Path(path).exists()


def _first_char(path: Path) -> str:
    """The first character of a file other than whitespace (a BOM counts as whitespace)."""
    try:
        with path.open("rb") as f:
            head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    except OSError:
        return ""
    return head[:1].decode("ascii", "replace")


def hub_dataset(name: str) -> Path | None:
    """The folder of Hub data set ``name``'s snapshot in the Hugging Face cache, or None (no network asked)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

        return Path(snapshot_download(name, repo_type="dataset", local_files_only=True))
    except (ImportError, HFValidationError, LocalEntryNotFoundError, ValueError, OSError):
        return None


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
        files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
    except OSError:
        return ""
    if not files:
        return ""
    more = f" and {len(files) - limit} more" if len(files) > limit else ""
    return f"; it holds {', '.join(files[:limit])}{more}"


def check_source(source: Source, label: str | None = None) -> None:
    """Raise a DataError naming the source (``label``, e.g. ``sources[1]``, and its path) when its
    path cannot be read as its file type: missing (or a broken link), a folder where a file is
    expected or the reverse, not a regular file, unreadable, or a Hub name the cache does not hold.
    Why: otherwise the first thing to touch the path (the cache key's ``stat``, ``open``,
    ``datasets``) fails with a raw OS error that names neither the source nor the fix."""
    path = Path(source.path)
    who = f"{label}: " if label else ""
    kind = source.file_type
    _check_table_options(source, who)
    if not path.exists() and (kind == "hub" or (kind == "auto" and is_hub_name(source.path))):
        if hub_dataset(source.path) is None:
            from huggingface_hub.constants import HF_HUB_CACHE

            folder = Path(HF_HUB_CACHE) / f"datasets--{source.path.replace('/', '--')}"
            raise DataError(
                f"{who}data source {source.path!r} is neither a file or folder here (looked for {path.resolve()}) "
                f"nor a Hugging Face Hub data set in the local cache (looked for {folder}; downloads are off: "
                f"fetch it first with `hf download --repo-type dataset {source.path}`)"
            )
        return
    if not path.exists():
        if path.is_symlink():
            where = f" (a symbolic link to {os.readlink(path)}, which does not exist)"
        elif not path.is_absolute():
            where = f" (looked for {path.resolve()}, relative to the working directory)"
        else:
            where = ""
        if any(c in source.path for c in "*?["):  # as the shell would, were it given one
            where += "; a path's wildcards are not expanded: give each file as a source of its own"
        raise DataError(f"{who}data source not found: {path}{where}{_near_names(path)}")
    if path.is_dir():
        if kind in ("jsonl", "json", "parquet", "arrow"):
            raise DataError(
                f"{who}data source {path} is a directory, but file_type {kind} reads a file: "
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
    if kind in ("hf", "hub"):
        raise DataError(
            f"{who}data source {path} is a file, but file_type {kind} reads "
            + ("a folder written by datasets.save_to_disk" if kind == "hf" else "a Hub data set by its name")
        )
    if not os.access(path, os.R_OK):
        raise DataError(f"{who}data source {path} cannot be read (permission denied)")
    if path.stat().st_size == 0:
        raise DataError(f"{who}data source {path} is empty (0 bytes): remove it from the list or give the right file")


def _check_table_options(source: Source, who: str) -> None:
    """``split`` is read from saved data sets and Hub data sets, ``subset`` from Hub data sets: given
    for another source, it is refused rather than ignored."""
    path = Path(source.path)
    hub = source.file_type == "hub" or (source.file_type == "auto" and is_hub_name(source.path))
    saved = source.file_type == "hf" or (source.file_type == "auto" and path.is_dir())
    if source.subset is not None and not hub:
        raise DataError(f"{who}data source {source.path}: subset is read from Hub data sets only")
    if source.split is not None and not (hub or saved):
        raise DataError(
            f"{who}data source {source.path}: split is read from data sets saved with save_to_disk and Hub data "
            "sets only; a file is one split: give the file of the split you want"
        )


def check_sources(sources: Sequence[Source], field: str = "sources", apart: Sequence[Source] = ()) -> None:
    """``check_source`` of every source, named by its place in the list (``sources[i]``): lets a
    data module reject a bad path when it is configured, before any tokenizer loads. Two sources reading the
    same data are refused (an epoch would hold its records twice, and records held out of one for validation
    would train through the other), and so is a source reading the data of one in ``apart`` (the training
    sources, for ``val_sources``: validation would measure records the run trains on)."""
    seen: dict[tuple, str] = {}
    for i, source in enumerate(sources):
        label = f"{field}[{i}]"
        check_source(source, label)
        key = _data_key(source)
        if key in seen:
            raise DataError(
                f"{label} reads the same data as {seen[key]} ({source.path}): an epoch would hold its records twice, "
                "and records held out of one for validation would train through the other; give it once (repeat: 2 "
                "enters it twice)"
            )
        seen[key] = label
    for i, source in enumerate(apart):
        if (key := _data_key(source)) in seen:
            raise DataError(
                f"{seen[key]} reads the data of sources[{i}] ({source.path}), which trains: validation would measure "
                "records the run trains on; give validation data of its own, or val_fraction"
            )


def _data_key(source: Source) -> tuple:
    """What a source reads: its file or folder (links followed) or Hub name, split (none given: train, as read) and
    subset."""
    path = Path(source.path)
    where = str(path.resolve()) if path.exists() else source.path
    return where, source.split or "train", source.subset


@dataclass(frozen=True)
class Chunk:
    """A piece of a source that a worker process tokenizes on its own: the raw bytes of whole JSONL
    lines (``first``: the first one's line number) or a list of records (``first``: the first one's
    row, from 1; ``record_lines``: each one's line in a JSON array file). ``size`` is its share of
    ``source_units`` (bytes or rows), for progress."""

    first: int
    lines: bytes | None = None
    records: list[dict] | None = None
    record_lines: list[int] | None = None
    size: int = 0


def source_units(source: Source) -> tuple[int, str]:
    """How much there is to read: (bytes, "B") of a JSONL or JSON file, (rows, " rows") of a table."""
    kind, path = source.resolved_file_type, source.local_path
    if kind in ("jsonl", "json"):
        return path.stat().st_size, "B"
    if kind == "parquet":
        return open_parquet(path).metadata.num_rows, " rows"
    return len(open_table(source)), " rows"


def iter_chunks(source: Source, chunk_bytes: int | None = None, chunk_rows: int | None = None) -> Iterator[Chunk]:
    """The source in order, a chunk at a time, never holding more than a chunk: JSONL cut at line ends
    (about ``chunk_bytes`` each, a longer line whole), tables and JSON arrays in ``chunk_rows`` records."""
    chunk_bytes, chunk_rows = chunk_bytes or CHUNK_BYTES, chunk_rows or CHUNK_ROWS
    check_source(source)
    kind, path = source.resolved_file_type, source.local_path
    if kind == "jsonl":
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
    elif kind == "json":
        yield from _array_chunks(path, chunk_bytes, chunk_rows)
    elif kind == "parquet":
        import pyarrow as pa

        row, batches, kept = 1, open_parquet(path).iter_batches(batch_size=chunk_rows), _token_fields(source)
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowInvalid, OSError) as e:  # a page cut or damaged after the footer read well
                raise DataError(f"{path}: rows from {row} on cannot be read ({e})") from None
            if batch is None:
                return
            records = [_table_row(r, kept) for r in batch.to_pylist()]
            yield Chunk(first=row, records=records, size=batch.num_rows)
            row += batch.num_rows
    else:
        table, kept = open_table(source), _token_fields(source)
        for row in range(0, len(table), chunk_rows):
            part = table.slice(row, chunk_rows) if kind == "arrow" else table[row : row + chunk_rows]
            records = part.to_pylist() if kind == "arrow" else [dict(zip(part, v)) for v in zip(*part.values())]
            yield Chunk(first=row + 1, records=[_table_row(r, kept) for r in records], size=len(records))


class DuplicateKey(ValueError):
    """A JSON object naming one key twice."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object's pairs as a dict, refusing a key given twice: ``json`` keeps the last value and drops the
    first without a word (a record's first ``messages``, a message's first ``content``)."""
    record = dict(pairs)
    if len(record) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(
                    f"the key {key!r} appears twice in one object; JSON keeps the last and would drop the first "
                    "without a word: keep one"
                )
            seen.add(key)
    return record


def without_nulls(value: Any) -> Any:
    """A table row as its record was written: Arrow stores rows of one column in one shape, the union of every
    row's keys, so a row reads back with the keys of the others set to null (a tool's parameters, a call's
    arguments, a content part's ``image`` beside its ``text``). Every null-valued key of a mapping is dropped,
    at any depth (a table cannot tell a null written from a key absent)."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def _token_fields(source: Source) -> tuple[str, tuple[str, ...]]:
    """The source's names of a pre-tokenized record's ``input_ids`` and of the fields whose null means no
    value rather than no column (``labels``, ``assistant_masks``)."""
    name = source.reader().name
    return name("input_ids"), (name("labels"), name("assistant_masks"))


def _table_row(row: dict, token_fields: tuple[str, tuple[str, ...]]) -> dict:
    """A table row without its null keys (``without_nulls``), but a pre-tokenized row whose ``labels`` and
    ``assistant_masks`` cells are all null keeps them: their columns hold them for other rows, and dropping the
    nulls would train every token of this one without a word (the record reader refuses it, as it does a JSON
    null). A row giving one of them (a table joined from two data sets) is read by that one."""
    ids, kept = token_fields
    record = without_nulls(row)
    if row.get(ids) is not None and not any(row.get(k) is not None for k in kept):  # one of them given: that one
        record.update({k: None for k in kept if k in row})
    return record


class _ArrayReader:
    """A JSON array file read a block at a time: the decoded text not yet consumed, the position in
    it, and the line there (counted once per character, so reading stays linear in the file)."""

    WHITESPACE = " \t\r\n\ufeff"

    def __init__(self, f, path: Path, block: int):
        self.f, self.path, self.block = f, path, block
        self.decode = codecs.getincrementaldecoder("utf-8")().decode  # a block may end inside a character
        self.text, self.pos, self.done, self.read = "", 0, False, 0
        self.line, self.counted = 1, 0  # the line at text[counted]

    def more(self, n: int) -> None:
        """Read ``n`` more bytes (dropping the text already consumed)."""
        data = self.f.read(n)
        self.done = not data
        self.read += len(data)
        self.line_at()
        try:
            text = self.decode(data, final=self.done)
        except UnicodeDecodeError as e:
            raise DataError(f"{self.path}: not valid UTF-8 ({e.reason} near byte {self.read})") from None
        self.text, self.counted, self.pos = self.text[self.pos :] + text, 0, 0

    def next_char(self) -> str:
        """Skip whitespace (reading on as needed); the next character, or "" at the end of the file."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in self.WHITESPACE:
                self.pos += 1
            if self.pos < len(self.text) or self.done:
                return self.text[self.pos : self.pos + 1]
            self.more(self.block)

    def line_at(self) -> int:
        self.line += self.text.count("\n", self.counted, self.pos)
        self.counted = self.pos
        return self.line


def _array_chunks(path: Path, chunk_bytes: int, chunk_rows: int) -> Iterator[Chunk]:
    """The records of a JSON array file, ``chunk_rows`` at a time, each with the line it starts on;
    read ``chunk_bytes`` at a time (more while one record is longer), never the whole file."""
    decoder = json.JSONDecoder(object_pairs_hook=unique_keys)
    with path.open("rb") as f:
        r = _ArrayReader(f, path, chunk_bytes)
        if r.next_char() != "[":
            first = r.next_char()
            fix = (
                ": JSON Lines? set file_type: jsonl (or auto, which reads the first character)" if first == "{" else ""
            )
            raise DataError(f"{path}: file_type json reads a JSON array of records; it starts with {first!r}{fix}")
        r.pos += 1
        records, lines, row, reported = [], [], 1, 0
        while True:
            c = r.next_char()
            if c == "]":
                r.pos += 1
                if r.next_char():
                    raise DataError(f"{path}:line {r.line_at()}: text after the end of the JSON array")
                break
            if not c:
                raise DataError(f"{path}: the JSON array is not closed (the file ends inside it)")
            if row > 1:
                if c != ",":
                    raise DataError(f"{path}:line {r.line_at()}: expected ',' or ']' between records, got {c!r}")
                r.pos += 1
                r.next_char()
            start, want = r.line_at(), chunk_bytes
            while True:
                try:
                    record, end = decoder.raw_decode(r.text, r.pos)
                    if end < len(r.text) or r.done:
                        break
                except json.JSONDecodeError as e:
                    if r.done:
                        raise DataError(f"{path}:row {row} (line {start}): malformed JSON: {e.msg}") from None
                except DuplicateKey as e:
                    raise DataError(f"{path}:row {row} (line {start}): {e}") from None
                r.more(want)  # the record goes on past what was read: read more, twice as much each time
                want *= 2
            if not isinstance(record, dict):
                raise DataError(f"{path}:row {row} (line {start}): expected a JSON object, got {type(record).__name__}")
            records.append(record)
            lines.append(start)
            r.pos, row = end, row + 1
            if len(records) == chunk_rows:
                yield Chunk(first=row - len(records), records=records, record_lines=lines, size=r.read - reported)
                records, lines, reported = [], [], r.read
        if records or r.read > reported:
            yield Chunk(first=row - len(records), records=records, record_lines=lines, size=r.read - reported)


def chunk_records(source: Source, chunk: Chunk) -> Iterator[tuple[dict, str, int]]:
    """(record, location, row) of each record of a chunk; location is ``file:line`` or ``file:row N``
    (``file:row N (line L)`` in a JSON array), row the line number or the row (from 1)."""
    path = source.path
    if chunk.records is not None:
        for i, record in enumerate(chunk.records):
            row = chunk.first + i
            line = f" (line {chunk.record_lines[i]})" if chunk.record_lines else ""
            yield record, f"{path}:row {row}{line}", row
        return
    for i, raw in enumerate(chunk.lines.split(b"\n")):
        lineno = chunk.first + i
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
        if lineno == 1:
            line = line.removeprefix("\ufeff")  # a byte order mark some editors write
        if not line.strip():
            continue
        is_array = lineno == 1 and line.lstrip().startswith("[")
        array = "; the file is a JSON array, not one object a line: set file_type: json" * is_array
        try:
            record = json.loads(line, object_pairs_hook=unique_keys)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: malformed JSON: {e.msg} (column {e.colno}){array}") from None
        except DuplicateKey as e:
            raise DataError(f"{path}:{lineno}: {e}") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}{array}")
        yield record, f"{path}:{lineno}", lineno


def iter_records(source: Source) -> Iterator[tuple[dict, str]]:
    """Yield (record, location) pairs; location is ``file:line`` or ``file:row N``."""
    for chunk in iter_chunks(source):
        for record, where, _ in chunk_records(source, chunk):
            yield record, where
