"""A chat record's tokens and supervised mask: rendered with the tokenizer's chat template (``data.chat_template``:
a built-in, a file or a Jinja string, ``resolve_chat_template``), its trained turns located by rendering prefixes
of the conversation (``{% generation %}`` blocks where the template has them). Pre-tokenized records are checked in
``lit_hbp.data.pretokenized``; ``lit_hbp.data.tokenize`` runs both over a source, in workers, into the token cache.

Label mask: ``target[t]`` is True when token t is a supervised prediction (learned from the tokens before it).
Chat samples supervise the trained turns, found by rendering the chat template for each prefix of the conversation
and mapping those character spans onto the tokens of the full rendering (one tokenization per sample). A template
with ``{% generation %}`` blocks says itself what an assistant turn trains: there a trained assistant turn
supervises the template's own assistant mask within the turn (``apply_chat_template(...,
return_assistant_tokens_mask=True)``; a turn ``train_on`` or a weight leaves out stays out). The template is the
tokenizer's own, or ``data.chat_template`` (``resolve_chat_template``); a chat record without any template is an
error, never a silent default (the served model would be prompted in a format it was not trained on).
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from dataclasses import replace

import numpy as np

from lit_hbp.data.chat_templates import CHAT_TEMPLATE_FIX
from lit_hbp.data.records import RENDERED, Conversation, joined_text
from lit_hbp.errors import ConfigError, DataError

# Which turns of a chat train: every assistant turn, the last one only, or every token; a message's
# ``weight`` (0 or 1) decides for its own turn.
TRAIN_ON = ("assistant", "last_assistant", "all")
# What locates the turns of a template that renders them otherwise once the conversation goes on.
UNSTABLE = "a chat template (data.chat_template) that renders earlier turns unchanged or has {% generation %} blocks"
# A template marking assistant output (transformers' tag; a loose match, whitespace control included).
GENERATION_TAG = re.compile(r"\{%[-+]?\s*generation\s*[-+]?%\}")


class _PrefixFailed(Exception):
    """The template cannot render the first messages of a conversation on their own."""


class _NotPrefixStable(Exception):
    """The turn of message ``args[0]`` renders otherwise once the conversation goes on (``_unstable_fix``)."""


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
    media = not isinstance(content, str) and any(p["type"] != "text" for p in content)
    return media or any(t.strip() for t in _texts(content)) or bool(message.get("tool_calls"))


def _joined(conv: Conversation, renders_parts) -> Conversation:
    """``conv`` with each content of text parts alone joined into one string, as written, where the template
    renders that role's content from a string only (``renders_parts(role)`` false)."""
    messages = [
        m if isinstance(m["content"], str) or renders_parts(m["role"]) else {**m, "content": joined_text(m["content"])}
        for m in conv.messages
    ]
    return replace(conv, messages=messages)


PROBE_TEXTS = ("\x02first part of a probe", "\x02second part")


def _parts_probe(role: str) -> list[dict]:
    """A conversation whose ``role`` message holds two text parts, after the turns a template may need first."""
    parts = {"role": role, "content": [{"type": "text", "text": t} for t in PROBE_TEXTS]}
    if role == "system":
        return [parts, {"role": "user", "content": "hi"}]
    if role == "user":
        return [parts]
    if role == "assistant":
        return [{"role": "user", "content": "hi"}, parts]
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, parts]


def _marked(content: str | list[dict], mark: str = "\x01", behind: str = "") -> str | list[dict]:
    """A message's content with characters in front that no template adds (where its turn departs), and
    ``behind`` it."""
    if isinstance(content, str):
        return mark + content + behind
    return [{"type": "text", "text": mark}, *content, *([{"type": "text", "text": behind}] if behind else [])]


def _texts(content: str | list[dict]) -> list[str]:
    """The texts of a message's content (a string, or its text parts)."""
    return [content] if isinstance(content, str) else [p["text"] for p in content if "text" in p]


def _rendered(text: str, full: str) -> bool:
    """Whether ``text`` stands in the rendering ``full`` as written or as a JSON string's inside (a template's
    ``content | tojson``: Llama 3.x's and gpt-oss's tool results, quoted, their control characters escaped)."""
    return text in full or json.dumps(text, ensure_ascii=False)[1:-1] in full


