"""One field of a record or a message, read: a content's text, image and video parts, a turn's weight, tool
definitions and tool calls. Each reader takes the value and where it stands (``at``: file, line, field) and returns
what the chat template renders, or refuses it in one line naming that place (``lit_hbp.data.records`` reads the
records that hold them)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from lit_hbp.errors import DataError

TEXT_PARTS = ("text", "input_text", "output_text")
MEDIA_PARTS = ("image_url", "image", "input_image", "input_audio", "audio", "video", "video_url", "file", "input_file")


def joined_text(content: str | list[dict]) -> str | list[dict]:
    """A content of text parts alone as one string, joined as written; any other content as it is."""
    if isinstance(content, list) and all(p["type"] == "text" for p in content):
        return "".join(p["text"] for p in content)
    return content


def text_of(content: Any, at: str, may_be_empty: bool = False) -> str | list[dict]:
    """A message's content: a string, a list's text parts in order (``{"type": "text", "text": ...}``: the
    encoder hands them to a template that renders parts, and joins them as written for one that does not), or
    null beside tool calls (``may_be_empty``); with image or video parts, the text, image and video parts in
    order (each one's file kept under ``path`` for the reader). Audio and files are refused."""
    if content is None:
        if may_be_empty:
            return ""
        raise DataError(f"{at} is null; only an assistant message with tool_calls may have no content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DataError(f"{at} must be str or a list of text parts, got {type(content).__name__}")
    parts: list[dict] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PARTS or kind in VIDEO_PARTS:
            media = "image" if kind in IMAGE_PARTS else "video"
            parts.append({"type": media, "path": media_file(part, kind, media, f"{at}[{j}]"), "at": f"{at}[{j}]"})
            if "fps" in part and kind == "video":
                parts[-1]["fps"] = frame_rate(part["fps"], f"{at}[{j}]")
            continue
        if kind in MEDIA_PARTS:
            raise DataError(f"{at}[{j}] is a {kind!r} part: not supported (lit-hbp trains on text, images and videos)")
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
            raise DataError(f'{at}[{j}] must be a text part {{"type": "text", "text": ...}}, got {part!r:.80}')
        parts.append({"type": "text", "text": part["text"]})
    return parts


class Frames(NamedTuple):
    """A video given as frames (a folder or a list of files) at the rate its record states, ``fps``."""

    source: str | tuple[str, ...]
    fps: float


IMAGE_PARTS = ("image", "image_url", "input_image")
VIDEO_PARTS = ("video", "video_url")


def media_file(part: Mapping, kind: str, media: str, at: str) -> str | list[str]:
    """The file of an image or video part: ``{"type": "image" | "video", "image" | "video" | "path" |
    "url": ...}`` (a video's may be a list of frame files), OpenAI's ``{"type": "image_url", "image_url":
    {"url": ...}}`` (``video_url`` alike) or ``{"type": "input_image", "image_url": ...}``."""
    direct = kind == media
    known = {"type", media, "path", "url"} if direct else {"type", f"{media}_url"}
    if direct and media == "video":
        known.add("fps")  # the rate of a video given as frames (``frame_rate``)
    unknown = sorted(set(part) - known)
    article = "an" if media == "image" else "a"
    if unknown:
        raise DataError(f"{at}: {article} {media} part's {unknown} is not read (it has {', '.join(sorted(known))})")
    value = part.get(media, part.get("path", part.get("url"))) if direct else part.get(f"{media}_url")
    if isinstance(value, Mapping):  # OpenAI's {"url": ..., "detail": ...}: the processor sizes the image, not detail
        if set(value) - {"url"}:
            raise DataError(
                f"{at}: {article} {media}_url's {sorted(set(value) - {'url'})} is not read (it has url): the "
                "processor sizes images (data.processor_kwargs); drop it"
            )
        value = value.get("url")
    if not is_media_source(value, frames=media == "video"):
        example = '"image": "path/to/file.png"' if media == "image" else '"video": "path/to/frames/" or a list of them'
        raise DataError(f"{at} is {article} {media} part without a file (give {example}), got {part!r:.80}")
    return value


def frame_rate(value: Any, at: str) -> float:
    """A video part's ``fps``: the frames a second of a video given as frames, a positive number (the
    processor reads time from it: Qwen2.5-VL's seconds per temporal patch, Qwen3-VL's timestamps)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise DataError(f"{at}: a video part's fps must be a positive number of frames a second, got {value!r:.40}")
    return float(value)


def is_media_source(value: Any, frames: bool) -> bool:
    """A non-empty path, or (``frames``: a video's) a non-empty list of them."""
    if frames and isinstance(value, list):
        return bool(value) and all(isinstance(x, str) and x for x in value)
    return isinstance(value, str) and bool(value)


def weight_of(value: Any, at: str) -> int | None:
    """A message's ``weight``: 0 (the turn does not train) or 1 (it trains), or None when absent."""
    if value is None:
        return None
    if isinstance(value, (bool, int, float)) and value in (0, 1):
        return int(value)
    raise DataError(f"{at} must be 0 or 1 (whether the turn trains), got {value!r}")


def _json(value: Any, at: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise DataError(f"{at} is not valid JSON: {e.msg} (column {e.colno})") from None


def tools_of(value: Any, at: str) -> list[dict] | None:
    """Tool definitions in OpenAI's form ``{"type": "function", "function": {name, description,
    parameters}}``: a list (or its JSON string); a bare function description is wrapped. An empty list stays one, as
    ``apply_chat_template(tools=[])`` takes it (Llama 3.1's template asks ``tools is not none``)."""
    value = _json(value, at)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"{at} must be a list of tool definitions (objects)")
    out = []
    for j, tool in enumerate(value):
        if "type" not in tool and "function" not in tool:
            if not isinstance(tool.get("name"), str):
                raise DataError(f"{at}[{j}] has neither a type nor a name: not a tool definition")
            tool = {"type": "function", "function": tool}
        out.append(tool)
    return out


def tool_calls_of(value: Any, at: str) -> list[dict]:
    """Tool calls as chat templates read them, ``{"type": "function", "function": {"name", "arguments"}}`` and the
    call's ``id``; the arguments as given, as ``apply_chat_template`` takes them: OpenAI's JSON string stays a string
    (checked to be JSON; Qwen3 and Hermes print it as written, a ``tojson`` quotes it), an object an object. An empty
    list (a table's rows without calls) stays empty, as the template gets it from ``apply_chat_template``."""
    if not isinstance(value, list):
        raise DataError(f"{at} must be a list of calls")
    out = []
    for j, call in enumerate(value):
        if not isinstance(call, dict):
            raise DataError(f"{at}[{j}] must be an object")
        if call.get("type", "function") != "function":
            raise DataError(f"{at}[{j}] is a {call['type']!r} call: only function calls are read")
        fn = call.get("function", call)
        unknown = set(call) - (
            {"id", "type", "function"} if "function" in call else {"id", "type", "name", "arguments"}
        )
        if unknown or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise DataError(f'{at}[{j}] must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}')
        if set(fn) - {"name", "arguments"}:
            raise DataError(
                f"{at}[{j}].function has fields {sorted(set(fn) - {'name', 'arguments'})}; a call has name, arguments"
            )
        arguments = {} if fn.get("arguments") is None else fn["arguments"]
        _json(arguments, f"{at}[{j}].function.arguments")  # a malformed string is refused, never rendered
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        if call.get("id") is not None:
            entry["id"] = call["id"]
        out.append(entry)
    return out


def calls_of_json(value: Any, at: str) -> list[dict]:
    """ShareGPT's ``function_call`` turn: the JSON of one call ``{"name", "arguments"}`` or a list of them."""
    calls = _json(value, at)
    if calls == []:
        raise DataError(f"{at} is an empty list: a function call turn holds a call")
    return tool_calls_of(calls if isinstance(calls, list) else [calls], at)
