"""Run the measured level search on N local processes (GPUs with NCCL, else CPU with gloo).

Each process builds the model, the SP groups of every candidate degree, and runs Algorithm 1
with the measured profiler in lockstep with the others (measurements are reduced across ranks, so
every rank takes the same decisions); rank 0 returns the selection.
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_errors
import socket
from pathlib import Path

from lit_hbp.autoselect.profiler import MeasuredProfiler
from lit_hbp.autoselect.search import Selection, select_levels, sp_candidates
from lit_hbp.costmodel import ModelSpec


def _worker(rank: int, world: int, port: int, model, vocab, lengths, candidates, capacity, margin, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    from lit_hbp.module import HBPLitModule
    from lit_hbp.parallel.groups import SPGroups

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    spec = ModelSpec.from_config(model if isinstance(model, dict) else Path(model))
    groups = SPGroups(sp_candidates(world, spec.heads, spec.kv_heads), world, rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")

    def factory():
        torch.manual_seed(0)
        module = HBPLitModule(model=model, vocab_size=vocab)
        module.configure_model()
        return module.to(device)

    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    profiler = MeasuredProfiler(factory, lengths, groups, capacity, forward_context=autocast)
    selection = select_levels(profiler, lengths, spec, world, candidates=candidates, margin=margin)
    if rank == 0:
        results.put(selection)
    dist.barrier()
    dist.destroy_process_group()


def measured_selection(model, vocab, lengths, devices: int, candidates, capacity: float, margin: float) -> Selection:
    """Algorithm 1 with real micro-steps of ``model`` on ``devices`` local processes."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (devices, port, model, vocab, lengths, candidates, capacity, margin, results)
    procs = [ctx.Process(target=_worker, args=(r, *args)) for r in range(devices)]
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
