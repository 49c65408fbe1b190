"""Attention kernels with separate query and key lengths (context parallelism): query range [a, b)
of a document against its keys [0, b), causal bottom-right. The CPU loops against a brute-force
reference over random ranges (forward and gradients), the CUDA adapters (flash-attn 2/3/4, torch's
varlen) with fakes of their real signatures, Flex's block mask against the element-wise mask."""

import importlib.machinery
import sys
import types
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_hbp.model.attention import backends, flash, flex, kernel, loops, torch_varlen
from lit_hbp.model.attention.backends import REGISTRY
from lit_hbp.model.attention.flex import cross_block_mask
from lit_hbp.model.attention.kernel import AttnArgs


def ranges_case(draw_lengths, draw_cuts, seed: int):
    """Documents of the given lengths, each contributing query ranges [a, b) (keys [0, b))."""
    rng = np.random.default_rng(seed)
    q_rows, k_rows, seen = [], [], []  # per range: its queries' document positions, its key positions
    for length, cuts in zip(draw_lengths, draw_cuts):
        bounds = sorted({0, length, *[c % (length + 1) for c in cuts]})
        for a, b in zip(bounds[:-1], bounds[1:]):
            if rng.random() < 0.7:  # a CP rank holds some of a document's ranges, not all
                q_rows.append(np.arange(a, b))
                k_rows.append(np.arange(0, b))
                seen.append((a, b))
    return q_rows, k_rows, seen


def reference(q, k, v, q_pos, k_len, scale, window=None, softcap=None, sinks=None):
    """Each query alone: the keys of its range it sees, by the definition (fp64)."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[1], q.shape[2], q.shape[3], dtype=torch.float64)
    row = key0 = 0
    for pos, m in zip(q_pos, k_len):
        for p in pos:
            keys = [t for t in range(m) if t <= p and (window is None or p - t < window)]
            ks = k[0, :, [key0 + t for t in keys]].double().repeat_interleave(group, 0)
            vs = v[0, :, [key0 + t for t in keys]].double().repeat_interleave(group, 0)
            s = (q[0, :, row].double()[:, None, :] @ ks.transpose(-1, -2))[:, 0] * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            if sinks is not None:
                s = torch.cat([s, sinks.double()[:, None]], -1)
                p_ = torch.softmax(s, -1)[:, :-1]
            else:
                p_ = torch.softmax(s, -1)
            out[:, row] = (p_[:, None, :] @ vs)[:, 0]
            row += 1
        key0 += m
    return out[None]


def inputs(q_rows, k_rows, hq=4, hkv=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(map(len, q_rows)), sum(map(len, k_rows))
    q = torch.randn(1, hq, tq, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, hkv, tk, dim, generator=g, dtype=torch.float64) for _ in range(2))
    cu_q = torch.tensor(np.r_[0, np.cumsum([len(r) for r in q_rows])], dtype=torch.int32)
    cu_k = torch.tensor(np.r_[0, np.cumsum([len(r) for r in k_rows])], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


lengths = st.lists(st.integers(1, 12), min_size=1, max_size=4)


@settings(max_examples=25, deadline=None)
@given(lengths=lengths, cuts=st.lists(st.lists(st.integers(0, 20), max_size=3), min_size=4, max_size=4),
       seed=st.integers(0, 10**6), feature=st.sampled_from(["plain", "window", "wide window", "softcap", "sinks"]),
       repeat_kv=st.booleans())  # fmt: skip
def test_cpu_kernels_compute_bottom_right_causal_ranges(lengths, cuts, seed, feature, repeat_kv):
    """``repeat_kv``: as a torch whose CPU flash kernel takes no fewer key/value heads than query heads (K/V
    repeated per document). A wide window (9) is often at least a document's keys: the unmasked split."""
    q_rows, k_rows, _ = ranges_case(lengths, cuts, seed)
    if not q_rows:
        return
    with mock.patch.object(loops, "_cpu_flash_takes_gqa", lambda: not repeat_kv):
        check_cpu_kernels(q_rows, k_rows, seed, feature)


