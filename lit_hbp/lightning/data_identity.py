"""What a run's training data is, kept in its checkpoints so a resume can say what changed.

A resume plans the checkpoint's epoch again from the samples' lengths and supervised counts (the plan key's
``data``); when those differ it is refused, and the refusal names the settings that made them differ (a source
added or moved, ``train_on``, ``over_length``, the tokenizer or chat template, the rendering libraries) rather
than a hash. When they are the same but a source's records hold other tokens (a file edited in place, a fixed
typo), the plan is the same and the run goes on: that is said, naming the source.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lit_hbp.data.media import processor_fingerprint
from lit_hbp.data.sources import Source
from lit_hbp.data.tokenize import renderer_versions, tokenizer_fingerprint

DEFAULTS = {f.name: f.default for f in dataclasses.fields(Source)}


def data_settings(dm: Any) -> dict:
    """The settings that make the training samples what they are (computed once per data module)."""
    if getattr(dm, "_data_settings", None) is None:
        template = str(getattr(dm.tokenizer, "chat_template", None))
        dm._data_settings = dict(
            sources=[source_setting(s) for s in dm.sources],
            train_on=dm.train_on,
            over_length=dm.over_length,
            val_fraction=dm.val_fraction,
            tokenizer=tokenizer_fingerprint(dm.tokenizer)[:16],
            chat_template=hashlib.sha256(template.encode()).hexdigest()[:16],
            processor=processor_fingerprint(dm.processor)[:16] if dm.processor is not None else None,
            renderers=renderer_versions(),
        )
    return dm._data_settings


def source_setting(source: Source) -> dict:
    """A source as its config gave it: its path and the fields it sets."""
    return {k: v for k, v in dataclasses.asdict(source).items() if k == "path" or v != DEFAULTS[k]}


def data_changes(saved: dict, now: dict) -> list[str]:
    """What differs between two plan keys' data, by setting, or by source content where no setting differs;
    empty where neither key says (a checkpoint of an older lit-hbp)."""
    was, is_ = saved.get("settings"), now.get("settings")
    if not was or not is_:
        return []
    out = []
    if was["sources"] != is_["sources"]:
        paths = [[s["path"] for s in x["sources"]] for x in (was, is_)]
        if paths[0] != paths[1]:
            out.append(f"data.sources: {paths[0]} -> {paths[1]}")
        else:
            for i, (a, b) in enumerate(zip(was["sources"], is_["sources"])):
                for k in sorted(set(a) | set(b)):
                    if a.get(k, DEFAULTS.get(k)) != b.get(k, DEFAULTS.get(k)):
                        out.append(f"data.sources[{i}] ({a['path']}) {k}: {a.get(k)} -> {b.get(k)}")
    for key in ("train_on", "over_length", "val_fraction"):
        if was.get(key) != is_.get(key):
            out.append(f"data.{key}: {was.get(key)} -> {is_.get(key)}")
    if was.get("chat_template") != is_.get("chat_template"):
        out.append("data.chat_template: the tokenizer's chat template is another")
    elif was.get("tokenizer") != is_.get("tokenizer"):
        out.append("data.tokenizer: its vocabulary, special tokens or encoding are other")
    if was.get("processor") != is_.get("processor"):
        out.append("data.processor_kwargs / the processor: images and videos become other token counts")
    for lib, version in (is_.get("renderers") or {}).items():
        if (was.get("renderers") or {}).get(lib, version) != version:
            out.append(f"{lib} {was['renderers'][lib]} -> {version} (it renders or splits records otherwise)")
    if not out:
        out = [f"the records of {name} hold other tokens (edited in place?)" for name in edited_sources(saved, now)]
    return out


def older_key_note(saved: dict) -> str:
    """What a refusal can say of a checkpoint whose plan key kept no data settings (an older lit-hbp's)."""
    if saved.get("settings"):
        return ""
    return (
        " (the checkpoint's lit-hbp kept no record of its data settings: compare them with its run's config.yaml; "
        "since then a mix by weight takes each source's share to the whole sample, which can move it by one)"
    )


def edited_sources(saved: dict, now: dict) -> list[str]:
    """The training sources (``data.sources[i] (path)``) whose records hold other tokens than at the save."""
    was, is_ = saved.get("content"), now.get("content")
    if not was or not is_ or len(was) != len(is_):
        return []
    paths = [s["path"] for s in now["settings"]["sources"]]
    return [f"data.sources[{i}] ({paths[i]})" for i, (a, b) in enumerate(zip(was, is_)) if a and b and a != b]


def say_edited_sources(saved: dict, now: dict) -> None:
    """Warn where a resumed run's sources hold other tokens with every sample's length and supervised count the
    same: its plan is the checkpoint's, so it goes on, training the edited records from the checkpoint's place."""
    edited = edited_sources(saved, now)
    if edited:
        rank_zero_warn(
            f"the records of {', '.join(edited)} hold other tokens than when the checkpoint was saved (each sample's "
            "length and supervised count are the same, so the plan is the checkpoint's): the run goes on from its "
            "place in that plan with the records as they are now"
        )
