"""Context parallelism (the ``cp`` SP kind, Ulysses x CP) on 2 and 4 gloo processes: attention and
the whole model's loss and every parameter gradient against a single process (fp64, each document
alone), the awkward packs (odd lengths, a document over every CP rank, a rank holding a piece of one
document, a pack shorter than 2 x cp), and Trainer.fit of a 2-head model at sp 4 against the
single-process reference update under ZeRO."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from distributed import Pool
from test_sp import ACCUMULATE, STEPS, SGDModule, gathered_params, reference_update, step_size

from lit_hbp.packing import Level
from lit_hbp.parallel.context_parallel import ContextParallel
from lit_hbp.parallel.topology import cp_group_ranks, cp_slices, default_layout, kv_slice, layout_coords, resolve_layout

TINY2 = {  # two query heads: Ulysses alone stops at sp 2
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 512,
}
# (lengths, what the pack exercises); sums are multiples of 4 so every layout of 4 ranks cuts them.
PACKS = {
    "odd": [7, 13, 3, 9, 5, 11],
    "spans_every_rank": [61, 3],
    "one_document": [64],
    "shorter_than_2cp": [3, 1],
    "many_short_one_long": [2, 1, 5, 40, 3, 1, 7, 2, 3],
}


@pytest.fixture(scope="module")
def pool4():
    p = Pool(4)
    yield p
    p.close()


@pytest.fixture(scope="module")
def pool2():
    p = Pool(2)
    yield p
    p.close()


# ---------------------------------------------------------------------------- layout and groups


def test_the_default_layout_puts_ulysses_on_what_the_heads_allow():
    assert default_layout(8, 32, 8) == (8, 1)
    assert default_layout(8, 28, 4) == (4, 2)  # Qwen2.5-7B: 28 heads stop Ulysses at 4
    assert default_layout(4, 2, 1) == (2, 2)
    assert default_layout(64, 32, 8) == (32, 2)
    # Given the ranks per node, Ulysses stays inside a node and CP goes across.
    assert default_layout(64, 32, 8, node_size=8) == (8, 8)
    assert default_layout(16, 32, 8, node_size=8) == (8, 2)
    assert default_layout(8, 32, 8, node_size=8) == (8, 1)
    assert default_layout(8, 28, 4, node_size=8) == (4, 2)
    assert default_layout(8, 32, 8, node_size=4) == (4, 2)  # 4-GPU nodes
    assert default_layout(4, 2, 1, node_size=4) == (2, 2)
    assert resolve_layout(Level(1024, 64), 32, 8, node_size=8).layout == (8, 8)
    level = resolve_layout(Level(1024, 8), 28, 4)
    assert (level.ulysses, level.cp, level.sp_kind) == (4, 2, "cp")
    assert resolve_layout(Level(1024, 8), 32, 8).sp_kind == "ulysses"
    assert resolve_layout(Level(1024, 8, cp=8), 32, 8).layout == (1, 8)  # given: kept


def test_level_layout_fields_are_checked():
    assert Level(64, 4, ulysses=2).layout == (2, 2) and Level(64, 4, ulysses=2).sp_kind == "cp"
    assert Level(64, 4, cp=1).sp_kind == "ulysses"
    with pytest.raises(ValueError, match=r"Level.ulysses \(2\) x Level.cp \(4\) must equal sp \(4\)"):
        Level(64, 4, ulysses=2, cp=4)
    with pytest.raises(ValueError, match=r"Level.cp \(3\) must be >= 1 and divide sp \(4\)"):
        Level(64, 4, cp=3)
    with pytest.raises(ValueError, match="needs sp_kind 'cp'"):
        Level(64, 4, cp=2, sp_kind="sp_kinds.GatherAll")
    # sp_kind cp without a degree trained the default layout, Ulysses at sp 4 on a 4-head model, renamed
    with pytest.raises(ValueError, match="sp_kind 'cp' without its layout would train the default one"):
        Level(64, 4, sp_kind="cp")
    assert Level(64, 4, sp_kind="cp", cp=4).layout == (1, 4) and Level(64, 1, sp_kind="cp").sp == 1


def test_cp_groups_are_strided_across_contiguous_ulysses_groups():
    assert cp_group_ranks(8, 4, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert cp_group_ranks(8, 8, 8) == [list(range(8))]
    for r in range(4):
        cp_rank, u_rank = layout_coords(r, 2)
        assert r == cp_rank * 2 + u_rank


def test_kv_slices_bound_the_gathered_kv():
    for kv in (1, 2, 3, 4, 8):
        for cp in (2, 4, 8):
            s = kv_slice(kv, cp)
            assert kv % s == 0 and (s <= kv / cp or s == 1)


def test_the_cp_kind_checks_only_the_ulysses_part():
    kind = ContextParallel()
    assert kind.check(2, 1, 4, 2) == 2  # ulysses 2 replicates the one kv head
    assert kind.check(2, 1, 4, 4) == 1
    with pytest.raises(ValueError, match="2 attention heads cannot be split over 4 Ulysses ranks"):
        kind.check(2, 1, 8, 2)
    assert (8, 8) in kind.layouts(8, 2, 1) and (8, 2) not in kind.layouts(8, 2, 1)


# ----------------------------------------------------------------------------- the shard


def test_shards_hold_every_token_once_with_their_positions_labels_and_counts():
    from lit_hbp.data.collate import collate_packs

    rng = np.random.default_rng(0)
    docs = {i: (rng.integers(0, 50, n), rng.random(n) < 0.7) for i, n in enumerate([7, 13, 3, 9, 5, 11, 40])}
    whole = collate_packs([np.arange(len(docs))], docs.__getitem__, sp=4, cp=2, sp_kind="cp")
    seen = []
    for rank in range(4):
        shard = ContextParallel().shard(whole, 4, rank)
        index = shard.pack_index
        seen.append(index)
        for key in ("input_ids", "labels", "position_ids", "sample_targets"):
            assert torch.equal(getattr(shard, key)[0], getattr(whole, key)[0, index])
        assert torch.equal(shard.target_index, torch.nonzero(shard.labels[0] != -100).flatten())
        assert shard.cp_shard.key_index.max() < whole.input_ids.shape[1]
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(whole.input_ids.shape[1]))
    # The two Ulysses ranks of a CP rank share its geometry.
    a, b = (ContextParallel().shard(whole, 4, r).cp_shard for r in (0, 1))
    assert torch.equal(a.cu_q, b.cu_q) and torch.equal(a.key_index, b.key_index)


# --------------------------------------------------------------------------- attention parity


def cp_attention_parity(
    sp: int,
    cp: int,
    kv_heads: int,
    lengths: list[int],
    window: int | None,
    sinks: bool,
    device: str = "cpu",
    compiled: bool = False,
) -> dict:
    """Largest errors of a CP rank's attention output and input gradients against one process
    over the whole pack: fp64 on CPU, bf16 (relative to the largest value) on a GPU; ``compiled``:
    the CP call under torch.compile (as in a compiled decoder layer), the reference eager."""
    import torch._dynamo
    import torch.distributed as dist

    from lit_hbp.model.attention import varlen_attention
    from lit_hbp.packing.context_split import split_pack
    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.context_parallel import cp_shard_of
    from lit_hbp.parallel.groups import SPGroups

    ctx = SPGroups([(sp, cp)], dist.get_world_size(), dist.get_rank())[(sp, cp)]
    g = torch.Generator().manual_seed(7)  # every SP group runs the same pack
    total, heads, dim = sum(lengths), 4, 8
    cu = torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32)
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    q = torch.randn(1, heads, total, dim, generator=g, dtype=torch.float64).to(device, dtype)
    k, v = (torch.randn(1, kv_heads, total, dim, generator=g, dtype=torch.float64).to(device, dtype) for _ in range(2))
    s = torch.randn(heads, generator=g, dtype=torch.float64).to(device, dtype) if sinks else None
    w = torch.randn(1, total, heads, dim, generator=g, dtype=torch.float64).to(device, dtype)
    cu = cu.to(device)
    module = SimpleNamespace(training=False)
    kw = dict(scaling=dim**-0.5, cu_seq_lens_q=cu, max_length_q=max(lengths), sliding_window=window)

    ref_in = [x.clone().requires_grad_() for x in (q, k, v, *([s] if sinks else []))]
    out_ref, _ = varlen_attention(module, *ref_in[:3], None, s_aux=ref_in[3] if sinks else None, **kw)
    (out_ref * w).sum().backward()

    split = split_pack(lengths, cp)
    cp_rank, u_rank = layout_coords(ctx.rank, sp // cp)
    size = total // sp
    index = torch.from_numpy(split.gather_index(cp_rank)[u_rank * size : (u_rank + 1) * size]).to(device)
    cp_in = [x[:, :, index].clone().requires_grad_() for x in (q, k, v)]
    sink_in = s.clone().requires_grad_() if sinks else None
    shard = cp_shard_of(split, cp_rank).apply(lambda t: t.to(device))
    attend = varlen_attention
    if compiled:
        torch._dynamo.reset()
        attend = torch.compile(varlen_attention, backend="aot_eager", dynamic=True)
    out, _ = attend(module, *cp_in, None, s_aux=sink_in, hbp_cp_shard=shard, hbp_sp=SPCall.of(ctx, "cp"), **kw)
    (out * w[:, index]).sum().backward()

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        scale = 1.0 if device == "cpu" else want.abs().max().item()
        return (got.double() - want.double()).abs().max().item() / scale

    errors = [error(a.grad, b.grad[:, :, index]) for a, b in zip(cp_in, ref_in)]
    if sinks:  # every rank's share of the sink gradient, summed over the CP group, is the whole
        grad = sink_in.grad.clone()
        dist.all_reduce(grad, group=ctx.cp.group)
        if ctx.ulysses.size > 1:
            dist.all_reduce(grad, group=ctx.ulysses.group)
        errors.append(error(grad, ref_in[3].grad))
    return dict(out=error(out, out_ref[:, index]), grads=errors, ranges=split.ranges_per_rank().tolist())


@pytest.mark.slow
@pytest.mark.parametrize("pack", sorted(PACKS))
@pytest.mark.parametrize("sp, cp, kv_heads", [(4, 4, 2), (4, 2, 2), (2, 2, 1), (4, 2, 1), (4, 4, 4)])
def test_cp_attention_matches_one_process_on_four_ranks(pool4, pack, sp, cp, kv_heads):
    for r in pool4.run(cp_attention_parity, sp, cp, kv_heads, PACKS[pack], None, False):
        assert r["out"] < 1e-12 and max(r["grads"]) < 1e-12, r


@pytest.mark.slow
@pytest.mark.parametrize("window, sinks", [(5, False), (None, True), (6, True)])
def test_cp_attention_keeps_window_and_sinks(pool4, window, sinks):
    for r in pool4.run(cp_attention_parity, 4, 2, 2, PACKS["spans_every_rank"], window, sinks):
        assert r["out"] < 1e-12 and max(r["grads"]) < 1e-12, r


@pytest.mark.slow
@pytest.mark.parametrize("sp, cp, window, sinks", [(4, 2, None, False), (4, 4, 5, True)])
def test_compiled_cp_attention_matches_one_process(pool4, sp, cp, window, sinks):
    """compile=True: the Ulysses part's attention is the compiled custom op, CP's its own kernels."""
    for r in pool4.run(cp_attention_parity, sp, cp, 2, PACKS["spans_every_rank"], window, sinks, "cpu", True):
        assert r["out"] < 1e-12 and max(r["grads"]) < 1e-12, r


def cp_kernel_calls(sp: int, cp: int, kv_heads: int, split: bool) -> dict:
    """``cp_attention_parity`` with the CPU kernel's calls and the CP collectives logged in order.
    With the kernel's LSE pair (``split``) the CP forward runs its forward once per kv-head slice
    and the backward its backward kernel once per slice, no forward; without it (the pair removed,
    as for Flex) the backward recomputes each slice's forward."""
    import dataclasses

    from lit_hbp.model.attention import backends
    from lit_hbp.parallel import context_parallel as cpm

    events: list[str] = []
    sdpa = backends.REGISTRY["sdpa"]

    def logged(what, fn):
        def call(*args, **kwargs):
            events.append(what)
            return fn(*args, **kwargs)

        return call

    lse = dataclasses.replace(sdpa.lse, forward=logged("forward", sdpa.lse.forward),
                              backward=logged("backward", sdpa.lse.backward)) if split else None  # fmt: skip
    patched = {
        "all_gather_flat": logged("gather", cpm.all_gather_flat),
        "reduce_scatter_flat": logged("scatter", cpm.reduce_scatter_flat),
    }
    saved = {name: getattr(cpm, name) for name in patched}
    backends.REGISTRY["sdpa"] = dataclasses.replace(sdpa, run=logged("run", sdpa.run), lse=lse)
    for name, fn in patched.items():
        setattr(cpm, name, fn)
    try:
        errors = cp_attention_parity(sp, cp, kv_heads, PACKS["many_short_one_long"], None, False)
    finally:
        backends.REGISTRY["sdpa"] = sdpa
        for name, fn in saved.items():
            setattr(cpm, name, fn)
    return {**errors, "events": events}


