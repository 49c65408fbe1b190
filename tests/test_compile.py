"""compile=True: each decoder layer compiles to one graph (attention is the opaque ``hbp::varlen_attention_v4``
custom op, on every backend), packs of other lengths and document counts reuse it (dynamic shapes, no
guard on the pack), and the compiled module trains like the eager one."""

import dataclasses

import numpy as np
import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from conftest import TINY_LLAMA
from test_attention import dense_reference, random_pack

from lit_hbp.data.collate import collate_packs
from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.lightning.recompile import set_recompile_limit
from lit_hbp.model import attention
from lit_hbp.model.attention import flex, op
from lit_hbp.model.attention.kernel import AttnArgs

MICRO_BATCHES = 13


def make_module(**kw) -> HBPLitModule:
    torch.manual_seed(0)
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=300, **kw)
    module.configure_model()
    return module


def packs(n: int) -> list:
    """``n`` micro-batches of 1 to 6 documents of 2 to 80 tokens (different lengths and counts each)."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(n):
        lengths = rng.integers(2, 80, rng.integers(1, 7))
        samples = {j: (rng.integers(0, 300, n), rng.random(n) < 0.7) for j, n in enumerate(lengths)}
        out.append(collate_packs([np.arange(len(lengths))], samples.__getitem__, loss_norm=40.0))
    return out


def grads(module: HBPLitModule, batch) -> list[torch.Tensor]:
    module.zero_grad()
    module(batch)[0].backward()
    return [p.grad.clone() for p in module.parameters()]


@pytest.mark.slow
def test_an_attend_call_hashes_before_its_fields_exist():
    """torch 2.11's dynamo hashes an object it builds while tracing before the object's fields are set
    (found on an H100 with torch 2.11: every compiled layer failed): ``Attend`` hashes by identity."""
    half_built = object.__new__(attention.Attend)
    assert hash(half_built) == object.__hash__(half_built)


def test_compiled_layers_are_one_graph_and_train_like_eager(monkeypatch):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    eager, compiled = make_module(), make_module(compile=True)
    for layer in compiled._layers:  # the module's own set-up, with a counting backend
        layer.compile(backend=backend, dynamic=True)
    graphs_after_first = None
    for i, batch in enumerate(packs(MICRO_BATCHES)):
        for a, b in zip(grads(eager, batch), grads(compiled, batch)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        if i == 0:
            graphs_after_first = backend.frame_count
            assert graphs_after_first >= 1
            # both layers, one graph: nothing per layer is a guard (each MLP's own tiling forward was one)
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert backend.frame_count - graphs_after_first <= 2, "recompiled for other packs"


def test_the_self_check_runs_through_compiled_layers():
    """``compile: true`` stopped every fit at its self-check ("compiled with non-empty donated buffers which requires
    create_graph=False and retain_graph=False"): AOTAutograd's backward (inductor's, as aot_eager's here) runs once
    per forward. Each document runs a forward of its own there, through the compiled layers."""
    from lit_hbp.model.selfcheck import run_self_check

    torch._dynamo.reset()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    module = make_module(compile=True)
    for layer in module._layers:
        layer.compile(backend=backend, dynamic=True)
    (result,) = run_self_check(module, [1]).values()
    assert backend.frame_count >= 1  # what the check ran: the compiled layers
    assert result.loss < 1e-5 and result.grads < 1e-4 and result.leak == 0


@pytest.mark.parametrize("first", [32, 64, 16], ids=["hidden", "intermediate", "kv_width"])
def test_a_first_pack_as_long_as_a_layer_width_compiles_a_graph_for_every_length(first):
    """A level's first micro-batch of exactly as many tokens as one of the layer's widths (an 8B model's 4096
    hidden, a 1K level and 1024-wide K/V): dynamo gave the pack's length and that width one symbol (duck
    shaping), the weight's fixed width pinned it, and every later length compiled again. The packed call
    compiles with a symbol per size: the first graph serves the later packs, and they train like eager."""
    torch._dynamo.reset()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    eager, compiled = make_module(), make_module(compile=True)
    for layer in compiled._layers:
        layer.compile(backend=backend, dynamic=True)
    rng = np.random.default_rng(3)
    for i, lengths in enumerate([[first // 2, first - first // 2], [40], [3, 21, 24], [first]]):
        samples = {j: (rng.integers(0, 300, n), rng.random(n) < 0.7) for j, n in enumerate(lengths)}
        batch = collate_packs([np.arange(len(lengths))], samples.__getitem__, loss_norm=20.0)
        assert batch.input_ids.shape[1] == sum(lengths)  # no padding: the first pack is as long as the width
        for a, b in zip(grads(eager, batch), grads(compiled, batch)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        if i == 0:
            graphs = backend.frame_count
    assert backend.frame_count == graphs, "a later pack length compiled again"


def test_a_static_graph_takes_each_packs_boundaries_and_a_new_longest_document_compiles_again():
    """What bench/graph_modes.py's static and CUDA-graph modes rest on: a layer compiled ``dynamic=False``
    serves every pack of its shape whose documents come in another order (the boundaries are the op's tensor
    input, read at each call, never a constant of the graph) and trains like eager; the longest document is a
    constant of a static graph (the kernels' grid), so a pack of the same shape with another longest document
    compiles a graph of its own rather than run with the old one."""
    torch._dynamo.reset()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    eager, compiled = make_module(), make_module(compile=True)
    for layer in compiled._layers:
        layer.compile(backend=backend, dynamic=False)
    rng = np.random.default_rng(5)
    orders = [[5, 19, 24], [24, 5, 19], [19, 24, 5], [5, 24, 19], [20, 20, 8]]  # the last: another longest
    for i, lengths in enumerate(orders):
        samples = {j: (rng.integers(0, 300, n), rng.random(n) < 0.7) for j, n in enumerate(lengths)}
        batch = collate_packs([np.arange(len(lengths))], samples.__getitem__, loss_norm=20.0)
        for a, b in zip(grads(eager, batch), grads(compiled, batch)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        if i == 0:
            graphs = backend.frame_count
        if i == len(orders) - 2:
            assert backend.frame_count == graphs, "a pack of the same shape and longest document compiled again"
    assert backend.frame_count > graphs, "a new longest document ran a graph built for another"


@pytest.mark.parametrize(("tiles", "most"), [(1, 2), (2, 6)])
def test_checkpointed_and_tiled_layers_share_their_graphs(tiles, most):
    """A level that checkpoints 3 of 6 layers (and tiles the MLPs): as many graphs as kinds of layer, not
    one per layer (the layers' checkpoint functions and the MLPs' forwards were per-layer objects, dynamo
    guards: 16 layers passed dynamo's recompile limit and ran eagerly on an H100). Two kinds: with and
    without checkpointing, one graph each; tiled MLPs break each layer's graph (their autograd function
    runs eagerly, and the checkpoint around it enters the call again: it crashed before), into 4 graphs
    with torch 2.13 and 5 with 2.11: at most 3 a kind, against 12 or more for one per layer. Trains like eager;
    after the packs the layers' flags are their class's again (no new guard for a later call). On transformers 5.25
    the attention's forward sets a context variable (its kernel routing): the checkpointed kind broke its graph and
    ran eagerly, one graph in all, until packed calls let dynamo skip replaying that write in the recomputation."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    config = {**TINY_LLAMA, "num_hidden_layers": 6}
    torch.manual_seed(0)
    eager = HBPLitModule(model=config, vocab_size=300)
    eager.configure_model()
    compiled = HBPLitModule(model=config, vocab_size=300, compile=True)
    compiled.configure_model()
    compiled.model.load_state_dict(eager.model.state_dict())
    for layer in compiled._layers:
        layer.compile(backend=backend, dynamic=True)
    for batch in packs(3):
        batch = batch.replace(ckpt_layers=3, mlp_tiles=tiles)
        for a, b in zip(grads(eager, batch), grads(compiled, batch)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    counters = torch._dynamo.utils.counters
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == most if tiles == 1 else 2 <= graphs <= most, dict(counters["stats"])
    assert bool(counters["graph_break"]) == (tiles > 1), dict(counters["graph_break"])
    assert all("gradient_checkpointing" not in layer.__dict__ for layer in compiled._layers)


def each_document_alone(reference, pairs, coefficient: float | None) -> torch.Tensor:
    """The unprepared model (eager) on each document alone: its summed cross-entropy, plus ``coefficient`` times
    the family's own load-balancing loss over every document's router logits (the pack's tokens) when given."""
    import sys

    import torch.nn.functional as F

    total, routed = 0.0, []
    for ids, mask in pairs:
        ids = torch.as_tensor(ids)[None]
        out = reference(input_ids=ids, output_router_logits=coefficient is not None, use_cache=False)
        labels = torch.where(torch.as_tensor(mask[1:]), ids[0, 1:], -100)
        total = total + F.cross_entropy(out.logits[0, :-1].float(), labels, reduction="sum")
        routed.append(out.router_logits if coefficient is not None else ())
    if coefficient is None:
        return total
    config = reference.config
    balance = sys.modules[type(reference).__module__].load_balancing_loss_func
    layers = tuple(torch.cat(per_layer, 0) for per_layer in zip(*routed))
    return total + coefficient * balance(layers, config.num_experts, config.num_experts_per_tok)


@pytest.mark.parametrize("way", ["torch.compile(model)", "compile=True"])
@pytest.mark.parametrize(
    ("family", "overrides", "coefficient"),
    [
        ("qwen3_moe", dict(output_router_logits=True, router_aux_loss_coef=0.5), 0.5),  # the router logits break
        ("lfm2", dict(layer_types=["conv", "full_attention"]), None),  # the per-document convolution breaks
    ],
)
def test_a_checkpointed_layer_with_a_graph_break_recomputes_inside_its_packed_call(family, overrides, coefficient, way):
    """A compiled layer that breaks its graph runs its checkpoint eagerly, and the recomputation in the backward,
    outside the packed call, ran it as a plain call (another attention): CheckpointError at the first backward of
    a level checkpointing layers, through ``torch.compile(model)`` and ``HBPLitModule(compile=True)``. It enters
    the call again now, and the pack trains as the unprepared model on each document alone."""
    import copy

    from families import small_config
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_hbp import pack_samples, packed_loss, prepare_model

    config = dict(small_config(family), **overrides)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation="eager").float()
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(3, 320, n), rng.random(n) < 0.7) for n in (21, 9, 34, 6)]
    torch._dynamo.reset()
    if way == "torch.compile(model)":
        model = torch.compile(prepare_model(copy.deepcopy(reference)), backend="aot_eager")
        got = packed_loss(model, pack_samples(pairs, ckpt_layers=2), "sum")
        params = dict(model._orig_mod.named_parameters())
    else:
        module = HBPLitModule(model=config, loss="sum", compile=True)
        module.configure_model()
        module.model.load_state_dict(reference.state_dict())
        for layer in module._layers:
            layer.compile(backend="aot_eager", dynamic=True)
        samples = dict(enumerate(pairs))
        got = module(collate_packs([np.arange(len(pairs))], samples.__getitem__).replace(ckpt_layers=2))
        params = dict(module.model.named_parameters())
    got.loss.backward()
    want = each_document_alone(reference.train(), pairs, coefficient)
    want.backward()
    assert got.loss.item() == pytest.approx(want.item(), rel=1e-5)
    for name, q in reference.named_parameters():
        if q.grad is not None:
            scale = float(q.grad.abs().max())
            torch.testing.assert_close(params[name].grad, q.grad, rtol=1e-4, atol=1e-4 * scale, msg=name)


