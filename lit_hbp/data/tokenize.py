"""Tokenize a source once, with the label mask of supervised tokens, and cache it on disk.

The cache of a source lives in ``cache_dir/<name>-<key>/`` (``lit_hbp.data.cache``) where the key hashes
the source file (path, size, mtime, ctime, inode), the tokenizer (vocabulary, special tokens, chat template, the date a
template prints), the versions of the libraries that render and split it, and the settings, so any change
re-tokenizes and a re-run with the same inputs only memory-maps the arrays. One process tokenizes a
cache, whatever the number of ranks and nodes; the others wait on its lock and read it. The source
streams from disk in chunks (``iter_chunks``), which ``num_proc`` worker processes tokenize while the
main process appends their results, in order, to the cache: memory is a few chunks, whatever the size of
the source.

Each record's tokens and supervised mask come from ``lit_hbp.data.encode`` (chats through the chat template,
pre-tokenized records checked against the vocabulary).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import sys
import tempfile
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import numpy as np

from lit_hbp.data.cache import CacheWriter, cache_lock, is_complete, mask_spans, read_cache, spans_mask
from lit_hbp.data.chat_templates import CHAT_TEMPLATES, resolve_chat_template  # noqa: F401  (public here too)
from lit_hbp.data.encode import TRAIN_ON, _Encoder  # noqa: F401  (TRAIN_ON: public here too)
from lit_hbp.data.media import Image, MediaExpander, Video, media_entry, processor_fingerprint
from lit_hbp.data.pretokenized import IGNORE_INDEX, pretokenized  # noqa: F401  (IGNORE_INDEX: public here too)
from lit_hbp.data.records import TokenRecord
from lit_hbp.data.sources import (
    CHUNK_BYTES,
    CHUNK_ROWS,
    Chunk,
    Source,
    check_source,
    chunk_records,
    iter_chunks,
    source_units,
)
from lit_hbp.data.tables import keyed_struct_fields
from lit_hbp.errors import ConfigError, DataError

# 5: no silent default chat template (caches of v4 may hold chats rendered with one).
# 6: narrow ids, supervised spans, per-sample counts (``lit_hbp.data.cache``).
# 7: record formats and tools, a token supervised when it overlaps a trained turn, table rows from 1,
#    metadata fields counted.
# 8: an assistant turn of a template with {% generation %} blocks trains what the blocks mark.
# 9: a video's row carries the frame rate its record gave its frames.
# 10: a table's rows without the other rows' null keys; text parts to a template that renders parts, as written.
# 11: tool-call arguments given as a JSON string go to the template as that string (they were parsed).
# 12: a tool_call_id the template does not render on a user or assistant message is refused (it was dropped).
# 13: image paths by the data file's folder made absolute (a source given relative to the run kept "./img/a.png").
# 14: a text record that starts with the tokenizer's BOS keeps it alone (the tokenizer's own was put before it); a
#     pre-tokenized record's null labels / assistant_masks refused (every token trained).
# 15: a table's pre-tokenized row with a null labels / assistant_masks cell refused (every token trained).
CACHE_VERSION = 15
# Below this much of a source, worker processes cost more to start than they save (num_proc=None).
PARALLEL_MIN_BYTES = 8 << 20
PARALLEL_MIN_ROWS = 8192
# A record with images or videos costs their decoding and encoding beside its bytes (about 6 ms for a 480 x 320
# image against 0.1 ms for a text record): with a checkpoint's processor, workers repay on a source this much smaller.
MEDIA_COST = 64

SKIP_REASONS = ("empty conversation", "no supervised token")


@dataclass
class TokenizedSource:
    """All kept samples of one source, as its cache holds them: ids split by ``offsets``, the
    supervised runs of sample i in ``spans[span_offsets[i]:span_offsets[i + 1]]``, and per sample its
    row and supervised count. ``ids`` and ``spans`` are memory-mapped: what set-up reads is per sample.
    ``metadata``: the record fields its format does not read, with how many records have each."""

    source: Source
    ids: np.ndarray
    offsets: np.ndarray
    rows: np.ndarray
    supervised: np.ndarray
    spans: np.ndarray
    span_offsets: np.ndarray
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_where: dict[str, list[str]] = field(default_factory=dict)
    metadata: dict[str, int] = field(default_factory=dict)
    from_cache: bool = False
    folder: Path | None = None
    # a sample's images and videos: rows media_offsets[i]:media_offsets[i + 1] of media (``media.media_entry``)
    media_offsets: np.ndarray | None = None
    media: list | None = None
    token_types: bool = False  # its processor marks image tokens in mm_token_type_ids
    content: str | None = None  # a digest of what its samples hold (``CacheWriter``): a resume tells an edit

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getstate__(self) -> dict:
        """Pickled (a DataLoader worker started by spawn or forkserver) without the token arrays, which
        the copy maps again from ``folder``: a memory map pickles as its whole data otherwise."""
        state = dict(self.__dict__)
        if self.folder is not None and self.folder.is_dir():
            state.update(ids=None, spans=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.ids is None:
            _, arrays = read_cache(self.folder)
            self.ids, self.spans = arrays["ids"], arrays["spans"]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sample_spans(self, row: int) -> np.ndarray:
        """The supervised ``[start, end)`` runs of sample ``row`` (relative to its first token)."""
        return np.asarray(self.spans[self.span_offsets[row] : self.span_offsets[row + 1]])

    def loss_tokens(self, rows: np.ndarray | None = None, window: tuple | None = None) -> np.ndarray:
        """Supervised targets of samples ``rows`` (all when None), from their spans alone; with
        ``window`` = (starts, length), only those a sample cut to tokens [start, start + length) keeps:
        the window's first token is no target (nothing before it predicts it)."""
        if window is None:
            return self.supervised if rows is None else self.supervised[rows]
        rows = np.arange(len(self)) if rows is None else np.asarray(rows, np.int64)
        counts = self.span_offsets[rows + 1] - self.span_offsets[rows]
        first = np.repeat(self.span_offsets[rows] - np.cumsum(counts) + counts, counts)
        spans = np.asarray(self.spans[first + np.arange(int(counts.sum()))], np.int64)
        starts, length = (np.broadcast_to(np.asarray(x, np.int64), rows.shape) for x in window)
        lo, hi = np.repeat(starts + 1, counts), np.repeat(starts + length, counts)
        width = np.maximum(np.minimum(spans[:, 1], hi) - np.maximum(spans[:, 0], lo), 0)
        return np.bincount(np.repeat(np.arange(rows.size), counts), weights=width, minlength=rows.size).astype(np.int64)

    def sample(self, row: int, length: int | None = None, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and supervised mask of sample ``row``, tokens [start, start + length) of it when
        given (a truncated sample); the first token is never supervised."""
        a, b = int(self.offsets[row]) + int(start), int(self.offsets[row + 1])
        n = b - a if length is None else min(int(length), b - a)
        spans = self.sample_spans(row) - int(start)
        mask = spans_mask(np.clip(spans, 0, n), n)
        mask[:1] = False
        return np.asarray(self.ids[a : a + n]), mask

    def sample_media(self, row: int) -> list[Image | Video]:
        """The images and videos of sample ``row`` (``media.Image``, ``media.Video``)."""
        if self.media_offsets is None:
            return []
        return [media_entry(m) for m in self.media[self.media_offsets[row] : self.media_offsets[row + 1]]]

    def where(self, i: int) -> str:
        """File and line (or row) a sample came from."""
        row = int(self.rows[i])
        return f"{self.source.path}:row {row}" if self.source.is_table else f"{self.source.path}:{row}"


# The tokenizer's settings that change the ids of the same text (``split_special_tokens``: a chat's special
# tokens as text), each part of the cache key.
ENCODING_FLAGS = ("add_bos_token", "add_eos_token", "add_prefix_space", "split_special_tokens")


def id_bound(tokenizer) -> int:
    """One past the largest token id: ``len(tokenizer)`` counts tokens, and a vocabulary with a gap in its ids
    (added tokens numbered past the rest) has ids at or above it, which the cache and the embedding must hold."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of everything about a tokenizer that changes the token ids we produce: its whole
    pipeline (normalizer, pre-tokenizer, model and merges, post-processor), special tokens and
    their ids, BOS/EOS handling and the chat template."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(
        backend.to_str().encode() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items())).encode()
    )
    specials = {str(t): tokenizer.convert_tokens_to_ids(str(t)) for t in tokenizer.all_special_tokens}
    h.update(json.dumps(sorted(specials.items())).encode())
    h.update(json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]).encode())
    flags = {k: tokenizer.init_kwargs.get(k, getattr(tokenizer, k, None)) for k in ENCODING_FLAGS}
    h.update(json.dumps(flags, sort_keys=True, default=str).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()


def renderer_versions() -> dict[str, str]:
    """The versions of the libraries that turn a record into ids (the chat template's jinja, transformers'
    rendering and processors, the tokenizers pipeline): an upgrade may render or split the same record
    otherwise, so it re-tokenizes rather than reading the ids the old versions gave (part of the cache key)."""
    return {name: version(name) for name in ("jinja2", "tokenizers", "transformers")}


# A chat template's call of transformers' ``strftime_now`` with a literal format (Llama 3.2's "%d %b %Y").
STRFTIME_NOW = re.compile(r"""strftime_now\s*\(\s*(['"])(.*?)\1\s*\)""")


def template_dates(tokenizer) -> list[str]:
    """What the chat template's ``strftime_now`` calls print now (Llama 3.2/3.3, Mistral Small 3, Granite 3,
    SmolLM3, gpt-oss write today's date), by the clock transformers renders with: part of the cache key, so a
    later day re-tokenizes rather than reading the tokens of the day they were rendered (a format that is no
    literal: the time to the second)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    template = "\n".join(template.values()) if isinstance(template, dict) else template  # named templates
    if "strftime_now" not in template:
        return []
    from transformers.utils import chat_template_utils

    now = chat_template_utils.datetime.now()
    formats = [m.group(2) for m in STRFTIME_NOW.finditer(template)]
    if len(re.findall(r"strftime_now\s*\(", template)) > len(formats):
        formats.append("%Y-%m-%dT%H:%M:%S")
    return [now.strftime(f) for f in formats]


def _source_stat(path: Path) -> list:
    """Each file's path, size, mtime, ctime and inode: a new version that keeps the size and mtime (``cp -p``,
    ``rsync -a``, a tarball with fixed mtimes, a rewrite within one timestamp tick) still changes the ctime or
    the inode, so it re-tokenizes rather than training the old version's tokens (a ``chmod`` re-tokenizes too)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stats = [(p, p.stat()) for p in files]
    return [(str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino) for p, st in stats]