@pytest.mark.slow
@pytest.mark.parametrize("sp, cp, kv_heads", [(4, 4, 4), (4, 2, 2)])
@pytest.mark.parametrize("split", [True, False])
def test_the_cp_backward_runs_the_backward_kernel_and_prefetches_the_next_slice(pool4, sp, cp, kv_heads, split):
    slices = cp_slices(kv_heads, sp // cp, cp)
    for r in pool4.run(cp_kernel_calls, sp, cp, kv_heads, split):
        assert r["out"] < 1e-12 and max(r["grads"]) < 1e-12, r
        ev = r["events"]
        assert ev[0] == "run"  # the single-process reference: its kernel, differentiated by autograd
        cp_events = ev[1:]
        kernels = [e for e in cp_events if e != "gather" and e != "scatter"]
        if split:
            assert kernels == ["forward"] * slices + ["backward"] * slices
        else:
            assert kernels == ["run"] * (2 * slices)  # the forward, then its recomputation
        assert cp_events.count("gather") == 2 * 2 * slices and cp_events.count("scatter") == 2 * slices
        # Before the kernel of slice j runs, the K and V gathers of slice j + 1 are in flight.
        for j, at in enumerate(i for i, e in enumerate(cp_events) if e not in ("gather", "scatter")):
            pass_j = j % slices
            assert cp_events[:at].count("gather") - 2 * slices * (j // slices) == 2 * min(pass_j + 2, slices), ev


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("window, sinks", [(None, False), (5, False), (None, True)])
def test_cp_attention_on_two_gpus_matches_one_gpu(window, sinks):
    """The CUDA kernels (flash-attn, torch's varlen or Flex, whichever the backend choice takes for
    the call) under CP over NCCL, against the same kernel over the whole pack on one GPU, in bf16."""
    pool = Pool(2, backend="nccl")
    try:
        for pack in PACKS.values():
            for r in pool.run(cp_attention_parity, 2, 2, 2, pack, window, sinks, "cuda"):
                assert r["out"] < 2e-2 and max(r["grads"]) < 3e-2, r
    finally:
        pool.close()


@pytest.mark.slow
@pytest.mark.parametrize("pack", sorted(PACKS))
def test_cp_attention_matches_one_process_on_two_ranks(pool2, pack):
    for r in pool2.run(cp_attention_parity, 2, 2, 2, PACKS[pack], None, False):
        assert r["out"] < 1e-12 and max(r["grads"]) < 1e-12, r


# ------------------------------------------------------------------------ whole-model parity


def cp_model_parity(sp: int, cp: int, lengths: list[int], model: dict, lora: bool = False) -> dict:
    """Summed cross-entropy and every trainable parameter's gradient of a pack trained over the
    (sp, cp) layout, in fp64, summed over the SP group; and of the documents alone in one process
    (eager attention). With ``lora``, LoRA adapters (B initialised away from zero, so every adapter
    has a gradient) are what trains."""
    import torch.distributed as dist

    from lit_hbp.data.collate import collate_packs
    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.groups import SPGroups

    torch.manual_seed(0)
    adapters = dict(lora={"rank": 4, "alpha": 8, "dropout": 0.0}) if lora else {}
    module = HBPLitModule(model=model, vocab_size=97, self_check=False, **adapters)
    module.configure_model()
    module.model.double()
    for name, p in module.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    rng = np.random.default_rng(1)
    docs = {i: (rng.integers(0, 97, n), rng.random(n) < 0.8) for i, n in enumerate(lengths)}
    whole = collate_packs([np.arange(len(docs))], docs.__getitem__, sp=sp, cp=cp, sp_kind="cp", loss_norm=1.0)
    ctx = SPGroups([(sp, cp)], dist.get_world_size(), dist.get_rank())[(sp, cp)]
    batch = ContextParallel().shard(whole, sp, ctx.rank).replace(sp_group=SPCall.of(ctx, "cp"))
    loss, _, _ = module.packed_loss(batch, weights=1.0, recompute=False)
    loss.backward()
    params = {n: p for n, p in module.model.named_parameters() if p.requires_grad}
    grads = {n: p.grad.clone() for n, p in params.items()}
    total = loss.detach().clone()
    dist.all_reduce(total, group=ctx.group)
    for g in grads.values():
        dist.all_reduce(g, group=ctx.group)
    net = module.model
    net.set_attn_implementation("eager")
    net.zero_grad()
    ref = torch.zeros((), dtype=torch.float64)
    for ids, sup in docs.values():
        ids = torch.as_tensor(ids)
        labels = torch.where(torch.as_tensor(sup[1:]), ids[1:], -100)
        logits = net(input_ids=ids[None], use_cache=False).logits[0, :-1]
        ref = ref + F.cross_entropy(logits.double(), labels, reduction="sum", ignore_index=-100)
    ref.backward()
    rel = {n: ((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30)).item() for n, p in params.items()}
    return dict(loss=abs(total.item() - ref.item()) / abs(ref.item()), grads=rel, n_params=len(params))


@pytest.mark.slow
@pytest.mark.parametrize("pack", sorted(PACKS))
@pytest.mark.parametrize("sp, cp", [(4, 4), (4, 2), (2, 2)])
def test_cp_loss_and_every_gradient_match_the_documents_alone_on_four_ranks(pool4, pack, sp, cp):
    for r in pool4.run(cp_model_parity, sp, cp, PACKS[pack], TINY2):
        assert r["loss"] < 1e-5, r
        assert max(r["grads"].values()) < 1e-5, r["grads"]
        assert r["n_params"] == len(r["grads"]) > 10


@pytest.mark.slow
@pytest.mark.parametrize("sp, cp", [(4, 4), (4, 2)])
def test_cp_trains_lora_adapters_exactly(pool4, sp, cp):
    for r in pool4.run(cp_model_parity, sp, cp, PACKS["many_short_one_long"], TINY2, True):
        assert r["loss"] < 1e-5 and max(r["grads"].values()) < 1e-5, r
        assert r["n_params"] == len(r["grads"]) and all("lora" in n for n in r["grads"])


@pytest.mark.slow
@pytest.mark.parametrize("pack", ["odd", "shorter_than_2cp", "one_document"])
def test_cp_loss_and_every_gradient_match_the_documents_alone_on_two_ranks(pool2, pack):
    for r in pool2.run(cp_model_parity, 2, 2, PACKS[pack], TINY2):
        assert r["loss"] < 1e-5 and max(r["grads"].values()) < 1e-5, r


# ------------------------------------------------------------------------------- Trainer.fit

# sp 1; sp 2 by CP alone; sp 4 = Ulysses 2 x CP 2 by default (two heads stop Ulysses at 2).
CP_LEVELS = [Level(96, 1, 0), Level(192, 2, 1, 2, cp=2), Level(384, 4, 2)]


def train_cp(stage: int, data: str, tokenizer: str, cache: str) -> dict:
    import lightning as L
    import torch.distributed as dist
    from conftest import quiet_trainer

    from lit_hbp.lightning.datamodule import HBPDataModule
    from lit_hbp.lightning.strategy import HBPStrategy

    class Trace(L.Callback):
        def __init__(self):
            self.rows, self.layouts, self.new_groups = [], set(), 0

        def on_fit_start(self, trainer, pl_module):
            self.initial = gathered_params(pl_module)
            real = dist.new_group

            def counting(*a, **kw):
                self.new_groups += 1
                return real(*a, **kw)

            dist.new_group, self.restore = counting, real

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            group = batch.sp_group  # the level's group, handed over with the batch (none at sp 1)
            self.layouts.add((batch.sp, batch.cp, *((group.size, group.ctx.cp_size) if group else (1, 1))))
            self.rows.append((batch.micro_index, batch.sp, batch.sp_rank, batch.level, batch.sample_index.tolist()))

        def on_fit_end(self, trainer, pl_module):
            dist.new_group = self.restore

    torch.manual_seed(0)
    dm = HBPDataModule(sources=[{"path": data}], tokenizer=tokenizer, levels=CP_LEVELS, cache_dir=cache)
    # The self-check (on_fit_start) is not what this run compares: the fits of validate_with and run_cp below
    # run it at these CP layouts (and tests/test_sp.py's ZeRO-3 checkpoint test under ZeRO-3).
    module = SGDModule(model=TINY2, vocab_size=dm.vocab_size, lr=step_size("ave_token"), self_check=False)
    trace = Trace()
    trainer = quiet_trainer(
        devices=4,
        strategy=HBPStrategy(stage=stage),
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=[trace],
    )
    trainer.fit(module, dm)
    final = gathered_params(module)
    return dict(initial=trace.initial, final=final, rows=trace.rows, layouts=trace.layouts, new_groups=trace.new_groups)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_two_head_model_trains_at_sp_4_like_one_process(pool4, sp_data, toy_tokenizer, tmp_path, stage):
    from lit_hbp.lightning.datamodule import HBPDataModule

    results = pool4.run(train_cp, stage, str(sp_data), toy_tokenizer, str(tmp_path / "cache"))
    rank0 = results[0]
    assert rank0["layouts"] == {(1, 1, 1, 1), (2, 2, 2, 2), (4, 2, 4, 2)}  # (sp, cp) of batch and of group
    for r in results[1:]:
        for name, p in r["final"].items():
            torch.testing.assert_close(p, rank0["final"][name], atol=0, rtol=0)
    rows = [row for r in results for row in r["rows"]]
    dm = HBPDataModule(
        sources=[{"path": str(sp_data)}], tokenizer=toy_tokenizer, levels=[384], cache_dir=str(tmp_path / "cache")
    )
    dm.setup("fit")
    reference = reference_update(dict(rank0, rows=rows), dm.store.tokens, dm.vocab_size, model=TINY2)
    for name, p in rank0["final"].items():
        torch.testing.assert_close(p, reference[name].detach(), atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    moved = max((rank0["final"][n] - rank0["initial"][n]).abs().max().item() for n in rank0["final"])
    assert moved > 1e-3
    assert all(r["new_groups"] == 0 for r in results)


def validate_with(levels: list, data: str, tokenizer: str, cache: str) -> tuple[float, list[int]]:
    """val/loss after one optimizer step that changes nothing (SGD at lr 0), validated in fit, and
    the levels of the validation plan's steps."""
    from conftest import quiet_trainer

    from lit_hbp.lightning.datamodule import HBPDataModule
    from lit_hbp.lightning.strategy import HBPStrategy

    torch.manual_seed(0)
    dm = HBPDataModule(sources=[{"path": data}], tokenizer=tokenizer, levels=levels, cache_dir=cache, val_fraction=0.3)
    module = SGDModule(model=TINY2, vocab_size=dm.vocab_size, lr=0.0)
    trainer = quiet_trainer(
        devices=4, strategy=HBPStrategy(stage=2), max_steps=1, val_check_interval=1, num_sanity_val_steps=0
    )
    trainer.fit(module, dm)
    return float(trainer.callback_metrics["val/loss"]), sorted(set(dm.val_plan().step_level.tolist()))


@pytest.mark.slow
def test_validation_under_cp_equals_validation_without_sp(pool4, sp_data, toy_tokenizer, tmp_path):
    cache = str(tmp_path / "cache")
    with_cp = pool4.run(validate_with, CP_LEVELS, str(sp_data), toy_tokenizer, cache)
    plain = [Level(lv.pack_len, 1, lv.ckpt_layers) for lv in CP_LEVELS]
    without = pool4.run(validate_with, plain, str(sp_data), toy_tokenizer, cache)
    assert 1 in with_cp[0][1], "validation must run the CP level"
    assert len({v for v, _ in with_cp}) == 1 and len({v for v, _ in without}) == 1  # the reduced value
    assert with_cp[0][0] == pytest.approx(without[0][0], rel=1e-5)


def run_cp(data: str, tokenizer: str, root: str, max_steps: int, ckpt_path: str | None, dropout: float = 0.0) -> tuple:
    """(micro-step, layout, samples, loss) of every micro-batch a rank trains, checkpointing every step, and the
    ``train/loss`` logged every third step, by the logger's step."""
    import lightning as L
    from conftest import quiet_trainer
    from test_hot_path import MemoryLogger

    from lit_hbp.lightning.datamodule import HBPDataModule
    from lit_hbp.lightning.strategy import HBPStrategy

    class Record(L.Callback):
        def __init__(self):
            self.rows = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.rows.append(
                (batch.micro_index, batch.sp, batch.cp, batch.sample_index.tolist(), float(outputs["loss"]))
            )

    L.seed_everything(0)
    dm = HBPDataModule(sources=[{"path": data}], tokenizer=tokenizer, levels=CP_LEVELS, cache_dir=f"{root}/cache")
    module = SGDModule(model={**TINY2, "attention_dropout": dropout}, vocab_size=dm.vocab_size, lr=0.05)
    record, logger = Record(), MemoryLogger()
    save = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=f"{root}/ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}"
    )
    trainer = quiet_trainer(
        devices=4,
        strategy=HBPStrategy(stage=2),
        max_steps=max_steps,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=[record, save],
        enable_checkpointing=True,
        logger=logger,
        log_every_n_steps=3,
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return record.rows, logger.values("train/loss")


@pytest.mark.slow
def test_a_cp_run_resumes_exactly(pool4, sp_data, toy_tokenizer, tmp_path):
    """With attention dropout: each of the 4 ranks draws its masks after the resume from its own generators as
    they were at the checkpoint (gathered into it), as the uninterrupted run drew them. The first ``train/loss``
    logged after the resume (step 3) averages steps 1-3 of every rank, as the uninterrupted run's."""
    # 4 steps (the plan's levels sp 2, 1, 1, 4): the resumed steps 2-3 hold the sp 4 (Ulysses 2 x CP 2) step.
    full = pool4.run(run_cp, str(sp_data), toy_tokenizer, str(tmp_path / "full"), 4, None, 0.3)
    ckpt = str(tmp_path / "full" / "ckpt" / "step=2.ckpt")
    resumed = pool4.run(run_cp, str(sp_data), toy_tokenizer, str(tmp_path / "resumed"), 4, ckpt, 0.3)
    logged = {rank: losses for rank, (_, losses) in enumerate(full)}
    assert list(logged[0]) == [2] and resumed[0][1] == pytest.approx(logged[0], rel=1e-6)  # logger step: step - 1
    full, resumed = [rows for rows, _ in full], [rows for rows, _ in resumed]
    for whole, rest in zip(full, resumed):
        assert any(cp > 1 for _, _, cp, _, _ in rest), "the resumed part must train CP micro-batches"
        expected = whole[2 * ACCUMULATE :]
        assert [r[:4] for r in rest] == [r[:4] for r in expected]
        np.testing.assert_allclose([r[4] for r in rest], [r[4] for r in expected], rtol=1e-6, atol=1e-7)


def cp_device_reads(sp: int, cp: int) -> list[str]:
    """Host reads of would-be device tensors in the forward and backward of a CP micro-batch
    (``tests/test_sync_audit.py``'s recorder; the kernel one opaque call, as on a GPU)."""
    import torch.distributed as dist
    from test_sync_audit import DeviceReads, opaque_kernel

    from lit_hbp.data.collate import collate_packs
    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.model.attention import backends
    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.groups import SPGroups

    mode = DeviceReads()
    backends.REGISTRY["opaque"] = opaque_kernel(mode)
    torch.manual_seed(0)
    module = HBPLitModule(model=TINY2, vocab_size=97, self_check=False, attn_backend="opaque")
    module.configure_model()
    rng = np.random.default_rng(1)
    docs = {i: (rng.integers(0, 97, n), rng.random(n) < 0.8) for i, n in enumerate(PACKS["many_short_one_long"])}
    ctx = SPGroups([(sp, cp)], dist.get_world_size(), dist.get_rank())[(sp, cp)]
    whole = collate_packs([np.arange(len(docs))], docs.__getitem__, sp=sp, cp=cp, sp_kind="cp", loss_norm=1.0)
    try:
        with mode:
            batch = ContextParallel().shard(whole, sp, ctx.rank).to("cpu")  # what batch_to_device does,
            batch = batch.replace(sp_group=SPCall.of(ctx, "cp"))  # with the level's group
            mode.watching = True
            loss, _, _ = module.packed_loss(batch)
            loss.backward()
            mode.watching = False
    finally:
        del backends.REGISTRY["opaque"]
    return mode.reads


@pytest.mark.slow
@pytest.mark.parametrize("sp, cp", [(4, 2), (4, 4)])
def test_a_cp_micro_batch_reads_nothing_back_from_the_device(pool4, sp, cp):
    for reads in pool4.run(cp_device_reads, sp, cp):
        assert reads == []


def cp_dropout_directional_derivative(sp: int, cp: int) -> tuple[float, float]:
    """With attention dropout, the backward recomputes each slice's attention: it must draw the
    forward's dropout mask again. The gradient along a random direction against a central
    difference of two forwards with the same seed (fp64)."""
    import torch.distributed as dist

    from lit_hbp.model.attention import varlen_attention
    from lit_hbp.packing.context_split import split_pack
    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.context_parallel import cp_shard_of
    from lit_hbp.parallel.groups import SPGroups

    lengths = PACKS["spans_every_rank"]
    ctx = SPGroups([(sp, cp)], dist.get_world_size(), dist.get_rank())[(sp, cp)]
    g = torch.Generator().manual_seed(3 + dist.get_rank())
    split = split_pack(lengths, cp)
    cp_rank, u_rank = layout_coords(ctx.rank, sp // cp)
    size = sum(lengths) // sp
    q, k, v = (torch.randn(1, 4, size, 8, generator=g, dtype=torch.float64) for _ in range(3))
    w, direction = torch.randn(1, size, 4, 8, generator=g, dtype=torch.float64), torch.randn_like(q)
    cu = torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32)
    module = SimpleNamespace(training=True)
    shard, sp_group = cp_shard_of(split, cp_rank), SPCall.of(ctx, "cp")

    def loss(query):
        torch.manual_seed(11)  # the same dropout masks in every forward
        out, _ = varlen_attention(
            module, query, k, v, None, dropout=0.3, cu_seq_lens_q=cu, max_length_q=64, hbp_cp_shard=shard,
            hbp_sp=sp_group,
        )  # fmt: skip
        return (out * w).sum()

    leaf = q.clone().requires_grad_()
    loss(leaf).backward()
    analytic = float((leaf.grad * direction).sum())
    eps = 1e-6
    with torch.no_grad():
        numeric = float((loss(q + eps * direction) - loss(q - eps * direction)) / (2 * eps))
    return analytic, numeric


@pytest.mark.slow
def test_cp_attention_dropout_replays_its_mask_in_the_backward(pool4):
    for analytic, numeric in pool4.run(cp_dropout_directional_derivative, 4, 2):
        assert analytic == pytest.approx(numeric, rel=1e-6)


# ------------------------------------------------------------- dK/dV: fp32, one order, every run


@pytest.mark.parametrize(
    "lengths, cp", [([64], 4), ([61, 3], 4), (PACKS["many_short_one_long"][:8] + [5], 2), ([4000, 96], 8)]
)
def test_key_gradients_add_up_in_fp32_like_a_brute_force_sum(lengths, cp):
    """``gathered_key_grad`` against np.add.at in fp64 over bf16 gradients: every key's sum, rounded
    to fp32 once per added range (exact for the two ranges of these packs), never to bf16."""
    from lit_hbp.packing.context_split import split_pack
    from lit_hbp.parallel.context_parallel import cp_shard_of, gathered_key_grad

    split = split_pack(np.asarray(lengths), cp)
    total = split.pack_len
    rounds = []
    for rank in range(cp):
        shard = cp_shard_of(split, rank)
        n = shard.key_index.numel()
        g = torch.randn(1, 2, n, 4, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        got = gathered_key_grad(g, shard, total)
        want = np.zeros((2, total, 4))
        np.add.at(want, (slice(None), shard.key_index.numpy()), g[0].double().numpy())
        assert got.dtype == torch.float32
        assert torch.equal(got[0], torch.from_numpy(want).float()), rank
        rounds.append(len(shard.key_rounds))
    assert max(rounds) >= 2, "a rank holds two ranges of a document: its keys add up"


def cp_bf16_gradients_twice(sp: int, cp: int, lengths: list[int]) -> dict:
    """A bf16 CP attention forward and backward on CPU, run twice on the same inputs: whether every
    input gradient is the same bits, and the dtypes the dK/dV reduce-scatters ran in."""
    import torch.distributed as dist

    from lit_hbp.model.attention import varlen_attention
    from lit_hbp.packing.context_split import split_pack
    from lit_hbp.parallel import context_parallel as cpm
    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.groups import SPGroups

    ctx = SPGroups([(sp, cp)], dist.get_world_size(), dist.get_rank())[(sp, cp)]
    g = torch.Generator().manual_seed(3)
    total, heads, dim = sum(lengths), 4, 8
    q, k, v = (torch.randn(1, heads, total, dim, generator=g).to(torch.bfloat16) for _ in range(3))
    w = torch.randn(1, total, heads, dim, generator=g).to(torch.bfloat16)
    split = split_pack(np.asarray(lengths), cp)
    cp_rank, u_rank = layout_coords(ctx.rank, sp // cp)
    size = total // sp
    index = torch.from_numpy(split.gather_index(cp_rank)[u_rank * size : (u_rank + 1) * size])
    kw = dict(scaling=dim**-0.5, cu_seq_lens_q=torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32),
              max_length_q=max(lengths))  # fmt: skip
    scattered = []
    reduce_scatter = cpm.reduce_scatter_flat

    def recorded(out, src, **kwargs):
        scattered.append(str(src.dtype))
        return reduce_scatter(out, src, **kwargs)

    cpm.reduce_scatter_flat = recorded
    shard, sp_group = cpm.cp_shard_of(split, cp_rank), SPCall.of(ctx, "cp")
    runs = []
    try:
        for _ in range(2):
            inputs = [x[:, :, index].clone().requires_grad_() for x in (q, k, v)]
            out, _ = varlen_attention(
                SimpleNamespace(training=False), *inputs, None, hbp_cp_shard=shard, hbp_sp=sp_group, **kw
            )
            (out * w[:, index]).sum().backward()
            runs.append([x.grad for x in inputs])
    finally:
        cpm.reduce_scatter_flat = reduce_scatter
    same = all(torch.equal(a, b) and a.dtype == torch.bfloat16 for a, b in zip(*runs))
    return dict(same=same, scattered=sorted(set(scattered)), rounds=len(cpm.cp_shard_of(split, cp_rank).key_rounds))


@pytest.mark.slow
def test_cp_gradients_of_a_bf16_micro_batch_are_the_same_bits_on_every_run(pool4):
    """The same bf16 micro-batch twice on 4 ranks (Ulysses 2 x CP 2 and CP 4): bit-identical
    gradients, dK/dV reduce-scattered in fp32, on ranks whose keys are seen by two ranges."""
    for sp, cp in [(4, 2), (4, 4)]:
        results = pool4.run(cp_bf16_gradients_twice, sp, cp, [64, 29, 3])
        assert all(r["same"] and r["scattered"] == ["torch.float32"] for r in results), results
        assert max(r["rounds"] for r in results) >= 2, results
