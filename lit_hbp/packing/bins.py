"""Lengths in, bins out (numpy only): reading and validating the length arrays every packer and
plan starts from, and the CSR storage of bins."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Bins:
    """Bins in CSR form: bin b holds ``members[offsets[b]:offsets[b + 1]]``."""

    members: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def loads(self, lengths: np.ndarray) -> np.ndarray:
        """Tokens per bin (or any per-member weight's sum: floats stay floats)."""
        out = np.zeros(len(self), dtype=np.result_type(np.asarray(lengths).dtype, np.int64))
        nonempty = self.sizes() > 0
        if self.members.size:
            out[nonempty] = np.add.reduceat(lengths[self.members], self.offsets[:-1][nonempty])
        return out

    def as_list(self) -> list[np.ndarray]:
        return np.split(self.members, self.offsets[1:-1]) if len(self) else []

    @staticmethod
    def from_assignment(bin_of: np.ndarray, n_bins: int, items: np.ndarray | None = None) -> Bins:
        """Build bins from a bin id per item (-1 = not placed), keeping item order within a bin."""
        placed = np.flatnonzero(bin_of >= 0)
        ids = bin_of[placed]
        order = np.argsort(ids, kind="stable")
        members = placed[order] if items is None else items[placed[order]]
        offsets = np.zeros(n_bins + 1, dtype=np.int64)
        np.cumsum(np.bincount(ids, minlength=n_bins), out=offsets[1:])
        return Bins(members.astype(np.int64, copy=False), offsets)


def check_lengths(lengths, capacity: int | None = None, what: str = "lengths") -> np.ndarray:
    """Return lengths as int64, or raise naming the first offending sample indices."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array of token counts, got shape {arr.shape}")
    if arr.dtype.kind not in "iuf" and arr.size:
        raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            raise ValueError(f"{what} must be integers: {describe_indices(bad, arr)}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr < 0)
    if bad.size:
        raise ValueError(f"{what} must be >= 0: negative at {describe_indices(bad, arr)}")
    if capacity is not None:
        bad = np.flatnonzero(arr > capacity)
        if bad.size:
            raise ValueError(f"{bad.size} item(s) longer than the capacity {capacity}: {describe_indices(bad, arr)}")
    return arr


def describe_indices(bad: np.ndarray, arr: np.ndarray, limit: int = 5) -> str:
    """The first offending indices and their values, for error messages."""
    shown = ", ".join(f"index {int(i)} = {arr[i]}" for i in bad[:limit])
    return shown + (f" and {bad.size - limit} more" if bad.size > limit else "")


LENGTHS_FORMS = ".npy, or one integer a line"  # what a lengths file may be (errors name them)


def load_lengths(path: str | Path) -> np.ndarray:
    """Read lengths from .npy or from a text file with one integer per line (errors name the line), checked
    (``check_lengths``: one row of whole token counts >= 0, errors naming the file), at least one. A folder,
    or a file of neither form, is refused naming the path (numpy's and Python's own errors name neither)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"lengths file not found: {path}")
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a lengths file ({LENGTHS_FORMS})")
    if path.suffix == ".npy":
        try:
            lengths = np.load(path, allow_pickle=False)
        except (ValueError, EOFError):  # numpy's words name no file (and advise unpickling it); an empty file
            raise ValueError(f"{path}: not a .npy array of lengths that numpy reads without pickle") from None
    else:
        lengths = _text_lengths(path)
    if not np.asarray(lengths).size:
        raise ValueError(f"{path} holds no sample lengths")
    return check_lengths(lengths, what=str(path))


def _text_lengths(path: Path) -> np.ndarray:
    values = []
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                text = line.strip()
                if not text:
                    continue
                try:
                    values.append(int(text))
                except ValueError:
                    raise ValueError(f"{path}:{lineno}: not an integer length: {text!r}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file of lengths ({LENGTHS_FORMS})") from None
    return np.asarray(values, dtype=np.int64)