def test_the_recompile_limit_is_raised_never_lowered_and_said_what_it_was():
    config = torch._dynamo.config
    before = config.recompile_limit  # (monkeypatch would delete the key from torch's config on undo)
    try:
        config.recompile_limit = 8
        assert set_recompile_limit(16) == 8 and config.recompile_limit == 16
        assert set_recompile_limit(4) == 16 and config.recompile_limit == 16  # never lowered
    finally:
        config.recompile_limit = before


def test_a_compiled_run_says_when_a_layer_falls_back_to_eager():
    """At dynamo's recompile limit a compiled layer runs uncompiled for the rest of the run: the module says
    so in lit-hbp's words (here the limit lowered to 1 and the layers called in train then eval mode, which
    recompiles them); the watch leaves with the run (teardown). The limit is dynamo's, whatever compiles the
    graphs: the layers compile with the "eager" backend here, as the module compiles them otherwise."""
    import logging

    from lit_hbp.lightning.recompile import DYNAMO_LOG, RecompileLimitWatch

    config = torch._dynamo.config
    before = config.recompile_limit
    torch._dynamo.reset()
    try:
        module = make_module(compile=True)
        for layer in module._layers:
            layer.compile(backend="eager", dynamic=True)
        config.recompile_limit = 1
        batch = packs(1)[0]
        module(batch)
        module.eval()
        with (
            torch.no_grad(),
            pytest.warns(UserWarning, match=r"compile: dynamo hit its recompile_limit \(1\) at '\w+'"),
        ):
            module(batch)
        watch = module._recompile_watch
        assert isinstance(watch, RecompileLimitWatch) and watch in logging.getLogger(DYNAMO_LOG).filters
        module.teardown("fit")
        assert watch not in logging.getLogger(DYNAMO_LOG).filters
    finally:
        config.recompile_limit = before
        torch._dynamo.reset()


