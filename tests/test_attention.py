"""Attention backends: each against a dense fp64 reference over the whole pack; the choice per
device, dtype, feature set and library version (torch 2.10-2.13 varlen signatures and flash-attn
2/3/4 faked on CPU); the FlexAttention block mask against torch's own ``create_block_mask``."""

import importlib.machinery
import sys
import types

import numpy as np
import pytest
import torch
from packaging.version import Version

from lit_hbp import prepare_model
from lit_hbp.model import attention
from lit_hbp.model.attention import backends, dispatch, flash, flex, loops, torch_varlen
from lit_hbp.model.attention.backends import REGISTRY, choose
from lit_hbp.model.attention.flex import tile_masks
from lit_hbp.model.attention.kernel import AttnArgs, call_needs
from lit_hbp.model.packed_call import record_of


def dense_reference(q, k, v, cu, scale, window=None, softcap=None, sinks=None, causal=True):
    """fp64, the whole pack at once: a T x T mask from document ids (causal, same document, window)."""
    total = q.shape[2]
    doc = np.repeat(np.arange(len(cu) - 1), np.diff(np.asarray(cu)))
    i = np.arange(total)
    keep = (doc[:, None] == doc[None, :]) & ((i[None, :] <= i[:, None]) | (not causal))
    if window is not None:
        keep &= i[:, None] - i[None, :] < window
    keep = torch.as_tensor(keep)
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = qd @ kd.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        col = sinks.double().reshape(1, -1, 1, 1).expand(1, -1, total, 1)
        p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return p @ vd


def random_pack(seed, total=90, hq=4, hkv=2, dim=8, docs=5):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=g)[: docs - 1].add(1).sort().values.tolist()
    cu = [0, *cuts, total]
    q = torch.randn(1, hq, total, dim, generator=g)
    k, v = (torch.randn(1, hkv, total, dim, generator=g) for _ in range(2))
    return q, k, v, cu


FEATURE_CASES = {
    "plain": {},
    "window": {"window": 7},
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
    "all": {"window": 5, "softcap": 2.0, "sinks": torch.tensor([1.0, 0.0, -0.5, 3.0])},
}


