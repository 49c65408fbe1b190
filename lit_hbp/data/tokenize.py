"""Tokenize a source once, with the label mask of supervised tokens, and cache it on disk.

The cache of a source lives in ``cache_dir/<name>-<key>/`` where the key hashes the source file
(path, size, mtime), the tokenizer (vocabulary, special tokens, chat template) and the settings, so
any change re-tokenizes and a re-run with the same inputs only memory-maps the arrays.

Label mask: ``target[t]`` is True when token t is a supervised prediction (the model learns to
produce token t from the tokens before it). Chat samples supervise the assistant turns, found by
rendering the chat template for each prefix of the conversation and mapping those character spans
onto the tokens of the full rendering (one tokenization per sample). The template is the tokenizer's
own, which the data module replaces with ``data.chat_template`` (``resolve_chat_template``) when
given; a chat record without any template is an error, never a silent default (the served model
would be prompted in a format it was not trained on).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lit_hbp.data.sources import Conversation, DataError, Source, check_source, iter_records, to_conversation
from lit_hbp.errors import ConfigError

TRAIN_ON = ("assistant", "all")
# 5: no silent default chat template (caches of v4 may hold chats rendered with one).
CACHE_VERSION = 5
BATCH = 512
# Built-in chat templates (``data.chat_template: NAME``). Each closes an assistant turn with the
# tokenizer's EOS, one token of every vocabulary, so the model learns to stop and generation stops
# there without new tokens; each is prefix-stable (the first k turns render to a prefix of them all).
CHAT_TEMPLATES = {
    "tags": (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    "plain": (
        "{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}assistant:\n{% endif %}"
    ),
}
CHAT_TEMPLATE_FIX = (
    f"set data.chat_template to a Jinja template string, a template file, or a built-in ({', '.join(CHAT_TEMPLATES)})"
)
SKIP_REASONS = ("empty conversation", "no supervised token")


@dataclass
class TokenizedSource:
    """All kept samples of one source: flat token ids and targets, split by ``offsets``."""

    source: Source
    ids: np.ndarray
    target: np.ndarray
    offsets: np.ndarray
    rows: np.ndarray
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_where: dict[str, list[str]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def loss_tokens(self, upto: np.ndarray | None = None) -> np.ndarray:
        """Supervised targets per sample (the first token of a sample is never a target), counting
        only the first ``upto[i]`` tokens of sample i when given (truncation)."""
        csum = np.r_[0, np.cumsum(self.target, dtype=np.int64)]
        start = self.offsets[:-1] + 1
        end = self.offsets[1:] if upto is None else self.offsets[:-1] + np.minimum(upto, self.lengths)
        return np.maximum(csum[np.maximum(end, start)] - csum[np.minimum(start, end)], 0)

    def where(self, i: int) -> str:
        """File and line (or row) a sample came from."""
        fmt = self.source.resolved_format
        return f"{self.source.path}:{int(self.rows[i])}" if fmt == "jsonl" else f"{self.source.path}:row {self.rows[i]}"


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
    flags = {k: tokenizer.init_kwargs.get(k) for k in ("add_bos_token", "add_eos_token", "add_prefix_space")}
    h.update(json.dumps(flags, sort_keys=True, default=str).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()


def resolve_chat_template(option: str, tokenizer) -> str:
    """The template ``data.chat_template`` names: a built-in name, a template file or a Jinja string
    (told apart by its ``{{`` / ``{%``); a short error naming the option for anything else."""
    if option in CHAT_TEMPLATES:
        if tokenizer.eos_token is None:
            raise ConfigError(
                f"data.chat_template {option!r} ends assistant turns with the tokenizer's EOS token, and this "
                "tokenizer has none: give a template of your own"
            )
        return CHAT_TEMPLATES[option]
    if "{{" in option or "{%" in option:
        return option
    if Path(option).expanduser().is_file():
        return Path(option).expanduser().read_text()
    raise ConfigError(
        f"data.chat_template {option!r} is no built-in template ({', '.join(CHAT_TEMPLATES)}), no existing file "
        "and no Jinja template string"
    )


def _source_stat(path: Path) -> list:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def cache_key(source: Source, tokenizer, train_on: str, label: str | None = None) -> str:
    """Hash of the source's files (path, size, mtime), format, tokenizer and settings; raises a
    DataError naming the source (``label``) if its path cannot be read."""
    check_source(source, label)
    path = Path(source.path).resolve()
    payload = dict(
        version=CACHE_VERSION,
        files=_source_stat(path),
        format=source.resolved_format,
        split=source.split,
        tokenizer=tokenizer_fingerprint(tokenizer),
        train_on=train_on,
    )
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


class _Encoder:
    """Turns normalized conversations into (ids, target) with the tokenizer's chat template (the data
    module sets it from ``data.chat_template``)."""

    def __init__(self, tokenizer, train_on: str):
        if train_on not in TRAIN_ON:
            raise ConfigError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(
                f"{type(tokenizer).__name__} is a slow tokenizer: lit-hbp needs a fast one (offset mapping) to "
                "locate assistant turns; load it with use_fast=True or convert it with the tokenizers library"
            )
        self.tok = tokenizer
        self.train_on = train_on
        self.template = getattr(tokenizer, "chat_template", None) or None
        self.eos = tokenizer.eos_token_id

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, chat_template=self.template
        )

    def prepare(self, conv: Conversation) -> tuple[str, list[tuple[int, int]] | None, bool] | str:
        """Rendered text, supervised character spans (None = all), and whether it is plain text;
        or a skip reason."""
        if conv.text is not None:
            return (conv.text, None, True) if conv.text.strip() else "empty conversation"
        msgs = conv.messages
        if not msgs or not any(m["content"].strip() for m in msgs):
            return "empty conversation"
        if self.template is None:
            raise DataError(
                f"{conv.where}: this chat record needs a chat template and the tokenizer has none: {CHAT_TEMPLATE_FIX}"
            )
        full = self._render(msgs, False)
        if self.train_on == "all":
            return full, None, False
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            start = len(self._render(msgs[:i], True)) if i else 0
            upto = self._render(msgs[: i + 1], False)
            if not full.startswith(upto):
                raise DataError(
                    f"{conv.where}: the chat template is not prefix-stable (rendering the conversation up to "
                    f"message {i} is not a prefix of the whole), so assistant turns cannot be located; "
                    "use train_on: all or a template that renders earlier turns unchanged"
                )
            spans.append((start, len(upto)))
        return full, spans, False

    def encode_batch(self, prepared: list[tuple[str, list | None, bool]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Tokenize a batch in one call per kind (the fast tokenizer parallelizes it)."""
        out: list = [None] * len(prepared)
        for is_text in (False, True):
            idx = [i for i, p in enumerate(prepared) if p[2] is is_text]
            if not idx:
                continue
            # Rendered chats already carry the template's special tokens; plain text gets the
            # tokenizer's own (e.g. BOS) plus an EOS so the model learns to stop.
            enc = self.tok(
                [prepared[i][0] for i in idx], add_special_tokens=is_text, return_offsets_mapping=not is_text
            )
            for j, i in enumerate(idx):
                ids = np.asarray(enc["input_ids"][j], dtype=np.int32)
                spans = prepared[i][1]
                if is_text and self.eos is not None and (ids.size == 0 or ids[-1] != self.eos):
                    ids = np.r_[ids, np.int32(self.eos)]
                target = np.ones(ids.size, dtype=bool)
                if spans is not None:
                    starts = np.asarray(enc["offset_mapping"][j], dtype=np.int64).reshape(-1, 2)[:, 0]
                    target[:] = False
                    for a, b in spans:
                        target |= (starts >= a) & (starts < b)
                target[:1] = False
                out[i] = (ids, target)
        return out


def tokenize_source(
    source: Source,
    tokenizer,
    train_on: str = "assistant",
    cache_dir: str | Path | None = None,
    progress: bool = True,
    label: str | None = None,
) -> TokenizedSource:
    """Tokenize ``source`` (or load its cache). Skipped samples are counted by reason. ``label``
    (e.g. ``sources[1]``) names the source in the error raised when its path cannot be read."""
    check_source(source, label)
    cache = None
    if cache_dir is not None:
        cache = Path(cache_dir) / f"{Path(source.path).stem}-{cache_key(source, tokenizer, train_on, label)}"
        if (cache / "meta.json").exists():
            return _load(cache, source)
    encoder = _Encoder(tokenizer, train_on)
    ids_parts, target_parts, lengths, rows = [], [], [], []
    skipped = dict.fromkeys(SKIP_REASONS, 0)
    skipped_where: dict[str, list[str]] = {r: [] for r in SKIP_REASONS}
    pending: list[tuple] = []

    def skip(reason: str, where: str) -> None:
        skipped[reason] += 1
        skipped_where[reason].append(where)

    def flush() -> None:
        for (where, row, _), (ids, target) in zip(pending, encoder.encode_batch([p[2] for p in pending])):
            if not target.any():
                skip("no supervised token", where)
                continue
            ids_parts.append(ids)
            target_parts.append(target)
            lengths.append(ids.size)
            rows.append(row)
        pending.clear()

    from tqdm.auto import tqdm

    # A context: a bad record closes the bar (ends its line) before its error is printed.
    with tqdm(desc=f"tokenizing {Path(source.path).name}", unit=" samples", disable=not progress) as bar:
        for record, where in iter_records(source):
            conv = to_conversation(record, where)
            prepared = encoder.prepare(conv)
            if isinstance(prepared, str):
                skip(prepared, where)
            else:
                row = int(where.rsplit(":", 1)[1].replace("row ", ""))
                pending.append((where, row, prepared))
                if len(pending) >= BATCH:
                    flush()
            bar.update(1)
        flush()
    out = TokenizedSource(
        source=source,
        ids=np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32),
        target=np.concatenate(target_parts) if target_parts else np.zeros(0, bool),
        offsets=np.r_[0, np.cumsum(lengths, dtype=np.int64)].astype(np.int64),
        rows=np.asarray(rows, dtype=np.int64),
        skipped=skipped,
        skipped_where=skipped_where,
    )
    if cache is not None:
        _save(cache, out)
    return out


def _save(cache: Path, t: TokenizedSource) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=".tmp-"))
    for name in ("ids", "target", "offsets", "rows"):
        np.save(tmp / f"{name}.npy", getattr(t, name))
    meta = dict(source=str(t.source.path), samples=len(t), skipped=t.skipped, skipped_where=t.skipped_where)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        os.replace(tmp, cache)
    except OSError:  # another process finished first: its cache is identical
        shutil.rmtree(tmp, ignore_errors=True)


def _load(cache: Path, source: Source) -> TokenizedSource:
    meta = json.loads((cache / "meta.json").read_text())
    arrays = {n: np.load(cache / f"{n}.npy", mmap_mode="r") for n in ("ids", "target", "offsets", "rows")}
    return TokenizedSource(source=source, skipped=meta["skipped"], skipped_where=meta["skipped_where"], **arrays)
