"""Run one function on N local processes joined in a process group (GPUs with NCCL, else CPU with gloo).

The measured level search runs this way from a tool: each process calls the selector in lockstep with the
others (every probe is a short distributed training run and its measurements are reduced across ranks, so
every rank takes the same decisions); rank 0's answer, or its refusal, comes back to the caller.
"""

from __future__ import annotations

import os
import queue as queue_errors
import socket
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_store() -> Any:
    """The store of a process group whose processes this one starts, served here on a port the system picks
    and holds for the store's life: a port found free and closed before the workers bind it can be taken
    meanwhile (by any connection on the machine, another run's gloo ones too), and the group then fails to
    start. Its ``port`` goes to the workers (``join_group``)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def join_group(backend: str, rank: int, world: int, port: int) -> None:
    """The process group of ``world`` processes through the store a parent serves on ``port`` (``host_store``)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


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


def _worker(rank: int, port: int, world: int, cuda: bool, fn: Callable, args: tuple, results) -> None:
    set_launch_env(rank, world, port)
    import torch
    import torch.distributed as dist

    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    join_group("nccl" if cuda else "gloo", rank, world, port)
    try:
        answer: tuple[bool, Any] = (True, fn(*args))
    except ValueError as e:  # a refusal: every rank took the same decisions and refuses alike
        answer = (False, e)
    if rank == 0:
        results.put(answer)
    dist.barrier()
    dist.destroy_process_group()


def launch(fn: Callable[..., T], args: tuple, world: int, cuda: bool) -> T:
    """``fn(*args)`` on ``world`` local processes started here, in one process group; rank 0's answer, or
    the ``ValueError`` it raised (raised here)."""
    import torch.multiprocessing as mp

    store = host_store()  # served here until every process has ended
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, store.port, world, cuda, fn, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        while True:
            try:
                ok, answer = results.get(timeout=1.0)
                break
            except queue_errors.Empty:
                failed = [p for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(
                        f"{len(failed)} of the {world} launched processes failed (exit codes "
                        f"{[p.exitcode for p in failed]}); see their output above"
                    ) from None
        for p in procs:
            p.join()
        if not ok:
            raise answer
        return answer
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
