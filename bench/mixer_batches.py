"""A hybrid's token mixers over a pack of many documents: one call a document, or the documents as the rows
of a few batches (``lit_hbp.packing.mixer_share.length_batches``), beside the model called once over the pack as if
it were one document (the unprepared model's speed, whose documents leak into each other: no mode to train).

    python bench/mixer_batches.py [--family qwen3_next] [--width 256] [--layers 4] [--pack-len 2048]
                                  [--docs 32] [--steps 6] [--warmup 2] [--rounds 3] [--threads 1]
                                  [--device cuda --dtype bfloat16]

SFT packs hold many short documents: a mixer run once per document makes tens of calls a layer. The same tiny
hybrid (``bench/sp_mixers.py``'s: the family's mixer beside attention, cut to ``--layers``), the same packs
(``--docs`` documents of random lengths filling ``--pack-len``), the same weights, one process. A step:
``packed_loss`` forward and backward (no optimizer). Timed alike: each round runs ``--steps`` steps of each
mode after ``--warmup`` untimed ones, the device synchronized at each end of the window; the median round
per mode; wall time, but the process's CPU time on one CPU thread (the default there), which other processes
on a busy machine do not change. On a GPU the model runs under ``--dtype`` autocast (fp32 weights) and each
batch takes the mixer's installed kernels (mamba_ssm, causal-conv1d, flash-linear-attention) or transformers'
PyTorch path. Also checked: ``loop`` and ``batches`` give the same loss on every pack. ``mixer calls/step``:
the calls of the mixers' own forward a step (counted on their first projection).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sp_mixers import hybrid_arguments, packs, tiny_hybrid  # noqa: E402

MODES = ("loop", "batches", "one_document")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hybrid_arguments(p, docs=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", help="the autocast dtype on a GPU")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from lit_hbp import pack_samples, packed_loss, prepare_model
    from lit_hbp.model.packed_call import record_of
    from lit_hbp.packing import mixer_share

    device = torch.device(args.device)
    net = prepare_model(tiny_hybrid(args.family, args.width, args.layers).to(device))
    batches = [pack_samples(docs, loss_norm=1.0).to(device) for docs in packs(args)]
    whole = [dict(cu_seqlens=b.cu_seqlens[[0, -1]], bounds=(0, b.bounds[-1]), max_seqlen=b.bounds[-1]) for b in batches]
    one = [b.replace(**w) for b, w in zip(batches, whole)]
    calls = [0]
    firsts = [next(x for x in m.modules() if isinstance(x, torch.nn.Linear)) for m in record_of(net).mixers]
    hooks = [x.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for x in firsts]
    slack = mixer_share.PAD_SLACK

    autocast = torch.autocast(device.type, getattr(torch, args.dtype), enabled=device.type == "cuda")

    def step(batch) -> torch.Tensor:
        with autocast:
            out = packed_loss(net, batch, weights=1.0)
        out.loss.backward()
        net.zero_grad(set_to_none=True)
        return out.ce_sum.detach()

    # one CPU thread: the process's CPU time (what a busy machine's other processes take does not count)
    clock = time.process_time if device.type == "cpu" and args.threads == 1 else time.perf_counter

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times, losses, per_step = {m: [] for m in MODES}, {m: [] for m in MODES}, {}
    for _ in range(args.rounds):
        for mode in MODES:
            mixer_share.PAD_SLACK = -1.0 if mode == "loop" else slack  # below 0: every document a batch of its own
            run = one if mode == "one_document" else batches
            for batch in run[: args.warmup]:
                step(batch)
            calls[0] = 0
            sync()
            start = clock()
            ce = [step(batch) for batch in run[args.warmup :]]
            sync()
            times[mode].append((clock() - start) / args.steps)
            losses[mode] = [float(x) for x in ce]
            per_step[mode] = calls[0] / args.steps
    mixer_share.PAD_SLACK = slack
    for h in hooks:
        h.remove()
    np.testing.assert_allclose(losses["batches"], losses["loop"], rtol=1e-5 if device.type == "cpu" else 2e-2)
    base = statistics.median(times["loop"])
    on = f"{device.type} ({args.dtype} autocast)" if device.type == "cuda" else "cpu"
    shape = f"{args.layers} layers at width {args.width}, {args.docs} documents in {args.pack_len} tokens"
    print(f"{args.family} on {on}: {shape}")
    print("| mode | ms/step | spread | vs loop | mixer calls/step |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        t = statistics.median(times[mode])
        spread = f"{min(times[mode]) * 1e3:.1f}-{max(times[mode]) * 1e3:.1f}"
        print(f"| {mode} | {t * 1e3:.1f} | {spread} | {t / base:.2f} | {per_step[mode]:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