def test_flex_block_masks_are_held_by_the_pack_being_trained():
    """Built once per pack and window (every layer shares it), kept on the pack's cu_seqlens and gone
    with it: nothing else holds a pack's masks."""
    import gc
    import weakref

    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    mask = flex.document_block_mask(cu, 9, None)
    assert flex.document_block_mask(cu, 9, None) is mask
    assert flex.document_block_mask(cu, 9, 3) is not mask
    assert flex.document_block_mask(cu.clone(), 9, None) is not mask  # not the pack's documents
    gone = weakref.ref(mask)
    del cu, mask
    gc.collect()
    assert gone() is None


COUNTED = ("run", "lse.forward", "lse.backward")


def count_kernel_calls(monkeypatch, name: str) -> dict[str, int]:
    """Backend ``name`` with its kernel and its LSE pair counting their calls."""
    calls = dict.fromkeys(COUNTED, 0)
    backend = attention.REGISTRY[name]

    def counted(what, fn):
        def call(*a, **kw):
            calls[what] += 1
            return fn(*a, **kw)

        return call

    lse = dataclasses.replace(
        backend.lse,
        forward=counted("lse.forward", backend.lse.forward),
        backward=counted("lse.backward", backend.lse.backward),
    )
    monkeypatch.setitem(
        attention.REGISTRY, name, dataclasses.replace(backend, run=counted("run", backend.run), lse=lse)
    )
    return calls