def check_cpu_kernels(q_rows, k_rows, seed, feature):
    q, k, v, cu_q, cu_k = inputs(q_rows, k_rows, seed=seed)
    feats = {
        "plain": {},
        "window": {"window": 3},
        "wide window": {"window": 9},
        "softcap": {"softcap": 1.5},
        "sinks": {"sinks": torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=torch.float64)},
    }[feature]
    want = reference(q, k, v, q_rows, [len(r) for r in k_rows], 0.4, **feats)
    for name in ("sdpa", "eager"):
        if set(feats) - REGISTRY[name].supports():
            continue
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        args = AttnArgs(cu_q, max(map(len, q_rows)), 0.4, cu_k=cu_k, max_len_k=max(map(len, k_rows)), **feats)
        got = REGISTRY[name].run(*leaves, args)
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10, msg=name)
        # Gradients: the same kernel against the reference, through autograd.
        ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        w = torch.randn_like(want)
        (got * w).sum().backward()
        (reference(*ref_leaves, q_rows, [len(r) for r in k_rows], 0.4, **feats) * w).sum().backward()
        for a, b in zip(leaves, ref_leaves):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=1e-10, msg=name)
        # The same call as a forward keeping the LSE and a backward from it (context parallelism).
        if backends.lse_why_not(name, "cpu", args.needs) is None:
            out, lse = REGISTRY[name].lse.forward(q, k, v, args)
            torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10, msg=name)
            assert lse.shape == q.shape[1:3] and lse.dtype == kernel.lse_dtype(q.dtype), name  # the op's fake
            sink_leaf = [feats["sinks"].clone().requires_grad_()] if "sinks" in feats else []
            ref_out = reference(*ref_leaves, q_rows, [len(r) for r in k_rows], 0.4,
                                **{**feats, **({"sinks": sink_leaf[0]} if sink_leaf else {})})  # fmt: skip
            grads = REGISTRY[name].lse.backward(w, q, k, v, out, lse, args)
            want_grads = torch.autograd.grad(ref_out, [*ref_leaves, *sink_leaf], w)
            assert (grads[3] is None) == (not sink_leaf)
            for got, ref in zip([g for g in grads if g is not None], want_grads):
                torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10, msg=f"{name} from its LSE")


def test_equal_lengths_are_plain_self_attention():
    q_rows = k_rows = [np.arange(5), np.arange(7)]
    q, k, v, cu, _ = inputs(q_rows, k_rows)
    for name in ("sdpa", "eager"):
        plain = REGISTRY[name].run(q, k, v, AttnArgs(cu, 7, 0.3))
        cross = REGISTRY[name].run(q, k, v, AttnArgs(cu, 7, 0.3, cu_k=cu, max_len_k=7))
        torch.testing.assert_close(cross, plain, atol=0, rtol=0)


# --------------------------------------------------------------------- CUDA adapters, faked on CPU


def cross_kernel(q, k, v, cu_q, cu_k, scale, left=-1, causal=False, softcap=0.0, sinks=None):
    """A varlen kernel in [T, H, D] layout with flash-attn's semantics: causal (and a left window)
    aligned bottom-right when a segment has more keys than queries."""
    assert causal and q.dim() == 3 and cu_q.dtype == cu_k.dtype == torch.int32
    n_q, n_k = np.diff(cu_q.tolist()), np.diff(cu_k.tolist())
    q_pos = [np.arange(m - n, m) for n, m in zip(n_q, n_k)]
    window = None if left is None or left < 0 else left + 1
    out = reference(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], q_pos, n_k,
                    scale, window, softcap or None, sinks)  # fmt: skip
    return out[0].transpose(0, 1).to(q.dtype)


def flash2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
           causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
           return_attn_probs=False, block_table=None):  # fmt: skip
    CALLS.append(dict(cu_k=cu_seqlens_k, max_k=max_seqlen_k))
    return cross_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_size[0], causal, softcap)