def cache_key(source: Source, tokenizer, train_on: str, label: str | None = None, processor=None) -> str:
    """Hash of the source's files (path, size, mtime, ctime, inode), how they are read (file type, record format,
    field and role names, split, subset), the tokenizer, the dates its chat template prints, the rendering
    libraries' versions and the settings; raises a DataError naming the source (``label``) if its path cannot be
    read."""
    check_source(source, label)
    path = source.local_path.resolve()
    payload = dict(
        version=CACHE_VERSION,
        files=_source_stat(path),
        file_type=source.resolved_file_type,
        format=source.format,
        fields=source.fields,
        roles=source.roles,
        split=source.split,
        subset=source.subset,
        tokenizer=tokenizer_fingerprint(tokenizer),
        dates=template_dates(tokenizer),
        libraries=renderer_versions(),
        train_on=train_on,
    )
    if processor is not None:  # how many tokens an image becomes
        payload["images"] = processor_fingerprint(processor)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


@dataclass
class ChunkResult:
    """What one chunk adds to the cache (``CacheWriter.append``), to the skip counts and to the counts
    of metadata fields."""

    ids: np.ndarray
    lengths: np.ndarray
    rows: np.ndarray
    spans: np.ndarray
    span_counts: np.ndarray
    records: int
    skipped: list[tuple[str, str]]
    metadata: dict[str, int]
    size: int
    media: list[list[Image | Video]] = field(default_factory=list)  # per kept sample
    token_types: bool = False  # the processor returned mm_token_type_ids for its images and videos
    roles: set[str] = field(default_factory=set)  # the role names the chunk's records use
    fields: set[str] = field(default_factory=set)  # the source's ``fields`` names the chunk's records have


