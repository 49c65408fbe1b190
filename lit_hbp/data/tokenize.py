"""Tokenize a source once, with the label mask of supervised tokens, and cache it on disk.

The cache of a source lives in ``cache_dir/<name>-<key>/`` (``lit_hbp.data.cache``) where the key
hashes the source file (path, size, mtime), the tokenizer (vocabulary, special tokens, chat
template) and the settings, so any change re-tokenizes and a re-run with the same inputs only
memory-maps the arrays. One process tokenizes a cache, whatever the number of ranks and nodes; the
others wait on its lock and read it. The source streams from disk in chunks (``iter_chunks``), which
``num_proc`` worker processes tokenize while the main process appends their results, in order, to
the cache: memory is a few chunks, whatever the size of the source.

Pre-tokenized records (``input_ids`` with ``labels`` or ``assistant_masks``, or alone: every token
supervised) are validated against the tokenizer's vocabulary and taken as they are.

Label mask: ``target[t]`` is True when token t is a supervised prediction (the model learns to
produce token t from the tokens before it). Chat samples supervise the trained turns, found by
rendering the chat template for each prefix of the conversation and mapping those character spans
onto the tokens of the full rendering (one tokenization per sample). A template with
``{% generation %}`` blocks says itself what an assistant turn trains: there a trained assistant
turn supervises the template's own assistant mask within the turn (``apply_chat_template(...,
return_assistant_tokens_mask=True)``; a turn ``train_on`` or a weight leaves out stays out). The
template is the tokenizer's own, which the data module replaces with ``data.chat_template``
(``resolve_chat_template``) when given; a chat record without any template is an error, never a
silent default (the served model would be prompted in a format it was not trained on).
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
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lit_hbp.data.cache import CacheWriter, cache_lock, is_complete, mask_spans, read_cache, spans_mask
from lit_hbp.data.media import Image, MediaExpander, Video, media_entry, processor_fingerprint
from lit_hbp.data.records import RENDERED, Conversation, TokenRecord
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
from lit_hbp.errors import ConfigError, DataError

# Which turns of a chat train: every assistant turn, the last one only, or every token; a message's
# ``weight`` (0 or 1) decides for its own turn.
TRAIN_ON = ("assistant", "last_assistant", "all")
# 5: no silent default chat template (caches of v4 may hold chats rendered with one).
# 6: narrow ids, supervised spans, per-sample counts (``lit_hbp.data.cache``).
# 7: record formats and tools, a token supervised when it overlaps a trained turn, table rows from 1,
#    metadata fields counted.
# 8: an assistant turn of a template with {% generation %} blocks trains what the blocks mark.
# 9: a video's row carries the frame rate its record gave its frames.
CACHE_VERSION = 9
# Below this much of a source, worker processes cost more to start than they save (num_proc=None).
PARALLEL_MIN_BYTES = 8 << 20
PARALLEL_MIN_ROWS = 8192
# A record with images or videos costs their decoding and encoding beside its bytes (about 6 ms for a 480 x 320
# image against 0.1 ms for a text record): with a checkpoint's processor, workers repay on a source this much smaller.
MEDIA_COST = 64
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
# A template marking assistant output (transformers' tag; a loose match, whitespace control included).
GENERATION_TAG = re.compile(r"\{%[-+]?\s*generation\s*[-+]?%\}")
IGNORE_INDEX = -100


class _PrefixFailed(Exception):
    """The template cannot render the first messages of a conversation on their own."""


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


def cache_key(source: Source, tokenizer, train_on: str, label: str | None = None, processor=None) -> str:
    """Hash of the source's files (path, size, mtime), how they are read (file type, record format,
    field and role names, split, subset), the tokenizer and the settings; raises a DataError naming
    the source (``label``) if its path cannot be read."""
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
        train_on=train_on,
    )
    if processor is not None:  # how many tokens an image becomes
        payload["images"] = processor_fingerprint(processor)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


def _has_content(message: dict) -> bool:
    """A message with text, images or tool calls (an empty string alone is nothing to train on)."""
    content = message["content"]
    return not isinstance(content, str) or bool(content.strip()) or bool(message.get("tool_calls"))


def _marked(content: str | list[dict]) -> str | list[dict]:
    """A message's content with a character in front that no template adds (where its turn departs)."""
    if isinstance(content, str):
        return "\x01" + content
    return [{"type": "text", "text": "\x01"}, *content]