def flash3(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
           softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
           sm_margin=0):  # fmt: skip
    CALLS.append(dict(cu_k=cu_seqlens_k, max_k=max_seqlen_k))
    out = cross_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_size[0], causal, softcap)
    return out, torch.zeros(q.shape[1], q.shape[0])


def flash4(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
           seqused_k=None, page_table=None, softmax_scale=None, causal=False, softcap=0.0,
           window_size=(None, None), learnable_sink=None, num_splits=1, pack_gqa=None):  # fmt: skip
    CALLS.append(dict(cu_k=cu_seqlens_k, max_k=max_seqlen_k))
    out = cross_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_size[0], causal, softcap,
                       learnable_sink)  # fmt: skip
    return out, torch.zeros(q.shape[1], q.shape[0])


def varlen_213(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
    enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    CALLS.append(dict(cu_k=cu_seq_k, max_k=max_k))
    assert window_size[1] == 0, "causal"
    return cross_kernel(query, key, value, cu_seq_q, cu_seq_k, scale, window_size[0], True)


CALLS: list[dict] = []


def install_fake(monkeypatch, module: str, fn) -> None:
    mod = types.ModuleType(module)
    mod.__spec__ = importlib.machinery.ModuleSpec(module, None)
    mod.flash_attn_varlen_func = fn
    monkeypatch.setitem(sys.modules, module, mod)


@pytest.mark.parametrize(
    "name, fake, feats",
    [
        ("flash_attn", flash2, dict(window=3, softcap=2.0)),
        ("flash_attn_3", flash3, dict(window=4)),
        ("flash_attn_4", flash4, dict(sinks=torch.tensor([0.5, 1.0, -1.0, 0.0], dtype=torch.float64))),
        ("torch_varlen", varlen_213, dict(window=3)),
    ],
)
def test_cuda_adapters_pass_the_key_documents(monkeypatch, name, fake, feats):
    if name == "torch_varlen":
        import torch.nn.attention.varlen as varlen_module

        monkeypatch.setattr(varlen_module, "varlen_attn", fake)
    else:
        install_fake(monkeypatch, backends.FLASH_MODULES[name][0], fake)
    CALLS.clear()
    q_rows, k_rows = [np.arange(3, 7), np.arange(0, 2), np.arange(5, 9)], [np.arange(7), np.arange(2), np.arange(9)]
    q, k, v, cu_q, cu_k = inputs(q_rows, k_rows)
    args = AttnArgs(cu_q, 4, 0.35, cu_k=cu_k, max_len_k=9, **feats)
    out = REGISTRY[name].run(q, k, v, args)
    assert torch.equal(CALLS[-1]["cu_k"], cu_k) and CALLS[-1]["max_k"] == 9
    want = reference(q, k, v, q_rows, [7, 2, 9], 0.35, **feats)
    torch.testing.assert_close(out.double(), want, atol=1e-10, rtol=1e-10)


# ------------------------------------------------------------------------------------- Flex


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=4),
       cuts=st.lists(st.lists(st.integers(0, 400), max_size=3), min_size=4, max_size=4),
       seed=st.integers(0, 10**6), window=st.sampled_from([None, 20, 200]))  # fmt: skip
def test_flex_cross_mask_equals_the_element_mask(lengths, cuts, seed, window):
    """Every (query, key) pair the block mask lets through is decided by the mask function, which
    equals the definition; no pair that attends sits in a skipped tile (tiles of 32)."""
    q_rows, k_rows, _ = ranges_case(lengths, cuts, seed)
    if not q_rows:
        return
    _, _, _, cu_q, cu_k = inputs(q_rows, k_rows, hq=1, hkv=1, dim=1)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    mask = cross_block_mask(cu_q, cu_k, tq, tk, window, block=32)
    qi, ki = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
    element = mask.mask_mod(0, 0, qi, ki)
    want = torch.zeros(tq, tk, dtype=torch.bool)
    row = key0 = 0
    for pos, keys in zip(q_rows, k_rows):
        p, t = torch.as_tensor(pos)[:, None], torch.as_tensor(keys)[None, :]
        want[row : row + len(pos), key0 : key0 + len(keys)] = (t <= p) & ((p - t < window) if window else True)
        row += len(pos)
        key0 += len(keys)
    assert torch.equal(element, want)
    tiles = mask.to_dense()[0, 0].bool()  # [query blocks, key blocks] the kernel visits
    visited = tiles.repeat_interleave(32, 0)[:tq].repeat_interleave(32, 1)[:, :tk]
    assert not (want & ~visited).any()


