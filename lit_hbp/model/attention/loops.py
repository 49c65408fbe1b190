"""The backends that loop over a pack's documents, for where no varlen kernel runs (a CPU): SDPA per
document (on CPU torch's flash kernel, whose forward keeps the LSE and whose backward takes it), and
the eager definition, which runs anywhere and differentiates everything, so every feature trains on CPU.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from lit_hbp.model.attention.kernel import (
    FEATURES,
    HEAD_DIM_NEEDS,
    NO_DROPOUT,
    AttnArgs,
    Backend,
    LseKernels,
    documents,
    lse_dtype,
    lse_unusable,
)


@torch.compiler.disable
def _sdpa_run(q, k, v, a: AttnArgs) -> torch.Tensor:
    """A causal scaled_dot_product_attention per document. Inputs stay 4-D: on CPU torch takes its
    flash kernel only for 4-D inputs (about 9x faster than the math fallback of 3-D inputs). SDPA's
    ``is_causal`` is top-left aligned, so query ranges shorter than their keys (and windows) pass
    the bottom-right band as a mask."""
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for qs, ks in documents(a):
        n, m = qs.stop - qs.start, ks.stop - ks.start
        if n != m or (a.window is not None and n > a.window):
            kwargs = dict(attn_mask=_band(n, a.window, q.device, m))
        else:
            kwargs = dict(is_causal=a.causal)
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, qs], k[:, :, ks], v[:, :, ks], dropout_p=a.dropout, scale=a.scale, enable_gqa=gqa, **kwargs
            )
        )
    return torch.cat(outs, dim=2)


def _band(n: int, window: int | None, device, m: int | None = None) -> torch.Tensor:
    """[n, m] bool: n queries that are the last n of m keys (m = n: self-attention) see the keys up to
    their own position (causal, bottom-right), and within the window when there is one."""
    m = n if m is None else m
    i = torch.arange(n, device=device)[:, None] + (m - n)
    j = torch.arange(m, device=device)[None, :]
    keep = j <= i
    if window is not None:
        keep &= j > i - window
    return keep


@torch.compiler.disable
def eager_run(q, k, v, a: AttnArgs) -> torch.Tensor:
    """The definition, document by document: scores, soft-cap, causal (and window) mask, softmax in
    fp32 with the sink logit as an extra column, dropout, weighted values. Slow; runs anywhere and
    differentiates everywhere, so every feature trains on CPU."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for rows, keys in documents(a):
        n, m = rows.stop - rows.start, keys.stop - keys.start
        qs = q[0, :, rows]
        ks, vs = (x[0, :, keys].repeat_interleave(group, dim=0) for x in (k, v))
        scores = (qs @ ks.transpose(-1, -2)).to(torch.promote_types(qs.dtype, torch.float32)) * a.scale
        if a.softcap:
            scores = a.softcap * torch.tanh(scores / a.softcap)
        if a.causal:
            scores = scores.masked_fill(~_band(n, a.window, q.device, m), float("-inf"))
        if a.sinks is not None:
            sink = a.sinks.to(scores.dtype).reshape(-1, 1, 1).expand(-1, n, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        if a.dropout:
            probs = F.dropout(probs, a.dropout, training=True)
        outs.append((probs.to(vs.dtype) @ vs)[None])
    return torch.cat(outs, dim=2)


def _cpu_doc_parts(n: int, m: int, window: int | None, like: torch.Tensor) -> list[tuple[slice, bool, object]]:
    """How torch's CPU flash kernel runs n queries that are the last n of m keys: (key rows of the
    document, causal flag, additive mask) per kernel call. Self-attention is its own causal call; a
    query chunk of a longer document (context parallelism) is two calls without a mask, the keys
    before the chunk seen whole and the chunk's own causally, merged by their LSEs: a dense [n, m]
    mask costs more to build than the attention it masks. Only a window shorter than the keys
    needs the band as an additive mask of the query's dtype."""
    if n == m and (window is None or n <= window):
        return [(slice(0, m), True, None)]
    if window is None or m <= window:
        return [(slice(0, m - n), False, None), (slice(m - n, m), True, None)]
    band = _band(n, window, like.device, m)
    return [(slice(0, m), False, torch.zeros(n, m, dtype=like.dtype).masked_fill(~band, float("-inf")))]


def _within(rows: slice, part: slice) -> slice:
    return slice(rows.start + part.start, rows.start + part.stop)


def _heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """Key or value heads repeated for their query heads where the kernel does not take fewer."""
    return x if group == 1 else x.repeat_interleave(group, 1)


@cache
def _cpu_flash_takes_gqa() -> bool:
    """Whether this torch's CPU flash kernel takes fewer key/value heads than query heads (probed
    once on a tiny call); else K/V are repeated per document."""
    q, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kv, kv, 0.0, True)
        return True
    except RuntimeError:
        return False