class ChunkTokenizer:
    """Tokenizes chunks of a source: in the main process or in each worker process. With the
    checkpoint's ``processor``, records with images and videos are expanded as the processor does."""

    def __init__(self, tokenizer, train_on: str, processor=None):
        self.encoder = _Encoder(tokenizer, train_on)
        self.vocab_size = id_bound(tokenizer)
        self.expander = MediaExpander(processor) if processor is not None else None

    def __call__(self, source: Source, chunk: Chunk) -> ChunkResult:
        reader = source.reader()
        kept: list[tuple[int, str, np.ndarray, np.ndarray, list]] = []
        skipped: list[tuple[str, str]] = []
        pending: list[tuple[int, tuple]] = []
        metadata: dict[str, int] = {}
        records = 0
        for record, where, row in chunk_records(source, chunk):
            records += 1
            read, extra = reader.read(record, where)
            for key in extra:
                metadata[key] = metadata.get(key, 0) + 1
            if isinstance(read, TokenRecord):
                ids, target = pretokenized(read, self.vocab_size)
                if self.expander is not None:  # ids holding image tokens, with no images to fill them
                    self.expander.refuse_placeholders(ids, where)
                kept.append((row, where, ids, target, []))
                continue
            if (read.images or read.videos) and self.expander is None:
                what = f"{len(read.images)} image(s)" if read.images else f"{len(read.videos)} video(s)"
                raise DataError(
                    f"{where}: the record has {what} and the tokenizer folder has no processor for them: give the "
                    "vision-language checkpoint's folder (its processor's files) as data.tokenizer"
                )
            prepared = self.encoder.prepare(read)
            if isinstance(prepared, str):
                skipped.append((prepared, where))
            else:
                pending.append((row, where, prepared, read))
        encoded = self.encoder.encode_batch([p[2] for p in pending]) if pending else []
        for (row, where, prepared, read), (ids, target) in zip(pending, encoded):
            media: list = []
            if read.images or read.videos:
                ids, target, media = self.expander(prepared[0], ids, target, read.images, read.videos, where)
            elif self.expander is not None:
                self.expander.refuse_placeholders(ids, where)
            kept.append((row, where, ids, target, media))
        kept.sort(key=lambda k: k[0])
        out_ids, lengths, rows, spans, counts, out_media = [], [], [], [], [], []
        for row, where, ids, target, media in kept:
            if not target.any():
                skipped.append(("no supervised token", where))
                continue
            out_media.append(media)
            runs = mask_spans(target)
            out_ids.append(ids)
            lengths.append(ids.size)
            rows.append(row)
            spans.append(runs)
            counts.append(len(runs))
        return ChunkResult(
            ids=np.concatenate(out_ids) if out_ids else np.zeros(0, np.int64),
            lengths=np.asarray(lengths, np.int64),
            rows=np.asarray(rows, np.int64),
            spans=np.concatenate(spans) if spans else np.zeros((0, 2), np.int32),
            span_counts=np.asarray(counts, np.int64),
            records=records,
            skipped=skipped,
            metadata=metadata,
            size=chunk.size,
            media=out_media,
            token_types=self.expander is not None and self.expander.token_types,
            roles=reader.roles_met,
            fields=reader.fields_met,
        )


