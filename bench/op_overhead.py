"""Host time of the compiled attention op around its kernel: what each of a step's attention calls adds.

    python bench/op_overhead.py [--device cpu] [--backend null] [--tokens 64] [--calls 2000] [--rounds 9]

A compiled decoder layer calls lit-hbp's custom attention op (``lit_hbp.model.attention.op.OP``) in its forward
graph and the op's backward op in its backward graph, through torch's dispatcher, grad off; the op picks the
kernel, lays out its tensors and calls the backend's LSE pair. On a small call the host
dominates, so this times, per call, on the same tensors and in the same way (one synchronization per window):

- ``op``: the two ops as a compiled graph calls them;
- ``kernel``: the backend's LSE pair called directly (no op);
- ``floor``: an op of the same signature that returns its output at once, through the same custom-op
  machinery (what torch charges any Python custom op);

so the op's own Python is ``op - kernel - floor``. ``--backend null`` is a kernel that only allocates its
outputs (the op's own cost on a CPU, nothing hidden by a kernel); on a GPU ``--backend torch_varlen`` or a
flash-attn name times the real pair. Each figure is the best window of ``--rounds`` (``--calls`` calls each)
after a warm-up; the table prints microseconds per call and, counted rather than timed (the same on a loaded
machine), the Python functions and builtins one call runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import cache

import torch

NULL = "null"


def null_backend():
    """A registry entry whose LSE pair allocates its outputs in the kernels' layouts and computes nothing."""
    from lit_hbp.model.attention.kernel import Backend, LseKernels
    from lit_hbp.model.attention.op import kernel_layout

    def forward(q, k, v, a):
        return kernel_layout(q), q.new_empty(q.shape[1:3], dtype=torch.float32)

    def backward(dout, q, k, v, out, lse, a):
        return kernel_layout(q), kernel_layout(k), kernel_layout(v), None

    return Backend(
        NULL,
        lambda device, dtype: None,
        frozenset,
        lambda q, k, v, a: forward(q, k, v, a)[0],
        LseKernels(lambda device, needs: None, forward, backward),
    )


@cache
def floor_ops():
    """Ops with the attention op's and its backward op's schemas (read from them) whose bodies return fresh
    outputs only (defined once a process: torch refuses a second definition of an op's name)."""

    def floor(q, k, v, *rest):
        return q.new_empty(q.shape), q.new_empty(q.shape[1:3]), torch.zeros((), dtype=torch.int64)

    def floor_backward(grad, q, k, v, *rest):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), q.new_empty(0)

    ops = []
    for fn, real in zip((floor, floor_backward), attention_ops()):
        schema = str(real._schema)
        torch.library.custom_op(f"hbp_bench::{fn.__name__}", fn, mutates_args=(), schema=schema[schema.index("(") :])
        ops.append(getattr(torch.ops.hbp_bench, fn.__name__).default)
    return tuple(ops)


def attention_ops():
    """lit-hbp's attention op and its backward op, by the name ``lit_hbp.model.attention.op.OP`` gives them."""
    from lit_hbp.model.attention.op import OP

    namespace, name = OP.split("::")
    ops = getattr(torch.ops, namespace)
    return getattr(ops, name).default, getattr(ops, f"{name}_backward").default


def per_call_us(fn: Callable[[], object], device: torch.device, calls: int, rounds: int) -> float:
    """The best window's microseconds per call of ``fn``, synchronized once per window."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(max(calls // 10, 20)):
        fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def python_calls(fn: Callable[[], object]) -> int:
    """The Python functions (and builtins) one call of ``fn`` calls: the host's work counted, not timed (the
    same on a loaded machine)."""
    n = 0

    def count(frame, event, arg):
        nonlocal n
        n += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n - 1  # the profiler's own sys.setprofile(None)


def measure(device: torch.device, backend: str, tokens: int, calls: int, rounds: int) -> dict[str, tuple[float, int]]:
    """(microseconds, Python calls) per call of each way, forward and backward, on a pack of two documents
    of ``tokens`` in all."""
    from lit_hbp.model.attention import backends
    from lit_hbp.model.attention.kernel import AttnArgs

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, kv_heads, dim = 16, 8, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, tokens, dim, generator=g).to(device, dtype) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, tokens // 3, tokens], dtype=torch.int32, device=device)
    max_len, scale = tokens - tokens // 3, dim**-0.5
    added = backend == NULL and NULL not in backends.REGISTRY
    if added:
        backends.REGISTRY[NULL] = null_backend()
    try:
        op, op_backward = attention_ops()
        floor, floor_backward = floor_ops()
        host = (max_len, scale, None, None, 0.0, backend, 0)
        pair = backends.REGISTRY[backend].lse
        args = AttnArgs(cu, max_len, scale)
        with torch.no_grad():
            out, lse, seed = op(q, k, v, cu, None, *host)
            grad = torch.randn(out.shape, generator=g).to(device, dtype)
            kernel_out, kernel_lse = pair.forward(q, k, v, args)
            grad_heads_first = grad.transpose(1, 2)
            ways = {
                "op forward": lambda: op(q, k, v, cu, None, *host),
                "op backward": lambda: op_backward(grad, q, k, v, cu, None, out, lse, seed, *host),
                "kernel forward": lambda: pair.forward(q, k, v, args),
                "kernel backward": lambda: pair.backward(grad_heads_first, q, k, v, kernel_out, kernel_lse, args),
                "floor forward": lambda: floor(q, k, v, cu, None, *host),
                "floor backward": lambda: floor_backward(grad, q, k, v, cu, None, out, lse, seed, *host),
            }
            return {name: (per_call_us(fn, device, calls, rounds), python_calls(fn)) for name, fn in ways.items()}
    finally:
        if added:
            del backends.REGISTRY[NULL]
            backends.reset_probes()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default=NULL, help="a registry name, or null (a kernel that computes nothing)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=9)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    us = measure(device, a.backend, a.tokens, a.calls, a.rounds)
    print(
        f"the attention op's host time, {a.backend} backend on {device}, {a.tokens} tokens, torch {torch.__version__}"
    )
    print(f"{'':<10} {'microseconds a call':^35}   {'Python calls a call':^35}")
    print(f"{'direction':<10}" + f" {'op':>8} {'kernel':>8} {'floor':>8} {'op own':>8} " * 2)
    for way in ("forward", "backward"):
        (op, op_n), (kernel, kernel_n), (floor, floor_n) = (us[f"{name} {way}"] for name in ("op", "kernel", "floor"))
        print(
            f"{way:<10} {op:8.1f} {kernel:8.1f} {floor:8.1f} {op - kernel - floor:8.1f}  "
            f" {op_n:8d} {kernel_n:8d} {floor_n:8d} {op_n - kernel_n - floor_n:8d}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
