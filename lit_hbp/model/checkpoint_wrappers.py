"""torch's own activation checkpointing around decoder layers, refused: it recomputes outside the packed call.

A packed call exists only while it runs (``lit_hbp.model.calls``): lit-hbp's varlen attention, the pack's
document boundaries and each stateful mixer's documents are this thread's for the call's duration, and a layer
lit-hbp checkpoints enters the same call again around its recomputation in the backward. torch's
``checkpoint_wrapper`` (``apply_activation_checkpointing``, as FSDP set-ups apply it) and its composable
``checkpoint(module)`` recompute the layer themselves, in the backward, after the call returned: with reentrant
checkpointing the layer then attends over the whole pack and runs its mixers across documents, so the gradients
are silently wrong; without it torch stops with a ``CheckpointError``. The packed call (``pack_scope``) and
``prepare_model`` refuse either, naming it and what does the same inside the call.
"""

from __future__ import annotations

import torch

FIX = (
    "remove it and let lit-hbp checkpoint the layers inside the call: the level's ckpt_layers, or "
    "model.gradient_checkpointing_enable(), whose checkpointing lit-hbp runs inside packed calls"
)


def _wrapper_class() -> type | None:
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # a torch built without torch.distributed has neither wrapper
        return None
    return CheckpointWrapper


def _composable(module: torch.nn.Module) -> bool:
    """Whether torch's composable ``checkpoint(module)`` (``torch.distributed._composable``) is on ``module``."""
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:
        return False
    return "checkpoint" in (_get_registry(module) or {})


def _wraps(module: torch.nn.Module, wrapper: type | None) -> bool:
    """Whether ``module`` is torch's ``CheckpointWrapper`` or carries its composable ``checkpoint``."""
    return (wrapper is not None and isinstance(module, wrapper)) or _composable(module)


def checkpoint_wrapper_over(net: torch.nn.Module, layers: list[torch.nn.Module], inside: bool = True) -> str | None:
    """The path in ``net`` of torch's own checkpointing of one of ``layers`` or of a module holding one (a
    ``CheckpointWrapper``, or the composable ``checkpoint`` on the module) or, ``inside``, of a module inside one
    (its attention, its mixer; False: around the layers only, a packed call's cheap walk), with what it is; None
    when there is none."""
    wrapper = _wrapper_class()
    targets = {id(layer) for layer in layers}
    stack: list[tuple[str, torch.nn.Module]] = [("", net)]
    while stack:
        path, module = stack.pop()
        name = path or type(net).__name__
        if _composable(module) and (id(module) in targets or any(id(m) in targets for m in module.modules())):
            return f"`{name}` has torch's composable checkpoint(module)"
        if id(module) in targets:  # inside a layer: a wrapped attention or mixer recomputes outside the call too
            inner = inside and next((p for p, m in module.named_modules(prefix=name) if _wraps(m, wrapper)), None)
            if inner:
                return f"`{inner}` inside a decoder layer is torch's own checkpointing (CheckpointWrapper, checkpoint)"
            continue
        if wrapper is not None and isinstance(module, wrapper):
            if any(id(m) in targets for m in module.modules()):
                return f"`{name}` is torch's CheckpointWrapper (apply_activation_checkpointing / checkpoint_wrapper)"
            continue
        children = [(f"{path}.{key}" if path else key, c) for key, c in module._modules.items() if c is not None]
        stack.extend(reversed(children))  # the first in the model's order first
    return None


def refuse_checkpoint_wrappers(net: torch.nn.Module, layers: list[torch.nn.Module] | None = None) -> None:
    """Raise ``ValueError`` when torch's own activation checkpointing wraps one of ``net``'s decoder ``layers``
    (None: its checkpointable layers outside a vision tower, before ``prepare_model`` found them, their insides
    walked too; given: a packed call's check, around the layers only, as a whole walk costs ~1 ms a call)."""
    inside = layers is None
    if layers is None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        from lit_hbp.model.vision import vision_tower

        tower = vision_tower(net)
        skip = set() if tower is None else {id(m) for m in tower.modules()}
        layers = [m for m in net.modules() if isinstance(m, GradientCheckpointingLayer) and id(m) not in skip]
    found = checkpoint_wrapper_over(net, layers, inside)
    if found is not None:
        raise ValueError(
            f"{type(net).__name__}: {found}, which recomputes a decoder layer in the backward after the packed call "
            f"returned, without the pack's document boundaries (wrong gradients, or torch's CheckpointError): {FIX}"
        )