def _sdpa_lse_unusable(device_type: str, needs: frozenset[str]) -> str | None:
    if "dropout" in needs:
        return NO_DROPOUT
    if device_type != "cpu":
        return f"its LSE kernel is torch's CPU flash kernel, not on {device_type}"
    missing = needs - {"window", *HEAD_DIM_NEEDS}
    if missing:
        return f"its backward kernel does not take {', '.join(sorted(missing))}"
    return None


@torch.compiler.disable
def _sdpa_forward(q, k, v, a: AttnArgs):
    """torch's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, what SDPA runs on
    CPU) document by document, keeping its LSE (as [1, Hq, T]; returned as [Hq, T])."""
    group = 1 if _cpu_flash_takes_gqa() else q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))
    for qs, ks in documents(a):
        n, m = qs.stop - qs.start, ks.stop - ks.start
        if not n:
            continue
        runs = []
        for part, causal, mask in _cpu_doc_parts(n, m, a.window, q):
            kd, vd = (_heads(x[:, :, _within(ks, part)], group) for x in (k, v))
            runs.append(
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q[:, :, qs], kd, vd, 0.0, causal, attn_mask=mask, scale=a.scale
                )[:2]
            )
        if len(runs) == 1:
            out[:, :, qs], lse[:, :, qs] = runs[0]
        else:  # the softmax over both key ranges: each part's output weighted by its share of the total
            (o1, l1), (o2, l2) = runs
            total = torch.logaddexp(l1, l2)
            w1, w2 = (torch.exp(x - total)[..., None] for x in (l1, l2))
            out[:, :, qs] = (w1 * o1.to(w1.dtype) + w2 * o2.to(w2.dtype)).to(out.dtype)
            lse[:, :, qs] = total
    return out, lse[0]


@torch.compiler.disable
def _sdpa_backward(dout, q, k, v, out, lse, a: AttnArgs):
    """The CPU flash kernel's backward document by document, from the saved output and LSE."""
    hkv, group = k.shape[1], 1 if _cpu_flash_takes_gqa() else q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    lse = lse[None]
    for qs, ks in documents(a):
        n, m = qs.stop - qs.start, ks.stop - ks.start
        if not n:
            continue
        # Each part's backward from the document's whole output and LSE: its exact share of the gradients.
        rows = [x[:, :, qs].contiguous() for x in (dout, q, out, lse)]
        for part, causal, mask in _cpu_doc_parts(n, m, a.window, q):
            keys = _within(ks, part)
            kd, vd = (_heads(x[:, :, keys], group) for x in (k, v))
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                rows[0], rows[1], kd, vd, rows[2], rows[3], 0.0, causal, attn_mask=mask, scale=a.scale
            )
            dq[:, :, qs] += gq
            dk[:, :, keys] += gk.unflatten(1, (hkv, group)).sum(2)
            dv[:, :, keys] += gv.unflatten(1, (hkv, group)).sum(2)
    return dq, dk, dv, None


