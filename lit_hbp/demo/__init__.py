"""The embedded demo data sets, built offline on first use: short chats and long documents about the
Python standard library (``text``: ``python -m lit_hbp.demo``), drawn-shape image chats with a tiny
LLaVA-NeXT folder (``vision``: ``python -m lit_hbp.demo.vision``), and chats with short drawn videos and
pictures with a tiny Qwen2-VL folder (``video``: ``python -m lit_hbp.demo.video``; torchvision needed)."""

import json
import os
from pathlib import Path
from typing import Any

DEMOS = ("text", "vision", "video")  # the kinds ``data.demo`` names


def ensure_kind(out_dir: str | os.PathLike[str], kind: str = "text") -> None:
    """Build the demo ``kind`` in ``out_dir`` when missing (the data module's ``demo_dir``). A ``demo_dir``
    that is a file, or a link to nothing, is refused by name (the build would stop on it with a traceback)."""
    from lit_hbp.errors import ConfigError

    path = Path(out_dir)
    if path.is_symlink() and not path.exists():
        raise ConfigError(
            f"data.demo_dir: {out_dir} is a link to {os.readlink(path)}, which does not exist: point the link at the "
            "demo's folder, or remove it and the demo is built there"
        )
    if path.exists() and not path.is_dir():
        raise ConfigError(f"data.demo_dir: {out_dir} is a file, not a folder: give a folder (the demo is built there)")
    held = held_kind(path)
    if held is not None and held != kind:  # a build would write over it, and the config's sources read the old one
        raise ConfigError(
            f"data.demo: {kind}, but data.demo_dir {out_dir} holds the {held} demo (its manifest.json): give the "
            f"{kind} demo a folder of its own (the configs use demo_data, demo_vlm, demo_video), or data.demo: {held}"
        )
    if kind == "vision":
        from lit_hbp.demo.vision import ensure_vlm_demo

        ensure_vlm_demo(out_dir)
    elif kind == "video":
        from lit_hbp.demo.video import ensure_video_demo

        ensure_video_demo(out_dir)
    else:
        from lit_hbp.demo.text import ensure_demo

        ensure_demo(out_dir)


def held_kind(path: Path) -> str | None:
    """The demo a folder's manifest says it holds (text, vision or video), None without one."""
    try:
        manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    if "generator_version" in manifest:
        return "text"
    return "video" if "videos" in manifest else "vision"


def __getattr__(name: str) -> Any:
    """What ``lit_hbp.demo`` held before it was a folder (0.1: ``ensure_demo``, ``build_demo``, ...: the
    module ``text`` now), imported on use."""
    if name.startswith("__"):
        raise AttributeError(name)
    import importlib

    try:
        return getattr(importlib.import_module("lit_hbp.demo.text"), name)
    except AttributeError:
        raise AttributeError(f"module 'lit_hbp.demo' has no attribute {name!r}") from None
