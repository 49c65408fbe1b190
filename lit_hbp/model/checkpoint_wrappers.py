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

import functools

import torch

FIX = (
    "remove it and let lit-hbp checkpoint the layers inside the call: the level's ckpt_layers, or "
    "model.gradient_checkpointing_enable(), whose checkpointing lit-hbp runs inside packed calls"
)
TORCHS = "torch's own checkpointing (CheckpointWrapper, checkpoint)"
CALL_DEPTH = 2  # levels inside a decoder layer a packed call looks at (prepare_model: all)
WRAPPER = "torch's CheckpointWrapper (apply_activation_checkpointing / checkpoint_wrapper)"


@functools.cache
def _torch_checks() -> tuple[type | None, str | None]:
    """torch's ``CheckpointWrapper`` and the attribute under which its composable APIs (``checkpoint(module)``)
    register on a module (None in a torch built without torch.distributed), looked up once: a packed call walks
    every module of the model with them. The registry sits in the module's ``__dict__`` (``contract`` puts it
    there), read so rather than through ``Module.__getattr__``, whose miss raises an error per module."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:
        CheckpointWrapper = None  # noqa: N806
    try:
        from torch.distributed._composable.contract import REGISTRY_KEY
    except ImportError:
        REGISTRY_KEY = None  # noqa: N806
    return CheckpointWrapper, REGISTRY_KEY


def checkpoint_wrapper_over(
    net: torch.nn.Module, layers: list[torch.nn.Module], depth: int | None = None
) -> str | None:
    """The path in ``net`` of torch's own checkpointing of one of ``layers``, of a module holding one (a
    ``CheckpointWrapper``, or the composable ``checkpoint`` on the module) or of a module inside one (its
    attention, its mixer), with what it is; None when there is none. ``depth``: how many levels inside a layer
    to look (None: all, as ``prepare_model`` does). Each module is visited once, its path found only for a
    refusal."""
    wrapper, key = _torch_checks()
    targets = {id(layer) for layer in layers}
    deepest = float("inf") if depth is None else depth
    stack: list[tuple[torch.nn.Module, float]] = [(net, -1)]  # (module, levels inside a layer: -1 outside)
    while stack:
        module, level = stack.pop()
        wrapped = wrapper is not None and isinstance(module, wrapper)
        composable = key is not None and "checkpoint" in (module.__dict__.get(key) or {})
        if level > 0 and (wrapped or composable):  # a wrapped attention or mixer recomputes outside the call too
            return f"`{_path(net, module)}` inside a decoder layer is {TORCHS}"
        if composable and (id(module) in targets or any(id(m) in targets for m in module.modules())):
            return f"`{_path(net, module)}` has torch's composable checkpoint(module)"
        if wrapped:
            if any(id(m) in targets for m in module.modules()):
                return f"`{_path(net, module)}` is {WRAPPER}"
            continue
        child = 1 if level < 0 and id(module) in targets else level + 1 if level > 0 else -1  # a layer's own: 1
        if child <= deepest:
            stack.extend((c, child) for c in reversed(module._modules.values()) if c is not None)  # the model's order
    return None


def _path(net: torch.nn.Module, module: torch.nn.Module) -> str:
    """``module``'s path in ``net`` (the model's class name for ``net`` itself)."""
    return next(p for p, m in net.named_modules() if m is module) or type(net).__name__


def refuse_checkpoint_wrappers(net: torch.nn.Module, layers: list[torch.nn.Module] | None = None) -> None:
    """Raise ``ValueError`` when torch's own activation checkpointing wraps one of ``net``'s decoder ``layers`` or a
    module inside one. None: its checkpointable layers outside a vision tower, before ``prepare_model`` found them,
    walked whole. Given: a packed call's check, two levels inside each layer (what reads the call's boundaries, an
    attention or a mixer, sits there: ``self_attn``, Zamba2's ``shared_transformer.self_attn``; a wrapper applied
    deeper after ``prepare_model`` is refused by the next one), as a whole walk of a large LoRA model (peft adds
    seven modules to each adapted projection) costs ~20 ms a call."""
    depth = None if layers is None else CALL_DEPTH
    if layers is None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        from lit_hbp.model.vision import vision_tower

        tower = vision_tower(net)
        skip = set() if tower is None else {id(m) for m in tower.modules()}
        layers = [m for m in net.modules() if isinstance(m, GradientCheckpointingLayer) and id(m) not in skip]
    found = checkpoint_wrapper_over(net, layers, depth)
    if found is not None:
        raise ValueError(
            f"{type(net).__name__}: {found}, which recomputes a decoder layer in the backward after the packed call "
            f"returned, without the pack's document boundaries (wrong gradients, or torch's CheckpointError): {FIX}"
        )