OP_CASES = {  # on CPU: sdpa takes windows and dropout; soft-capping and sinks go to the eager backend
    "sdpa": ("sdpa", {}),
    "sdpa window": ("sdpa", {"window": 7}),
    "eager softcap sinks": ("eager", {"softcap": 1.5, "sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}),
}


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_compiled_attention_backward_runs_the_kernel_from_the_saved_lse(monkeypatch, case):
    """Under torch.compile the op keeps the LSE and its backward runs the backend's backward kernel:
    one forward kernel per step, none in the backward; output and gradients equal the dense fp64
    reference; one graph, no breaks, and packs of other document counts reuse it."""
    name, feats = OP_CASES[case]
    calls = count_kernel_calls(monkeypatch, name)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    sinks = feats.get("sinks")

    @torch.compile(backend=backend, dynamic=True, fullgraph=True)
    def attend(q, k, v, sinks, cu, max_len):
        return attention.Attend(cu, max_len, 0.3, feats.get("window"), feats.get("softcap"), 0.0)(q, k, v, sinks)

    for seed, docs in enumerate([5, 3, 6]):
        q, k, v, cu = random_pack(seed, docs=docs)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, *([sinks] if sinks is not None else []))]
        cu_t = torch.tensor(cu, dtype=torch.int32)
        out = attend(*leaves[:3], leaves[3] if sinks is not None else None, cu_t, int(max(np.diff(cu))))
        ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
        ref = dense_reference(*ref_leaves[:3], cu, 0.3, feats.get("window"), feats.get("softcap"), *ref_leaves[3:])
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        w = torch.randn_like(ref)
        got = torch.autograd.grad((out.double() * w).sum(), leaves)
        want = torch.autograd.grad((ref * w).sum(), ref_leaves)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)
        assert calls == {"run": 0, "lse.forward": seed + 1, "lse.backward": seed + 1}, calls
    assert not torch._dynamo.utils.counters["graph_break"]
    assert backend.frame_count <= 2  # the first pack, then one dynamic-shape graph


