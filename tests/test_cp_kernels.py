"""Attention kernels with separate query and key lengths (context parallelism): query range [a, b)
of a document against its keys [0, b), causal bottom-right. The CPU loops against a brute-force
reference over random ranges (forward and gradients), the CUDA adapters (flash-attn 2/3/4, torch's
varlen) with fakes of their real signatures, Flex's block mask against the element-wise mask."""

import importlib.machinery
import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_hbp.attention import backends
from lit_hbp.attention.backends import REGISTRY, AttnArgs
from lit_hbp.attention.flex import cross_block_mask


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
       seed=st.integers(0, 10**6), feature=st.sampled_from(["plain", "window", "softcap", "sinks"]))  # fmt: skip
def test_cpu_kernels_compute_bottom_right_causal_ranges(lengths, cuts, seed, feature):
    q_rows, k_rows, _ = ranges_case(lengths, cuts, seed)
    if not q_rows:
        return
    q, k, v, cu_q, cu_k = inputs(q_rows, k_rows, seed=seed)
    feats = {
        "plain": {},
        "window": {"window": 3},
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
    out = backends.flex_run(q, k, v, AttnArgs(cu_q, 30, 0.3, cu_k=cu_k, max_len_k=70), fn=flex_attention)
    want = reference(q, k, v, q_rows, [70, 20], 0.3)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
