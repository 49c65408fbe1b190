"""``lit-hbp preview --config CONFIG [--data.* ...] [--n N] [--json]``: the first samples of a config's
data as the run will train them, so a person sees what the chat template rendered and which tokens
the loss supervises before spending a GPU hour on it.

The samples come from the same pipeline as ``fit``: the sources' records read by their format,
rendered by the chat template, tokenized (through the token cache, which the run then reuses), the
validation hold-out removed and the over-length policy applied. Text output marks the supervised
tokens (green on a terminal, else between ``⟦`` and ``⟧``); ``--json`` prints one object per sample and
line: ``{"source": <path as given>, "line": <line or row, from 1>, "input_ids": [...], "supervised":
[...]}``, ``supervised[i]`` 1 exactly when token ``input_ids[i]`` is a target of the loss.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from typing import TextIO

from lit_hbp.data.media import Image, Video, image_token_id, video_token_id
from lit_hbp.data.store import SampleStore
from lit_hbp.lightning.datamodule import HBPDataModule

OPEN, CLOSE = "⟦", "⟧"
GREEN, RESET = "\x1b[1;32m", "\x1b[0m"


def training_store(dm: HBPDataModule) -> tuple[SampleStore, str | None]:
    """The training samples as set-up builds them, and a note when the over-length policy could not be
    applied (levels a ``LevelSelector`` chooses are known only once a run sets up)."""
    store = SampleStore.build(dm.tokenize_sources(), None, dm.over_length, dm.seed)
    if dm.val_fraction:
        store = store.hold_out(dm.val_fraction, dm.seed)[0]
    if dm.levels is None:
        return store, "the levels are chosen when the run sets up: samples longer than them are shown whole"
    return store, store.apply_over_length(dm.levels[-1].pack_len, dm.over_length)


def samples(store: SampleStore, n: int) -> Iterator[dict]:
    """The first ``n`` distinct training samples in source order (a repeated record once), as the
    ``--json`` objects plus ``index``, the sample's place in the store."""
    seen: set[tuple[int, int]] = set()
    for i in range(store.lengths.size):
        key = (int(store.source_of[i]), int(store.row_of[i]))
        if key in seen:
            continue
        seen.add(key)
        ids, supervised = store.tokens(i)
        source = store.sources[key[0]]
        sample = dict(
            source=source.source.path,
            line=int(source.rows[key[1]]),
            input_ids=ids.tolist(),
            supervised=supervised.astype(int).tolist(),
            index=i,
        )
        media = store.media(i)
        images = [m for m in media if isinstance(m, Image)]
        videos = [m for m in media if isinstance(m, Video)]
        if images:
            sample["images"] = [dict(file=m.file, width=m.width, height=m.height) for m in images]
        if videos:
            sample["videos"] = [
                dict(source=m.source if isinstance(m.source, str) else list(m.source), width=m.width, height=m.height,
                     frames=m.frames, **({"fps": m.fps} if m.fps else {}))
                for m in videos
            ]  # fmt: skip
        yield sample
        if len(seen) == n:
            return


def token_runs(ids: list[int], token_id: int | None) -> list[tuple[int, int]]:
    """The [start, end) runs of ``token_id`` in ``ids``: where each image or video stands, and its token count."""
    runs, start = [], None
    for k, t in enumerate([*ids, None]):
        if t == token_id and token_id is not None and start is None:
            start = k
        elif t != token_id and start is not None:
            runs.append((start, k))
            start = None
    return runs


def _describe(kind: str, entry: dict) -> str:
    if kind == "image":
        return f"{entry['file']} {entry['width']}x{entry['height']}"
    source = entry["source"]
    name = source if isinstance(source, str) else f"{source[0]} ... ({len(source)} files)"
    rate = f" at {entry['fps']:g} fps" if entry.get("fps") else ""
    return f"{name} {entry['frames']} frames{rate} {entry['width']}x{entry['height']}"


def render(
    tokenizer, ids: list[int], supervised: list[int], color: bool, media: Sequence[tuple[str, int | None, list]] = ()
) -> str:
    """The decoded tokens with each supervised run marked, each image's and video's tokens as one line
    saying its file, size and how many tokens it became. ``media``: (kind, its token id, its entries,
    each with the runs of tokens it became: one, or one per temporal patch where the processor puts a
    timestamp before each, Qwen3-VL's)."""
    runs = []
    for kind, token_id, entries in media:
        found = token_runs(ids, token_id) if entries else []
        per = [1] * len(entries)
        if len(found) != len(entries) and len(found) == sum(e["runs"] for e in entries):
            per = [e["runs"] for e in entries]
        if len(found) != sum(per):  # items next to each other share a run: not told apart
            runs += [(a, b, f"[{len(entries)} {kind}s -> {b - a} tokens]") for a, b in found]
            continue
        at = 0
        for j, (entry, k) in enumerate(zip(entries, per)):
            mine = found[at : at + k]
            at += k
            tokens = sum(b - a for a, b in mine)
            runs.append((mine[0][0], mine[-1][1], f"[{kind} {j + 1}: {_describe(kind, entry)} -> {tokens} tokens]"))
    if runs:
        out, at = [], 0
        for a, b, line in sorted(runs):
            out.append(render(tokenizer, ids[at:a], supervised[at:a], color))
            out.append(line)
            at = b
        out.append(render(tokenizer, ids[at:], supervised[at:], color))
        return "".join(out)
    out, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or supervised[k] != supervised[start]:
            text = tokenizer.decode(ids[start:k], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if supervised[start]:
                text = f"{GREEN}{text}{RESET}" if color else f"{OPEN}{text}{CLOSE}"
            out.append(text)
            start = k
    return "".join(out)


def preview(dm: HBPDataModule, n: int, as_json: bool, out: TextIO | None = None) -> int:
    """Print the first ``n`` training samples of ``dm`` (to stdout); return how many were printed."""
    out = out or sys.stdout
    store, note = training_store(dm)
    print(store.summary() + (f"\nnote: {note}" if note else ""), file=sys.stderr)
    color = not as_json and out.isatty()
    if not as_json:
        mark = "in green" if color else f"between {OPEN} and {CLOSE}"
        print(f"supervised tokens (what the loss trains on) are shown {mark}", file=out)
    shown = 0
    for shown, sample in enumerate(samples(store, n), 1):
        index = sample.pop("index")
        if as_json:
            print(json.dumps(sample), file=out)
            continue
        tokens, trained = len(sample["input_ids"]), sum(sample["supervised"])
        start = int(store.starts[index])
        full = int(store.sources[store.source_of[index]].lengths[store.row_of[index]])
        cut = f" (truncated: tokens {start}-{start + tokens} of {full} kept)" if tokens < full else ""
        print(f"\n━━ sample {shown}: {store.where(index)}: {tokens} tokens, {trained} supervised{cut}", file=out)
        media = []
        if sample.get("images"):
            media.append(("image", image_token_id(dm.processor), [{**e, "runs": 1} for e in sample["images"]]))
        if sample.get("videos"):
            tiles = [m.tiles for m in store.media(index) if isinstance(m, Video)]
            entries = [{**e, "runs": t} for e, t in zip(sample["videos"], tiles)]
            media.append(("video", video_token_id(dm.processor), entries))
        print(render(dm.tokenizer, sample["input_ids"], sample["supervised"], color, media), file=out)
    if not shown:
        print("no training samples: every record was skipped (see the summary above)", file=sys.stderr)
    return shown
