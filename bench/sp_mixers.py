"""A hybrid's token mixers on a Ulysses level: the ranks splitting the mixer's heads, or sharing the pack's
documents, beside every rank running them all.

    python bench/sp_mixers.py [--family qwen3_next] [--width 256] [--layers 4] [--pack-len 2048] [--docs 8]
                              [--steps 6] [--warmup 2] [--rounds 3]

A mixer that carries state along a document (the gated delta rule, a Mamba scan) runs each document whole.
On an sp 2 level every rank gathers the pack's mixer inputs; then either each rank runs every document on
its half of the mixer's heads (``heads``: ``lit_hbp.model.mixer_heads.HEAD_SPLITS``, the outputs partial sums
reduce-scattered into each rank's shard: what lit-hbp does for a mixer class it splits), or the ranks share
the documents (``share``: ``document_owners``, each document on one rank, the outputs summed into each
rank's shard: what it does for the others), or every rank runs every document and keeps its shard (``all``:
what it did before, and still does for a mixer that does not split on a pack of fewer documents than
ranks). All on 2 CPU processes (gloo, one thread each), the same tiny hybrid (``--family``'s default layer
kinds cut to ``--layers``, its mixer beside attention), the same packs (``--docs`` documents of random
lengths filling ``--pack-len``), from the same weights. A step: ``packed_loss`` forward and backward of the
rank's shard (no optimizer). Timed alike: each round runs ``--steps`` steps of each mode after
``--warmup`` untimed ones, barriers around the window, the slower rank's time; the median round per mode.
Also checked: every mode gives the same loss (the summed cross-entropy over the ranks) on every pack. A
family whose mixer does not split by heads has no ``heads`` row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("all", "share", "heads")


def tiny_hybrid(family: str, width: int, layers: int):
    """``family``'s default config at ``width`` with ``layers`` layers of its own kinds (its mixer first)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family)
    heads = max(width // 64, 2)
    sizes = dict(hidden_size=width, intermediate_size=2 * width, num_attention_heads=heads, num_key_value_heads=heads,
                 head_dim=64, vocab_size=1024, linear_key_head_dim=64, linear_value_head_dim=64,
                 linear_num_key_heads=heads, linear_num_value_heads=heads, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=width, shared_expert_intermediate_size=width, mamba_n_heads=2 * width // 64,
                 mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=64, mamba_num_heads=2 * width // 64,
                 mamba_head_dim=64, ssm_state_size=64, chunk_size=64, n_groups=2, embedding_dim=width)  # fmt: skip
    for key, value in sizes.items():
        if hasattr(config, key):
            setattr(config, key, value)
    kinds = list(getattr(config, "layer_types", None) or [])
    if hasattr(config, "attn_layer_indices"):  # Bamba: its layer kinds follow from where attention is
        config.attn_layer_indices = [layers - 1]
    elif hasattr(config, "attn_layer_period"):  # Jamba: from the attention layers' period
        config.attn_layer_offset, config.attn_layer_period = layers - 1, layers
    elif family.startswith("lfm"):  # LFM2's default config attends in every layer: its convolutions first
        config.layer_types = ["conv"] * (layers - 1) + ["full_attention"]
    elif kinds:
        config.layer_types = [kinds[i % len(kinds)] for i in range(len(kinds))][:layers]
        if len(set(config.layer_types)) < 2:  # keep an attention layer beside the mixer
            config.layer_types[-1] = next(k for k in kinds if k != config.layer_types[0])
    config.num_hidden_layers = layers
    if hasattr(config, "num_blocks"):  # xLSTM counts its layers so
        config.num_blocks = layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float().train()


def packs(args: argparse.Namespace) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """``--warmup + --steps`` packs of ``--docs`` documents of random lengths, ``--pack-len`` tokens each."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(args.warmup + args.steps):
        cuts = np.sort(rng.choice(np.arange(8, args.pack_len - 8), args.docs - 1, replace=False))
        lengths = np.diff(np.r_[0, cuts, args.pack_len])
        out.append([(rng.integers(3, 1000, n), np.ones(n, bool)) for n in lengths])
    return out


def mixers_of(net) -> list[torch.nn.Module]:
    """The prepared model's stateful mixers (its record's)."""
    from lit_hbp.model.packed_call import record_of

    return record_of(net).mixers


def worker(rank: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from lit_hbp import packed_loss, prepare_model
    from lit_hbp.data.collate import collate_packs
    from lit_hbp.model import mixers
    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.groups import SPGroups
    from lit_hbp.parallel.ulysses import Ulysses

    ctx = SPGroups([(2, 1)], 2, rank)[(2, 1)]
    net = prepare_model(tiny_hybrid(args.family, args.width, args.layers))
    shards = []
    for docs in packs(args):
        whole = collate_packs([np.arange(len(docs))], docs.__getitem__, sp=2, loss_norm=1.0)
        shards.append(Ulysses().shard(whole, 2, rank).replace(sp_group=SPCall.of(ctx, "ulysses")))
    owners, heads = mixers.document_owners, mixers.heads_part
    splits = heads(mixers_of(net)[0], rank, 2, SPCall.of(ctx, "ulysses")) is not None

    def step(batch) -> float:
        out = packed_loss(net, batch, weights=1.0)
        out.loss.backward()
        net.zero_grad(set_to_none=True)
        ce = out.ce_sum.detach().clone()
        dist.all_reduce(ce)
        return float(ce)

    modes = MODES if splits else MODES[:2]
    times, losses = {m: [] for m in modes}, {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            mixers.document_owners = owners if mode == "share" else (lambda bounds, ranks: None)
            mixers.heads_part = heads if mode == "heads" else (lambda mixer, part, parts, sp=None: None)
            for batch in shards[: args.warmup]:
                step(batch)
            dist.barrier()
            start = time.perf_counter()
            losses[mode] = [step(batch) for batch in shards[args.warmup :]]
            dist.barrier()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[mode].append(float(elapsed) / args.steps)
    mixers.document_owners, mixers.heads_part = owners, heads
    if rank == 0:
        results.put({"times": times, "losses": losses, "mixers": len(mixers.stateful_mixers(net.base_model))})
    dist.destroy_process_group()


def hybrid_arguments(p: argparse.ArgumentParser, docs: int) -> None:
    """The tiny hybrid, its packs and the timing (``tiny_hybrid``, ``packs``): the options of the hybrid benches."""
    p.add_argument("--family", default="qwen3_next")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--pack-len", type=int, default=2048)
    p.add_argument("--docs", type=int, default=docs)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hybrid_arguments(p, docs=8)
    args = p.parse_args(argv)
    from lit_hbp.autoselect.launch import free_port

    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(free_port(), args, results), nprocs=2, join=True)
    r = results.get()
    modes = list(r["times"])
    same = all(np.allclose(r["losses"]["all"], r["losses"][m], rtol=1e-5) for m in modes)
    median = {m: statistics.median(r["times"][m]) * 1e3 for m in modes}
    print(f"{args.family}, width {args.width}, {args.layers} layers ({r['mixers']} stateful mixers), sp 2 on 2 CPU "
          f"processes, packs of {args.pack_len} tokens in {args.docs} documents")  # fmt: skip
    print("| mode | ms/step (median of rounds) | rounds | vs all |")
    print("|---|---|---|---|")
    for m in modes:
        rounds = ", ".join(f"{t * 1e3:.0f}" for t in r["times"][m])
        print(f"| {m} | {median[m]:.0f} | {rounds} | {median[m] / median['all']:.2f} |")
    print(f"same loss on every pack: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
