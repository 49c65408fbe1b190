"""What a packed call sets for the graphs compiled inside it, for the call's duration: torch settings read when
dynamo traces a compiled layer, so they must hold while the layers run, not where they were compiled
(``packed_call.pack_scope`` enters them)."""

from __future__ import annotations

import contextlib

import torch
from torch._dynamo import config as dynamo_config
from torch.fx.experimental import _config as fx_config


def sizes_apart() -> contextlib.AbstractContextManager:
    """Compilations inside give each size its own symbol. By default dynamo gives sizes of equal value one
    symbol (duck shaping): a level's first pack exactly as long as one of a layer's widths (a 4K pack and an 8B
    model's 4096 hidden units, a 1K pack and 1024-wide K/V heads) tied the pack's length to that width, the
    weight's fixed width then pinned it, and every later length compiled the layers again
    (tests/test_compile.py). Compiled layers see the length change every call; widths never do."""
    return fx_config.patch(use_duck_shape=False)


def kernel_routing(layers: list[torch.nn.Module]) -> bool:
    """Whether a module of ``layers`` routes functions through ``kernels`` per model: transformers 5.25 (which
    installs ``kernels``) decorates its attention classes with ``use_kernelized_func``, whose forward sets a context
    variable naming the model's kernel functions and resets it on return; ``kernels`` keeps them in the module's
    ``_kernel_funcs``."""
    return any("_kernel_funcs" in m.__dict__ for layer in layers for m in layer.modules())


def replay_free_checkpoints(routes_kernels: bool) -> contextlib.AbstractContextManager:
    """Compilations inside trace a checkpointed layer whose forward sets and resets a context variable (its
    kernel routing: ``routes_kernels``, from ``kernel_routing``) into the layer's graph. Dynamo refuses a
    checkpoint whose body writes state from outside it (the recomputation in the backward would write it again):
    it broke the graph and ran every layer the level checkpoints eagerly, without a word (tests/test_compile.py).
    The write is undone by the same forward, so not replaying it in the recomputation changes nothing: torch's
    setting allowing that, process-wide for the call's duration as ``sizes_apart``; a model whose layers route no
    kernels keeps torch's default."""
    if not routes_kernels:
        return contextlib.nullcontext()
    return dynamo_config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