def test_flex_runs_cross_ranges_on_cpu_forward():
    """FlexAttention's CPU forward (no backward on CPU) with the cross mask equals the reference."""
    from torch.nn.attention.flex_attention import flex_attention

    q_rows, k_rows = [np.arange(40, 70), np.arange(0, 20)], [np.arange(70), np.arange(20)]
    q, k, v, cu_q, cu_k = inputs(q_rows, k_rows, hq=2, hkv=2)
    q, k, v = (x.float() for x in (q, k, v))
    out = flex.flex_run(q, k, v, AttnArgs(cu_q, 30, 0.3, cu_k=cu_k, max_len_k=70), fn=flex_attention)
    want = reference(q, k, v, q_rows, [70, 20], 0.3)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------- forward with the LSE, backward from it
#
# Fakes of the private functions each library's autograd calls, with the upstream signatures
# (flash-attn 2.6.3 and 2.8.3 flash_attn/flash_attn_interface.py, hopper/flash_attn_interface.py,
# flash_attn/cute/interface.py, torch 2.13 torch/nn/attention/varlen.py). Their backward computes the
# gradients from the LSE it is handed (the reference formulas), so a wrong or stale LSE fails.

LSE_CALLS: list[tuple[str, dict]] = []


def _lse_args(cu_q, cu_k, max_q, max_k, scale, left=-1, softcap=None, sinks=None):
    window = None if left is None or left < 0 else left + 1
    return AttnArgs(cu_q, max_q, scale, window, softcap or None, sinks, 0.0, cu_k, max_k)


def _fake_forward(q, k, v, args, **seen):
    LSE_CALLS.append(("forward", seen))
    out, lse = loops._eager_forward(*(kernel.unflat(x) for x in (q, k, v)), args)
    return kernel.flat(out), lse


def _fake_backward(dout, q, k, v, out, lse, args, **seen):
    LSE_CALLS.append(("backward", seen))
    return loops._eager_backward(*(kernel.unflat(x) for x in (dout, q, k, v, out)), lse, args)


def flash2_8_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                 window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
                 block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False):  # fmt: skip
    assert causal and dropout_p == 0 and q.shape[-1] % 8 == 0, "flash-attn 2 needs head dims of multiples of 8"
    args = _lse_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_size_left, softcap)
    out, lse = _fake_forward(q, k, v, args, window=(window_size_left, window_size_right))
    return out, lse, torch.empty(0), torch.zeros(2, dtype=torch.int64)


def flash2_8_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
                 deterministic, rng_state=None, zero_tensors=False):  # fmt: skip
    assert causal and dropout_p == 0 and q.shape[-1] % 8 == 0
    args = _lse_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_size_left, softcap)
    grads = _fake_backward(dout, q, k, v, out, softmax_lse, args, window=(window_size_left, window_size_right))
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(kernel.flat(g))
    return torch.empty(0)  # softmax_d


def flash2_6_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                 window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False, block_table=None,
                 leftpad_k=None, seqused_k=None):  # fmt: skip
    out, lse, s_dmask, rng = flash2_8_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                         softmax_scale, causal, *window_size, softcap)  # fmt: skip
    return out, q, k, v, out, lse, s_dmask, rng


def flash2_6_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                 rng_state=None):  # fmt: skip
    flash2_8_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 dropout_p, softmax_scale, causal, *window_size, softcap, alibi_slopes, deterministic)  # fmt: skip
    return dq, dk, dv, torch.empty(0)


