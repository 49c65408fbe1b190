"""Whether one graph per level pays, before lit-hbp builds it: the bare training step with its decoder layers
compiled dynamic over pack lengths (as ``HBPLitModule(compile=True)`` compiles them), static (a graph per
shape, what a level padded to one shape would run), and static under CUDA graphs (a GPU only), on the same
packs from the same weights.

    python bench/graph_modes.py [--device cpu] [--layers 16] [--width 64] [--pack-len 64] [--docs 3]
                                [--steps 20] [--warmup 5] [--rounds 3] [--modes eager,dynamic,static,cudagraphs]

Every pack has one shape: ``--pack-len`` tokens in ``--docs`` documents whose lengths are the same, in
another order each step, so the boundaries move and the shapes and the longest document stay (a level in
one static shape, as far as this bench can make one without padding). The step is ``step_overhead.py``'s
bare loop: ``prepare_model`` + ``packed_loss`` + AdamW (fused on CUDA, multi-tensor on CPU) +
``clip_grad_norm_(foreach=True)``, bf16 autocast on a GPU. Modes:

- ``eager``: no compilation;
- ``dynamic``: each decoder layer ``compile(dynamic=True)`` (the run's);
- ``static``: each decoder layer ``compile(dynamic=False)``;
- ``cudagraphs``: ``compile(dynamic=False, mode="reduce-overhead")``, the step begun with
  ``torch.compiler.cudagraph_mark_step_begin()`` (CUDA only: on a CPU its row says so);
- ``cudagraphs_whole``: the same with inductor's graph partitions off (torch 2.11's partitions stopped on the
  H200 in ``CUDAGraphNode``: "AssertionError: <class 'tuple'>"): each layer's graph captured whole, or
  skipped, which its row counts (``cudagraph_skips``).

Every mode is timed alike: from the first step after ``--warmup`` to the end of the last, one device
synchronization at each end and nothing in between; each round runs every mode once, in turn, and a mode's
figure is its median round. Per mode: ms per optimizer step, its ratio to ``dynamic``, the Python calls of one
step (counted, not timed: the same on a loaded machine) and ``loss_vs_eager``, the largest relative difference
of its per-step losses from the eager mode's over the whole run (a graph that replayed one pack's boundaries
for another's would show here, far above the compiled modes' rounding).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback
import warnings

import numpy as np
import torch
from op_overhead import python_calls  # counted, not timed
from step_overhead import bare_step, model_config, timed_window  # the same step, timed alike
from torch._dynamo.utils import counters

from lit_hbp import pack_samples, prepare_model
from lit_hbp.model.build import build_causal_lm
from lit_hbp.model.packed_call import record_of
from lit_hbp.report import format_table

MODES = ("eager", "dynamic", "static", "cudagraphs", "cudagraphs_whole")
COMPILE = {
    "dynamic": dict(dynamic=True),
    "static": dict(dynamic=False),
    "cudagraphs": dict(dynamic=False, mode="reduce-overhead"),
    "cudagraphs_whole": dict(dynamic=False, mode="reduce-overhead"),
}
INDUCTOR = {"cudagraphs_whole": dict(graph_partition=False)}  # one graph a layer, or none (a skip, counted)


def same_shape_packs(n: int, pack_len: int, docs: int, vocab: int, seed: int = 0) -> list:
    """``n`` packs of ``docs`` documents whose lengths (fixed, filling ``pack_len``) come in a new order each
    pack: one shape, one longest document, boundaries that move; fresh tokens and supervision each pack."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(4, pack_len - 4), docs - 1, replace=False))
    lengths = np.diff(np.r_[0, cuts, pack_len])
    out = []
    for _ in range(n):
        order = rng.permutation(lengths)
        batch = pack_samples([(rng.integers(3, vocab, k), rng.random(k) < 0.7) for k in order])
        out.append(batch.replace(loss_norm=float(batch.n_targets)))
    return out


def run(mode: str, config: dict, packs: list, args, device: torch.device) -> tuple[float, list[float], int]:
    """(seconds per optimizer step over the timed window, every step's loss, Python calls of one step)."""
    with torch._inductor.config.patch(**INDUCTOR.get(mode, {})):
        return _run(mode, config, packs, args, device)