@pytest.mark.parametrize("case", sorted(FEATURE_CASES))
@pytest.mark.parametrize("name", ["sdpa", "eager"])
def test_cpu_backends_match_the_dense_reference_with_gradients(name, case):
    feats = FEATURE_CASES[case]
    needs = AttnArgs(torch.zeros(2), 1, 1.0, **feats).needs
    if needs - REGISTRY[name].supports():
        assert backends.why_not(name, "cpu", torch.float32, needs).startswith("does not support")
        return
    q, k, v, cu = random_pack(1)
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    scale = 0.3
    args = AttnArgs(torch.tensor(cu, dtype=torch.int32), max(np.diff(cu)), scale, **feats)
    out = REGISTRY[name].run(*ins, args)
    ref = dense_reference(*ref_in, cu, scale, **feats)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(ref)
    (out.double() * w).sum().backward()
    (ref * w).sum().backward()
    for a, b in zip(ins, ref_in):
        torch.testing.assert_close(a.grad.double(), b.grad.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", sorted(FEATURE_CASES))
def test_flex_forward_matches_the_dense_reference_on_cpu(case):
    """FlexAttention runs forward (not backward) on CPU: the block mask, soft-capping and the sink
    correction from the log-sum-exp are checked here; gradients in the GPU test."""
    from torch.nn.attention.flex_attention import flex_attention

    feats = FEATURE_CASES[case]
    q, k, v, cu = random_pack(2, total=300)
    args = AttnArgs(torch.tensor(cu, dtype=torch.int32), max(np.diff(cu)), 0.4, **feats)
    with torch.no_grad():
        out = flex.flex_run(q, k, v, args, fn=flex_attention)
    torch.testing.assert_close(out.double(), dense_reference(q, k, v, cu, 0.4, **feats), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("feats", [{"window": 7}, {"window": 5, "softcap": 2.0}])
def test_compiled_flex_lowers_the_windowed_mask_on_cpu(feats):
    """Inductor lowers a block mask's mask_mod as one pointwise subgraph, in which an in-place ``&=``
    cannot be written (on an H100 every windowed family failed its self-check on flex): compiled, the
    windowed cases lower and match the dense reference (CPU forward without sinks, which need the LSE that
    compiled CPU flex does not return; the GPU test has them and the gradients)."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    q, k, v, cu = random_pack(2, total=300)
    args = AttnArgs(torch.tensor(cu, dtype=torch.int32), max(np.diff(cu)), 0.4, **feats)
    with torch.no_grad():
        out = flex.flex_run(q, k, v, args, fn=torch.compile(flex_attention))
    torch.testing.assert_close(out.double(), dense_reference(q, k, v, cu, 0.4, **feats), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "causal"), [(None, True), (1, True), (20, True), (130, True), (400, True),
                                               (None, False)])  # fmt: skip
@pytest.mark.parametrize("seed", range(4))
def test_flex_tiles_equal_torchs_create_block_mask(seed, window, causal):
    """Causal (with windows) and both ways (a vision tower's images): the tiles torch marks, for random packs
    with documents of every size against 16-wide tiles (one document per tile, several, a long one over many)."""
    from torch.nn.attention.flex_attention import create_block_mask

    rng = np.random.default_rng(seed)
    total = int(rng.integers(40, 400))
    cuts = np.sort(rng.choice(np.arange(1, total), size=int(rng.integers(0, 8)), replace=False))
    cu = torch.tensor([0, *cuts, total], dtype=torch.int32)
    doc = torch.as_tensor(np.repeat(np.arange(len(cu) - 1), np.diff(cu.numpy())))

    def mask_mod(b, h, q_idx, kv_idx):
        keep = (doc[q_idx] == doc[kv_idx]) & ((q_idx >= kv_idx) | (not causal))
        return keep & (q_idx - kv_idx < window) if window is not None else keep

    expected = create_block_mask(mask_mod, None, None, total, total, device="cpu", BLOCK_SIZE=16)
    partial, full = tile_masks(cu, total, window, block=16, causal=causal)
    nb = partial.shape[0]
    dense = expected.to_dense()[0, 0, :nb, :nb].bool()  # full and partial tiles
    assert torch.equal(partial | full, dense), (cu.tolist(), window)
    full_expected = torch.zeros(nb, nb, dtype=torch.bool)
    counts, idx = expected.full_kv_num_blocks[0, 0], expected.full_kv_indices[0, 0]
    for r in range(nb):
        full_expected[r, idx[r, : counts[r]].long()] = True
    assert torch.equal(full, full_expected)


@torch.library.custom_op("hbp_test::block_mask_in_op", mutates_args=())
def _block_mask_in_op(cu: torch.Tensor, x: torch.Tensor, window: int) -> torch.Tensor:
    mask = flex.build_block_mask(cu, x.shape[0], window or None, block=16)
    return x * mask.q_num_blocks.sum()


@_block_mask_in_op.register_fake
def _(cu, x, window):
    return torch.empty_like(x)


@pytest.mark.parametrize("window", [None, 20])
def test_a_block_mask_is_built_inside_a_compiled_graphs_op_with_torchs_query_lists(window):
    """The attention op builds its BlockMask while a compiled graph runs; torch's ``from_kv_blocks`` derives
    the query-side lists under vmap, which fails there ("Cannot access storage of BatchedTensorImpl": flex
    under torch.compile failed on an H100). Built from the transposed tiles, they equal torch's own, in
    torch's row-major layout too: the GPU kernels read the lists by their rows' strides, so column-major
    lists (a sort of the transposed tiles keeps its strides) gave wrong gradients on an H100 wherever a
    key block had several query blocks, and CPU flex (which does not read them) passed."""
    from torch.nn.attention.flex_attention import BlockMask

    cu = torch.tensor([0, 37, 40, 150, 190], dtype=torch.int32)
    mask = flex.build_block_mask(cu, 190, window, block=16)
    torchs = BlockMask.from_kv_blocks(
        mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices, BLOCK_SIZE=16
    )
    names = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    for name in names:
        assert torch.equal(getattr(mask, name), getattr(torchs, name)), name
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", *names):
        assert getattr(mask, name).is_contiguous(), name
    x = torch.ones(190)
    got = torch.compile(lambda cu, x: _block_mask_in_op(cu, x, window or 0) + 1, fullgraph=True)(cu, x)
    assert torch.equal(got, x * mask.q_num_blocks.sum() + 1)


# ------------------------------------------------------------------- choice, versions faked on CPU


def fake_kernel(q, k, v, cu, scale=None, left=-1, right=-1, causal=False, softcap=0.0, sinks=None):
    """Reference semantics of a varlen kernel in [T, H, D] layout: window (left, right), -1 or None
    unbounded; causal caps right at 0."""
    assert q.dim() == 3 and cu.dtype == torch.int32
    total = q.shape[0]
    cu_l = cu.tolist()
    doc = np.repeat(np.arange(len(cu_l) - 1), np.diff(cu_l))
    i = np.arange(total)
    dist = i[:, None] - i[None, :]
    keep = doc[:, None] == doc[None, :]
    if left is not None and left >= 0:
        keep &= dist <= left
    if causal:
        right = 0
    if right is not None and right >= 0:
        keep &= -dist <= right
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.transpose(0, 1).double() for x in (q, k, v))
    kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
    s = qd @ kd.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~torch.as_tensor(keep), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().reshape(-1, 1, 1).expand(-1, total, 1)], -1)
        p = torch.softmax(s, -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return (p @ vd).transpose(0, 1).to(q.dtype)


def varlen_210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    assert query.shape[1] == key.shape[1], "torch 2.10 has no GQA"
    return fake_kernel(query, key, value, cu_seq_q, causal=is_causal)


def varlen_211(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    assert query.shape[1] == key.shape[1], "torch 2.11 has no enable_gqa"
    return fake_kernel(query, key, value, cu_seq_q, scale, *window_size)


def varlen_213(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
    enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    assert enable_gqa or query.shape[1] == key.shape[1]
    return fake_kernel(query, key, value, cu_seq_q, scale, *window_size)


TORCH_VARLEN = {"2.10": varlen_210, "2.11": varlen_211, "2.13": varlen_213}


def fake_installed(monkeypatch, installed) -> None:
    """``installed(module)`` as what each backend family asks before its probe."""
    for family in (flash, torch_varlen, flex):
        monkeypatch.setattr(family, "installed", installed)


@pytest.fixture
def no_flash(monkeypatch):
    """A machine with torch but no flash-attn of any version."""
    fake_installed(monkeypatch, lambda m: m.startswith("torch."))


@pytest.mark.parametrize("version", sorted(TORCH_VARLEN))
def test_every_torch_version_picks_its_varlen_kernel_for_bf16_on_cuda(monkeypatch, no_flash, version):
    import torch.nn.attention.varlen as varlen_module

    monkeypatch.setattr(varlen_module, "varlen_attn", TORCH_VARLEN[version])
    assert choose("cuda", torch.bfloat16, frozenset())[0] == "torch_varlen"
    assert choose("cuda", torch.float16, frozenset())[0] == "torch_varlen"
    name, skipped = choose("cuda", torch.bfloat16, frozenset({"window"}))
    if version == "2.10":
        assert name == "flex" and "does not support window" in skipped["torch_varlen"]
    else:
        assert name == "torch_varlen"
    name, skipped = choose("cuda", torch.float32, frozenset())
    assert name == "flex" and "fp16/bf16 only" in skipped["torch_varlen"]
    assert choose("cuda", torch.bfloat16, frozenset({"softcap"}))[0] == "flex"
    assert choose("cuda", torch.bfloat16, frozenset({"dropout"}))[0] == "sdpa"
    assert choose("cpu", torch.bfloat16, frozenset())[0] == "sdpa"
    assert choose("cpu", torch.float32, frozenset({"sinks"}))[0] == "eager"

    # The adapter: scale (pre-scaled q where the keyword is missing), GQA (k/v repeated where
    # enable_gqa is missing) and the window convention give the definition's numbers.
    q, k, v, cu = random_pack(3, hq=4, hkv=2)
    for window in (None, 6):
        if window is not None and version == "2.10":
            continue
        args = AttnArgs(torch.tensor(cu, dtype=torch.int32), max(np.diff(cu)), 0.27, window=window)
        out = REGISTRY["torch_varlen"].run(q, k, v, args)
        torch.testing.assert_close(out.double(), dense_reference(q, k, v, cu, 0.27, window), atol=1e-5, rtol=1e-5)


def flash2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
           causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
           return_attn_probs=False, block_table=None):  # fmt: skip
    assert dropout_p == 0.0
    return fake_kernel(q, k, v, cu_seqlens_q, softmax_scale, *window_size, causal=causal, softcap=softcap)


def flash3(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
           softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
           sm_margin=0):  # fmt: skip
    out = fake_kernel(q, k, v, cu_seqlens_q, softmax_scale, *window_size, causal=causal, softcap=softcap)
    return out, torch.zeros(q.shape[1], q.shape[0])  # early flash-attn 3 builds return (out, lse)


def flash4(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
           seqused_k=None, page_table=None, softmax_scale=None, causal=False, softcap=0.0,
           window_size=(None, None), learnable_sink=None, num_splits=1, pack_gqa=None):  # fmt: skip
    out = fake_kernel(q, k, v, cu_seqlens_q, softmax_scale, *window_size, causal=causal, softcap=softcap,
                      sinks=learnable_sink)  # fmt: skip
    return out, torch.zeros(q.shape[1], q.shape[0])


def install_fake(monkeypatch, module: str, fn) -> None:
    mod = types.ModuleType(module)
    mod.__spec__ = importlib.machinery.ModuleSpec(module, None)
    mod.flash_attn_varlen_func = fn
    monkeypatch.setitem(sys.modules, module, mod)


BOTH_WAYS = ["sdpa", "eager", "flex", "torch_varlen 2.10", "torch_varlen 2.11", "torch_varlen 2.13", "flash_attn",
             "flash_attn_3", "flash_attn_4"]  # fmt: skip


@pytest.mark.parametrize("kernel", BOTH_WAYS)
def test_every_backend_attends_both_ways_inside_each_document_when_asked(monkeypatch, kernel):
    """``AttnArgs(causal=False)`` (a vision tower's images, ``lit_hbp.model.attention.tower``): each backend's run,
    the GPU kernels as their upstream signatures on CPU (flex: its CPU forward), gives the dense reference
    with every key of the document seen, the output's gradients too where CPU differentiates it."""
    from torch.nn.attention.flex_attention import flex_attention

    name, _, version = kernel.partition(" ")
    if version:
        import torch.nn.attention.varlen as varlen_module

        monkeypatch.setattr(varlen_module, "varlen_attn", TORCH_VARLEN[version])
    fakes = {"flash_attn": ("flash_attn", flash2), "flash_attn_3": ("flash_attn_interface", flash3),
             "flash_attn_4": ("flash_attn.cute", flash4)}  # fmt: skip
    if name in fakes:
        install_fake(monkeypatch, *fakes[name])
    q, k, v, cu = random_pack(5, hq=4, hkv=4 if version in ("2.10", "2.11") else 2)
    grads = name in ("sdpa", "eager")  # the GPU kernels' backward is theirs (flex has none on CPU)
    ins = [x.clone().requires_grad_(grads) for x in (q, k, v)]
    args = AttnArgs(torch.tensor(cu, dtype=torch.int32), max(np.diff(cu)), 0.31, causal=False)
    run = (lambda *a: flex.flex_run(*a, fn=flex_attention)) if name == "flex" else REGISTRY[name].run
    out = run(*ins, args)
    ref_in = [x.clone().double().requires_grad_() for x in (q, k, v)]
    ref = dense_reference(*ref_in, cu, 0.31, causal=False)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ref, dense_reference(q, k, v, cu, 0.31)), "both ways differs from causal"
    if grads:
        w = torch.randn_like(ref)
        (out.double() * w).sum().backward()
        (ref * w).sum().backward()
        for a, b in zip(ins, ref_in):
            torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="no sliding window"):
        AttnArgs(args.cu, args.max_len, 0.31, window=4, causal=False)


def test_flash_attn_versions_are_preferred_and_adapted(monkeypatch):
    fake_installed(monkeypatch, lambda m: m in sys.modules or m.startswith("torch"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100: all three run
    backends.reset_probes()
    # The fakes come without dist-info: flash-attn 4 as its newest release (installs: test_backend_install.py).
    monkeypatch.setattr(flash, "_flash4_version", lambda: Version("4.0.0b27"))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    install_fake(monkeypatch, "flash_attn", flash2)
    assert choose("cuda", torch.bfloat16, frozenset({"window", "softcap", "dropout"}))[0] == "flash_attn"
    assert choose("cuda", torch.bfloat16, frozenset({"sinks"}))[0] == "flex"
    assert choose("cuda", torch.float32, frozenset())[0] == "flex"
    install_fake(monkeypatch, "flash_attn_interface", flash3)
    install_fake(monkeypatch, "flash_attn.cute", flash4)
    assert choose("cuda", torch.bfloat16, frozenset({"window", "softcap"}))[0] == "flash_attn_3"
    name, skipped = choose("cuda", torch.bfloat16, frozenset({"sinks"}))
    assert name == "flash_attn_4" and "does not support sinks" in skipped["flash_attn_3"]
    assert choose("cuda", torch.bfloat16, frozenset({"dropout"}))[0] == "flash_attn"

    q, k, v, cu = random_pack(4)
    cases = {
        "flash_attn": dict(window=5, softcap=2.0),
        "flash_attn_3": dict(window=9),
        "flash_attn_4": dict(softcap=1.0, sinks=torch.tensor([0.5, 1.0, -1.0, 0.0])),
    }
    for name, feats in cases.items():
        args = AttnArgs(torch.tensor(cu, dtype=torch.int32), max(np.diff(cu)), 0.35, **feats)
        out = REGISTRY[name].run(q, k, v, args)
        ref = dense_reference(q, k, v, cu, 0.35, **feats)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=name)


def test_each_models_choice_is_logged_once_with_the_reasons_and_a_forced_backend_is_checked(monkeypatch):
    """The choice is the model's: logged the first time each model makes such a call (a second model
    logs its own), listed by ``choices(model)`` for that model only; a forced backend that cannot run
    the call is refused naming why, and an unknown name is refused where the model is prepared."""
    from test_packed_loss import tiny_model

    lines = []
    monkeypatch.setattr(dispatch, "rank_zero_info", lines.append)
    first, second = prepare_model(tiny_model()), prepare_model(tiny_model(), attn_backend="eager")
    owner = record_of(first).owner
    assert attention.backend_for("cpu", torch.float32, frozenset({"softcap"}), "auto", owner) == "eager"
    assert attention.backend_for("cpu", torch.float32, frozenset({"softcap"}), "auto", owner) == "eager"
    (line,) = lines
    assert "eager backend for torch.float32 on cpu with softcap" in line
    assert "not sdpa: does not support softcap" in line and "not flex: CUDA only" in line
    (chosen,) = attention.choices(first)  # what a run or a benchmark reports: the logged line's parts
    assert (chosen["device"], chosen["dtype"], chosen["needs"], chosen["backend"]) == (
        "cpu",
        "float32",
        "softcap",
        "eager",
    )
    assert chosen["why"] in line and chosen["why"].startswith("not ")
    assert attention.choices(second) == []
    attention.backend_for("cpu", torch.float32, frozenset({"softcap"}), "eager", record_of(second).owner)
    assert len(lines) == 2 and [c["why"] for c in attention.choices(second)] == ["forced"]
    with pytest.raises(ValueError, match="attention backend 'flex' cannot run torch.float32 on cpu: CUDA only"):
        attention.backend_for("cpu", torch.float32, frozenset(), "flex", owner)
    with pytest.raises(ValueError, match="must be one of"):
        prepare_model(tiny_model(), attn_backend="flash")
    with pytest.raises(ValueError, match="is not prepared"):
        attention.choices(tiny_model())


class Layer(torch.nn.Module):
    training = False


def test_autocast_runs_attention_in_the_autocast_dtype(monkeypatch):
    """Rotary embeddings leave q and k in fp32 under autocast while v is bf16: the kernel is chosen,
    and runs, for bf16."""
    seen = []
    real = attention._attend

    def spy(q, k, v, args, backend="auto", owner=0):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, args, backend, owner)

    monkeypatch.setattr(attention, "_attend", spy)
    q, k, v, cu = random_pack(5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention.varlen_attention(
            Layer(), q, k, v.bfloat16(), None, scaling=0.3, cu_seq_lens_q=torch.tensor(cu), max_length_q=40
        )
    assert seen == [(torch.bfloat16,) * 3] and out.dtype == torch.bfloat16
    ref = dense_reference(q, k, v, cu, 0.3).transpose(1, 2)
    torch.testing.assert_close(out.double(), ref, atol=0.05, rtol=0.05)


# ---------------------------------------------------------------------------------- on a GPU

CUDA_BACKENDS = ["flash_attn_3", "flash_attn_4", "flash_attn", "torch_varlen", "flex", "sdpa", "eager"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dim", [64, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", sorted(FEATURE_CASES))
@pytest.mark.parametrize("name", CUDA_BACKENDS)
def test_cuda_backends_match_the_fp32_definition_with_gradients(name, case, dtype, dim):
    """Outputs and q/k/v gradients of every backend that can run the case against the eager
    definition in fp64 on the same inputs: a 6K pack of 60 chat-sized and 2 long documents, 8 query
    heads over 2 kv heads, head_dim 64, and 16 (the tiny families' shape: GPT-OSS's self-check was refused
    on an H100 with flex at head_dim 16) for the plain and all-features cases. Tolerances: fp32 1e-3
    relative to the largest value (TF32 off), bf16 2e-2."""
    if dim != 64 and case not in ("plain", "all"):
        pytest.skip("head_dim 16: the plain and all-features cases only")
    feats = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in FEATURE_CASES[case].items()}
    if "sinks" in feats:
        feats["sinks"] = torch.linspace(-1, 2, 8, device="cuda")
    needs = AttnArgs(torch.zeros(2), 1, 1.0, **feats).needs
    reason = backends.why_not(name, "cuda", dtype, needs)
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    torch.backends.cuda.matmul.allow_tf32 = False
    rng = np.random.default_rng(0)
    lengths = np.r_[rng.integers(8, 120, 60), 1500, 900]
    rng.shuffle(lengths)
    cu = np.r_[0, np.cumsum(lengths)]
    total, hq, hkv = int(cu[-1]), 8, 2
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, hq, total, dim, device="cuda", generator=g)
    k, v = (torch.randn(1, hkv, total, dim, device="cuda", generator=g) for _ in range(2))
    rounded = [x.to(dtype) for x in (q, k, v)]  # (in fp32 the inputs themselves: leaves of their own below)
    ins = [x.clone().requires_grad_() for x in rounded]
    ref_in = [x.double().requires_grad_() for x in rounded]
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    args = AttnArgs(cu_t, int(lengths.max()), dim**-0.5, **feats)
    out = REGISTRY[name].run(*ins, args)
    ref_args = AttnArgs(
        cu_t, int(lengths.max()), dim**-0.5, **{k: (v.double() if torch.is_tensor(v) else v) for k, v in feats.items()}
    )
    ref = loops.eager_run(*ref_in, ref_args)
    w = torch.randn_like(ref)
    (out.double() * w).sum().backward()
    (ref * w).sum().backward()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    for got, want in [(out, ref), *((a.grad, b.grad) for a, b in zip(ins, ref_in))]:
        err = (got.double() - want).abs().max().item() / want.abs().max().item()
        assert err < tol, (name, case, dtype, err)


@pytest.mark.parametrize(
    "head_dim, want", [(4, "sdpa"), (12, "sdpa"), (64, "torch_varlen"), (256, "torch_varlen"), (512, "sdpa")]
)
def test_a_head_dim_the_flash_kernels_cannot_run_takes_a_loop_on_cuda(head_dim, want):
    """torch's varlen kernel (and flash-attn's) run head dims that are multiples of 8 up to 256 and stop
    with "head_size must be a multiple of 8" otherwise (seen on an H200 with a 4-wide head): such a call
    takes the next backend that runs it, and a model prepared with torch_varlen is refused by name."""
    if backends.why_not("torch_varlen", "cuda", torch.bfloat16, frozenset()) is not None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    q = torch.empty(1, 2, 5, head_dim, device="meta")
    needs = call_needs(q, AttnArgs(torch.zeros(2), 1, 1.0))
    name, why = backends.decide("auto", "cuda", torch.bfloat16, needs)
    flash = {n for n in backends.REGISTRY if n.startswith("flash")}
    assert name == want or (name in flash and want == "torch_varlen"), (name, why)
    if want == "sdpa":
        assert "not torch_varlen: does not support a head dim" in why and "not flex: does not support a head dim" in why
        with pytest.raises(ValueError, match="attention backend 'torch_varlen' cannot run .* a head dim"):
            backends.decide("torch_varlen", "cuda", torch.bfloat16, needs)
    # on CPU the loops keep their LSE kernels whatever the head dim: nothing recomputed
    assert backends.lse_why_not("sdpa", "cpu", needs) is None
    assert backends.lse_why_not("eager", "cpu", needs) is None


def _recorder(signature: str, calls: list, result: str):
    """A function with an upstream flash-attn signature (``flash_installs.SIGNATURES``) recording its arguments."""
    scope = {"torch": torch, "calls": calls, "Optional": __import__("typing").Optional, "Tuple": tuple}
    exec(f"{signature}\n    calls.append(dict(locals()))\n    return {result}", scope)
    return scope[signature.split("(")[0].removeprefix("def ")]


@pytest.mark.parametrize("asked", ["none", "torch", "hf_env"])
def test_flash_kernels_run_deterministically_where_asked(asked, monkeypatch):
    """``Trainer(deterministic=True)`` (torch's switch) and Hugging Face's ``FLASH_ATTENTION_DETERMINISTIC=1`` were
    not read: the flash-attn backward ran its atomic (non-deterministic) kernels, where HF's flash path honours its
    switch. Each call now passes ``deterministic`` as asked (flash-attn 2.8.3's signatures, recorded)."""
    from flash_installs import SIGNATURES

    varlen, _, bwd = SIGNATURES["v2.8.3"]
    calls, bwd_calls = [], []
    monkeypatch.setattr(flash, "_flash_fn", lambda name: _recorder(varlen, calls, "torch.zeros_like(q)"))
    bwd_fn = _recorder(bwd, bwd_calls, "None")
    monkeypatch.setattr(flash, "_flash_lse_fns", lambda name: (None, bwd_fn))
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    if asked == "hf_env":
        monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(asked == "torch")
    try:
        q, k, v, cu = random_pack(1)
        args = AttnArgs(torch.tensor(cu, dtype=torch.int32), max(np.diff(cu)), 0.3)
        flash._flash_run("flash_attn")(q, k, v, args)
        lse = torch.zeros(q.shape[1], q.shape[2])
        flash._flash2_backward(torch.zeros_like(q), q, k, v, torch.zeros_like(q), lse, args)
    finally:
        torch.use_deterministic_algorithms(before)
    assert calls[0].get("deterministic", False) == (asked != "none")
    assert bwd_calls[0]["deterministic"] == (asked != "none")


def test_a_prepared_model_keeps_its_backend_unless_another_is_named():
    """``prepare_model(model)`` again (``with prepared(model):`` does it) reset a model prepared with a backend to
    ``auto``; and one prepared again with another backend listed in ``choices`` what its calls ran before, with the
    old backend. A model keeps its backend unless another is named; a new one empties its list."""
    from test_packed_loss import samples, tiny_model

    from lit_hbp import pack_samples, packed_loss, prepared

    model = prepare_model(tiny_model(), attn_backend="eager")
    batch = pack_samples(samples())
    for again in (lambda: prepare_model(model), lambda: prepared(model).__enter__()):
        again()
        assert record_of(model).backend == "eager"
        packed_loss(model, batch, "sum")
        assert [(c["backend"], c["why"]) for c in attention.choices(model)] == [("eager", "forced")]
    prepare_model(model, attn_backend="sdpa")
    assert attention.choices(model) == []
    packed_loss(model, batch, "sum")
    assert [(c["backend"], c["why"]) for c in attention.choices(model)] == [("sdpa", "forced")]