_WORKER: ChunkTokenizer | None = None


def _start_worker(tokenizer, train_on: str, processor=None) -> None:
    global _WORKER
    # One thread per worker: the workers are the parallelism (the fast tokenizer's own thread pool
    # would oversubscribe the cores).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = ChunkTokenizer(tokenizer, train_on, processor)


def _worker_context():
    """Fork where the platform has it (as ``datasets.map(num_proc=...)`` does): a forked worker has the
    tokenizer already, starts in milliseconds, and does not re-run the user's main module, which
    spawn does (a script without an ``if __name__ == "__main__"`` guard would start itself again).
    The workers only tokenize: they never touch torch, CUDA or the parent's threads."""
    import multiprocessing

    return multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


def _work(source: Source, chunk: Chunk) -> ChunkResult:
    return _WORKER(source, chunk)


def cores() -> int:
    """The cores this process may run on (its affinity, not the whole machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_num_proc(num_proc: int | None) -> None:
    """A short ConfigError for a ``num_proc`` below 1 (None: every core)."""
    if num_proc is not None and num_proc < 1:
        raise ConfigError(f"data.num_proc must be >= 1 (or null: every core), got {num_proc}")


def worker_count(source: Source, num_proc: int | None, media: bool = False) -> int:
    """Worker processes for ``source``: ``num_proc`` when given (1: the main process tokenizes), else
    every core, except for a source too small to repay starting them (``media``: records read with a
    vision-language checkpoint's processor, whose images make each record ``MEDIA_COST`` times dearer)."""
    check_num_proc(num_proc)
    if num_proc is not None:
        return num_proc
    total, unit = source_units(source)
    small = total < (PARALLEL_MIN_BYTES if unit == "B" else PARALLEL_MIN_ROWS) // (MEDIA_COST if media else 1)
    return 1 if small else cores()


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def tokenize_source(
    source: Source,
    tokenizer,
    train_on: str = "assistant",
    cache_dir: str | Path | None = None,
    progress: bool = True,
    label: str | None = None,
    num_proc: int | None = None,
    processor=None,
) -> TokenizedSource:
    """Tokenize ``source`` (or read its cache). Skipped samples are counted by reason. ``label``
    (e.g. ``sources[1]``) names the source in the error raised when its path cannot be read.
    ``num_proc``: worker processes (None: every core for a large source, the main process for a
    small one). Without ``cache_dir`` the cache is written to a temporary folder and read from there.
    ``processor``: the vision-language checkpoint's, for records with images and videos (``lit_hbp.data.media``)."""
    check_source(source, label)
    if cache_dir is None:
        with tempfile.TemporaryDirectory(prefix="lit-hbp-tokens-") as tmp:
            # The arrays stay memory-mapped after the folder is removed (POSIX keeps unlinked files).
            return tokenize_source(source, tokenizer, train_on, tmp, progress, label, num_proc, processor)
    key = cache_key(source, tokenizer, train_on, label, processor)
    folder = Path(cache_dir) / f"{Path(source.path).stem}-{key}"
    if is_complete(folder):
        return _load(folder, source)
    with cache_lock(folder, say=_say if progress else None):
        if is_complete(folder):  # the process we waited for wrote it
            return _load(folder, source)
        workers = worker_count(source, num_proc, media=processor is not None)
        _write(folder, source, tokenizer, train_on, progress, workers, processor)
    return _load(folder, source, from_cache=False)


def _write(
    folder: Path, source: Source, tokenizer, train_on: str, progress: bool, workers: int, processor=None
) -> None:
    """Tokenize ``source`` chunk by chunk into the cache ``folder`` (we hold its lock)."""
    from tqdm.auto import tqdm

    run = ChunkTokenizer(tokenizer, train_on, processor)  # checks the settings before any worker starts
    _say_keyed_structs(source)
    writer = CacheWriter(folder, id_bound(tokenizer))
    skipped = dict.fromkeys(SKIP_REASONS, 0)
    skipped_where: dict[str, list[str]] = {r: [] for r in SKIP_REASONS}
    metadata: dict[str, int] = {}
    records = 0
    token_types = False
    roles: set[str] = set()
    fields: set[str] = set()
    started = time.perf_counter()
    total, unit = source_units(source)
    # records with images come in smaller chunks, which keep every worker busy on a source of a few MB
    chunks = {}
    if processor is not None:
        chunks = dict(chunk_bytes=CHUNK_BYTES // MEDIA_COST, chunk_rows=CHUNK_ROWS // MEDIA_COST)
    pool = None
    # A context: a bad record closes the bar (ends its line) before its error is printed.
    with tqdm(
        total=total, unit=unit, unit_scale=unit == "B", disable=not progress,
        desc=f"tokenizing {Path(source.path).name}" + (f" ({workers} processes)" if workers > 1 else ""),
    ) as bar:  # fmt: skip
        try:
            if workers > 1:
                from concurrent.futures import ProcessPoolExecutor

                pool = ProcessPoolExecutor(workers, _worker_context(), _start_worker, (tokenizer, train_on, processor))
                results = _in_order(pool, source, 2 * workers, **chunks)
            else:
                results = (run(source, chunk) for chunk in iter_chunks(source, **chunks))
            for result in results:
                writer.append(result.ids, result.lengths, result.rows, result.spans, result.span_counts, result.media)
                records += result.records
                token_types |= result.token_types
                roles |= result.roles
                fields |= result.fields
                for reason, where in result.skipped:
                    skipped[reason] += 1
                    skipped_where[reason].append(where)
                for key, n in result.metadata.items():
                    metadata[key] = metadata.get(key, 0) + n
                bar.update(result.size)
                bar.set_postfix_str(f"{records:,} records, {writer.tokens:,} tokens", refresh=False)
        except BaseException:
            writer.abort()
            raise
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
    if records == 0:  # as a 0-byte file is refused: a source of blank lines or no rows is a wrong file
        writer.abort()
        raise DataError(
            f"data source {source.path} holds no records (blank lines or no rows): remove it from the list or give "
            "the right file"
        )
    unmet = sorted(set(source.roles or ()) - roles)
    if unmet:  # a mapping that renames nothing is a typo or another data set's: it would do nothing
        writer.abort()
        used = ", ".join(sorted(roles)) or "none (its records have no roles)"
        raise ConfigError(
            f"data source {source.path}: roles maps {', '.join(map(repr, unmet))}, a role no record has (its "
            f"records' roles: {used}): fix the name or drop it from roles"
        )
    unnamed = {k: v for k, v in (source.fields or {}).items() if v not in fields}
    if unnamed:  # as for roles: the records' own field would go untrained as metadata, or the option does nothing
        writer.abort()
        said = ", ".join(f"{k} to {v!r}" for k, v in unnamed.items())
        unread = f" (the fields its records have and lit-hbp does not read: {', '.join(sorted(metadata))})"
        raise ConfigError(
            f"data source {source.path}: fields renames {said}, a field no record has{unread if metadata else ''}: "
            "fix the name or drop it from fields"
        )
    writer.commit(
        dict(
            version=CACHE_VERSION,
            source=str(source.path),
            records=records,
            skipped=skipped,
            skipped_where=skipped_where,
            metadata=metadata,
            tokenized_by=f"{socket.gethostname()}:{os.getpid()}",
            processes=workers,
            seconds=round(time.perf_counter() - started, 3),
            token_types=token_types,
        )
    )


def _say_keyed_structs(source: Source) -> None:
    """Warn where a table source holds tool parameters or call arguments as struct columns (``keyed_struct_fields``):
    its rows render with the column's key order and number type, not always their records' own."""
    if source.resolved_file_type not in ("parquet", "arrow", "hf", "hub") or source.format in ("tokens", "text"):
        return
    keyed = keyed_struct_fields(source)
    if keyed:
        warnings.warn(
            f"data source {source.path}: its table holds {', '.join(keyed)} as struct columns, which keep one key "
            "order and one number type per column (the first rows' order; 1 beside another row's 1.5 reads 1.0): a "
            "record that wrote its keys in another order, or a whole number, renders otherwise than it wrote them; "
            "store them as JSON strings (OpenAI's arguments) to keep each record's own",
            stacklevel=3,
        )


def _in_order(pool, source: Source, window: int, **chunks):
    """The chunks' results in source order, with at most ``window`` chunks in flight (bounded memory)."""
    futures: deque = deque()
    for chunk in iter_chunks(source, **chunks):
        futures.append(pool.submit(_work, source, chunk))
        if len(futures) >= window:
            yield futures.popleft().result()
    while futures:
        yield futures.popleft().result()


def _load(folder: Path, source: Source, from_cache: bool = True) -> TokenizedSource:
    meta, a = read_cache(folder)
    written, given = f"{meta.get('source')}:", f"{source.path}:"  # the cache is by the file, not how a run names it
    where = {r: [given + w.removeprefix(written) if w.startswith(written) else w for w in ws] for r, ws in
             meta["skipped_where"].items()}  # fmt: skip
    return TokenizedSource(
        source=source,
        ids=a["ids"],
        offsets=a["offsets"],
        rows=a["rows"],
        supervised=a["supervised"],
        spans=a["spans"],
        span_offsets=a["span_offsets"],
        skipped=meta["skipped"],
        skipped_where=where,
        metadata=meta["metadata"],
        from_cache=from_cache,
        folder=folder,
        media_offsets=a.get("media_offsets"),
        media=a.get("media"),
        token_types=bool(meta.get("token_types", False)),
        content=meta.get("content"),
    )
