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


class TiledForward:
    """An MLP's ``forward`` in the tiles its packed call asks for (``tiles_of()``), around ``inner``:
    the forward it had (None: its class's own, looked up at each call). A plain object in the
    module's dict, so the model pickles and deep-copies with it; the state dict is unchanged."""

    def __init__(self, mlp: torch.nn.Module, inner, tiles_of) -> None:
        self.mlp, self.inner, self.tiles_of = mlp, inner, tiles_of

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) if self.inner is not None else type(self.mlp).forward(self.mlp, x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The family's MLP with 1 tile, TiledMLP with more; without gradients (validation at a long
        level) a plain loop over the tiles, whose intermediates live one tile at a time."""
        tiles = min(self.tiles_of(), x.shape[-2])
        if tiles <= 1:
            return self.forward(x)
        if not torch.is_grad_enabled():
            return run_tiles(self.forward, x, tiles)
        params = [p for p in self.mlp.parameters() if p.requires_grad]
        return TiledMLP.apply(self.forward, tiles, x, *params)


def install_tiling(mlp: torch.nn.Module, tiles_of) -> None:
    """Make ``mlp`` run in the tiles ``tiles_of()`` says: its forward becomes a ``TiledForward``
    around the forward it had (the family's, or one an integration such as Liger bound later:
    installing again wraps that one)."""
    current = mlp.__dict__.get("forward")
    if isinstance(current, TiledForward):
        return
    mlp.forward = TiledForward(mlp, current, tiles_of)


def uninstall_tiling(mlp: torch.nn.Module) -> None:
    """The forward ``mlp`` had before ``install_tiling``."""
    current = mlp.__dict__.get("forward")
    if not isinstance(current, TiledForward):
        return
    if current.inner is None:
        del mlp.forward  # the class's own forward
    else:
        mlp.forward = current.inner  # one an integration bound before


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