def flash3_fwd(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, cu_seqlens_k=None,
               cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
               page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None,
               seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
               window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0, rotary_interleaved=True,
               scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):  # fmt: skip
    assert causal
    args = _lse_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_size_left, softcap)
    out, lse = _fake_forward(q, k, v, args, window=(window_size_left, window_size_right))
    return out, lse, torch.empty(0), torch.empty(0)


def flash3_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None, sequed_k=None,
               max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None, softmax_scale=None, is_causal=False,
               window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0):  # fmt: skip
    assert is_causal
    args = _lse_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_size_left, softcap)
    grads = _fake_backward(dout, q, k, v, out, softmax_lse, args, window=(window_size_left, window_size_right))
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(kernel.flat(g))
    return torch.empty(0)


def flash4_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
               max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
               causal=False, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
               tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384, num_splits=1, pack_gqa=None,
               _arch=None, score_mod=None, mask_mod=None, block_sparse_tensors=None, return_lse=False, out=None,
               lse=None, aux_tensors=None, aux_scalars=None, q_descale=None, k_descale=None, v_descale=None,
               gather_kv_indices=None, scheduler_metadata=None, seqlen_k_per_split=None,
               disable_scheduler_metadata=False):  # fmt: skip
    assert causal and return_lse
    args = _lse_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_size_left, softcap,
                     learnable_sink)  # fmt: skip
    out, lse = _fake_forward(q, k, v, args, window=(window_size_left, window_size_right), softcap=softcap)
    return out, lse, None, None


def flash4_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
               window_size_right=None, m_block_size=64, n_block_size=128, num_threads=256, pack_gqa=False,
               num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False,
               AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2, V_in_regs=False, cu_seqlens_q=None,
               cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
               deterministic=False, dq=None, dk=None, dv=None, score_mod=None, score_mod_bwd=None, mask_mod=None,
               aux_tensors=None, aux_scalars=None, block_sparse_tensors=None, dlse=None,
               learnable_sink=None):  # fmt: skip
    assert causal
    args = _lse_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_size_left, softcap,
                     learnable_sink)  # fmt: skip
    dq, dk, dv, dsink = _fake_backward(dout, q, k, v, out, lse, args, window=(window_size_left, window_size_right))
    grads = tuple(kernel.flat(g) for g in (dq, dk, dv))
    return grads if learnable_sink is None else (*grads, dsink)


def flash4_bwd_without_sinks(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                             window_size_left=None, window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None,
                             max_seqlen_q=None, max_seqlen_k=None):  # fmt: skip
    """flash-attn 4 before the learnable sink reached its backward (Dao-AILab/flash-attention#2706)."""
    return flash4_bwd(q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left, window_size_right,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k)  # fmt: skip


