"""The epoch's sample table: sources mixed by repeat or weight, over-length samples handled.

A global sample id maps to (source, row). Repeats make several ids point at one row; the planner
treats them as separate samples, so a repeated sample is trained on twice, never silently once. The
report and the summary count, per source, what is left after the validation hold-out and the
over-length policy: the samples and tokens that really train (or validate). Everything here is per
sample (lengths and supervised counts come from the caches' per-sample arrays), so a store of a
billion tokens costs tens of bytes a sample, not bytes a token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

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


def count_phrase(n: int, n_distinct: int) -> str:
    """'40 sample(s) (20 distinct records, repeated in the epoch)': occurrences alone mislead when
    sources repeat, since one long record of a source with repeat 2 is two dropped samples."""
    repeated = ", repeated in the epoch" if n_distinct < n else ""
    return f"{n} sample(s) ({n_distinct} distinct record{'s' if n_distinct != 1 else ''}{repeated})"


def _empty_over_length_report() -> dict:
    return {**{k: [] for k in OVER_LENGTH_LISTS}, **{f"{k}_distinct": 0 for k in OVER_LENGTH_LISTS}}


def mixture_repeats(sizes: list[int], repeats: list[float | None], weights: list[float | None]) -> list[float]:
    """Repeat factor per source. Weights share the total sample count of all sources; sources with
    neither repeat nor weight enter once."""
    if any(w is not None for w in weights) and any(r is not None for r in repeats):
        raise ConfigError("mix sources by repeat or by weight, not both")
    if any(w is not None for w in weights):
        if any(w is None for w in weights):
            raise ConfigError("when one source has a weight, every source needs one")
        total_w, total_n = sum(weights), sum(sizes)
        if total_w <= 0:
            raise ConfigError(f"source weights must not all be zero: {weights}")
        return [w / total_w * total_n / n if n else 0.0 for w, n in zip(weights, sizes)]
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
                      skipped=dict(s.skipped), skipped_where={k2: list(v) for k2, v in s.skipped_where.items()})
                 for k, s in enumerate(sources)]  # fmt: skip
        report = dict(sources=mixed, over_length=None, max_len=None, **_empty_over_length_report())
        return cls(list(sources), source_of, row_of, lengths, loss, report)

    def hold_out(self, fraction: float, seed: int) -> tuple[SampleStore, np.ndarray, np.ndarray]:
        """Move a seeded ``fraction`` of the records (source, row), every repeat of them, out of this
        store: (the rest, held-out source ids, held-out row ids, each record once). Training and
        validation never share a record, whatever the repeats."""
        if not 0 < fraction < 1:
            raise ConfigError(f"val_fraction must be between 0 and 1, got {fraction}")
        records = np.unique(np.stack([self.source_of, self.row_of], axis=1), axis=0)
        n_val = max(1, int(round(fraction * len(records))))
        if n_val >= len(records):
            raise DataError(f"val_fraction {fraction} leaves no training record of {len(records)}")
        chosen = records[np.sort(np.random.default_rng(seed).permutation(len(records))[:n_val])]
        key = self.source_of * (int(self.row_of.max()) + 1) + self.row_of
        held = np.isin(key, chosen[:, 0] * (int(self.row_of.max()) + 1) + chosen[:, 1])
        keep = ~held
        per_source = np.bincount(self.source_of[held], minlength=len(self.sources))
        sources = [{**m, "held_out": int(n)} for m, n in zip(self.report["sources"], per_source)]
        rest = replace(
            self,
            source_of=self.source_of[keep],
            row_of=self.row_of[keep],
            lengths=self.lengths[keep],
            loss_tokens=self.loss_tokens[keep],
            report={**self.report, "sources": sources, "held_out_for_validation": int(n_val)},
        )
        return rest, chosen[:, 0], chosen[:, 1]

    def where(self, i: int) -> str:
        return self.sources[self.source_of[i]].where(int(self.row_of[i]))

    def _describe(self, idx: np.ndarray, limit: int = 5) -> str:
        """The distinct records among samples ``idx`` (a repeated record is named once)."""
        first = {}
        for i in idx:
            first.setdefault(self.where(int(i)), int(i))
        shown = ", ".join(f"{w} ({self.lengths[i]} tokens)" for w, i in list(first.items())[:limit])
        return shown + (f" and {len(first) - limit} more" if len(first) > limit else "")

    def apply_over_length(self, max_len: int, policy: str) -> None:
        """Drop, truncate or reject (``error``) the samples longer than ``max_len``, and record them."""
        over = np.flatnonzero(self.lengths > max_len)
        self.report.update(over_length=policy, max_len=max_len)
        if not over.size:
            return
        if policy == "error":
            n_distinct = len(distinct([self.where(int(i)) for i in over]))
            raise DataError(
                f"{over.size} sample(s) longer than the largest level ({max_len} tokens): {self._describe(over)}; "
                f"{count_phrase(int(over.size), n_distinct)} in all. "
                "Add a larger level, or set over_length: drop | truncate"
            )
        keep = np.ones(self.lengths.size, dtype=bool)
        if policy == "drop":
            self.report["dropped"] = [self.where(int(i)) for i in over]
            keep[over] = False
        else:
            # Keep the first max_len tokens (the prompt side); recount the targets that survive.
            new_loss = self.loss_tokens.copy()
            for k, s in enumerate(self.sources):
                sel = over[self.source_of[over] == k]
                new_loss[sel] = s.loss_tokens(self.row_of[sel], max_len)
            self.report["truncated"] = [self.where(int(i)) for i in over]
            self.loss_tokens = new_loss
            self.lengths = np.minimum(self.lengths, max_len)
            empty = over[new_loss[over] == 0]
            self.report["truncated_to_nothing"] = [self.where(int(i)) for i in empty]
            keep[empty] = False
        for name in OVER_LENGTH_LISTS:
            self.report[f"{name}_distinct"] = len(distinct(self.report[name]))
        for name in ("source_of", "row_of", "lengths", "loss_tokens"):
            setattr(self, name, getattr(self, name)[keep])

    def tokens(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and target mask of sample i, cut to its effective length."""
        return self.sources[self.source_of[i]].sample(int(self.row_of[i]), int(self.lengths[i]))

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
        r = self.report
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
        return "\n".join(lines)
