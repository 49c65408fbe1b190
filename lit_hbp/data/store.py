"""The epoch's sample table: sources mixed by repeat or weight, over-length samples handled.

A global sample id maps to (source, row). Repeats make several ids point at one row; the planner
treats them as separate samples, so a repeated sample is trained on twice, never silently once. The
report and the summary count, per source, what is left after the validation hold-out and the
over-length policy: the samples and tokens that really train (or validate). Everything here is per
sample (lengths and supervised counts come from the caches' per-sample arrays), so a store of a
billion tokens costs tens of bytes a sample, not bytes a token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import numpy as np

from lit_hbp.data.media import media_entry
from lit_hbp.data.tokenize import TokenizedSource
from lit_hbp.errors import ConfigError, DataError
from lit_hbp.packing.plan import OVER_LENGTH

# The report's lists of samples the over-length policy removed or cut: one ``file:line`` entry per
# occurrence in the epoch (a record of a source with repeat 2 is listed twice). Beside each list the
# report keeps ``<name>_distinct``, the number of distinct records among them.
OVER_LENGTH_LISTS = ("dropped", "truncated", "truncated_to_nothing")


def distinct(where: list[str]) -> list[str]:
    """The distinct records of a list of sample locations, in first-seen order."""
    return list(dict.fromkeys(where))


OVER_LENGTH_FIX = "Add a larger level, or set over_length: drop | truncate"


def count_phrase(n: int, n_distinct: int) -> str:
    """'40 sample(s) (20 distinct records, repeated in the epoch)': occurrences alone mislead when
    sources repeat, since one long record of a source with repeat 2 is two dropped samples."""
    repeated = ", repeated in the epoch" if n_distinct < n else ""
    return f"{n} sample(s) ({n_distinct} distinct record{'s' if n_distinct != 1 else ''}{repeated})"


def _empty_over_length_report() -> dict:
    return {**{k: [] for k in OVER_LENGTH_LISTS}, **{f"{k}_distinct": 0 for k in OVER_LENGTH_LISTS}, "truncation": []}


def truncation_window(spans: np.ndarray, length: int, max_len: int) -> int:
    """Where the ``max_len`` tokens kept of a sample of ``length`` start: the window holding the most
    supervised targets (its first token is none: nothing before it predicts it), the earliest of
    those, so it keeps the most context before them. A document question whose answer ends the sample
    keeps its end (question and answer) and cuts the document's start; a sample supervised
    throughout keeps its first tokens. ``spans``: the sample's sorted, disjoint supervised runs.

    The count of a window is piecewise linear in its start, so the earliest best start is 0 or a
    point where a window edge meets a span edge: a few candidates per span, no token-sized array."""
    last = length - max_len
    spans = np.asarray(spans, np.int64).reshape(-1, 2)
    if last <= 0 or not len(spans):
        return 0
    a, b = spans[:, 0], spans[:, 1]
    before_span = np.r_[0, np.cumsum(b - a)]

    def supervised_before(x: np.ndarray) -> np.ndarray:  # supervised tokens in [0, x)
        j = np.searchsorted(b, x, side="right")  # spans wholly before x
        inside = np.maximum(x - a[np.minimum(j, len(a) - 1)], 0) * (j < len(a))
        return before_span[j] + inside

    starts = np.unique(np.clip(np.r_[0, last, a - 1, b - 1, a - max_len, b - max_len], 0, last))
    kept = supervised_before(starts + max_len) - supervised_before(starts + 1)
    return int(starts[np.argmax(kept)])


def mixture_repeats(sizes: list[int], repeats: list[float | None], weights: list[float | None]) -> list[float]:
    """Repeat factor per source. Weights share the total sample count of all sources (each share a whole count
    of samples, the total kept exactly); sources with neither repeat nor weight enter once."""
    if any(w is not None for w in weights) and any(r is not None for r in repeats):
        raise ConfigError("mix sources by repeat or by weight, not both")
    if any(w is not None for w in weights):
        if any(w is None for w in weights):
            raise ConfigError("when one source has a weight, every source needs one")
        total_w, total_n = sum(weights), sum(sizes)
        if total_w <= 0:
            raise ConfigError(f"source weights must not all be zero: {weights}")
        for i, (w, n) in enumerate(zip(weights, sizes)):
            if w > 0 and n == 0:  # its share would be left out of the epoch, the others' shares kept as they are
                raise ConfigError(
                    f"data.sources[{i}] has weight {w} but no sample (every record skipped: see the data report); "
                    "fix the source or drop it from the mix"
                )
        shares = np.asarray(weights, float) / total_w * total_n
        counts = np.floor(shares).astype(np.int64)  # whole samples, then the largest remainders: the total kept
        counts[np.argsort(-(shares - counts), kind="stable")[: total_n - int(counts.sum())]] += 1
        return [int(c) / n if n else 0.0 for c, n in zip(counts, sizes)]
    return [1.0 if r is None else float(r) for r in repeats]


def _per_sample(sources: list[TokenizedSource], source_of: np.ndarray, row_of: np.ndarray) -> tuple[np.ndarray, ...]:
    """(length, supervised tokens) of each (source, row) sample, from the caches' per-sample arrays."""
    lengths = np.zeros(source_of.size, np.int64)
    loss = np.zeros(source_of.size, np.int64)
    for k, s in enumerate(sources):
        sel = source_of == k
        lengths[sel] = s.lengths[row_of[sel]]
        loss[sel] = s.loss_tokens(row_of[sel])
    return lengths, loss


