"""The packed calls a thread is running: the only place a call's state lives while it runs.

A packed call of a prepared model (``lit_hbp.model.packed_call``) needs its modules to see, for exactly
its duration and nowhere else, lit-hbp's varlen attention in place of the model's own, its level's
settings (checkpointed layers, host offload, MLP tiles) and, for families whose layers drop the
attention keywords, its pack. Setting any of that on the model (its config, its layers) would show
it to every other thread calling the model meanwhile, to every model built from the same config and
to every later call that reads it by mistake. So a call is a ``PackCall`` pushed on this thread's
stack while it runs (and pushed again, in the backward, around a checkpointed layer's recomputation):
another thread, or this thread after the call, sees nothing of it.

The attention implementation transformers dispatches on is read from ``config._attn_implementation``
(a property of ``PretrainedConfig``, or of a family's config class that defines its own). ``install``
makes that property answer lit-hbp's name for the configs of the model whose packed call runs on this
thread, and what the class's own getter says everywhere else: the one change lit-hbp makes to
transformers, inert outside a packed call. The getter reads a thread-local dict, which
``torch.compile`` traces with guards on its content (no graph break).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

ATTN_NAME = "hbp_varlen"
TOWER_NAME = (
    "hbp_tower_flash_varlen"  # a vision tower's (``lit_hbp.model.attention.tower``): "flash" gets its images' bounds
)
_local = threading.local()


@dataclass(frozen=True, eq=False)
class PackCall:
    """One packed call of a prepared model: ``prepared`` (its ``Prepared`` record), ``pack`` (the
    keywords attention needs: ``cu_seq_lens_q``, ``max_length_q``, ``hbp_cp_shard``, ``hbp_sp``),
    the level's ``ckpt_layers`` (None: the layers the project checkpoints itself), ``offload`` (the
    model's ``HostOffload`` or None) and MLP ``tiles``; ``tower``: the attention a vision tower's configs
    name while it encodes the call's images (config id -> transformers' implementation; the others their own);
    ``host``: what its modules read back from the device once for the call (``lit_hbp.model.mixers``: the pack's
    document boundaries), kept for its recomputations."""

    prepared: Any
    pack: dict
    ckpt_layers: int | None = None
    offload: Any = None
    tiles: int = 1
    tower: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)


def current(prepared) -> PackCall | None:
    """The packed call of the model ``prepared`` this thread is running (its innermost), or None."""
    stack = getattr(_local, "calls", None)
    if stack and stack[-1].prepared is prepared:
        return stack[-1]
    return None


def running() -> PackCall | None:
    """This thread's innermost packed call, of whichever model."""
    stack = getattr(_local, "calls", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def entered(call: PackCall, route: bool = True) -> Iterator[PackCall]:
    """``call`` is this thread's innermost packed call inside: its model's configs name lit-hbp's
    attention (on this thread only; with ``route`` False a vision tower encoding the call's images: its
    configs name the call's ``tower`` attention, every other config its own); the previous state after,
    however the block ends."""
    stack = getattr(_local, "calls", None)
    if stack is None:
        stack = _local.calls = []
    before = getattr(_local, "names", None)
    stack.append(call)
    _local.names = {id(config): ATTN_NAME for config, _ in call.prepared.configs} if route else dict(call.tower)
    try:
        yield call
    finally:
        stack.pop()
        _local.names = before


class _Routed:
    """The getter of a config class's ``_attn_implementation`` property: lit-hbp's attention for the
    configs of this thread's packed call, the class's own getter otherwise."""

    def __init__(self, own) -> None:
        self.own = own

    def __call__(self, config) -> str | None:
        names = getattr(_local, "names", None)
        if names:
            name = names.get(id(config))
            if name is not None:
                return name
        return self.own(config)


def install(config_class: type | None = None) -> None:
    """Route ``_attn_implementation`` through this thread's packed call: on ``PretrainedConfig`` and on
    ``config_class``'s own property where a family defines one (once each; setters stay the family's)."""
    from transformers import PretrainedConfig

    for cls in {PretrainedConfig, *([config_class] if config_class is not None else [])}:
        owner = next(c for c in cls.__mro__ if "_attn_implementation" in c.__dict__)
        prop = owner.__dict__["_attn_implementation"]
        if not isinstance(prop.fget, _Routed):
            owner._attn_implementation = property(_Routed(prop.fget), prop.fset, prop.fdel, prop.__doc__)