def varlen_213_aux(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
    enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    assert window_size[1] == 0 and (enable_gqa or query.shape[1] == key.shape[1])
    args = _lse_args(cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size[0])
    out, lse = _fake_forward(query, key, value, args, window=tuple(window_size))
    return (out, lse) if return_aux is not None and return_aux.lse else out


@torch.library.custom_op("hbp_test::_varlen_attn_backward", mutates_args={})
def varlen_213_backward(
    grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, max_q: int, max_k: int, is_causal: bool,
    rng_state: torch.Tensor, scale: float | None = None, window_size: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """torch 2.13's ``torch_attn::_varlen_attn_backward`` schema, computed on CPU from the LSE."""
    assert rng_state.dtype == torch.uint64 and is_causal == (window_size[0] == -1) and window_size[1] == 0
    args = _lse_args(cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size[0])
    dq, dk, dv, _ = _fake_backward(grad_out, query, key, value, out, lse, args, window=tuple(window_size))
    return tuple(kernel.flat(g).contiguous() for g in (dq, dk, dv))


VARLEN_KERNELS: list[str] = []  # the kernel each fake torch > 2.13 varlen pass ran: "flash" or "cudnn"


def varlen_215_aux(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
    enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    """torch > 2.13's varlen_attn: cuDNN's kernel when enabled and eligible (causal needs ``cu_seq_q is
    cu_seq_k``), else flash's (``_select_backend`` of torch/nn/attention/varlen.py)."""
    causal_ok = list(window_size) != [-1, 0] or cu_seq_q is cu_seq_k
    cudnn = torch._C._get_cudnn_sdp_enabled() and causal_ok
    VARLEN_KERNELS.append("cudnn" if cudnn else "flash")
    res = varlen_213_aux(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux, scale=scale,
                         window_size=window_size, enable_gqa=enable_gqa)  # fmt: skip
    if return_aux is None:
        return res
    return res[0], res[1] + 1.0 if cudnn else res[1]  # cuDNN's LSE is not one flash's backward takes


@torch.library.custom_op("hbp_test::_varlen_attn_backward_215", mutates_args={})
def varlen_215_backward(
    grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, max_q: int, max_k: int, is_causal: bool,
    rng_state: torch.Tensor, scale: float | None = None, window_size: list[int] | None = None, backend: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """torch > 2.13's ``_varlen_attn_backward`` schema: ``backend`` (an SDPBackend value, flash by default)."""
    VARLEN_KERNELS.append("flash" if backend == torch.nn.attention.SDPBackend.FLASH_ATTENTION.value else "cudnn")
    return varlen_213_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                               rng_state, scale, window_size)  # fmt: skip


def install_lse_fake(monkeypatch, name: str, fwd, bwd) -> None:
    """Modules at the upstream paths holding the fake forward/backward (and the public function);
    flash-attn 4 as the newest release (installs with their dist-info: test_backend_install.py)."""
    from packaging.version import Version

    if name == "flash_attn_4":
        monkeypatch.setattr(flash, "_flash4_version", lambda: Version("4.0.0b27"))
    module, fwd_name, bwd_name = flash.FLASH_LSE[name]
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        path = ".".join(parts[:i])
        mod = types.ModuleType(path)
        mod.__spec__ = importlib.machinery.ModuleSpec(path, None)
        monkeypatch.setitem(sys.modules, path, mod)
        if i > 1:
            setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], mod)
    setattr(sys.modules[module], fwd_name, fwd)
    setattr(sys.modules[module], bwd_name, bwd)


def install_torch_varlen_fake(monkeypatch) -> None:
    import torch.nn.attention.varlen as varlen_module

    monkeypatch.setattr(varlen_module, "varlen_attn", varlen_213_aux)
    monkeypatch.setattr(torch_varlen, "_torch_varlen_backward_op", lambda: torch.ops.hbp_test._varlen_attn_backward)


def test_torch_varlen_with_a_backend_argument_runs_the_forwards_kernel_backward(monkeypatch):
    """torch > 2.13 prefers cuDNN in the forward for self-attention, and its backward op runs flash's
    unless told ``backend``: the LSE pair pins its forward to flash's kernel and says so to the
    backward, whose gradients then equal the reference."""
    import torch.nn.attention.varlen as varlen_module

    monkeypatch.setattr(varlen_module, "varlen_attn", varlen_215_aux)
    monkeypatch.setattr(torch_varlen, "_torch_varlen_backward_op", lambda: torch.ops.hbp_test._varlen_attn_backward_215)
    rows = [np.arange(6), np.arange(5)]
    q, k, v, cu, _ = inputs(rows, rows, dim=8)
    args = AttnArgs(cu, 6, 0.35)  # self-attention: the key documents are the query documents
    assert args.keys_cu is args.cu and backends.lse_why_not("torch_varlen", "cuda", args.needs) is None
    torch.backends.cuda.enable_cudnn_sdp(True)
    VARLEN_KERNELS.clear()
    flat = [kernel.flat(x) for x in (q, k, v)]
    varlen_215_aux(*flat, args.cu, args.keys_cu, 6, 6, scale=0.35, window_size=(-1, 0), enable_gqa=True)
    assert VARLEN_KERNELS == ["cudnn"], "unpinned, the fake prefers cuDNN as torch does"
    VARLEN_KERNELS.clear()
    pair = REGISTRY["torch_varlen"].lse
    out, lse = pair.forward(q, k, v, args)
    dout = torch.randn_like(out)
    grads = pair.backward(dout, q, k, v, out, lse, args)
    assert VARLEN_KERNELS == ["flash", "flash"] and torch._C._get_cudnn_sdp_enabled(), "pinned for the call only"
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = reference(*leaves, rows, [6, 5], 0.35)
    for got, ref in zip(grads[:3], torch.autograd.grad(want, leaves, dout)):
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)


