"""Tiled MLP: a decoder layer's MLP over the sequence in tiles, so its working set stops growing with the pack.

An MLP works token by token, yet run on a whole shard it holds [tokens, intermediate] activations
(gate, up, their product: 3.5x the hidden states of a Llama layer) for its backward, and its
recompute under checkpointing materializes them again. ``TiledMLP`` runs the forward tile by
tile without keeping them, and the backward recomputes one tile at a time and backpropagates
through it: the layer keeps only the MLP's input, and the working set is one tile's. The weights'
gradients are summed over the tiles in fp32 (or wider) and handed to autograd once per backward,
so gradient hooks (DeepSpeed's ZeRO-1/2 reduction, LoRA) see one gradient per step as without
tiles. Exact up to the order of fp32 sums.

Tiles are a level's setting (``Level.mlp_tiles``) of a packed call: the MLP asks the call running on
its thread (``tiles_of``, given when ``prepare_model`` installs the tiling); outside a packed call, and
at a level with 1 tile, the family's MLP runs untouched.
"""

from __future__ import annotations

import functools
import inspect

import torch


class TiledMLP(torch.autograd.Function):
    """``out = mlp(x)`` computed in ``tiles`` pieces of the sequence dimension (-2), saving only ``x``.

    ``params`` are the MLP's parameters that require gradients: inputs of the function, so their
    gradients leave its backward as outputs (once), not by accumulation inside it."""

    @staticmethod
    def forward(ctx, forward, tiles: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.forward, ctx.tiles, ctx.rng = forward, tiles, _rng_state(x.device)
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            return run_tiles(forward, x, tiles)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *params = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        sums = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) for p in params]
        devices = [x.device] if x.device.type == "cuda" else []
        device, enabled, dtype = ctx.autocast
        # the forward's dropout masks, tile by tile, under the forward's autocast
        with torch.random.fork_rng(devices=devices), torch.autocast(device, dtype=dtype, enabled=enabled):
            _set_rng_state(x.device, ctx.rng)
            for (piece, index), (g, _) in zip(_tiles(x, ctx.tiles), _tiles(grad, ctx.tiles)):
                piece = piece.detach().requires_grad_(grad_x is not None)
                with torch.enable_grad():
                    y = ctx.forward(piece)
                wrt = ([piece] if grad_x is not None else []) + params
                grads = torch.autograd.grad(y, wrt, g, allow_unused=True)
                if grad_x is not None:
                    grad_x[index] = grads[0]
                    grads = grads[1:]
                for total, part in zip(sums, grads):
                    if part is not None:
                        total.add_(part)
        return (None, None, grad_x, *(s.to(p.dtype) for s, p in zip(sums, params)))


def run_tiles(forward, x: torch.Tensor, tiles: int) -> torch.Tensor:
    """``forward`` over ``tiles`` pieces of x's sequence dimension, written into one output."""
    out = None
    for piece, index in _tiles(x, tiles):
        y = forward(piece)
        if y.shape != piece.shape[:-1] + y.shape[-1:]:
            raise ValueError(
                f"a tiled MLP must work token by token; it mapped {tuple(piece.shape)} to {tuple(y.shape)}"
            )
        if out is None:
            out = y.new_empty(x.shape[:-1] + y.shape[-1:])
        out[index] = y
    return out


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _tiles(x: torch.Tensor, tiles: int):
    """(tile, index of the tile in x) over the sequence dimension (-2), ``tiles`` near-equal pieces."""
    length = x.shape[-2]
    bounds = [length * i // tiles for i in range(tiles + 1)]
    for a, b in zip(bounds, bounds[1:]):
        index = (..., slice(a, b), slice(None))
        yield x[index], index


TILES_OF = "_lit_hbp_tiles_of"  # on a tiled MLP: the callable that says its packed call's tiles (one per model)
INNER = "_lit_hbp_inner_forward"  # on a tiled MLP: a forward an integration (Liger) bound on the instance
OWN = "_lit_hbp_own_forward"  # on the class's tiling forward: the class's forward it runs


def _tiling_forward(own):
    """The forward of an MLP class whose instances may run in tiles: an instance that ``install_tiling``
    marked asks its packed call for the tiles; any other runs ``own`` untouched. On the class, not the
    instance, so every layer's MLP is the same code to dynamo (compiled layers share one graph)."""

    @functools.wraps(own)
    def forward(self, x, *args, **kwargs):
        tiles_of = self.__dict__.get(TILES_OF)
        inner = self.__dict__.get(INNER)
        if tiles_of is None or args or kwargs:
            return own(self, x, *args, **kwargs) if inner is None else inner(x, *args, **kwargs)
        untiled = functools.partial(own, self) if inner is None else inner
        tiles = min(tiles_of(), x.shape[-2])
        if tiles <= 1:
            return untiled(x)
        if not torch.is_grad_enabled():  # validation at a long level: one tile's intermediates at a time
            return run_tiles(untiled, x, tiles)
        params = [p for p in self.parameters() if p.requires_grad]
        return TiledMLP.apply(untiled, tiles, x, *params)

    setattr(forward, OWN, own)
    return forward


def install_tiling(mlp: torch.nn.Module, tiles_of) -> None:
    """Make ``mlp`` run in the tiles ``tiles_of()`` says (pass one callable for all of a model's MLPs):
    its class's forward becomes the tiling one (once per class; again if something replaced it since),
    and a forward an integration bound on the instance is run inside the tiles."""
    cls = type(mlp)
    if getattr(cls.forward, OWN, None) is None:
        cls.forward = _tiling_forward(cls.forward)
    bound = mlp.__dict__.pop("forward", None)
    if bound is not None:
        mlp.__dict__[INNER] = bound
    mlp.__dict__[TILES_OF] = tiles_of


def uninstall_tiling(mlp: torch.nn.Module) -> None:
    """``mlp`` as before ``install_tiling``: its class's tiling forward runs the class's own for it (the
    class keeps it: other prepared models may share the class), an integration's bound forward is back."""
    mlp.__dict__.pop(TILES_OF, None)
    bound = mlp.__dict__.pop(INNER, None)
    if bound is not None:
        mlp.forward = bound


def mlp_of(layer: torch.nn.Module) -> torch.nn.Module | None:
    """A decoder layer's token-wise MLP of one input, or None when it has none a tiling may run (an MoE
    block: its router's logits feed the auxiliary loss and would be split over tiles and lose their
    gradient)."""
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, torch.nn.Module) or any(hasattr(mlp, a) for a in ("experts", "router", "shared_expert")):
        return None
    try:
        params = list(inspect.signature(mlp.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    if len(params) != 1 or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        return None  # an MLP of more inputs (Bloom's adds the residual inside): not a map of tokens alone
    return mlp