@dataclass
class SampleStore:
    """Global sample ids over tokenized sources, with effective (possibly truncated) lengths."""

    sources: list[TokenizedSource]
    source_of: np.ndarray
    row_of: np.ndarray
    lengths: np.ndarray
    loss_tokens: np.ndarray
    report: dict = field(default_factory=dict)
    starts: np.ndarray | None = None  # per sample, its first token kept (truncation), else 0

    PER_SAMPLE = ("source_of", "row_of", "lengths", "loss_tokens", "starts")

    def __post_init__(self) -> None:
        if self.starts is None:
            self.starts = np.zeros(self.lengths.size, np.int64)

    @classmethod
    def build(
        cls, sources: list[TokenizedSource], max_len: int | None, over_length: str = "error", seed: int = 0
    ) -> SampleStore:
        """Mix the sources and apply the over-length policy (error / drop / truncate) for samples
        longer than ``max_len`` (None: not yet, e.g. before the levels are chosen)."""
        if over_length not in OVER_LENGTH:
            raise ConfigError(f"over_length must be one of {OVER_LENGTH}, got {over_length!r}")
        reps = mixture_repeats(
            [len(s) for s in sources], [s.source.repeat for s in sources], [s.source.weight for s in sources]
        )
        rng = np.random.default_rng(seed)
        src, rows, mixed = [], [], []
        for k, (s, r) in enumerate(zip(sources, reps)):
            n = len(s)
            whole, frac = int(r), r - int(r)
            part = np.sort(rng.permutation(n)[: int(round(frac * n))])
            chosen = np.r_[np.tile(np.arange(n), whole), part].astype(np.int64)
            weight = s.source.weight
            if weight is not None and weight > 0 and n > 0 and chosen.size == 0:
                total = sum(x.source.weight for x in sources) or 1.0
                share = weight / total * sum(len(x) for x in sources)
                raise ConfigError(
                    f"sources[{k}] ({s.source.path}): its weight {weight} shares {share:.3g} of the epoch's samples, "
                    "which the apportionment to whole samples rounds to none (each source's share a whole count, the "
                    "total kept): give it a larger weight, or remove the source"
                )
            if r > 0 and n > 0 and chosen.size == 0:  # a repeat (a weight's whole share is refused above)
                raise ConfigError(
                    f"sources[{k}] ({s.source.path}): its repeat {s.source.repeat} takes {r * n:.3g} of its {n} "
                    f"samples into an epoch, which rounds to none: it needs a repeat of at least {0.5 / n:.3g}, or "
                    "remove the source"
                )
            src.append(np.full(chosen.size, k, dtype=np.int64))
            rows.append(chosen)
            mixed.append(
                dict(
                    path=s.source.path,
                    samples=n,
                    repeat=r,
                    in_epoch=int(chosen.size),
                    skipped=dict(s.skipped),
                    skipped_where={k2: list(v) for k2, v in s.skipped_where.items()},
                    metadata_fields=dict(s.metadata),
                )
            )
        source_of, row_of = np.concatenate(src), np.concatenate(rows)
        if source_of.size == 0:
            raise DataError(
                "no training samples: every source is empty or was skipped entirely "
                f"({[(m['path'], m['skipped']) for m in mixed]})"
            )
        lengths, loss = _per_sample(sources, source_of, row_of)
        store = cls(sources, source_of, row_of, lengths, loss, dict(sources=mixed))
        store.report.update(over_length=over_length, max_len=max_len, **_empty_over_length_report())
        if max_len is not None:
            store.apply_over_length(max_len, over_length)
        return store

    @classmethod
    def from_rows(cls, sources: list[TokenizedSource], source_of: np.ndarray, row_of: np.ndarray) -> SampleStore:
        """The samples (source, row) given, each once: a validation set."""
        source_of, row_of = np.asarray(source_of, np.int64), np.asarray(row_of, np.int64)
        lengths, loss = _per_sample(sources, source_of, row_of)
        mixed = [dict(path=s.source.path, samples=len(s), selected=int((source_of == k).sum()),
                      skipped=dict(s.skipped), skipped_where={k2: list(v) for k2, v in s.skipped_where.items()},
                      metadata_fields=dict(s.metadata))
                 for k, s in enumerate(sources)]  # fmt: skip
        report = dict(sources=mixed, over_length=None, max_len=None, **_empty_over_length_report())
        return cls(list(sources), source_of, row_of, lengths, loss, report)

    def hold_out(self, fraction: float, seed: int) -> tuple[SampleStore, np.ndarray, np.ndarray]:
        """Move a seeded ``fraction`` of the records (source, row), every repeat of them and every copy (a
        record whose tokens, supervision and media equal a chosen one's, on another line or in another
        source), out of this store: (the rest, held-out source ids, held-out row ids, each record once).
        Training and validation never share a sample, whatever the repeats and duplicates."""
        if not 0 < fraction < 1:
            raise ConfigError(f"val_fraction must be between 0 and 1, got {fraction}")
        width = int(self.row_of.max()) + 1  # (source, row) as one sortable key: the records in (source, row) order
        unique = np.unique(self.source_of * width + self.row_of)
        records = np.stack([unique // width, unique % width], axis=1)
        n_val = max(1, int(round(fraction * len(records))))
        if n_val >= len(records):
            raise DataError(f"val_fraction {fraction} leaves no training record of {len(records)}")
        chosen = records[np.sort(np.random.default_rng(seed).permutation(len(records))[:n_val])]
        chosen, copies = self._with_copies(records, chosen)
        if len(chosen) >= len(records):
            raise DataError(
                f"val_fraction {fraction} leaves no training record of {len(records)}: with their copies "
                f"({copies} records equal to a held-out one) every record is held out"
            )
        held = np.isin(self.source_of * width + self.row_of, chosen[:, 0] * width + chosen[:, 1])
        keep = ~held
        per_source = np.bincount(self.source_of[held], minlength=len(self.sources))
        sources = [{**m, "held_out": int(n)} for m, n in zip(self.report["sources"], per_source)]
        rest = replace(
            self,
            **{name: getattr(self, name)[keep] for name in self.PER_SAMPLE},
            report={
                **self.report, "sources": sources, "held_out_for_validation": int(len(chosen)),
                "held_out_copies": int(copies),
            },
        )  # fmt: skip
        return rest, chosen[:, 0], chosen[:, 1]

    def _with_copies(self, records: np.ndarray, chosen: np.ndarray) -> tuple[np.ndarray, int]:
        """``chosen`` records plus every other record of ``records`` equal to one of them (``_copies``), and how
        many were added."""
        is_chosen = np.zeros(len(records), bool)
        width = int(records[:, 1].max()) + 1
        is_chosen[np.searchsorted(records[:, 0] * width + records[:, 1], chosen[:, 0] * width + chosen[:, 1])] = True
        copies = self._copies(records, is_chosen)
        is_chosen |= copies
        return records[is_chosen], int(copies.sum())

    def _copies(self, records: np.ndarray, reference: np.ndarray) -> np.ndarray:
        """Which of ``records`` (source, row), outside the ``reference`` mask, equal a reference record (ids,
        supervised mask, media). A record is read whole and hashed only when its length, supervised count and
        tokens at a few spread positions (``_probe``, vectorised) match a reference one's: a corpus of
        equal-length chunks reads a few tokens a record, not all of them."""
        sig = self._probe(records)
        out = np.zeros(len(records), bool)
        candidates = np.flatnonzero(np.isin(sig, sig[reference]) & ~reference)
        if not candidates.size:
            return out

        def digest(i: int) -> bytes:
            return self._record_digest(int(records[i, 0]), int(records[i, 1]))

        held = {digest(int(i)) for i in np.flatnonzero(reference & np.isin(sig, sig[candidates]))}
        out[[i for i in candidates if digest(int(i)) in held]] = True
        return out

    def _record_digest(self, source_id: int, row: int) -> bytes:
        """What record ``row`` of source ``source_id`` holds: its ids, supervised mask and media."""
        source = self.sources[source_id]
        ids, mask = source.sample(row)
        h = hashlib.blake2b(np.asarray(ids, np.int64).tobytes(), digest_size=16)
        h.update(np.packbits(mask).tobytes())
        h.update(repr(source.sample_media(row)).encode())
        return h.digest()

    def records_identity(self, source_of: np.ndarray, row_of: np.ndarray) -> dict:
        """Which records (source, row) these are, two ways: where they lie (each one's source path and row) and
        what they hold (``_record_digest``). A later run holding out records that match either way holds out the
        same ones (its data moved; its tokenizer changed); matching neither, other ones (a source added, removed
        or moved in the list; another seed or share)."""
        pairs = sorted(zip(np.asarray(source_of).tolist(), np.asarray(row_of).tolist()))
        where = "\n".join(f"{self.sources[s].source.path}\0{r}" for s, r in pairs).encode()
        what = b"".join(sorted(self._record_digest(s, r) for s, r in pairs))
        where, what = (hashlib.blake2b(b, digest_size=16).hexdigest() for b in (where, what))
        return dict(records=len(pairs), where=where, what=what)

    def count_training_copies(self, training: SampleStore, first: int) -> None:
        """Count (and name a few of) this validation set's records from sources ``first`` on (``val_sources``)
        that equal a record of ``training``, whose sources this store's first ones are: val/loss would partly
        measure records the run trains on. Reported in the summary and data_report.json, not dropped (the
        user's validation data is theirs)."""
        assert all(a is b for a, b in zip(self.sources[:first], training.sources, strict=True))
        width = int(max(self.row_of.max(initial=0), training.row_of.max(initial=0))) + 1
        trains = np.unique(training.source_of * width + training.row_of)
        validates = np.unique(self.source_of[self.source_of >= first] * width + self.row_of[self.source_of >= first])
        keys = np.concatenate([trains, validates])
        records = np.stack([keys // width, keys % width], axis=1)
        copies = records[self._copies(records, np.arange(len(keys)) < len(trains))]
        self.report["records_that_train"] = int(len(copies))
        self.report["records_that_train_where"] = [self.sources[s].where(int(r)) for s, r in copies[:3]]

    def _probe(self, records: np.ndarray, points: int = 8) -> np.ndarray:
        """Per record (source, row), a 64-bit mix of its length, supervised count and its tokens at ``points``
        spread positions: equal records have equal probes (unequal ones rarely do)."""
        lengths, loss = _per_sample(self.sources, records[:, 0], records[:, 1])
        mix = np.uint64(0x9E3779B97F4A7C15)
        out = (lengths.astype(np.uint64) * mix) ^ (loss.astype(np.uint64) + np.uint64(1))
        for k, s in enumerate(self.sources):
            sel = np.flatnonzero(records[:, 0] == k)
            if not sel.size:
                continue
            start, last = s.offsets[records[sel, 1]], s.lengths[records[sel, 1]] - 1
            h = out[sel]
            for j in range(points):  # a point at a time: a few arrays of one entry a record alive, whatever points
                tokens = np.asarray(s.ids[start + last * j // (points - 1)], np.uint64)
                h = (h ^ tokens) * mix
            out[sel] = h
        return out

    def where(self, i: int) -> str:
        return self.sources[self.source_of[i]].where(int(self.row_of[i]))

    def _describe(self, idx: np.ndarray, limit: int = 5) -> str:
        """The distinct records among samples ``idx`` (a repeated record is named once)."""
        first = {}
        for i in idx:
            first.setdefault(self.where(int(i)), int(i))
        shown = ", ".join(f"{w} ({self.lengths[i]} tokens)" for w, i in list(first.items())[:limit])
        return shown + (f" and {len(first) - limit} more" if len(first) > limit else "")

    def over_length_said(self, max_len: int) -> str | None:
        """The samples longer than ``max_len``, named and counted as ``over_length: error`` says them; None for none."""
        over = np.flatnonzero(self.lengths > max_len)
        if not over.size:
            return None
        n_distinct = len(distinct([self.where(int(i)) for i in over]))
        return (
            f"{over.size} sample(s) longer than the largest level ({max_len} tokens): {self._describe(over)}; "
            f"{count_phrase(int(over.size), n_distinct)} in all"
        )

    def apply_over_length(self, max_len: int, policy: str) -> str | None:
        """Drop, truncate or reject (``error``) the samples longer than ``max_len``, and record them; returns a
        warning where sources mixed by weight lost samples unevenly (``weight_shares_note``)."""
        over = np.flatnonzero(self.lengths > max_len)
        self.report.update(over_length=policy, max_len=max_len)
        if not over.size:
            return None
        before = self._shares()
        if policy == "error":
            raise DataError(f"{self.over_length_said(max_len)}. {OVER_LENGTH_FIX}")
        keep = np.ones(self.lengths.size, dtype=bool)
        if policy == "drop":
            self.report["dropped"] = [self.where(int(i)) for i in over]
            keep[over] = False
        else:
            self._truncate(over, max_len)
            empty = over[self.loss_tokens[over] == 0]
            self.report["truncated_to_nothing"] = [self.where(int(i)) for i in empty]
            keep[empty] = False
        for name in OVER_LENGTH_LISTS:
            self.report[f"{name}_distinct"] = len(distinct(self.report[name]))
        for name in self.PER_SAMPLE:
            setattr(self, name, getattr(self, name)[keep])
        return self.weight_shares_note(before, policy)

    def _shares(self) -> np.ndarray:
        """Each source's share of the samples."""
        counts = np.bincount(self.source_of, minlength=len(self.sources))
        return counts / max(int(counts.sum()), 1)

    def weight_shares_note(self, before: np.ndarray, policy: str) -> str | None:
        """The weights share the samples before the over-length ones go (the largest level is chosen after
        mixing): where dropping them moved a weighted source's share (by over half a point), say the shares
        asked and trained, per source, and record them in the report, rather than train another mix silently."""
        weights = [s.source.weight for s in self.sources]
        after = self._shares()
        if any(w is None for w in weights) or "in_epoch" not in self.report["sources"][0]:
            return None  # mixed by repeat, or a validation set (not mixed)
        if np.abs(after - before).max() <= 0.005:
            return None
        asked = np.asarray(weights, float) / sum(weights)
        self.report["weight_shares"] = [dict(path=s.source.path, asked=float(a), trained=float(t))
                                        for s, a, t in zip(self.sources, asked, after)]  # fmt: skip
        shares = "; ".join(
            f"{s.source.path}: asked {a:.3g}, trained {t:.3g}" for s, a, t in zip(self.sources, asked, after)
        )
        return (
            f"over_length: {policy} removed long samples after the sources were mixed by weight, so the epoch "
            f"trains other shares than the weights ask ({shares}): add a larger level, filter the long records out "
            "of their source, or adjust the weights"
        )

    def _truncate(self, over: np.ndarray, max_len: int) -> None:
        """Cut samples ``over`` to ``max_len`` tokens, keeping the window with the most supervised
        targets (``truncation_window``): unsupervised tokens go first, the answer stays while it fits.
        The report lists each cut: the tokens kept and the supervised targets before and after."""
        with_media = [int(i) for i in over if self.media(int(i))]
        if with_media:
            raise DataError(
                f"{len(with_media)} sample(s) with images or videos longer than the largest level "
                f"({max_len} tokens): {self._describe(np.asarray(with_media))}; over_length: truncate would cut their "
                "image or video tokens from their pixels. Add a larger level, or set over_length: drop"
            )
        cuts = []
        self.starts, self.loss_tokens = self.starts.copy(), self.loss_tokens.copy()
        for k, s in enumerate(self.sources):
            sel = over[self.source_of[over] == k]
            rows, lengths = self.row_of[sel], s.lengths
            starts = np.array(
                [truncation_window(s.sample_spans(int(r)), int(lengths[r]), max_len) for r in rows], np.int64
            )
            kept = s.loss_tokens(rows, (starts, max_len))
            for i, start, after in zip(sel.tolist(), starts.tolist(), kept.tolist()):
                cuts.append((i, start, after))
            self.starts[sel], self.loss_tokens[sel] = starts, kept
        cuts.sort()
        self.report["truncated"] = [self.where(i) for i, _, _ in cuts]
        self.report["truncation"] = [
            dict(sample=self.where(i), tokens=int(self.lengths[i]), kept=[start, start + max_len],
                 supervised=int(self.sources[self.source_of[i]].supervised[self.row_of[i]]), supervised_kept=after)
            for i, start, after in cuts
        ]  # fmt: skip
        self.lengths = np.minimum(self.lengths, max_len)

    def tokens(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and target mask of sample i, cut to its kept window."""
        return self.sources[self.source_of[i]].sample(int(self.row_of[i]), int(self.lengths[i]), int(self.starts[i]))

    def media(self, i: int) -> list[tuple]:
        """The images and videos of sample i (``media.Image`` and ``media.Video`` entries: file, size, the
        pixels its encoder sees), each kind in the order it stands."""
        return self.sources[self.source_of[i]].sample_media(int(self.row_of[i]))

    def media_pixels(self) -> list[list[tuple[int, int]]]:
        """Per sample, each image's and video's (pixels, tiles) as its encoder sees them (``media.encoded_pixels``)."""
        return [[(int(m.pixels), int(m.tiles)) for m in self.media(i)] for i in range(self.lengths.size)]

    def media_counts(self, kinds: tuple[str, ...] = ("image", "video")) -> np.ndarray:
        """Per sample, how many images and videos it holds (of ``kinds``)."""
        counts = np.zeros(self.lengths.size, np.int64)
        for k, s in enumerate(self.sources):
            if s.media_offsets is not None:
                sel = self.source_of == k
                per_row = np.diff(s.media_offsets)
                if set(kinds) != {"image", "video"}:
                    of_kind = np.array([type(media_entry(m)).__name__.lower() in kinds for m in s.media], np.int64)
                    owner = np.repeat(np.arange(per_row.size), per_row)
                    per_row = np.bincount(owner, weights=of_kind, minlength=per_row.size).astype(np.int64)
                counts[sel] = per_row[self.row_of[sel]]
        return counts

    @property
    def has_media(self) -> bool:
        return any(s.media_offsets is not None for s in self.sources)

    def source_counts(self) -> list[dict[str, int]]:
        """Per source, the samples, tokens and supervised tokens this store holds now (after the
        hold-out and the over-length policy, truncated lengths counted as cut)."""
        n = len(self.sources)
        samples = np.bincount(self.source_of, minlength=n)
        tokens = np.bincount(self.source_of, weights=self.lengths, minlength=n)
        supervised = np.bincount(self.source_of, weights=self.loss_tokens, minlength=n)
        counts = zip(samples, tokens, supervised)
        return [dict(samples=int(a), tokens=int(b), supervised_tokens=int(c)) for a, b, c in counts]

    def final_report(self) -> dict:
        """The report with each source's ``kept`` counts as they stand now (``data_report.json``)."""
        sources = [{**m, "kept": c} for m, c in zip(self.report["sources"], self.source_counts())]
        return {**self.report, "sources": sources}

    def summary(self) -> str:
        """One report of what the data pipeline kept, skipped, dropped and truncated: per source, what
        it contributes after the repeat, the validation hold-out and the over-length policy."""
        lines = [
            f"data: {self.lengths.size} samples, {int(self.lengths.sum())} tokens, "
            f"{int(self.loss_tokens.sum())} supervised"
        ]
        for m, kept in zip(self.report["sources"], self.source_counts()):
            skipped = ", ".join(f"{n} {reason}" for reason, n in m["skipped"].items() if n)
            n_skipped = sum(m["skipped"].values())
            if "selected" in m:  # a validation set: records picked once each
                steps, before = [f"{m['selected']} of its {m['samples']} records"], m["selected"]
            else:
                steps = [f"{m['samples']} samples x {m['repeat']:.3g} -> {m['in_epoch']} in the epoch"]
                before = m["in_epoch"] - m.get("held_out", 0)
                if m.get("held_out"):
                    steps.append(f"{m['held_out']} held out for validation")
            if before > kept["samples"]:
                steps.append(f"{before - kept['samples']} over-length dropped")
            # Records are skipped when the file is read, before the repeat: the counts are records.
            lines.append(
                f"  {m['path']}: {', '.join(steps)} -> {kept['samples']} samples, {kept['tokens']} tokens "
                f"({kept['supervised_tokens']} supervised)"
                + (
                    f"; skipped {n_skipped} distinct record(s) of the file ({skipped}) "
                    f"(e.g. {', '.join(sum(m['skipped_where'].values(), [])[:3])})"
                    if skipped
                    else ""
                )
            )
            if m.get("metadata_fields"):
                fields = ", ".join(f"{k} ({n})" for k, n in m["metadata_fields"].items())
                lines.append(f"    record fields read as metadata, not trained on: {fields}")
        r = self.report
        if r.get("held_out_copies"):
            lines.append(
                f"  validation holds {r['held_out_for_validation']} records, {r['held_out_copies']} of them copies of "
                "another held-out record (the same tokens on another line): no copy of a validation record trains"
            )
        if r.get("records_that_train"):
            lines.append(
                f"  {r['records_that_train']} record(s) of val_sources equal a training record (the same tokens, "
                f"supervision and media; e.g. {', '.join(r['records_that_train_where'])}): val/loss partly measures "
                "records the run trains on"
            )
        for key, what in (
            ("dropped", "dropped as longer than"),
            ("truncated", "truncated to"),
            ("truncated_to_nothing", "dropped: no supervised token left after truncation to"),
        ):
            if r[key]:
                records = distinct(r[key])
                more = f" and {len(records) - 3} more" if len(records) > 3 else ""
                lines.append(
                    f"  {count_phrase(len(r[key]), len(records))} {what} {r['max_len']} tokens: "
                    f"{', '.join(records[:3])}{more}"
                )
                if key == "truncated":
                    lines.append(
                        "    (each keeps the window with the most supervised tokens: unsupervised tokens are cut "
                        "first; data_report.json's truncation lists the tokens kept of each)"
                    )
        return "\n".join(lines)
