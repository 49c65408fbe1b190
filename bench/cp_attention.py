"""Context-parallel attention: the backward from the saved LSE against recomputing the forward.

    python bench/cp_attention.py [--world 2] [--pack-len 8192] [--heads 8] [--kv-heads 4] [--rounds 3]

The ``cp`` SP kind gathers each kv-head slice's K/V again in the backward instead of keeping it.
With a backend that exposes its kernel as a forward keeping the LSE and a backward from it
(flash-attn 2/3/4, torch's varlen, the CPU loops) the backward then runs only the backward kernel;
without one (Flex, attention dropout) it recomputes the slice's forward first. This benchmark
times one attention layer's forward and backward under CP on --world CPU processes (gloo, one
thread each; cp = world, Ulysses 1) both ways, over the same pack: a paper-like mix of documents
(one long one and many short ones, fixed seed) split by the planner's ``split_pack``. The CPU
kernel is torch's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward), run document by document; "recompute" is the same backend with its LSE pair removed.

Each way runs a warm-up and --rounds timed rounds (max over ranks between barriers, median over
rounds); the gradients of both ways are compared (they must agree to the dtype's rounding). The
table prints forward and backward seconds and the backward ratio recompute / LSE: the forward's
share of the backward that the LSE path saves. Exit code 0 when the LSE backward is faster.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_hbp.autoselect.launch import free_port, set_launch_env


def pack_lengths(total: int, seed: int) -> list[int]:
    """One long document (a third of the pack) and short ones of 50-800 tokens, summing to ``total``."""
    rng = np.random.default_rng(seed)
    docs, room = [total // 3], total - total // 3
    while room > 0:
        n = min(room, int(rng.integers(50, 800)))
        docs.append(n)
        room -= n
    return [int(x) for x in rng.permutation(docs)]


def run_rank(rank: int, world: int, port: int, args, results) -> None:
    set_launch_env(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from types import SimpleNamespace

    from lit_hbp.model.attention import backends, varlen_attention
    from lit_hbp.packing.context_split import split_pack
    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.context_parallel import cp_shard_of
    from lit_hbp.parallel.groups import SPGroups

    assert backends.choose("cpu", torch.float32, frozenset())[0] == "sdpa"  # what these calls run (auto, CPU)
    cp = world
    ctx = SPGroups([(cp, cp)], world, rank)[(cp, cp)]
    lengths = pack_lengths(args.pack_len, args.seed)
    split = split_pack(lengths, cp)
    index = torch.from_numpy(split.gather_index(ctx.rank))
    g = torch.Generator().manual_seed(args.seed)
    total, dim = sum(lengths), args.head_dim
    q = torch.randn(1, args.heads, total, dim, generator=g)[:, :, index]
    k, v = (torch.randn(1, args.kv_heads, total, dim, generator=g)[:, :, index] for _ in range(2))
    w = torch.randn(1, total, args.heads, dim, generator=g)[:, index]
    cu = torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32)
    kw = dict(scaling=dim**-0.5, cu_seq_lens_q=cu, max_length_q=max(lengths), hbp_cp_shard=cp_shard_of(split, ctx.rank))
    kw["hbp_sp"] = SPCall.of(ctx, "cp")  # the level's group, carried by the call
    module = SimpleNamespace(training=False)
    sdpa = backends.REGISTRY["sdpa"]
    ways = {"lse": sdpa, "recompute": dataclasses.replace(sdpa, lse=None)}

    def once() -> tuple[float, float, list[torch.Tensor]]:
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        dist.barrier()
        t0 = time.perf_counter()
        out, _ = varlen_attention(module, *leaves, None, **kw)
        t1 = time.perf_counter()
        (out * w).sum().backward()
        t2 = time.perf_counter()
        times = torch.tensor([t1 - t0, t2 - t1], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        return float(times[0]), float(times[1]), [x.grad for x in leaves]

    timings: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
    grads = {}
    try:
        for r in range(args.rounds + 1):
            for way, backend in ways.items():
                backends.REGISTRY["sdpa"] = backend
                fwd, bwd, grads[way] = once()
                if r:  # round 0 warms up
                    timings[way].append((fwd, bwd))
    finally:
        backends.REGISTRY["sdpa"] = sdpa
    diff = max((a - b).abs().max().item() / b.abs().max().item() for a, b in zip(grads["lse"], grads["recompute"]))
    diff_t = torch.tensor(diff, dtype=torch.float64)
    dist.all_reduce(diff_t, op=dist.ReduceOp.MAX)
    if rank == 0:
        results.put(
            dict(
                timings=timings,
                grad_diff=float(diff_t),
                ranges=split.ranges_per_rank().tolist(),
                imbalance=split.imbalance(),
                docs=len(lengths),
            )
        )
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2, help="CPU processes = the CP degree")
    p.add_argument("--pack-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.pack_len % args.world:
        p.error(f"--pack-len {args.pack_len} must be a multiple of --world {args.world}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=run_rank, args=(r, args.world, port, args, results)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    res = results.get(timeout=3600)
    for proc in procs:
        proc.join()
    med = {way: tuple(statistics.median(t[i] for t in ts) for i in range(2)) for way, ts in res["timings"].items()}
    print(
        f"CP attention, one layer: pack {args.pack_len} tokens ({res['docs']} documents), cp {args.world}, "
        f"{args.heads} heads / {args.kv_heads} kv heads x {args.head_dim}, fp32, CPU flash kernel per document; "
        f"ranges per rank {res['ranges']}, area max/mean {res['imbalance']:.4f}; median of {args.rounds} rounds, "
        "max over ranks"
    )
    print(f"{'backward':<10} {'forward s':>10} {'backward s':>11} {'total s':>8}")
    for way, (f, b) in med.items():
        print(f"{way:<10} {f:>10.3f} {b:>11.3f} {f + b:>8.3f}")
    ratio = med["recompute"][1] / med["lse"][1]
    total = sum(med["recompute"]) / sum(med["lse"])
    print(f"backward recompute / LSE: {ratio:.2f}x; forward + backward: {total:.2f}x")
    print(f"gradients of the two ways: max relative difference {res['grad_diff']:.1e}")
    ok = ratio > 1.0 and res["grad_diff"] < 1e-5
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
