"""A pool of CPU processes with one gloo process group, reused by many tests.

Importing torch, transformers, Lightning and DeepSpeed costs a process seconds: a fork server imports them
once per test process and every worker is forked from it; a module-scoped pool also starts its workers once.
Each worker sets the environment a launcher would (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), so Lightning inside a worker sees an external launch and
starts no processes of its own, and DeepSpeed reuses the initialized process group.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback

import torch.multiprocessing as mp
from conftest import HANG_S

from lit_hbp.autoselect.launch import host_store, join_group, set_launch_env

# By name from the installed package (Python 3.11's fork server does not take this process's sys.path).
PRELOAD = ["lit_hbp.autoselect.launch", "lit_hbp.lightning.strategy", "lit_hbp.lightning.module", "deepspeed"]


def _worker(rank: int, world: int, port: int, tasks, results, backend: str, isolate: bool, env: dict[str, str]) -> None:
    # The environment of the test process at the pool's start, as a spawned worker's (a fork server's child
    # has the server's, from its own start).
    os.environ.clear()
    os.environ.update(env)
    import numpy as np

    np.random.seed()  # each worker its own global numpy draws, as a spawned one (a fork copies the server's)
    # As lit-hbp's command line imports (``cli.command.heap_left_alone``): the first task imports the
    # library, Lightning and transformers without the cyclic collector walking them, frozen after it.
    gc.disable()
    set_launch_env(rank, world, port)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    join_group(backend, rank, world, port)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        state = None
        if isolate:  # a pool shared by tests of several modules: each task leaves the worker as it found it
            from conftest import ProcessState

            state = ProcessState()
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # report everything, keep serving
            results.put((rank, False, traceback.format_exc()))
        finally:
            if state is not None:
                state.restore()
            if not gc.isenabled():
                gc.freeze()
                gc.enable()
    dist.destroy_process_group()
    # Every result is read: end without the interpreter's teardown of torch, DeepSpeed and gloo (C code,
    # ~2 s a worker on 2 cores, paid by every pool's close).
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


class Pool:
    """``world`` worker processes; ``run(fn, *args)`` calls fn on every rank, returns results by rank.
    ``isolate``: every call leaves each worker's process-wide settings as it found them (conftest's
    ProcessState), for a pool the tests of several modules share (``shared_pool2``)."""

    def __init__(self, world: int, backend: str = "gloo", isolate: bool = False):
        ctx = mp.get_context("forkserver")
        # Forked from one server that imported torch, transformers, Lightning, DeepSpeed and lit-hbp once: a
        # worker starts in well under a second, where a spawned one imports for seconds. The server is a fresh
        # process (not this test process, whose state a fork would copy), started at the first pool.
        ctx.set_forkserver_preload(PRELOAD)
        self.world = world
        self.broken = ""  # the traceback that stopped the pool
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.store = host_store()  # served by this process for the pool's life
        port = self.store.port
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, world, port, self.tasks[r], self.results, backend, isolate, dict(os.environ)),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = HANG_S):
        """fn(*args) on every rank, the results by rank. A rank that fails ends the call at once with its
        traceback (the other ranks may be waiting for it in a collective: the pool is stopped, and a
        later call says why), never a wait for the ranks that cannot finish."""
        if self.broken:
            raise RuntimeError(f"the pool stopped after an earlier failure:\n{self.broken}")
        for q in self.tasks:
            q.put((fn, args))
        out = {}
        for _ in range(self.world):
            rank, ok, value = self.results.get(timeout=timeout)
            out[rank] = (ok, value)
            if not ok:
                self.broken = f"rank {rank}:\n{value}"
                self.kill()
                raise RuntimeError(self.broken)
        return [out[r][1] for r in range(self.world)]

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=30)

    def close(self) -> None:
        if self.broken:
            return
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


class SharedPool:
    """A pool of ``world`` isolating workers (``Pool(isolate=True)``) kept for the whole session: the
    tests of several modules that each started a pool of their own pay one start. A pool a failed call
    stopped is replaced at the next ``get``."""

    def __init__(self, world: int):
        self.world, self.pool = world, None

    def get(self) -> Pool:
        if self.pool is None or self.pool.broken:
            self.pool = Pool(self.world, isolate=True)
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
