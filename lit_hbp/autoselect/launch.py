"""Run a measured level search on N local processes (GPUs with NCCL, else CPU with gloo).

Each process joins one process group and calls the selector in lockstep with the others (every
probe is a short distributed training run and its measurements are reduced across ranks, so every
rank takes the same decisions); rank 0 returns the selection.
"""

from __future__ import annotations

import dataclasses
import os
import queue as queue_errors
import socket
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lit_hbp.autoselect.search import Selection
    from lit_hbp.autoselect.selector import MeasuredSelector, RunSetting


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_launch_env(rank: int, world: int, port: int) -> None:
    """What a launcher sets for a process of a one-node world: Lightning inside it then sees an
    external launch (starts no processes) and DeepSpeed reuses the process group. Lightning's
    rank-zero-only logging learns the rank too: it read the environment when it was imported,
    which in a spawned process is before this call."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        NODE_RANK="0",
    )
    rank_zero_only.rank = rank


def _worker(rank: int, port: int, selector: MeasuredSelector, lengths: np.ndarray, run: RunSetting, results) -> None:
    set_launch_env(rank, run.world, port)
    import torch
    import torch.distributed as dist

    cuda = run.trainer_args.get("accelerator") == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // run.world))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=run.world)
    selection = selector.select(lengths, dataclasses.replace(run, in_world=True))
    if rank == 0:
        results.put(selection)
    dist.barrier()
    dist.destroy_process_group()


def launch(selector: MeasuredSelector, lengths: np.ndarray, run: RunSetting) -> Selection:
    """``selector.select`` on ``run.world`` local processes started here; rank 0's selection."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, selector, lengths, run, results)) for r in range(run.world)]
    for p in procs:
        p.start()
    try:
        while True:
            try:
                selection = results.get(timeout=1.0)
                break
            except queue_errors.Empty:
                failed = [p for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(
                        f"measured profiling failed on {len(failed)} process(es) (exit codes "
                        f"{[p.exitcode for p in failed]}); see their output above"
                    ) from None
        for p in procs:
            p.join()
        return selection
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