def test_compiled_attention_with_dropout_recomputes_the_forward(monkeypatch):
    """Dropout has no backward kernel to call: the op saves no LSE and its backward runs the forward
    again on the forward's dropout seed (the same mask: gradients equal those of the eager kernel
    under that seed)."""
    calls = count_kernel_calls(monkeypatch, "sdpa")
    q, k, v, cu = random_pack(0)
    cu_t, max_len = torch.tensor(cu, dtype=torch.int32), int(max(np.diff(cu)))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse, seed = op._varlen_op(*leaves, cu_t, None, max_len, 0.3, None, None, 0.4, "auto", 0)
    out = out.transpose(1, 2)  # the op's [1, T, H, D]
    assert lse.numel() == 0 and calls == {"run": 1, "lse.forward": 0, "lse.backward": 0}
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), leaves)
    assert calls["run"] == 2 and calls["lse.backward"] == 0
    ref_leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    with attention.replay_rng(q.device, int(seed)):
        ref = attention.REGISTRY["sdpa"].run(*ref_leaves, AttnArgs(cu_t, max_len, 0.3, dropout=0.4))
    torch.testing.assert_close(out, ref.detach(), atol=0, rtol=0)
    for a, b in zip(got, torch.autograd.grad((ref * w).sum(), ref_leaves)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_attention_op_passes_torchs_opcheck(case):
    """torch.library.opcheck: schema, fake (the LSE's shape decided as the kernel decides it),
    autograd registration and AOT dispatch with dynamic shapes."""
    _, feats = OP_CASES[case]
    q, k, v, cu = random_pack(2)
    sinks = feats.get("sinks")
    leaves = [x.clone().requires_grad_() for x in (q, k, v, *([sinks] if sinks is not None else []))]
    args = (*leaves[:3], torch.tensor(cu, dtype=torch.int32), leaves[3] if sinks is not None else None)
    torch.library.opcheck(
        op._varlen_op,
        (*args, int(max(np.diff(cu))), 0.3, feats.get("window"), feats.get("softcap"), 0.0, "auto", 0),
    )


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_ops_outputs_stay_on_the_gpu_so_a_layer_can_be_one_cuda_graph(dropout):
    """Inductor skips a compiled layer's CUDA graph when a node puts out a host tensor, and torch 2.11's graph
    partitions stopped on it (bench/graph_modes.py on the H200, 2026-11-30 and 2026-12-04: "skipping
    cudagraphs due to cpu device (varlen_attention_v4)"). Traced as a compiled CUDA layer traces it (fake
    CUDA tensors, so on any machine): without dropout every output is on the GPU; with dropout the seed that
    the backward's recomputation reads stays on the host (no device read)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (torch.empty(1, 4, 16, 8, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0, 5, 16], dtype=torch.int32, device="cuda")
        outs = torch.ops.hbp.varlen_attention_v4(q, k, v, cu, None, 11, 0.3, None, None, dropout, "auto", 0)
    assert [o.device.type for o in outs] == ["cuda", "cuda", "cpu" if dropout else "cuda"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["flash_attn", "flash_attn_3", "flash_attn_4", "torch_varlen", "flex"])
def test_compiled_attention_on_the_gpu_matches_the_kernels_own_autograd(monkeypatch, name):
    """Inductor, bf16, GQA, several documents: the op's output and gradients against the same kernel
    differentiated by its own autograd; backends with a backward kernel run it and no second forward
    (Flex recomputes). A backend not installed here is skipped with the reason."""
    from lit_hbp.model.attention import backends

    reason = backends.why_not(name, "cuda", torch.bfloat16, frozenset())
    if reason:
        pytest.skip(f"{name}: {reason}")
    has_pair = backends.lse_why_not(name, "cuda", frozenset()) is None
    calls = count_kernel_calls(monkeypatch, name) if has_pair else None
    torch._dynamo.reset()
    q, k, v, cu = random_pack(0, total=3000, hq=8, hkv=2, dim=128, docs=7)
    q, k, v = (x.cuda().bfloat16() for x in (q, k, v))
    cu_t, max_len = torch.tensor(cu, dtype=torch.int32, device="cuda"), int(max(np.diff(cu)))
    attend = attention.Attend(cu_t, max_len, None, None, None, 0.0, None, name)  # the model's forced backend
    layer = torch.compile(lambda q, k, v: attend(q, k, v, None))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = layer(*leaves)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout)
    if has_pair:  # before the reference below, which runs the kernel through the same counted registry
        assert calls["lse.backward"] == 1 and calls["run"] == 0, calls
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = attention.REGISTRY[name].run(*ref_leaves, AttnArgs(cu_t, max_len, 128**-0.5))
    want = torch.autograd.grad(ref, ref_leaves, dout)
    for a, b in zip([out, *got], [ref, *want]):
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() < 1e-2, name


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_the_backward_op_returns_the_kernels_own_gradients(monkeypatch, case):
    """q, k, v in the model's layout ([1, T, H, D] in memory, what a q_proj(...).view().transpose(1, 2)
    gives): the backward op hands back the very tensors its kernel wrote, no copy, in the layout its
    fake declares (opcheck compares the two)."""
    name, feats = OP_CASES[case]
    backend = attention.REGISTRY[name]
    written = []

    def backward(*args):
        grads = backend.lse.backward(*args)
        written.extend(g.untyped_storage().data_ptr() for g in grads[:3])
        return grads

    monkeypatch.setitem(
        attention.REGISTRY, name, dataclasses.replace(backend, lse=dataclasses.replace(backend.lse, backward=backward))
    )
    q, k, v, cu = random_pack(3)
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))  # the model's layout
    sinks = feats.get("sinks")
    cu_t, max_len = torch.tensor(cu, dtype=torch.int32), int(max(np.diff(cu)))
    host = (max_len, 0.3, feats.get("window"), feats.get("softcap"), 0.0, "auto", 0)
    out, lse, seed = op._varlen_op(q, k, v, cu_t, sinks, *host)
    grad = torch.randn_like(out)
    grads = op._varlen_backward_op(grad, q, k, v, cu_t, sinks, out, lse, seed, *host)
    assert [g.untyped_storage().data_ptr() for g in grads[:3]] == written
    assert [g.stride() for g in grads[:3]] == [op.kernel_layout(x).stride() for x in (q, k, v)]
    torch.library.opcheck(op._varlen_backward_op, (grad, q, k, v, cu_t, sinks, out, lse, seed, *host))
