"""Run the measured level search on N local processes (GPUs with NCCL, else CPU with gloo).

Each process joins one process group and runs Algorithm 1 with the measured profiler in lockstep
with the others (every probe is a short distributed training run and its measurements are reduced
across ranks, so every rank takes the same decisions); rank 0 returns the selection.
"""

from __future__ import annotations

import os
import queue as queue_errors
import socket

from lit_hbp.autoselect.search import Selection, select_levels


def run_arguments(config: dict, vocab: int | None) -> tuple[dict, dict, dict]:
    """(HBPLitModule, Trainer, HBPStrategy) arguments of a training config that a probe reuses:
    the model and its loss settings, the precision, accumulation and clipping, the ZeRO settings."""
    module = dict(config.get("model") or {})
    if vocab is not None:
        module["vocab_size"] = vocab
    trainer = config.get("trainer") or {}
    trainer_args = {
        k: trainer[k] for k in ("precision", "accumulate_grad_batches", "gradient_clip_val") if k in trainer
    }
    strategy = trainer.get("strategy")
    strategy_args = {}
    if isinstance(strategy, dict) and str(strategy.get("class_path", "")).endswith("HBPStrategy"):
        strategy_args = dict(strategy.get("init_args") or {})  # the profiler sets its own levels
    return module, trainer_args, strategy_args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_launch_env(rank: int, world: int, port: int) -> None:
    """What a launcher sets for a process of a one-node world: Lightning inside it then sees an
    external launch (starts no processes) and DeepSpeed reuses the process group."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        NODE_RANK="0",
    )


def _worker(rank: int, world: int, port: int, run_args, spec, lengths, candidates, capacity, margin, results) -> None:
    set_launch_env(rank, world, port)
    import torch
    import torch.distributed as dist

    from lit_hbp.autoselect.measured import MeasuredProfiler, zero_stage
    from lit_hbp.costmodel import HARDWARE, CostModel
    from lit_hbp.module import HBPLitModule

    module_args, trainer_args, strategy_args = run_args
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)

    def factory() -> HBPLitModule:
        torch.manual_seed(0)
        return HBPLitModule(**module_args)

    trainer_args = {"accelerator": "cuda" if cuda else "cpu", "devices": world, **trainer_args}
    cost = CostModel(spec, HARDWARE["h100"], world, zero_stage=zero_stage(strategy_args))  # memory: no GPU kind
    profiler = MeasuredProfiler(factory, lengths, capacity, trainer_args, strategy_args, estimate=cost.memory_bytes)
    selection = select_levels(profiler, lengths, spec, world, candidates=candidates, margin=margin)
    if rank == 0:
        results.put(selection)
    dist.barrier()
    dist.destroy_process_group()


def measured_selection(
    run_args: tuple[dict, dict, dict], spec, lengths, devices: int, candidates, capacity: float, margin: float
) -> Selection:
    """Algorithm 1 with real training steps (``run_arguments`` of a config) on ``devices`` local processes."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (devices, port, run_args, spec, lengths, candidates, capacity, margin, results)
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