def _complement(spans: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The parts of [0, n) outside ``spans``."""
    out, at = [], 0
    for a, b in sorted(spans):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    return out + ([(at, n)] if at < n else [])


class _Encoder:
    """Turns conversations into (ids, target) with the tokenizer's chat template (the data module sets
    it from ``data.chat_template``): the template renders every message, the record's tools and tool
    calls; the trained turns are located by rendering prefixes of the conversation."""

    def __init__(self, tokenizer, train_on: str):
        if train_on not in TRAIN_ON:
            raise ConfigError(f"train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(
                f"{type(tokenizer).__name__} is a slow tokenizer: lit-hbp needs a fast one (offset mapping) to "
                "locate assistant turns; load it with use_fast=True or convert it with the tokenizers library"
            )
        self.tok = tokenizer
        self.train_on = train_on
        self.template = getattr(tokenizer, "chat_template", None) or None
        self.eos = tokenizer.eos_token_id

    def _render(self, conv: Conversation, upto: int | None, generation_prompt: bool = False, tools=True, messages=None):
        """The template's text of the first ``upto`` messages (all: None) of ``conv`` (or ``messages``).
        The tokenizer's own template: a tokenizer with named templates (``{"default", "tool_use"}``)
        lets transformers pick the one for the call, as it does at inference."""
        msgs = (conv.messages if messages is None else messages)[:upto]
        try:
            return self.tok.apply_chat_template(
                msgs, tools=conv.tools if tools else None, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # the template's raise_exception, or a value it cannot handle
            if upto is not None and upto < len(conv.messages):
                raise _PrefixFailed(str(e)) from None
            raise DataError(f"{conv.where}: the chat template cannot render this record: {e}") from None

    def _prefix(self, conv: Conversation, i: int, generation_prompt: bool) -> str | None:
        """The rendering of the messages before message i; None before the first one when the template
        cannot render an empty conversation (transformers refuses to)."""
        try:
            return self._render(conv, i, generation_prompt)
        except _PrefixFailed as e:
            if i == 0:
                return None
            raise DataError(
                f"{conv.where}: messages[{i}]: the chat template cannot render the conversation before this message "
                f"({e}), so the turn cannot be located"
            ) from None

    def _trained(self, conv: Conversation) -> list[bool]:
        """Per message: does it train? ``train_on`` decides, a message's weight overrides it."""
        roles = [m["role"] for m in conv.messages]
        if self.train_on == "all":
            out = [True] * len(roles)
        elif self.train_on == "assistant":
            out = [r == "assistant" for r in roles]
        else:
            last = max((i for i, r in enumerate(roles) if r == "assistant"), default=-1)
            out = [i == last for i in range(len(roles))]
        return [bool(w) if w is not None else t for t, w in zip(out, conv.weights or [None] * len(roles))]

    def _check_rendered(self, conv: Conversation, full: str) -> None:
        """Refuse what the template would drop: the record's tools, a message's content, tool calls or
        reasoning. (A template that cannot render without the tools needs them: it renders them.)"""
        if conv.tools:
            try:
                dropped = self._render(conv, None, tools=False) == full
            except DataError:
                dropped = False
            if dropped:
                raise DataError(
                    f"{conv.where}: tools: the chat template does not render tools, so the model would never see the "
                    "tool definitions: use a chat template that renders them (data.chat_template), or drop the field"
                )
        for i, m in enumerate(conv.messages):
            content = m["content"]
            texts = [content] if isinstance(content, str) else [p["text"] for p in content if "text" in p]
            if any(t.strip() and t.strip() not in full for t in texts):
                raise DataError(
                    f"{conv.where}: messages[{i}] ({m['role']}): the chat template does not render its content, so "
                    "the model would never see it: use a chat template that renders the role, or drop the message"
                )
            # A tool result's name and call id link it to its call: the template may leave them out.
            for key in RENDERED + (("name",) if m["role"] != "tool" else ()):
                if key in m:
                    without = [*conv.messages[:i], {k: v for k, v in m.items() if k != key}]
                    if self._render(conv, i + 1) == self._render(conv, None, messages=without):
                        raise DataError(
                            f"{conv.where}: messages[{i}].{key}: the chat template does not render it, so the model "
                            "would learn the turn without it: use a chat template that renders it (data.chat_template)"
                        )

    def _turn(self, conv: Conversation, i: int, full: str) -> tuple[str | None, str]:
        """The renderings of the messages before message i (None: see ``_prefix``) and up to its end. The
        conversation must render the same when cut there (prefix-stable): otherwise the turn's
        characters in the whole are not the ones located."""
        try:
            upto = self._render(conv, i + 1)
        except _PrefixFailed as e:
            raise DataError(
                f"{conv.where}: messages[{i}]: the chat template cannot render the conversation up to this message "
                f"({e}), so the turn cannot be located"
            ) from None
        before = self._prefix(conv, i, False)
        if not (full.startswith(upto) and upto.startswith(before or "")):
            raise DataError(
                f"{conv.where}: the chat template is not prefix-stable at message {i} (the conversation cut before "
                "or after it does not render as the start of the whole), so its turns cannot be located: use "
                "train_on: last_assistant (only the last turn is located) or a template that renders "
                "earlier turns unchanged"
            )
        return before, upto

    def _span(self, conv: Conversation, i: int, full: str, whole: bool) -> tuple[int, int]:
        """The characters of message i: from where its rendering departs from the prefix before it (for
        an assistant turn, the prefix with the generation prompt: its header is the prompt's, not
        trained) to its end."""
        before, upto = self._turn(conv, i, full)
        generation = conv.messages[i]["role"] == "assistant" and not whole
        if before is None:
            return self._first_start(conv, upto, generation), len(upto)
        head = self._prefix(conv, i, True) if generation else before
        return max(_common_prefix(head, upto), len(before)), len(upto)

    def _first_start(self, conv: Conversation, upto: str, generation: bool) -> int:
        """Where the first message's turn starts in ``upto`` (its rendering alone), the template's preamble
        (a default system prompt, the tools) excluded: an assistant turn's content starts where the
        rendering with other content departs; a whole message is what a second copy of it adds."""
        first = conv.messages[0]
        try:
            if generation:
                other = self._render(conv, None, messages=[{**first, "content": _marked(first["content"])}])
                return _common_prefix(upto, other)
            twice = self._render(conv, None, messages=[first, first])
        except DataError:
            twice = ""
        own = len(twice) - len(upto)
        if not (twice.startswith(upto) and 0 < own <= len(upto) and twice[len(upto) :] == upto[len(upto) - own :]):
            raise DataError(
                f"{conv.where}: messages[0]: the chat template renders the first message with a preamble that cannot "
                "be told apart from it, so its turn cannot be located: leave its weight unset"
            )
        return len(upto) - own

    def prepare(self, conv: Conversation) -> tuple[str, list[tuple[int, int]] | None, bool] | str:
        """Rendered text, supervised character spans (None = all), and whether it is plain text;
        or a skip reason."""
        if conv.text is not None:
            return (conv.text, None, True) if conv.text.strip() else "empty conversation"
        msgs = conv.messages
        if not msgs or not any(_has_content(m) for m in msgs):
            return "empty conversation"
        if self.template is None:
            raise DataError(
                f"{conv.where}: this chat record needs a chat template and the tokenizer has none: {CHAT_TEMPLATE_FIX}"
            )
        full = self._render(conv, None)
        self._check_rendered(conv, full)
        trained = self._trained(conv)
        if self.train_on == "all":
            if all(trained):
                return full, None, False
            left_out = [self._span(conv, i, full, whole=True) for i, t in enumerate(trained) if not t]
            return full, _complement(left_out, len(full)), False
        blocks = self._generation_blocks(conv, full)
        spans = []
        for i, t in enumerate(trained):
            if not t:
                continue
            if blocks is None or conv.messages[i]["role"] != "assistant":
                spans.append(self._span(conv, i, full, whole=False))
                continue
            before, upto = self._turn(conv, i, full)
            a, b = len(before or ""), len(upto)  # the turn, its header and separators included
            # A block is cut to the turn; an empty one still marks a token it falls inside, as transformers does.
            spans += [(max(s, a), min(e, b)) for s, e in blocks if max(s, a) < min(e, b) or a <= s == e < b]
        return full, spans, False

    def _generation_blocks(self, conv: Conversation, full: str) -> list[tuple[int, int]] | None:
        """The characters the template's ``{% generation %}`` blocks mark in ``full``, as
        ``apply_chat_template(..., return_assistant_tokens_mask=True)`` finds them (the same call of
        transformers' renderer, its text checked equal to ``full``); None for a template without them,
        whose turns are located by renderings."""
        from transformers.utils.chat_template_utils import render_jinja_template

        template = self.tok.get_chat_template(None, conv.tools)
        if not GENERATION_TAG.search(template):
            return None
        # apply_chat_template drops None-valued message fields and hands the template the special tokens.
        messages = [{k: v for k, v in m.items() if v is not None} for m in conv.messages]
        (text,), (blocks,) = render_jinja_template(
            [messages],
            tools=conv.tools,
            chat_template=template,
            return_assistant_tokens_mask=True,
            **self.tok.special_tokens_map,
        )
        if text != full:
            raise DataError(
                f"{conv.where}: the chat template renders this record otherwise when its {{% generation %}} blocks "
                f"are tracked (at character {_common_prefix(text, full)}), so its assistant mask cannot be located"
            )
        return [tuple(block) for block in blocks]

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
                if spans is not None:  # a token trains when it overlaps a trained turn (as char_to_token maps)
                    offsets = np.asarray(enc["offset_mapping"][j], dtype=np.int64).reshape(-1, 2)
                    target[:] = False
                    for a, b in spans:
                        target |= (offsets[:, 1] > a) & (offsets[:, 0] < b)
                target[:1] = False
                out[i] = (ids, target)
        return out


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


class ChunkTokenizer:
    """Tokenizes chunks of a source: in the main process or in each worker process. With the
    checkpoint's ``processor``, records with images and videos are expanded as the processor does."""

    def __init__(self, tokenizer, train_on: str, processor=None):
        self.encoder = _Encoder(tokenizer, train_on)
        self.vocab_size = len(tokenizer)
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
                kept.append((row, where, *pretokenized(read, self.vocab_size), []))
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
    writer = CacheWriter(folder, len(tokenizer))
    skipped = dict.fromkeys(SKIP_REASONS, 0)
    skipped_where: dict[str, list[str]] = {r: [] for r in SKIP_REASONS}
    metadata: dict[str, int] = {}
    records = 0
    token_types = False
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
    return TokenizedSource(
        source=source,
        ids=a["ids"],
        offsets=a["offsets"],
        rows=a["rows"],
        supervised=a["supervised"],
        spans=a["spans"],
        span_offsets=a["span_offsets"],
        skipped=meta["skipped"],
        skipped_where=meta["skipped_where"],
        metadata=meta["metadata"],
        from_cache=from_cache,
        folder=folder,
        media_offsets=a.get("media_offsets"),
        media=a.get("media"),
        token_types=bool(meta.get("token_types", False)),
    )
