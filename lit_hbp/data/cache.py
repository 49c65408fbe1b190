"""The on-disk token cache of one source: written once, incrementally, and valid or absent.

Layout of ``<cache_dir>/<name>-<key>/``:

- ``ids.bin``: every kept sample's token ids, back to back, in the narrowest unsigned dtype that
  holds the vocabulary (uint16 up to 65,536 ids, else uint32);
- ``spans.bin``: the supervised runs of each sample as int32 ``[start, end)`` pairs relative to the
  sample's first token (a chat has one run per assistant turn: a few pairs a sample, not a byte a
  token);
- ``samples.npz``: per sample, its token offset, source row (file line or table row), supervised
  token count and span offset: what set-up reads, so set-up memory grows with samples, not tokens;
- ``media.json``: only for records with images or videos: each image's file, width and height, each
  video's frames (folder, list or file), frame size and count, and the pixels its encoder sees
  (samples.npz's ``media_offsets`` says whose), never the pixels themselves: the DataLoader workers load them;
- ``meta.json``: counts, dtype, skipped records, a digest of what the samples hold (``content``: their ids,
  supervised runs and media, so a resume can tell a source edited in place); written last.

The writer fills a hidden sibling folder and renames it into place when complete, so a reader sees
the whole cache or none. One process per cache writes it: ``cache_lock`` is an ``flock`` the kernel
releases when its holder dies, so a crashed writer never blocks the next one, and the next holder
removes the crashed writer's half-written folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from lit_hbp.errors import DataError

FILES = ("ids.bin", "spans.bin", "samples.npz", "meta.json")


def id_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding ids below ``vocab_size``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def mask_spans(target: np.ndarray) -> np.ndarray:
    """The ``[start, end)`` runs of True in a boolean mask, as an (n, 2) int32 array."""
    edges = np.diff(np.r_[np.int8(0), target.view(np.int8), np.int8(0)])
    return np.stack([np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)], axis=1).astype(np.int32)


def spans_mask(spans: np.ndarray, length: int) -> np.ndarray:
    """The boolean mask of ``length`` tokens that is True on ``spans`` (cut at ``length``); a sample
    has a few spans (its assistant turns), so a loop over them costs less than any token-sized temporary."""
    mask = np.zeros(length, bool)
    for a, b in spans.tolist():
        mask[a:b] = True
    return mask


def is_complete(folder: Path) -> bool:
    """A cache folder a reader may use: every file present and the arrays as long as ``meta.json`` says
    (a folder copied in part, or written by an older version, is not)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        return (
            (folder / "ids.bin").stat().st_size == meta["tokens"] * np.dtype(meta["id_dtype"]).itemsize
            and (folder / "spans.bin").stat().st_size == meta["spans"] * 8
            and (folder / "samples.npz").is_file()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


class CacheWriter:
    """Appends tokenized samples chunk by chunk into a hidden folder; ``commit`` renames it into place."""

    def __init__(self, folder: Path, vocab_size: int):
        self.folder = folder
        folder.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp-"))
        umask = os.umask(0)
        os.umask(umask)
        self.tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would hide the cache from other users' runs
        self.dtype = id_dtype(vocab_size)
        self._ids = open(self.tmp / "ids.bin", "wb")  # noqa: SIM115  (closed in commit/abort)
        self._spans = open(self.tmp / "spans.bin", "wb")  # noqa: SIM115
        self.tokens = self.n_spans = 0
        self._lengths: list[np.ndarray] = []
        self._rows: list[np.ndarray] = []
        self._supervised: list[np.ndarray] = []
        self._span_counts: list[np.ndarray] = []
        self._media_counts: list[np.ndarray] = []  # per sample: how many images and videos
        self._media: list[tuple] = []  # every image's and video's entry (``media.Image``, ``media.Video``)
        # what the samples hold, a digest per stream (not per chunk: another chunk size keeps it)
        self._content = {
            k: hashlib.blake2b(digest_size=16) for k in ("lengths", "span_counts", "ids", "spans", "media")
        }

    def append(
        self, ids: np.ndarray, lengths: np.ndarray, rows: np.ndarray, spans: np.ndarray, span_counts, media=None
    ) -> None:
        """One chunk: flat ids of its samples, their lengths and rows, flat spans and spans per sample,
        and per sample its images and videos (files and sizes, never pixels)."""
        self._media_counts.append(np.asarray([len(m) for m in media] if media else np.zeros(len(lengths)), np.int64))
        self._media += [m for ms in media or () for m in ms]
        if len(ids) and int(np.max(ids)) > np.iinfo(self.dtype).max:
            raise DataError(f"token id {int(np.max(ids))} does not fit the cache's {self.dtype.name} ids")
        ids_bytes, spans_bytes = (
            np.ascontiguousarray(ids, self.dtype).tobytes(),
            np.ascontiguousarray(spans, np.int32).tobytes(),
        )
        self._ids.write(ids_bytes)
        self._spans.write(spans_bytes)
        content = self._content
        content["lengths"].update(np.asarray(lengths, np.int64).tobytes())
        content["span_counts"].update(np.asarray(span_counts, np.int64).tobytes())
        content["ids"].update(ids_bytes)
        content["spans"].update(spans_bytes)
        for sample in media or ():
            content["media"].update(repr(_named(sample)).encode() + b"\n")
        self.tokens += int(ids.size)
        self.n_spans += int(spans.shape[0])
        span_counts = np.asarray(span_counts, np.int64)
        widths = (spans[:, 1] - spans[:, 0]).astype(np.int64)
        owner = np.repeat(np.arange(span_counts.size), span_counts)
        self._supervised.append(np.bincount(owner, weights=widths, minlength=span_counts.size).astype(np.int64))
        self._lengths.append(np.asarray(lengths, np.int64))
        self._rows.append(np.asarray(rows, np.int64))
        self._span_counts.append(span_counts)

    def commit(self, meta: dict) -> Path:
        """Finish the files and rename the folder into place (atomic: readers see all or nothing)."""
        for f in (self._ids, self._spans):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        span_counts = np.concatenate(self._span_counts) if self._span_counts else np.zeros(0, np.int64)
        arrays = dict(
            offsets=np.r_[0, np.cumsum(lengths)].astype(np.int64),
            rows=np.concatenate(self._rows) if self._rows else np.zeros(0, np.int64),
            supervised=np.concatenate(self._supervised) if self._supervised else np.zeros(0, np.int64),
            span_offsets=np.r_[0, np.cumsum(span_counts)].astype(np.int64),
        )
        if self._media:  # images: per sample an offset into media.json's (file, width, height) rows
            arrays["media_offsets"] = np.r_[0, np.cumsum(np.concatenate(self._media_counts))].astype(np.int64)
            (self.tmp / "media.json").write_text(json.dumps([list(m) for m in self._media]))
        np.savez(self.tmp / "samples.npz", **arrays)
        meta = {**meta, "samples": int(lengths.size), "tokens": self.tokens, "spans": self.n_spans}
        whole = hashlib.blake2b(self.dtype.name.encode(), digest_size=16)
        for part in self._content.values():
            whole.update(part.digest())
        meta["content"] = whole.hexdigest()
        (self.tmp / "meta.json").write_text(json.dumps({**meta, "id_dtype": self.dtype.name}, indent=1))
        if self.folder.exists():  # a stale folder that failed ``is_complete``: we hold the lock
            shutil.rmtree(self.folder)
        os.replace(self.tmp, self.folder)
        return self.folder

    def abort(self) -> None:
        for f in (self._ids, self._spans):
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _named(value):
    """A media entry with each absolute path as its file name: a cache rebuilt with the data under another root
    holds the same samples (``CacheWriter``'s content digest)."""
    if isinstance(value, str):
        return os.path.basename(value) if os.path.isabs(value) else value
    if isinstance(value, (list, tuple)):
        return [_named(v) for v in value]
    return value


def read_cache(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays) of a complete cache; the token-sized arrays are memory-mapped, never read."""
    meta = json.loads((folder / "meta.json").read_text())
    # Numbers only: an object array in a cache folder someone else wrote is refused, never unpickled.
    try:
        with np.load(folder / "samples.npz", allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except ValueError as e:
        raise DataError(
            f"{folder / 'samples.npz'}: {e} (lit-hbp's token cache holds numbers only, and a pickle is never "
            f"opened): remove {folder} and the run tokenizes its source again"
        ) from None
    if (folder / "media.json").exists():
        arrays["media"] = json.loads((folder / "media.json").read_text())
    for name, dtype, shape in (
        ("ids", meta["id_dtype"], (meta["tokens"],)),
        ("spans", np.int32, (meta["spans"], 2)),
    ):
        size = int(np.prod(shape))
        arrays[name] = (
            np.memmap(folder / f"{name}.bin", dtype=dtype, mode="r", shape=shape) if size else np.zeros(shape, dtype)
        )
    return meta, arrays


@contextmanager
def cache_lock(folder: Path, say=None) -> Iterator[None]:
    """Hold the lock of cache ``folder`` (``.locks/<name>.lock`` beside it), waiting for its holder if
    there is one (``say`` reports who); on entry, remove what a crashed writer left (its hidden folders)."""
    path = folder.parent / ".locks" / f"{folder.name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            if say is not None:
                say(f"waiting for {holder}, which is tokenizing into {folder}")
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:
            raise DataError(
                f"cannot lock {path} ({e.strerror}): data.cache_dir must be on a file system with file locks, "
                "shared by every rank that reads it"
            ) from None
        try:
            f.seek(0)
            f.truncate()
            f.write(f"{socket.gethostname()}:{os.getpid()} ({Path(sys.argv[0]).name or 'python'})")
            f.flush()
            for stale in folder.parent.glob(f".{folder.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)
