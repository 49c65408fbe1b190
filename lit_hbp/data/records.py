"""Record formats: one record of a source, read as the chat messages its template renders.

A source's ``format`` names the shape of its records (``auto``: decided per record by its fields):

- ``openai``: ``{"messages": [...], "tools": [...]}``, the OpenAI chat format: ``role`` and ``content``
  (a string, null beside ``tool_calls``, or a list of text parts), assistant ``tool_calls``, ``tool``
  messages with ``tool_call_id`` and ``name``, ``reasoning_content`` / ``thinking``, and a per-message
  ``weight`` (0 or 1) deciding whether that turn trains;
- ``sharegpt``: ``{"conversations": [{"from": "human", "value": ...}], "system": ..., "tools": ...}``;
- ``alpaca``: ``{"instruction", "input", "output"}`` with optional ``system`` and ``history``;
- ``prompt_response``: ``{"prompt", "response"}`` with an optional ``system``;
- ``text``: ``{"text"}``, every token trained;
- ``tokens``: pre-tokenized ``{"input_ids"}`` with ``labels`` or ``assistant_masks``.

``fields`` renames any of a format's fields (``{messages: dialog, role: speaker}``) and ``roles`` maps
a data set's role names onto chat roles (``{bot: assistant}``). Used or refused: a field of a message
is rendered or the record is refused with its file and line; a record's other fields are metadata,
counted per source in the data report.

Every format's reader beside the field and role mapping and the refusals they share, read together when a format
or a field is added (``auto`` decides between them); what one field's value means (a content's parts, a weight, tool
calls) is ``lit_hbp.data.message_fields``.
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lit_hbp.data.message_fields import (
    Frames,
    calls_of_json,
    is_media_source,
    joined_text,
    text_of,
    tool_calls_of,
    tools_of,
    weight_of,
)
from lit_hbp.errors import ConfigError, DataError

RECORD_FORMATS = ("auto", "openai", "sharegpt", "alpaca", "prompt_response", "text", "tokens")
# The record fields of each format, by their default names (``fields`` renames them).
RECORD_FIELDS = {
    "openai": ("messages", "tools", "system", "images", "videos"),
    "sharegpt": ("conversations", "system", "tools", "images", "image", "videos", "video"),
    "alpaca": ("instruction", "input", "output", "system", "history", "tools"),
    "prompt_response": ("prompt", "response", "system", "tools"),
    "text": ("text",),
    "tokens": ("input_ids", "labels", "assistant_masks", "attention_mask"),
}
# The fields of one message of the chat formats.
MESSAGE_FIELDS = {"openai": ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "thinking",
                             "weight", "function_call"), "sharegpt": ("from", "value", "weight")}  # fmt: skip
# Fields of OpenAI API responses that carry nothing when empty: taken when null or empty, else refused.
EMPTY_ONLY = ("refusal", "annotations", "audio")
# Record fields that would change what trains if they were read, and are not: refused, never metadata.
NOT_READ = ("weight", "weights", "loss_weight", "training", "images", "image", "audios", "videos", "video", "history",
            "loss_mask", "label_mask", "position_ids", "functions", "chat_template_kwargs", "documents")  # fmt: skip
# What to do instead, for the NOT_READ fields that are not a per-message weight (TRL hands a record's
# chat_template_kwargs, transformers its documents, to the chat template; here each record renders with neither).
NOT_READ_FIX = {"functions": "give the definitions as tools: [{type: function, function: ...}]",
                "chat_template_kwargs": "remove it, and set data.chat_template to a template that sets them itself",
                "documents": "remove it, and put the documents in a message's content"}  # fmt: skip
# Fields a message passes to the chat template besides role and content; each must change the rendering.
RENDERED = ("tool_calls", "reasoning_content", "thinking")
# Chat roles a record may use. A role outside these is a typo far more often than a real role, and
# a misspelled "assistant" would silently lose every supervised token of the record.
KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer", "function", "ipython")
# ShareGPT's role names (``from``), understood in every chat format; ``function_call`` is an assistant
# turn whose value is the JSON of the call(s).
FUNCTION_CALL = "function_call"
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "observation": "tool", FUNCTION_CALL: FUNCTION_CALL}
ROLE_TYPO_CUTOFF = 0.7  # assitant / assistant 0.94, usr / user 0.86; model / developer 0.43
FIELD_TYPO_CUTOFF = 0.8  # tool / tools 0.89, conversation / conversations 0.96
# LLaVA's and LLaMA-Factory's record fields of each media kind (its list, its one-item form) and the
# marker that stands in the text where each of them goes.
MEDIA_FIELDS = {"image": ("images", "image", "<image>"), "video": ("videos", "video", "<video>")}
IMAGE_MARKER = MEDIA_FIELDS["image"][2]


@dataclass(frozen=True)
class Conversation:
    """A chat record as its template renders it, or plain text (``messages`` is None).

    messages: role, content (a string, or text, image and video parts where the message has media) and the
        optional fields the template reads (``tool_calls`` with their arguments as the record gives them,
        ``tool_call_id``, ``name``, ``reasoning_content``, ``thinking``).
    tools: the tool definitions handed to the template (OpenAI's ``{"type": "function", ...}`` form).
    weights: per message, 0 or 1 when the record says whether it trains, None where ``train_on`` decides.
    images: the files of its image parts, in the order they stand (paths as the source's folder resolves
        them): loaded with the model's processor, never stored in the token cache.
    videos: its videos in the order they stand, each a folder of frames, a list of frame files (either as
        ``Frames`` with the rate a video part gave them, ``fps``) or a video file (``media.load_video``).
    """

    messages: list[dict] | None
    text: str | None
    where: str
    tools: list[dict] | None = None
    weights: tuple[int | None, ...] = ()
    images: tuple[str, ...] = ()
    videos: tuple[str | tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class TokenRecord:
    """A pre-tokenized record: its ids and ``labels`` or ``assistant_masks`` (None when absent)."""

    input_ids: Any
    labels: Any
    assistant_masks: Any
    where: str


def _near(name: str, names: tuple[str, ...] | list[str], cutoff: float = FIELD_TYPO_CUTOFF) -> str | None:
    close = difflib.get_close_matches(str(name), list(names), n=1, cutoff=cutoff)
    return close[0] if close else None


def check_role(role: str, where: str, said: set[str]) -> None:
    """Raise for a role that looks like a misspelled known one (``assitant``, ``Usr``), naming the known
    roles and the closest: only ``assistant`` turns are supervised, so a misspelled one would silently
    train on nothing. Any other role (``model``, ``critic``: some chat templates use their own) is
    passed to the template as it is, and said once per role of those in ``said`` (a reader's own)."""
    if role in KNOWN_ROLES:
        return
    close = _near(role.lower(), KNOWN_ROLES, ROLE_TYPO_CUTOFF)
    known = ", ".join(KNOWN_ROLES)
    if close:
        raise DataError(f"{where} has unknown role {role!r}: known roles are {known}; did you mean {close!r}?")
    if role not in said:
        said.add(role)
        warnings.warn(
            f"{where}: role {role!r} is none of {known}; it goes to the chat template as it is and is not "
            "supervised (only assistant turns are, unless train_on: all or the message's weight is 1)",
            stacklevel=2,
        )


# The fields that tell a record's format (``auto``), in the order they are looked for.
FORMAT_KEYS = (
    ("tokens", ("input_ids",)),
    ("openai", ("messages",)),
    ("sharegpt", ("conversations",)),
    ("alpaca", ("instruction",)),
    ("prompt_response", ("prompt", "response")),
    ("text", ("text",)),
)
# What trains in each format: a record that holds two formats' is ambiguous under ``auto``.
TRAINED_KEYS = {**dict(FORMAT_KEYS), "alpaca": ("instruction", "output")}


def detect_format(record: Mapping, where: str) -> str:
    """The format of a record by its fields (``auto``): pre-tokenized ids first, then the chat shapes. A record
    holding what two formats train on (``messages`` and ``prompt``/``response``, ``messages`` and ``text``) is
    refused: which one trains is the user's to say (the source's ``format``; the other's fields are then
    metadata)."""
    for fmt, keys in FORMAT_KEYS:
        if any(k in record for k in keys):
            others = [
                f"{other} ({', '.join(trained)})"
                for other, trained in TRAINED_KEYS.items()
                if other != fmt and all(record.get(k) not in (None, "", []) for k in trained)
            ]
            if others:
                raise DataError(
                    f"{where}: record holds what two formats train on: {fmt} ({', '.join(keys)}) and "
                    f"{' and '.join(others)}; set the source's format to the one to train on (format: {fmt}; the "
                    "other fields are then the record's metadata)"
                )
            return fmt
    raise DataError(
        f"{where}: record has none of the fields 'messages', 'conversations', 'instruction', 'prompt'/'response', "
        f"'text', 'input_ids' (it has {sorted(record)}); name the record's format and fields in the source "
        "(format: openai | sharegpt | alpaca | prompt_response | text | tokens, fields: {...})"
    )


class RecordReader:
    """Reads the records of one source (its ``format``, ``fields`` and ``roles``); picklable, so every
    tokenizer worker process reads with the same settings. ``label`` names the source in config errors."""

    def __init__(
        self,
        format: str = "auto",
        fields: Mapping[str, str] | None = None,
        roles: Mapping[str, str] | None = None,
        label: str = "source",
        root: str | None = None,
    ):
        if format not in RECORD_FORMATS:
            close = _near(format, RECORD_FORMATS, 0.6)
            hint = f" (did you mean {close!r}?)" if close else ""
            raise ConfigError(
                f"{label}: format {format!r} is not a record format{hint}; formats: {', '.join(RECORD_FORMATS)}"
            )
        for option, value in (("fields", fields), ("roles", roles)):
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(
                    f"{label}: {option} maps the data set's names to the format's, e.g. "
                    f"{'{messages: dialog}' if option == 'fields' else '{bot: assistant}'}; got {value!r}"
                )
        self.format = format
        self.fields = dict(fields or {})
        if self.fields:
            if format == "auto":
                raise ConfigError(f"{label}: fields renames the fields of a format: give the source's format too")
            known = RECORD_FIELDS[format] + MESSAGE_FIELDS.get(format, ())
            for key, value in self.fields.items():
                if key not in known:
                    close = _near(key, known, 0.6)
                    hint = f" (did you mean {close!r}?)" if close else ""
                    raise ConfigError(
                        f"{label}: fields: {key!r} is no field of format {format}{hint}; it has {', '.join(known)}"
                    )
                if not isinstance(value, str) or not value:
                    raise ConfigError(f"{label}: fields: {key!r} must name a field (a string), got {value!r}")
        self.roles = dict(roles or {})
        if self.roles and format not in ("auto", "openai", "sharegpt"):
            raise ConfigError(f"{label}: roles renames the roles of chat records; format {format} has none: drop roles")
        self.roles_said: set[str] = set()  # the unknown roles this reader warned of, each once
        self.roles_met: set[str] = set()  # the data set's role names read so far (a ``roles`` key none has: refused)
        self.fields_met: set[str] = set()  # the ``fields`` names read so far (one no record has: refused)
        self.root = root  # the folder image paths are relative to (the data file's)
        targets = KNOWN_ROLES + (FUNCTION_CALL,)
        for key, value in self.roles.items():
            if not isinstance(key, str):
                raise ConfigError(f"{label}: roles: the data set's role names are strings, got {key!r}")
            if value not in targets:
                raise ConfigError(
                    f"{label}: roles: {key!r} maps to {value!r}, which is no chat role ({', '.join(targets)})"
                )

    def name(self, canonical: str) -> str:
        """The data set's name of a field (``fields`` renames it)."""
        return self.fields.get(canonical, canonical)

    def read(self, record: Mapping, where: str) -> tuple[Conversation | TokenRecord, list[str]]:
        """The record as a conversation, text or token record, and its metadata fields (those its format
        does not read); a field that would change training without being read is refused."""
        fmt = self.format if self.format != "auto" else detect_format(record, where)
        used = {self.name(k) for k in RECORD_FIELDS[fmt]}
        self._met(record)
        extra = [k for k in record if k not in used]
        for key in extra:
            close = _near(key, sorted(used))
            if close is not None and close not in record:
                raise DataError(f"{where}: record field {key!r} is not read by format {fmt}: did you mean {close!r}?")
            if key in RECORD_FIELDS[fmt] and self.name(key) not in record:
                raise DataError(
                    f"{where}: record field {key!r} is not read: fields renames {key} to {self.name(key)!r}, "
                    "which this record has not; fix fields, or the record"
                )
            if key in NOT_READ and record[key] not in (None, [], ""):
                raise DataError(
                    f"{where}: record field {key!r} is not supported (format {fmt} reads {', '.join(sorted(used))}): "
                    f"{NOT_READ_FIX.get(key, 'remove it, or set weight per message')}"
                )
            if fmt == "tokens" and _per_token(record[key], record.get(self.name("input_ids"))):
                raise DataError(
                    f"{where}: record field {key!r} has a value per token, which format tokens does not read "
                    "(it reads labels, assistant_masks: 1 where a token trains); a mask of trained tokens (TRL's "
                    f"completion_mask) is read with fields: {{assistant_masks: {key}}}, else remove it"
                )
        return getattr(self, f"_{fmt}")(record, where), extra

    def _met(self, keys) -> None:
        """Note the ``fields`` names among a record's or message's keys (set-up checks each names a field)."""
        if self.fields:
            self.fields_met.update(k for k in keys if k in self.fields.values())

    # ---------------------------------------------------------------------------------------- formats

    def _required(self, record: Mapping, key: str, where: str, kind: type = str):
        name = self.name(key)
        if name not in record:
            raise DataError(f"{where}: record has no {name!r} field")
        value = record[name]
        if not isinstance(value, kind):
            raise DataError(f"{where}: field {name!r} must be {kind.__name__}, got {type(value).__name__}")
        return value

    def _optional_text(self, record: Mapping, key: str, where: str) -> str | None:
        value = record.get(self.name(key))
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise DataError(f"{where}: field {self.name(key)!r} must be str, got {type(value).__name__}")
        return value

    def _tools(self, record: Mapping, where: str) -> list[dict] | None:
        return tools_of(record.get(self.name("tools")), f"{where}: {self.name('tools')}")

    def _conversation(
        self, messages: list[tuple[dict, int | None]], where: str, tools, system=None, record: Mapping | None = None
    ) -> Conversation:
        if system is not None:
            if any(m["role"] == "system" for m, _ in messages):  # two system prompts: which one is meant?
                raise DataError(
                    f"{where}: the record has a {self.name('system')!r} field and a system message: give one"
                )
            messages = [({"role": "system", "content": system}, None), *messages]
        msgs = [m for m, _ in messages]
        media = self._media(msgs, record or {}, where)
        return Conversation(msgs, None, where, tools, tuple(w for _, w in messages), media["image"], media["video"])

    def _media(self, messages: list[dict], record: Mapping, where: str) -> dict[str, tuple]:
        """The record's images and videos, each kind in the order it stands: its messages' parts of that
        kind, or its list field (``images``, ``videos``; LLaVA's ``image``, ``video``) placed at the
        kind's markers in the text (``<image>``, ``<video>``), one marker per item. A message with media
        gets its content as parts; paths resolve against the data file's folder."""
        out: dict[str, tuple] = {}
        markers: dict[str, str] = {}
        for kind, (plural, single, marker) in MEDIA_FIELDS.items():
            listed = [(key, record[self.name(key)]) for key in (plural, single) if record.get(self.name(key))]
            parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == kind]
            if not listed:
                out[kind] = tuple(self._part_source(p) for p in parts)
                continue
            if parts:
                raise DataError(f"{where}: the record has both {kind} parts and a {listed[0][0]!r} field: give one")
            if len(listed) > 1:
                raise DataError(f"{where}: the record has both {plural!r} and {single!r}: give one")
            key, value = listed[0]
            items = [value] if isinstance(value, str) or (kind == "video" and key == single) else value
            if not isinstance(items, list) or not all(is_media_source(x, frames=kind == "video") for x in items):
                what = "a path or a list of paths" if kind == "image" else "a list of videos (paths or lists of frames)"
                raise DataError(f"{where}: field {self.name(key)!r} must be {what}, got {value!r:.80}")
            for m in messages:  # markers stand in the text as written: a content of text parts alone, joined
                m["content"] = joined_text(m["content"])
            found = sum(m["content"].count(marker) for m in messages if isinstance(m["content"], str))
            if found != len(items):
                raise DataError(
                    f"{where}: {len(items)} {kind}(s) in {self.name(key)!r} but {found} {marker} marker(s) in the "
                    f"text: each {kind} stands at one marker"
                )
            out[kind] = tuple(self._source(x, f"{where}: {self.name(key)}") for x in items)
            markers[marker] = kind
        if markers:
            split = re.compile("(" + "|".join(re.escape(m) for m in markers) + ")")
            for m in messages:
                if isinstance(m["content"], str) and split.search(m["content"]):
                    pieces = split.split(m["content"])
                    m["content"] = [
                        {"type": markers[p]} if p in markers else {"type": "text", "text": p} for p in pieces if p
                    ]
        return out

    def _part_source(self, part: dict) -> str | tuple[str, ...] | Frames:
        """A part's file (its rate with it where the record gave one), taken out of the part the template renders."""
        source = self._source(part.pop("path"), part.pop("at"))
        return Frames(source, part.pop("fps")) if "fps" in part else source

    def _source(self, source: str | list[str], at: str) -> str | tuple[str, ...]:
        """An image's or video's file, or a video's frame files: local paths, relative to the data file's folder."""
        if isinstance(source, list):
            return tuple(self._path(p, at) for p in source)
        return self._path(source, at)

    def _path(self, path: str, at: str) -> str:
        """A local file, relative to the data file's folder."""
        if path.startswith("file://"):
            path = path[len("file://") :]
        if "://" in path or path.startswith("data:"):
            raise DataError(
                f"{at}: {path[:60]!r} is not a local file: lit-hbp reads images and videos from disk (no network at "
                "run time); download them and give their paths"
            )
        if self.root is not None and not os.path.isabs(path):
            path = os.path.join(self.root, path)
        return path

    def _openai(self, record: Mapping, where: str) -> Conversation:
        messages = self._required(record, "messages", where, list)
        out = [self._openai_message(m, i, where) for i, m in enumerate(messages)]
        system = self._optional_text(record, "system", where)
        return self._conversation(out, where, self._tools(record, where), system, record)

    def _openai_message(self, m: Any, i: int, where: str) -> tuple[dict, int | None]:
        at = f"{where}: messages[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{at} must be an object with role and content")
        known = {self.name(k): k for k in MESSAGE_FIELDS["openai"]}
        self._met(m)
        for key in m:
            if key in known or (key in EMPTY_ONLY and m[key] in (None, [], "")):
                continue
            close = _near(key, list(known))
            hint = f"; did you mean {close!r}?" if close else ""
            raise DataError(
                f"{at} has field {key!r}, which lit-hbp does not read{hint} (a message has {', '.join(known)})"
            )
        fields = {canonical: m[name] for name, canonical in known.items() if name in m and m[name] is not None}
        if "role" not in fields:
            raise DataError(f"{at} has no {self.name('role')!r} field")
        if not isinstance(fields["role"], str):
            raise DataError(f"{at}.{self.name('role')} must be str, got {type(fields['role']).__name__}")
        role = self._role(fields.pop("role"), at)
        content = fields.pop("content", None)
        if "function_call" in fields:  # the legacy single call: one tool call
            if fields.get("tool_calls"):
                raise DataError(f"{at} has both function_call and tool_calls: give tool_calls")
            fields["tool_calls"] = [fields.pop("function_call")]
        if role == FUNCTION_CALL:  # ShareGPT's call turn inside messages: its content is the call
            role, fields["tool_calls"], content = "assistant", calls_of_json(content, f"{at}.content"), None
        calls = bool(fields.get("tool_calls"))  # an empty list calls nothing
        if self.name("content") not in m and not calls:
            raise DataError(f"{at} has no {self.name('content')!r} field")
        message = {"role": role, "content": text_of(content, f"{at}.{self.name('content')}", calls)}
        if "tool_calls" in fields:
            if role != "assistant" and fields["tool_calls"] != []:
                raise DataError(f"{at}: tool_calls on a {role!r} message; only assistant messages call tools")
            message["tool_calls"] = tool_calls_of(fields.pop("tool_calls"), f"{at}.tool_calls")
        for key in ("name", "tool_call_id", "reasoning_content", "thinking"):
            if key in fields:
                value = fields.pop(key)
                if not isinstance(value, str):
                    raise DataError(f"{at}.{self.name(key)} must be str, got {type(value).__name__}")
                message[key] = value
        return message, weight_of(fields.pop("weight", None), f"{at}.{self.name('weight')}")

    def _role(self, raw: str, at: str) -> str:
        self.roles_met.add(raw)
        role = self.roles.get(raw) or SHAREGPT_ROLES.get(raw, raw)
        if role != FUNCTION_CALL:
            check_role(role, at, self.roles_said)
        return role

    def _sharegpt(self, record: Mapping, where: str) -> Conversation:
        turns = self._required(record, "conversations", where, list)
        known = {self.name(k): k for k in MESSAGE_FIELDS["sharegpt"]}
        out = []
        for i, t in enumerate(turns):
            at = f"{where}: {self.name('conversations')}[{i}]"
            if not isinstance(t, dict):
                raise DataError(f"{at} must be an object with {self.name('from')} and {self.name('value')}")
            self._met(t)
            for key in t:
                if key not in known:
                    close = _near(key, list(known))
                    hint = f"; did you mean {close!r}?" if close else ""
                    raise DataError(
                        f"{at} has field {key!r}, which lit-hbp does not read{hint} (a turn has {', '.join(known)})"
                    )
            for key in ("from", "value"):
                if self.name(key) not in t:
                    raise DataError(f"{at} has no {self.name(key)!r} field")
            raw = t[self.name("from")]
            if not isinstance(raw, str):
                raise DataError(f"{at}.{self.name('from')} must be str, got {type(raw).__name__}")
            self.roles_met.add(raw)
            role = self.roles.get(raw) or SHAREGPT_ROLES.get(raw, raw)
            if role not in KNOWN_ROLES and role != FUNCTION_CALL:
                known_from = sorted({*KNOWN_ROLES, *SHAREGPT_ROLES} - {"developer", "function", "ipython"})
                raise DataError(
                    f"{at} is from {raw!r}, which is no ShareGPT role ({', '.join(known_from)}); map it with the "
                    f"source's roles, e.g. roles: {{{raw}: assistant}}"
                )
            value = t[self.name("value")]
            if role == FUNCTION_CALL:
                message = {"role": "assistant", "content": "", "tool_calls": calls_of_json(value, f"{at}.value")}
            else:
                message = {"role": role, "content": text_of(value, f"{at}.{self.name('value')}")}
            out.append((message, weight_of(t.get(self.name("weight")), f"{at}.{self.name('weight')}")))
        system = self._optional_text(record, "system", where)
        return self._conversation(out, where, self._tools(record, where), system, record)

    def _alpaca(self, record: Mapping, where: str) -> Conversation:
        instruction = self._required(record, "instruction", where)
        output = self._required(record, "output", where)
        question = "\n".join(x for x in (instruction, self._optional_text(record, "input", where)) if x)
        history = record.get(self.name("history")) or []
        if not isinstance(history, list):
            raise DataError(f"{where}: field {self.name('history')!r} must be a list of [instruction, response] pairs")
        turns = []
        for i, pair in enumerate(history):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise DataError(
                    f"{where}: {self.name('history')}[{i}] must be a pair of strings [instruction, response]"
                )
            turns += [({"role": "user", "content": pair[0]}, None), ({"role": "assistant", "content": pair[1]}, None)]
        turns += [({"role": "user", "content": question}, None), ({"role": "assistant", "content": output}, None)]
        system = self._optional_text(record, "system", where)
        return self._conversation(turns, where, self._tools(record, where), system)

    def _prompt_response(self, record: Mapping, where: str) -> Conversation:
        for key, other in (("prompt", "response"), ("response", "prompt")):
            if self.name(key) not in record:
                trl = key == "response" and "completion" in record  # TRL's prompt/completion records
                strings = isinstance(record.get("completion"), str)
                hint = "set the source's format: prompt_response, fields: {response: completion}" if strings \
                    else "give its prompt's messages and completion's as messages"  # fmt: skip
                raise DataError(
                    f"{where}: record has {self.name(other)!r} but no {self.name(key)!r}" + f"; {hint}" * trl
                )
        prompt, response = self._required(record, "prompt", where), self._required(record, "response", where)
        turns = [({"role": "user", "content": prompt}, None), ({"role": "assistant", "content": response}, None)]
        return self._conversation(
            turns, where, self._tools(record, where), self._optional_text(record, "system", where)
        )

    def _text(self, record: Mapping, where: str) -> Conversation:
        return Conversation(None, self._required(record, "text", where), where)

    def _tokens(self, record: Mapping, where: str) -> TokenRecord:
        mask, ids = record.get(self.name("attention_mask")), record.get(self.name("input_ids"))
        n_ids = len(ids) if isinstance(ids, (list, tuple)) else None  # other input_ids are refused when read
        listed = isinstance(mask, (list, tuple))
        if mask is not None and not (listed and (n_ids is None or len(mask) == n_ids)):
            given = f"{len(mask)} values" if listed else f"{type(mask).__name__} {mask!r}"
            raise DataError(
                f"{where}: attention_mask must hold one value per token of input_ids ({given} for {n_ids} tokens): "
                "a pre-tokenized record holds one unpadded sample"
            )
        if mask is not None and not all(x == 1 for x in mask):
            raise DataError(
                f"{where}: attention_mask has zeros: a pre-tokenized record must hold one unpadded sample "
                "(lit-hbp packs and pads itself)"
            )
        for field in ("labels", "assistant_masks"):
            if self.name(field) in record and record[self.name(field)] is None:
                raise DataError(
                    f"{where}: {self.name(field)} is null: give it (labels: -100 on the tokens that do not train; "
                    "assistant_masks: 1 on those that do), or leave the field out for every token to train (in a "
                    "table, whose column has every row, give the input_ids as labels)"
                )
        return TokenRecord(
            record[self.name("input_ids")],
            record.get(self.name("labels")),
            record.get(self.name("assistant_masks")),
            where,
        )


# ------------------------------------------------------------------------------------------- pieces


def _per_token(value: Any, ids: Any) -> bool:
    """Whether a pre-tokenized record's field holds one value per token of ``ids`` (a mask or weights)."""
    return isinstance(value, (list, tuple)) and isinstance(ids, (list, tuple)) and len(value) == len(ids) > 1
