"""The random state a resumed run continues from. Lightning's checkpoints hold none, so a resumed run drew the
dropout masks (attention's, the hidden states', LoRA's) of its seed again, not those the uninterrupted run drew
at that step. Each rank's generators (torch's CPU one and its CUDA device's, numpy's, Python's) are saved in the
data module's state and set again as the resumed run fetches its first micro-batch (``PlanLoader``)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rank_state() -> dict[str, Any]:
    """This process's generators, as ``set_rank_state`` takes them (the CUDA one only once CUDA is in use), in
    types a ``weights_only`` load reads (numpy's keys as a tensor)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos)}
    numpy_state.update(has_gauss=int(has_gauss), gauss=float(gauss))
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rank_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def every_rank_state() -> list[dict[str, Any]]:
    """Every rank's ``rank_state``, in rank order: a collective of the default group when one is initialized
    (a checkpoint is dumped on every rank and written by rank 0)."""
    import torch.distributed as dist

    state = rank_state()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states