@pytest.fixture(autouse=True)
def _fresh_lse_probe():
    backends.reset_probes()  # what was probed of the (faked) installs, and the answers read from it
    yield
    backends.reset_probes()


SINKS = torch.tensor([0.5, 1.0, -1.0, 0.0], dtype=torch.float64)
LSE_FAKES = {
    "flash-attn 2.8": ("flash_attn", flash2_8_fwd, flash2_8_bwd, dict(window=3, softcap=2.0)),
    "flash-attn 2.6": ("flash_attn", flash2_6_fwd, flash2_6_bwd, dict(window=3)),
    "flash-attn 3": ("flash_attn_3", flash3_fwd, flash3_bwd, dict(window=4, softcap=1.5)),
    "flash-attn 4": ("flash_attn_4", flash4_fwd, flash4_bwd, dict(window=4, softcap=1.5, sinks=SINKS)),
    "flash-attn 4 plain": ("flash_attn_4", flash4_fwd, flash4_bwd, {}),
    "torch 2.13 varlen": ("torch_varlen", None, None, dict(window=3)),
}


@pytest.mark.parametrize("version", sorted(LSE_FAKES))
@pytest.mark.parametrize("dim", [8, 6])
def test_lse_pairs_run_the_backward_kernel_from_the_saved_lse(monkeypatch, version, dim):
    """The forward returns the reference output and an LSE; the backward hands that LSE to the
    library's backward kernel (no forward runs) and returns the reference gradients; flash-attn 2
    gets head dims padded to a multiple of 8."""
    name, fwd, bwd, feats = LSE_FAKES[version]
    if fwd is None:
        install_torch_varlen_fake(monkeypatch)
    else:
        install_lse_fake(monkeypatch, name, fwd, bwd)
    q_rows, k_rows = [np.arange(3, 7), np.arange(0, 2), np.arange(5, 9)], [np.arange(7), np.arange(2), np.arange(9)]
    q, k, v, cu_q, cu_k = inputs(q_rows, k_rows, dim=dim)
    sinks = feats.get("sinks")
    args = AttnArgs(cu_q, 4, 0.35, cu_k=cu_k, max_len_k=9, **feats)
    assert backends.lse_why_not(name, "cuda", args.needs) is None
    LSE_CALLS.clear()
    pair = REGISTRY[name].lse
    out, lse = pair.forward(q, k, v, args)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, *([sinks] if sinks is not None else []))]
    want = reference(
        *leaves[:3], q_rows, [7, 2, 9], 0.35, **{**feats, "sinks": leaves[3] if sinks is not None else None}
    )
    torch.testing.assert_close(out, want.detach(), atol=1e-12, rtol=1e-12)
    dout = torch.randn_like(out)
    grads = pair.backward(dout, q, k, v, out, lse, args)
    assert [what for what, _ in LSE_CALLS] == ["forward", "backward"]
    window = (feats["window"] - 1, 0) if "window" in feats else ((None, None) if name == "flash_attn_4" else (-1, -1))
    assert LSE_CALLS[0][1]["window"] == LSE_CALLS[1][1]["window"] == window
    want_grads = torch.autograd.grad(want, leaves, dout)
    assert (grads[3] is None) == (sinks is None)
    for got, ref in zip([g for g in grads if g is not None], want_grads):
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)


