"""Pre-tokenized records (``input_ids`` with ``labels`` or ``assistant_masks``, or alone: every token
supervised): validated against the tokenizer's vocabulary and taken as they are. Chat records are rendered by
``lit_hbp.data.encode``; ``lit_hbp.data.tokenize`` runs both over a source into the token cache."""

from __future__ import annotations

import numpy as np

from lit_hbp.data.records import TokenRecord
from lit_hbp.errors import DataError

IGNORE_INDEX = -100


def _integers(value, name: str, where: str, bools: bool = False) -> np.ndarray:
    """A flat list of integers (and booleans where ``bools``) as an int64 array, or a DataError."""
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        array = None
    kinds = "iub" if bools else "iu"
    if array is None or array.ndim != 1 or (array.size and array.dtype.kind not in kinds):
        raise DataError(f"{where}: {name} must be a flat list of integers, got {str(value)[:60]}")
    return array.astype(np.int64)


def pretokenized(record: TokenRecord, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, supervised mask) of a pre-tokenized record, checked against the vocabulary: ``labels``
    unshifted with -100 on unsupervised tokens (the Hugging Face convention), or ``assistant_masks``
    (1 on supervised tokens), or neither (every token supervised)."""
    where = record.where
    ids = _integers(record.input_ids, "input_ids", where)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise DataError(
            f"{where}: input_ids holds token id {bad}, outside the tokenizer's vocabulary (0..{vocab_size - 1}): "
            "was it tokenized with another tokenizer?"
        )
    target = np.ones(ids.size, dtype=bool)
    if record.labels is not None:
        labels = _integers(record.labels, "labels", where)
        if labels.shape != ids.shape:
            raise DataError(f"{where}: labels has {labels.size} entries for {ids.size} input_ids")
        target = labels != IGNORE_INDEX
        wrong = np.flatnonzero(target & (labels != ids))
        if wrong.size:
            t = int(wrong[0])
            raise DataError(
                f"{where}: labels[{t}] = {labels[t]} is neither {IGNORE_INDEX} nor input_ids[{t}] = {ids[t]}: labels "
                "are read unshifted, equal to input_ids where supervised (the Hugging Face convention)"
            )
    if record.assistant_masks is not None:
        mask = _integers(record.assistant_masks, "assistant_masks", where, bools=True)
        if mask.shape != ids.shape:
            raise DataError(f"{where}: assistant_masks has {mask.size} entries for {ids.size} input_ids")
        if not np.isin(mask, (0, 1)).all():
            raise DataError(f"{where}: assistant_masks must hold 0 and 1 only")
        if record.labels is not None and not np.array_equal(mask.astype(bool)[1:], target[1:]):
            t = 1 + int(np.flatnonzero(mask.astype(bool)[1:] != target[1:])[0])
            raise DataError(f"{where}: labels and assistant_masks disagree at token {t}: give one of them")
        target = mask.astype(bool)
    target[:1] = False
    return ids, target
