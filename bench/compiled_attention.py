"""Compiled attention (``compile: true``): the backward from the saved LSE against recomputing the forward.

    python bench/compiled_attention.py [--pack-len 8192] [--heads 8] [--kv-heads 4] [--rounds 5]

Under torch.compile attention is the custom op ``hbp::varlen_attention_v4``. Where the backend has a
backward kernel for the call (flash-attn 2/3/4, torch's varlen, the CPU flash kernel, eager) the op
keeps the kernel's LSE and its backward runs that kernel; without one (Flex, attention dropout) the
backward recomputes the forward first. This benchmark times one attention layer's forward and
backward, compiled (``aot_eager``: the op is opaque to the compiler, so inductor would time the same
kernels), over the same pack both ways: a paper-like mix (one long document, many short ones, fixed
seed). The kernel is torch's CPU flash kernel document by document; "recompute" is the same backend
with its LSE pair removed. Each way is compiled afresh, warmed up once and timed --rounds times
(median); the gradients of both ways are compared. Exit code 0 when the LSE backward is faster.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch._dynamo.testing
from cp_attention import pack_lengths


def timed_way(backend, args, q, k, v, w, kw) -> tuple[list[tuple[float, float]], list[torch.Tensor], int]:
    """(forward, backward) seconds per round, the gradients, the number of compiled graphs."""
    from lit_hbp.model.attention import backends, varlen_attention

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    module = SimpleNamespace(training=False)
    layer = torch.compile(lambda q, k, v: varlen_attention(module, q, k, v, None, **kw)[0], backend=counter)
    saved, backends.REGISTRY["sdpa"] = backends.REGISTRY["sdpa"], backend
    times, grads = [], []
    try:
        for r in range(args.rounds + 1):  # round 0 compiles and warms up
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            t0 = time.perf_counter()
            out = layer(*leaves)
            t1 = time.perf_counter()
            (out * w).sum().backward()
            t2 = time.perf_counter()
            if r:
                times.append((t1 - t0, t2 - t1))
            grads = [x.grad for x in leaves]
    finally:
        backends.REGISTRY["sdpa"] = saved
    return times, grads, counter.frame_count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pack-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from lit_hbp.model.attention import backends

    assert backends.choose("cpu", torch.float32, frozenset())[0] == "sdpa"  # what these calls run (auto, CPU)
    lengths = pack_lengths(args.pack_len, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    total, dim = sum(lengths), args.head_dim
    q = torch.randn(1, args.heads, total, dim, generator=g)
    k, v = (torch.randn(1, args.kv_heads, total, dim, generator=g) for _ in range(2))
    w = torch.randn(1, total, args.heads, dim, generator=g)
    cu = torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32)
    kw = dict(scaling=dim**-0.5, cu_seq_lens_q=cu, max_length_q=max(lengths))
    sdpa = backends.REGISTRY["sdpa"]
    ways = {"lse": sdpa, "recompute": dataclasses.replace(sdpa, lse=None)}
    results = {way: timed_way(backend, args, q, k, v, w, kw) for way, backend in ways.items()}
    med = {way: tuple(statistics.median(t[i] for t in ts) for i in range(2)) for way, (ts, _, _) in results.items()}
    (_, g_lse, graphs), (_, g_rec, _) = results["lse"], results["recompute"]
    diff = max((a - b).abs().max().item() / b.abs().max().item() for a, b in zip(g_lse, g_rec))
    print(
        f"compiled attention, one layer: pack {args.pack_len} tokens ({len(lengths)} documents), {args.heads} heads"
        f" / {args.kv_heads} kv heads x {dim}, fp32, CPU flash kernel per document, {torch.get_num_threads()} "
        f"threads; aot_eager, {graphs} graph(s); median of {args.rounds} rounds"
    )
    print(f"{'backward':<10} {'forward s':>10} {'backward s':>11} {'total s':>8}")
    for way, (f, b) in med.items():
        print(f"{way:<10} {f:>10.3f} {b:>11.3f} {f + b:>8.3f}")
    ratio = med["recompute"][1] / med["lse"][1]
    print(f"backward recompute / LSE: {ratio:.2f}x; forward + backward: {sum(med['recompute']) / sum(med['lse']):.2f}x")
    print(f"gradients of the two ways: max relative difference {diff:.1e}")
    ok = ratio > 1.0 and diff < 1e-5
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