def _run(mode: str, config: dict, packs: list, args, device: torch.device) -> tuple[float, list[float], int]:
    torch._dynamo.reset()
    counters["inductor"].clear()
    torch.manual_seed(args.seed)
    net = prepare_model(build_causal_lm(config).to(device))
    for layer in record_of(net).layers if mode in COMPILE else ():
        layer.compile(**COMPILE[mode])
    optimizer_step = bare_step(net, device)
    losses: list[torch.Tensor] = []

    def step(batch) -> None:
        if mode.startswith("cudagraphs"):
            torch.compiler.cudagraph_mark_step_begin()
        losses.append(optimizer_step(batch).detach())

    seconds = timed_window(step, packs, args.warmup, args.steps, device)
    calls = python_calls(lambda: step(packs[args.warmup + args.steps]))
    return seconds, [float(x) for x in losses], calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--pack-len", type=int, default=64)
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; modes: {', '.join(MODES)}")
    if args.docs < 1 or args.pack_len < 8 * args.docs:
        p.error("--pack-len must be at least 8 tokens a document")
    device = torch.device(args.device)
    cpu_only = device.type != "cuda"
    skipped = {m: "CUDA graphs: CUDA only" for m in MODES if m.startswith("cudagraphs") and cpu_only}
    measured = [m for m in modes if m not in skipped]
    vocab = 256 if args.width < 512 else 32000
    config = model_config(args.layers, args.width, vocab)
    packs = same_shape_packs(args.warmup + args.steps + 1, args.pack_len, args.docs, vocab, args.seed)
    times: dict[str, list[float]] = {m: [] for m in measured}
    losses: dict[str, list[float]] = {}
    calls: dict[str, int] = {}
    graph_skips: dict[str, int] = {}
    for _ in range(args.rounds):
        for mode in measured:
            if mode in skipped:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    seconds, losses[mode], calls[mode] = run(mode, config, packs, args, device)
            except Exception as e:  # a mode that fails is reported in its row; the others still measure
                traceback.print_exc()
                skipped[mode] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
                continue
            graph_skips[mode] = int(counters["inductor"]["cudagraph_skips"])
            times[mode].append(seconds)
            print(f"measured {mode}: {seconds * 1e3:.2f} ms a step, {graph_skips[mode]} cudagraph skips", flush=True)
    base = statistics.median(times["dynamic"]) if times.get("dynamic") else None
    ref = np.array(losses["eager"]) if "eager" in losses else None
    rows = []
    for mode in modes:
        if mode in skipped:
            rows.append(dict(mode=mode, ms_per_step=skipped[mode]))
            continue
        ms = statistics.median(times[mode]) * 1e3
        gap = float(np.max(np.abs(np.array(losses[mode]) - ref) / np.abs(ref))) if ref is not None else float("nan")
        rows.append(
            dict(
                mode=mode,
                ms_per_step=f"{ms:.2f}",
                spread=f"{min(times[mode]) * 1e3:.1f}-{max(times[mode]) * 1e3:.1f}",
                vs_dynamic=f"{ms / (base * 1e3):.2f}" if base else "",
                python_calls=str(calls[mode]),
                loss_vs_eager=f"{gap:.1e}",
                cudagraph_skips=str(graph_skips[mode]) if mode.startswith("cudagraphs") else "",
            )
        )
    print(
        f"{args.device}, torch {torch.__version__}, {args.layers} layers at width {args.width}, {args.pack_len}-token "
        f"packs of {args.docs} documents in one shape, {args.steps} timed steps after {args.warmup}, median of "
        f"{args.rounds} rounds\n"
    )
    cols = ["ms_per_step", "spread", "vs_dynamic", "python_calls", "loss_vs_eager", "cudagraph_skips"]
    table = [{"name": r.pop("mode"), **dict.fromkeys(cols, ""), **r} for r in rows]
    print(format_table(table, [(c, "s") for c in cols], name="mode"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