def test_lse_pairs_say_what_they_cannot_take(monkeypatch):
    install_lse_fake(monkeypatch, "flash_attn_4", flash4_fwd, flash4_bwd_without_sinks)
    assert "does not take sinks" in backends.lse_why_not("flash_attn_4", "cuda", frozenset({"sinks"}))
    assert backends.lse_why_not("flash_attn_4", "cuda", frozenset({"window"})) is None
    assert backends.lse_why_not("flash_attn_4", "cuda", frozenset({"dropout"})) == kernel.NO_DROPOUT

    def old_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                     rng_state=None):  # fmt: skip
        """flash-attn 2.5: no soft-capping."""

    backends.reset_probes()
    install_lse_fake(monkeypatch, "flash_attn", flash2_8_fwd, old_backward)
    reason = backends.lse_why_not("flash_attn", "cuda", frozenset())
    assert "flash_attn.flash_attn_interface._flash_attn_varlen_backward takes no softcap" in reason
    backends.reset_probes()
    monkeypatch.delitem(sys.modules, "flash_attn.flash_attn_interface")
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    assert "has no _flash_attn_varlen_forward" in backends.lse_why_not("flash_attn", "cuda", frozenset())
    assert "CPU flash kernel, not on cuda" in backends.lse_why_not("sdpa", "cuda", frozenset())
    assert backends.lse_why_not("flex", "cuda", frozenset()) == "the library exposes no backward kernel"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["flash_attn", "flash_attn_3", "flash_attn_4", "torch_varlen"])
@pytest.mark.parametrize("feature", ["plain", "window", "softcap", "sinks"])
def test_lse_pairs_on_the_gpu_match_the_kernels_own_autograd(name, feature):
    """The installed CUDA kernel's forward-with-LSE and backward (what CP's backward runs) against
    the same kernel differentiated by its own autograd, bf16, query ranges against key prefixes;
    a kernel that is not installed here, or lacks the feature, is skipped with the reason."""
    q_rows = [np.arange(300, 700), np.arange(0, 130), np.arange(900, 1024), np.arange(10, 11)]
    k_rows = [np.arange(700), np.arange(130), np.arange(1024), np.arange(11)]
    q, k, v, cu_q, cu_k = (x.cuda() for x in inputs(q_rows, k_rows, hq=8, hkv=2, dim=128))
    q, k, v = (x.bfloat16() for x in (q, k, v))
    sinks = torch.randn(8, device="cuda", dtype=torch.bfloat16)
    feats = {"plain": {}, "window": {"window": 64}, "softcap": {"softcap": 30.0}, "sinks": {"sinks": sinks}}[feature]
    args = AttnArgs(cu_q, 400, 128**-0.5, cu_k=cu_k, max_len_k=1024, **feats)
    reason = backends.why_not(name, "cuda", torch.bfloat16, args.needs) or backends.lse_why_not(
        name, "cuda", args.needs
    )
    if reason:
        pytest.skip(f"{name}: {reason}")
    leaves = [x.clone().requires_grad_() for x in (q, k, v, *([sinks] if "sinks" in feats else []))]
    run_args = AttnArgs(**{**args.__dict__, "sinks": leaves[3] if "sinks" in feats else None})
    want = REGISTRY[name].run(*leaves[:3], run_args)
    dout = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, dout)
    out, lse = REGISTRY[name].lse.forward(q, k, v, args)
    assert lse.shape == q.shape[1:3] and lse.dtype == torch.float32, (name, lse.shape, lse.dtype)  # the op's fake
    grads = [g for g in REGISTRY[name].lse.backward(dout, q, k, v, out, lse, args) if g is not None]
    assert len(grads) == len(want_grads)
    for got, ref in zip([out, *grads], [want, *want_grads]):
        scale = ref.abs().max().float()
        assert ((got.float() - ref.float()).abs().max() / scale).item() < 1e-2, name