def _eager_scores(qs, ks, a: AttnArgs, n: int, m: int):
    """Scores of one document [H, n, m] in fp32 (or wider): scaled, soft-capped (with the tanh kept
    for the backward), masked outside the causal band with -inf."""
    raw = (qs @ ks.transpose(-1, -2)).to(torch.promote_types(qs.dtype, torch.float32)) * a.scale
    capped = torch.tanh(raw / a.softcap) if a.softcap else None
    scores = a.softcap * capped if a.softcap else raw
    return scores.masked_fill(~_band(n, a.window, qs.device, m), float("-inf")), capped


@torch.compiler.disable
def _eager_forward(q, k, v, a: AttnArgs):
    """``eager_run`` keeping the log-sum-exp [Hq, T] (the sink logit included in it)."""
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for rows, keys in documents(a):
        n, m = rows.stop - rows.start, keys.stop - keys.start
        ks, vs = (x[0, :, keys].repeat_interleave(group, dim=0) for x in (k, v))
        scores, _ = _eager_scores(q[0, :, rows], ks, a, n, m)
        if a.sinks is not None:
            sink = a.sinks.to(scores.dtype).reshape(-1, 1, 1).expand(-1, n, 1)
            lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
        else:
            lse = torch.logsumexp(scores, dim=-1)
        outs.append((torch.exp(scores - lse[..., None]).to(vs.dtype) @ vs)[None])
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=1)


@torch.compiler.disable
def _eager_backward(dout, q, k, v, out, lse, a: AttnArgs):
    """The softmax backward from the LSE, document by document (flash-attention's formulas): P =
    exp(S - lse), dV = P^T dO, dS = P (dO V^T - rowsum(dO O)), through the soft-cap's tanh, dQ = dS K
    scale, dK = dS^T Q scale; a sink's gradient is -sum_i P_sink,i rowsum(dO O)_i."""
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    dq, dk, dv = (torch.zeros_like(x, dtype=acc) for x in (q, k, v))
    dsinks = torch.zeros_like(a.sinks, dtype=acc) if a.sinks is not None else None
    for rows, keys in documents(a):
        n, m = rows.stop - rows.start, keys.stop - keys.start
        qs = q[0, :, rows]
        ks, vs = (x[0, :, keys].repeat_interleave(group, dim=0) for x in (k, v))
        scores, capped = _eager_scores(qs, ks, a, n, m)
        lse_d = lse[:, rows].to(acc)[..., None]
        p = torch.exp(scores - lse_d)
        do, o = dout[0, :, rows].to(acc), out[0, :, rows].to(acc)
        rowsum = (do * o).sum(-1, keepdim=True)
        ds = p * (do @ vs.to(acc).transpose(-1, -2) - rowsum)
        if capped is not None:
            ds = ds * (1 - capped**2)
        dq[0, :, rows] = ds @ ks.to(acc) * a.scale
        dk[0, :, keys] += (ds.transpose(-1, -2) @ qs.to(acc) * a.scale).unflatten(0, (hkv, group)).sum(1)
        dv[0, :, keys] += (p.transpose(-1, -2) @ do).unflatten(0, (hkv, group)).sum(1)
        if dsinks is not None:
            dsinks -= (torch.exp(a.sinks.to(acc)[:, None] - lse_d[..., 0]) * rowsum[..., 0]).sum(-1)
    grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))
    return (*grads, dsinks.to(a.sinks.dtype) if dsinks is not None else None)


def _anywhere(device_type: str, dtype: torch.dtype) -> None:
    return None


def sdpa_backend() -> Backend:
    return Backend(
        "sdpa",
        _anywhere,
        lambda: frozenset({"window", "dropout", *HEAD_DIM_NEEDS}),
        _sdpa_run,
        LseKernels(_sdpa_lse_unusable, _sdpa_forward, _sdpa_backward),
    )


def eager_backend() -> Backend:
    return Backend(
        "eager",
        _anywhere,
        lambda: frozenset({*FEATURES, *HEAD_DIM_NEEDS}),
        eager_run,
        LseKernels(
            lse_unusable(lambda: frozenset({"window", "softcap", "sinks", *HEAD_DIM_NEEDS}), lambda: None),
            _eager_forward,
            _eager_backward,
        ),
    )