def _without_tail(text: str, tail: str | None) -> str:
    """``text`` without the conversation's tail (``_Encoder._conversation_tail``) where it ends with it."""
    return text[: -len(tail)] if tail and text.endswith(tail) else text


def _without_marks(text: str, marks) -> str:
    """``text`` with every mark taken out."""
    for mark in marks:
        text = text.replace(mark, "")
    return text


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
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        self._stops = {t for t in (*tokenizer.all_special_tokens, *(a.content for a in added if a.special)) if t}
        self._parts: dict[str, bool] = {}  # per role: whether the template renders its text parts
        self._quoted_said = False  # whether string tool-call arguments the template quotes were said

    def renders_parts(self, role: str) -> bool:
        """Whether the chat template renders a ``role`` message's content given as text parts (Gemma 3's,
        Llama 4's, Qwen2-VL's users: each part as the template writes it), probed once per role on a message
        of two parts: it renders both texts and none of the parts' keys. A record's text parts go to such a
        template as written, as ``apply_chat_template`` hands them at inference; where the template renders
        that role's content from a string only (many do for system or assistant turns) they are joined as
        written (it would print the list, or fail)."""
        if role not in self._parts:
            try:
                out = self.tok.apply_chat_template(_parts_probe(role), tokenize=False)
            except Exception:  # a template that cannot render parts (or this probe): the joined string
                out = ""
            self._parts[role] = all(t in out for t in PROBE_TEXTS) and "'type'" not in out and '"type"' not in out
        return self._parts[role]

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
        dropped = self._unrendered(conv)
        for i, m in enumerate(conv.messages):
            if i == dropped or any(t.strip() and not _rendered(t.strip(), full) for t in _texts(m["content"])):
                raise DataError(
                    f"{conv.where}: messages[{i}] ({m['role']}): the chat template does not render its content, so "
                    "the model would never see it: use a chat template that renders the role, or drop the message"
                )
            # A tool result's name and call id link it to its call (may go unrendered); an empty value carries nothing.
            for key in RENDERED + (("name", "tool_call_id") if m["role"] != "tool" else ()):
                if m.get(key) not in (None, "", []):
                    without = [*conv.messages[:i], {k: v for k, v in m.items() if k != key}]
                    if self._render(conv, i + 1) == self._render(conv, None, messages=without):
                        raise DataError(
                            f"{conv.where}: messages[{i}].{key}: the chat template does not render it, so the model "
                            "would learn the turn without it: use a chat template that renders it (data.chat_template)"
                        )
                    if i + 1 < len(conv.messages) and self._renders_as(conv, without + conv.messages[i + 1 :], full):
                        raise DataError(
                            f"{conv.where}: messages[{i}].{key}: the chat template drops it once the conversation goes "
                            "on (Qwen3 renders reasoning only after the last user turn), so the model would never see "
                            "it: drop it from this turn, or give the conversation up to this turn as a record"
                        )

    def _renders_as(self, conv: Conversation, messages: list[dict], full: str) -> bool:
        """Whether ``messages`` (``conv``'s, one changed) render as ``full``: the change is not rendered."""
        try:
            return self._render(conv, None, messages=messages) == full
        except DataError:
            return False

    def _unrendered(self, conv: Conversation) -> int | None:
        """The first message with text that the template leaves out, found by one rendering with every such
        message's content marked in front and behind (its text may stand elsewhere: a tool result the answer
        repeats): rendered where either mark stands in it, as written or JSON-escaped (``_rendered``; Qwen3 moves
        an answer's inline ``<think>`` part, the front mark with it, out of the content). None when all are
        rendered, or when the marked conversation does not render (the check by text stands)."""
        msgs, marks = list(conv.messages), {}
        for i, m in enumerate(msgs):
            if any(t.strip() for t in _texts(m["content"])):
                marks[i] = (f"\x01{i}\x02", f"\x01{i}.\x02")
                msgs[i] = {**m, "content": _marked(m["content"], *marks[i])}
        try:
            text = self._render(conv, None, messages=msgs)
        except DataError:
            return None
        return next((i for i, pair in marks.items() if not any(_rendered(mark, text) for mark in pair)), None)

    def _turn(self, conv: Conversation, i: int, full: str) -> tuple[str | None, str]:
        """The renderings of the messages before message i (None: see ``_prefix``) and up to its end. The
        conversation must render the same when cut there (prefix-stable), but for what the template writes at
        the conversation's end only (``_conversation_tail``), cut off the shorter renderings: otherwise the turn's
        characters in the whole are not the ones located (``_NotPrefixStable``)."""
        try:
            upto = self._render(conv, i + 1)
        except _PrefixFailed as e:
            raise DataError(
                f"{conv.where}: messages[{i}]: the chat template cannot render the conversation up to this message "
                f"({e}), so the turn cannot be located"
            ) from None
        before = self._prefix(conv, i, False)
        if not (full.startswith(upto) and upto.startswith(before or "")):
            if self._tail is None:
                self._tail = self._conversation_tail(conv, full)
            if i + 1 < len(conv.messages):
                upto = _without_tail(upto, self._tail)
            before = before if before is None else _without_tail(before, self._tail)
        if not (full.startswith(upto) and upto.startswith(before or "")):
            raise _NotPrefixStable(i)
        return before, upto

    def _conversation_tail(self, conv: Conversation, full: str) -> str:
        """What the template writes at the conversation's end only (Phi-3 its EOS where no generation prompt
        follows): the shortest end of ``full``, from one of its tokens on, that the rendering of every shorter
        conversation (the first k messages) ends with and without which that rendering is the start of ``full``,
        up to one of its tokens; "" where there is none (a turn that renders otherwise is not a tail)."""
        cuts = []
        for k in range(1, len(conv.messages)):
            try:
                cuts.append(self._render(conv, k))
            except _PrefixFailed:
                return ""
        offsets = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        starts = {a for a, _ in offsets}
        for j in range(1, min(map(len, cuts), default=0) + 1):
            tail = full[len(full) - j :]
            if not all(c.endswith(tail) for c in cuts):
                break  # no longer end is common either
            if len(full) - j in starts and all(full.startswith(c[:-j]) and len(c) - j in starts for c in cuts):
                return tail
        return ""

    def _span(self, conv: Conversation, i: int, full: str, whole: bool) -> tuple[int, int]:
        """The characters of message i: from where its rendering departs from the prefix before it (for
        an assistant turn, the prefix with the generation prompt: its header is the prompt's, not
        trained) to its end."""
        before, upto = self._turn(conv, i, full)
        generation = conv.messages[i]["role"] == "assistant" and not whole
        if before is None:
            return self._first_start(conv, upto, generation), len(upto)
        head = self._prefix(conv, i, True) if generation else before
        start = _common_prefix(head, upto)
        if start < len(head):  # a prompt the turn does not start with (R1's "<think>\n"): not into the answer
            start = min(start, self._content_start(conv, i, upto))
        return max(start, len(before)), len(upto)

    def _content_start(self, conv: Conversation, i: int, upto: str) -> int:
        """Where message i's content starts in ``upto`` (the rendering up to its end): where the rendering with
        its content marked departs (the end when the template does not render the mark)."""
        msgs = list(conv.messages)
        msgs[i] = {**msgs[i], "content": _marked(msgs[i]["content"])}
        try:
            return _common_prefix(upto, self._render(conv, i + 1, messages=msgs))
        except (_PrefixFailed, DataError):
            return len(upto)

    def _first_start(self, conv: Conversation, upto: str, generation: bool) -> int:
        """Where the first message's turn starts in ``upto`` (its rendering alone), the template's preamble
        (a default system prompt, the tools) excluded: an assistant turn's content starts where the
        rendering with other content departs; a whole message is what a second copy of it adds (the
        conversation's tail, ``_conversation_tail``, cut off both)."""
        first = conv.messages[0]
        try:
            if generation:
                other = self._render(conv, None, messages=[{**first, "content": _marked(first["content"])}])
                return _common_prefix(upto, other)
            twice = _without_tail(self._render(conv, None, messages=[first, first]), self._tail)
        except DataError:
            twice = ""
        upto = _without_tail(upto, self._tail)
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
        conv = _joined(conv, self.renders_parts)
        full = self._render(conv, None)
        self._check_rendered(conv, full)
        self._say_quoted_arguments(conv, full)
        self._tail: str | None = None  # this conversation's (``_conversation_tail``), found where needed
        self._owners: list[int] | None = None  # which message each generation block marks (``_block_owners``)
        try:
            return self._spans(conv, full)
        except _NotPrefixStable as e:
            raise DataError(
                f"{conv.where}: the chat template is not prefix-stable at message {e.args[0]} (the conversation cut "
                "before or after it does not render as the start of the whole), so its turns cannot be located: "
                f"{self._unstable_fix(conv)}"
            ) from None

    def _unstable_fix(self, conv: Conversation) -> str:
        """What to do about a template whose turns cannot be located: ``train_on: last_assistant`` where this
        record would pass with it and train (only the last turn is located), else another template."""
        if self.train_on != "last_assistant":
            other = copy.copy(self)
            other.train_on, other._quoted_said = "last_assistant", True
            try:
                passes = any(b > a for a, b in other.prepare(conv)[1])  # and trains a token
            except DataError:
                passes = False
            if passes:
                return (
                    f"use train_on: last_assistant (only the last turn is located: this record passes), or {UNSTABLE}"
                )
        return f"use {UNSTABLE}"

    def _spans(self, conv: Conversation, full: str) -> tuple[str, list[tuple[int, int]] | None, bool] | str:
        """``prepare``'s result for a chat rendered as ``full``."""
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
            if conv.messages[i]["role"] != "assistant":
                spans.append(self._span(conv, i, full, whole=False))
                continue
            turn = (
                [self._span(conv, i, full, whole=False)] if blocks is None else self._blocks_of(conv, i, full, blocks)
            )
            self._check_stop(conv, i, full, turn)
            spans += turn
        return full, spans, False

    def _say_quoted_arguments(self, conv: Conversation, full: str) -> None:
        """Say once when the template writes tool-call arguments given as a JSON string otherwise than as given
        (Qwen2.5's and Llama 3.1's ``tojson`` quote it, as ``apply_chat_template`` of the record does): the model
        then learns to answer with a quoted string where the template's own calls hold an object."""
        arguments = [c["function"]["arguments"] for m in conv.messages for c in m.get("tool_calls", ())]
        if not self._quoted_said and any(isinstance(a, str) and a not in full for a in arguments):
            self._quoted_said = True
            warnings.warn(
                f"{conv.where}: the chat template writes the tool-call arguments given as a JSON string quoted, as "
                "apply_chat_template does with this record, so the model learns to call tools with a string: give "
                "arguments as JSON objects where the template expects objects (Qwen2.5, Llama 3.1)",
                stacklevel=2,
            )

    def _check_stop(self, conv: Conversation, i: int, full: str, turn: list[tuple[int, int]]) -> None:
        """Refuse a trained assistant turn whose last trained characters end in no special token: the model would
        never learn to stop (GLM-4.5's template ends a turn with the next turn's role token, outside it)."""
        turn = [span for span in turn if span[1] > span[0]]
        if not turn:
            return  # nothing trains in this turn
        start, end = max(turn, key=lambda span: span[1])
        trained = full[start:end].rstrip()
        if not any(trained.endswith(stop) for stop in self._stops):
            raise DataError(
                f"{conv.where}: messages[{i}] (assistant): the chat template ends the trained turn with no special "
                f"token ({trained[-24:]!r}), so the model would never learn to stop: use a template whose assistant "
                "turns end with one, or whose {% generation %} blocks take the stop token in (data.chat_template)"
            )

    def _blocks_of(self, conv: Conversation, i: int, full: str, blocks: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The characters the template's blocks mark in assistant message i's turn: the blocks cut to the turn
        where renderings locate it, else (the turn renders otherwise once the conversation goes on: phi3_5's and
        gpt-oss's training templates) the blocks message i owns (``_block_owners``), taken as they are."""
        try:
            before, upto = self._turn(conv, i, full)
        except _NotPrefixStable:
            if self._owners is None:
                self._owners = self._block_owners(conv, full, blocks) or []
            if not self._owners:
                raise
            return [block for block, owner in zip(blocks, self._owners) if owner == i]
        a, b = len(before or ""), len(upto)  # the turn, its header and separators included
        # A block is cut to the turn; an empty one still marks a token it falls inside, as transformers does.
        return [(max(s, a), min(e, b)) for s, e in blocks if max(s, a) < min(e, b) or a <= s == e < b]

    def _block_owners(self, conv: Conversation, full: str, blocks: list[tuple[int, int]]) -> list[int] | None:
        """Per generation block of ``full``, the assistant message it marks, from one tracked rendering with a mark
        in front of each assistant's content (``_marked``): a block holding message i's mark is i's. A block with no
        mark (a call whose content the template leaves out) lies between the marks of assistants a and b: it is
        one of theirs or of those between, which must all train or all not (the mask is then exact whichever it
        is), and is given, for the stop check, to the one between whose mark is not rendered, else to b. None
        unless the marked rendering is ``full`` with the marks added and its blocks ``blocks`` moved by them."""
        msgs, marks = list(conv.messages), {}
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                marks[i] = f"\x01{i}\x02"
                msgs[i] = {**m, "content": _marked(m["content"], marks[i])}
        try:
            text, tracked = self._tracked(conv, msgs)
        except Exception:  # the marks broke the template: no owners
            return None
        if any(text.count(mark) > 1 for mark in marks.values()) or _without_marks(text, marks.values()) != full:
            return None
        at = sorted((text.find(mark), i) for i, mark in marks.items() if mark in text)
        moved = [(s - sum(len(marks[i]) for p, i in at if p < s), e - sum(len(marks[i]) for p, i in at if p < e))
                 for s, e in tracked]  # fmt: skip
        if moved != blocks:
            return None
        trained, owners = self._trained(conv), []
        for s, e in tracked:
            inside = [i for p, i in at if s <= p < e]
            if len(inside) > 1:
                return None
            if not inside:  # between the marks of assistants a and b (the first and last where there is none)
                a = max((i for p, i in at if p < s), default=min(marks))
                b = min((i for p, i in at if p >= e), default=max(marks))
                around = [i for i in marks if a <= i <= b]
                unseen = [i for i in around if marks[i] not in text]
                if len({trained[i] for i in around}) > 1:
                    return None
                inside = unseen if len(unseen) == 1 else [b]
            owners.append(inside[0])
        return owners

    def _tracked(self, conv: Conversation, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The text of ``messages`` and the characters its ``{% generation %}`` blocks mark, by the call of
        transformers' renderer that ``apply_chat_template(..., return_assistant_tokens_mask=True)`` makes."""
        from transformers.utils.chat_template_utils import render_jinja_template

        # apply_chat_template drops None-valued message fields and hands the template the special tokens.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        (text,), (blocks,) = render_jinja_template(
            [messages],
            tools=conv.tools,
            chat_template=self.tok.get_chat_template(None, conv.tools),
            return_assistant_tokens_mask=True,
            **self.tok.special_tokens_map,
        )
        return text, [tuple(block) for block in blocks]

    def _generation_blocks(self, conv: Conversation, full: str) -> list[tuple[int, int]] | None:
        """The characters the template's ``{% generation %}`` blocks mark in ``full``, as
        ``apply_chat_template(..., return_assistant_tokens_mask=True)`` finds them (the same call of
        transformers' renderer, its text checked equal to ``full``); None for a template without them,
        whose turns are located by renderings."""
        if not GENERATION_TAG.search(self.tok.get_chat_template(None, conv.tools)):
            return None
        text, blocks = self._tracked(conv, conv.messages)
        if text != full:
            raise DataError(
                f"{conv.where}: the chat template renders this record otherwise when its {{% generation %}} blocks "
                f"are tracked (at character {_common_prefix(text, full)}), so its assistant mask cannot be located"
            )
        return blocks

    def _doubled_bos(self, text: str, ids: np.ndarray) -> bool:
        """Whether the tokenizer put its BOS before a text that starts with it (a chat rendered with
        ``apply_chat_template(tokenize=False)``): the text as written, and the template's ids, hold one."""
        bos, token = self.tok.bos_token_id, self.tok.bos_token
        return bool(bos is not None and token and text.startswith(token) and ids.size > 1 and ids[0] == ids[1] == bos)

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
                if is_text and self._doubled_bos(prepared[i][0], ids):  # a rendered chat's own BOS: kept alone
                    ids = ids[1:]
                target = np.ones(ids.size, dtype=bool)
                if spans is not None:  # a token trains when it overlaps a trained turn (as char_to_token maps)
                    offsets = np.asarray(enc["offset_mapping"][j], dtype=np.int64).reshape(-1, 2)
                    target[:] = False
                    for a, b in spans:
                        target |= (offsets[:, 1] > a) & (offsets[:, 0] < b)
                target[:1] = False
                out[i] = (ids, target)
        return out
