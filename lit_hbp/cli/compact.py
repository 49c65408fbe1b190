"""The resolved config printed compact after set-up: what a run sets other than the defaults, class specs
without their default ``init_args``, short leaf lists and mappings inline."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import typing
from collections.abc import Mapping
from typing import Any

import yaml

# (field names, field defaults) of the dataclasses a list option's entries may be.
EntryDefaults = list[tuple[frozenset[str], dict[str, Any]]]


@functools.cache
def class_arguments(class_path: str) -> dict[str, Any]:
    """The init arguments jsonargparse accepts for a class (``**kwargs`` resolved the way it resolves
    them) with their defaults as a config dump writes them; {} when the class cannot be resolved."""
    from jsonargparse import ArgumentParser

    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, fail_untyped=False)
        dumped = parser.dump(parser.get_defaults(), skip_validation=True, skip_none=False)
    except (ImportError, AttributeError, TypeError, ValueError, argparse.ArgumentError):
        return {}
    return yaml.safe_load(dumped) or {}


def dataclass_defaults(typehint: Any) -> EntryDefaults:
    """(field names, field defaults) of every dataclass a type hint names (``list[Source | dict]``:
    Source's)."""
    out = []
    if dataclasses.is_dataclass(typehint) and isinstance(typehint, type):
        fields = dataclasses.fields(typehint)
        defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
        out.append((frozenset(f.name for f in fields), defaults))
    for arg in typing.get_args(typehint):
        out += dataclass_defaults(arg)
    return out


def _compact_value(value: Any, entry_defaults: EntryDefaults) -> Any:
    if isinstance(value, list):
        return [_compact_value(v, entry_defaults) for v in value]
    if not isinstance(value, dict):
        return value
    if "class_path" in value:
        init = value.get("init_args") or {}
        defaults = class_arguments(value["class_path"])
        init = {k: v for k, v in init.items() if k not in defaults or defaults[k] != v}
        return {"class_path": value["class_path"], **({"init_args": init} if init else {})}
    for names, defaults in entry_defaults:  # a dataclass entry: the fields it sets to other than their default
        if set(value) <= names:
            return {k: v for k, v in value.items() if k not in defaults or defaults[k] != v}
    return value


def compact_config(
    config: Mapping[str, Any],
    defaults: Mapping[str, Any],
    entry_defaults: Mapping[str, EntryDefaults] | None = None,
) -> dict[str, Any]:
    """``config`` without what equals ``defaults`` (nested by section), class specs without their
    default init_args, and dataclass entries (``entry_defaults``: per dotted key) without default
    fields: what a run actually sets, short enough to read at the start of its log."""
    entry_defaults = entry_defaults or {}

    def walk(cfg: Mapping[str, Any], dflt: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        out = {}
        for key, value in cfg.items():
            dotted = f"{prefix}{key}"
            default = dflt.get(key, dataclasses.MISSING) if isinstance(dflt, Mapping) else dataclasses.MISSING
            if isinstance(value, Mapping) and "class_path" not in value and isinstance(default, Mapping):
                sub = walk(value, default, f"{dotted}.")
                if sub:
                    out[key] = sub
            elif value != default:
                out[key] = _compact_value(value, entry_defaults.get(dotted, []))
        return out

    return walk(config, defaults, "")


class _CompactDumper(yaml.SafeDumper):
    """Block YAML whose short leaf collections (no nested ones) are written on one line."""


def _represent_compact(dumper: yaml.SafeDumper, data: dict | list) -> yaml.Node:
    items = data.values() if isinstance(data, dict) else data
    flow = bool(data) and not any(isinstance(v, (dict, list)) for v in items) and len(repr(data)) <= 72
    if isinstance(data, dict):
        return dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=flow)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_CompactDumper.add_representer(dict, _represent_compact)
_CompactDumper.add_representer(list, _represent_compact)


def compact_yaml(data: Mapping[str, Any]) -> str:
    """``data`` as block YAML in its own key order, short leaf lists and mappings inline."""
    return yaml.dump(dict(data), Dumper=_CompactDumper, sort_keys=False, width=120).rstrip()
