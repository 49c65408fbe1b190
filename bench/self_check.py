"""What the self-check at the start of ``fit`` costs: its seconds beside one forward and backward of its own pack.

    python bench/self_check.py [--layers 4] [--hidden 64] [--rounds 5]

The self-check (``lit_hbp.model.selfcheck.run_self_check``) packs six documents (about 180 tokens), measures
each document's leak onto the others, runs the pack once against each document alone, and compares. This
bench builds a Llama of ``--layers`` layers at width ``--hidden`` (the tiny configs' shape), prepares it as
``HBPLitModule`` does, and times, in one process on one thread, round by round in turn: the self-check at
sp 1, and the baseline, a forward and backward of the same pack through ``packed_loss`` with the gradients
of every weight. Printed: each one's median seconds and the self-check's cost in baseline steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.model import selfcheck


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = dict(model_type="llama", hidden_size=args.hidden, intermediate_size=3 * args.hidden, vocab_size=2048,
                  num_hidden_layers=args.layers, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    module = HBPLitModule(model=config, loss="sum")
    module.configure_model()
    net = module.model
    docs = selfcheck._documents(selfcheck._vocab(net), net.config, None)
    pack = selfcheck._pack(docs, {}, 1, None, torch.device("cpu"), None)

    def baseline() -> None:
        module.packed_loss(pack["batch"]).loss.backward()
        net.zero_grad(set_to_none=True)

    def check() -> None:
        selfcheck.run_self_check(module, [1])

    times: dict[str, list[float]] = {"self-check": [], "baseline": []}
    for fn in (check, baseline):  # warm-up
        fn()
    for _ in range(args.rounds):
        for name, fn in (("self-check", check), ("baseline", baseline)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = int(np.sum([len(ids) for ids, _ in docs.values()]))
    print(f"self-check at sp 1: {len(docs)} documents, {tokens} tokens; Llama {args.layers} layers x {args.hidden}, "
          f"fp32, CPU, 1 thread; median of {args.rounds} rounds")  # fmt: skip
    print(
        f"self-check {med['self-check'] * 1e3:.1f} ms, baseline (forward + backward of the pack) "
        f"{med['baseline'] * 1e3:.1f} ms: {med['self-check'] / med['baseline']:.1f} baseline steps"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
