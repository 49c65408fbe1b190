"""The self-check at the start of fit: the user's real model trains a pack exactly as it trains its
documents one by one, or training is refused.

No list of model families can be complete (a new transformers release, a custom or remote-code
model): a model whose layers let the documents of a pack see each other (a token mixer other than
attention, attention outside transformers' AttentionInterface, absolute positions), whose output
head differs from what lit-hbp reproduces, or that changes under sequence parallelism, would train
silently wrong. So before the first step, with the run's weights, dtype, attention backend and
precision, a handful of short documents (the same on every rank) runs

- packed, through the module's own path (decoder, output head, chunked cross-entropy), for each
  sequence-parallel degree the levels use, on this rank's shard;
- each alone, through the family's own ``forward`` with transformers' eager attention (its own
  output head, its own masks: a sliding window the family applies through its mask and not
  through the attention call is caught here), no SP. When the config has a sliding window (or an
  attention chunk) shorter than the longest pack, one document is longer than it.

The summed cross-entropy and the gradient with respect to the input embeddings (which reaches
every layer) must agree within the dtype's tolerance. And in the pack, the loss of each document
must have exactly no gradient on the other documents' embeddings: isolation is structural, so
this part holds to the last bit in any dtype and catches leaks far below bf16 noise. A model that
fails on a packed batch at all (an unsupported attention feature, a layer that needs a mask) is
refused the same way, with the error it raised. Every rank runs the same forwards (ZeRO-3
gathers and SP all-to-alls stay matched), and the ranks agree on the verdict before anyone raises.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

from lit_hbp import attention
from lit_hbp.data.collate import collate_packs, shard
from lit_hbp.parallel import context as sp_context

DOC_LENGTHS = (9, 23, 5, 31, 14)
# (loss, input-gradient) tolerances, relative: bf16/fp16 noise against cross-document leakage,
# which moves input gradients by tens of percent.
TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.float64: (1e-8, 1e-7)}
LOW_PRECISION = (2e-2, 1.5e-1)
LEAK_TOLERANCE = 1e-6  # gradient of one document's loss on the others, relative to its own
SUSPECTS = ("mamba", "ssm", "recurrent", "linearattention", "lightning", "deltanet", "conv", "rwkv", "xlstm")


class SelfCheckError(RuntimeError):
    """The model does not train a pack as it trains its documents one by one."""


def _documents(vocab: int, config, max_len: int | None) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    lengths = list(DOC_LENGTHS)
    windows = [getattr(config, k, None) for k in ("sliding_window", "attention_chunk_size")]
    windows = [int(w) for w in windows if isinstance(w, int) and w > 0]
    if windows and (max_len is None or min(windows) < max_len):
        lengths.insert(2, min(windows) + 8)
    rng = np.random.default_rng(1234)
    return {i: (rng.integers(0, vocab, n), np.ones(n, bool)) for i, n in enumerate(lengths)}


def _errors(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    return (got.double() - want.double()).abs().max().item() / max(scale, 1e-12)


def run_self_check(
    module, sp_degrees, sp_groups=None, autocast=contextlib.nullcontext, max_len: int | None = None
) -> dict:
    """Compare packed and alone for each degree in ``sp_degrees``; returns (loss error, gradient
    error, leak) per degree and raises SelfCheckError (after every rank agrees) when one is out of
    tolerance. ``module`` is an HBPLitModule after configure_model; ``autocast`` the run's
    precision context; ``max_len`` the longest pack (a longer sliding window never matters)."""
    net = module.model
    embed = net.get_input_embeddings()
    device = embed.weight.device
    docs = _documents(_vocab(net), net.config, max_len)
    was_training = net.training
    net.eval()  # dropout and router jitter off: the comparison is between two deterministic runs
    try:
        with autocast():
            on = device.type
            dtype = torch.get_autocast_dtype(on) if torch.is_autocast_enabled(on) else embed.weight.dtype
            reference = _alone(net, embed, docs, device)
            results = {}
            for sp in sorted(set(sp_degrees)):
                ctx = sp_groups[sp] if sp > 1 else None
                results[sp] = _packed_errors(module, embed, docs, reference, sp, ctx, device)
    except SelfCheckError:
        raise
    except Exception as e:
        raise SelfCheckError(
            f"self-check: model family {net.config.model_type!r} ({type(net).__name__}) fails on a packed batch of "
            f"short documents, so it cannot train with lit-hbp: {type(e).__name__}: {e}"
        ) from e
    finally:
        net.train(was_training)
        sp_context.activate(None)
        attention.set_pack(None)
    loss_tol, grad_tol = TOLERANCE.get(dtype, LOW_PRECISION)
    worst = _agree(np.array([results[sp] for sp in sorted(results)]), device)
    for (loss_err, grad_err, leak), sp in zip(worst, sorted(results)):
        if loss_err > loss_tol or grad_err > grad_tol or leak > LEAK_TOLERANCE:
            raise SelfCheckError(_explain(module, len(docs), sp, loss_err, grad_err, leak, loss_tol, grad_tol, dtype))
    return {sp: tuple(e) for sp, e in zip(sorted(results), worst.tolist())}


def _vocab(net) -> int:
    """Token ids both the input embedding and the output head know."""
    head = net.get_output_embeddings()
    sizes = [net.get_input_embeddings().num_embeddings, getattr(head, "out_features", None)]
    return min(s for s in sizes if s)


def _alone(net, embed, docs, device):
    """Per document: (CE per position [n - 1], d(its CE) / d(its embeddings) [n, H]), through the
    family's own forward, output head and masks, with transformers' eager attention."""
    out = {}
    attention.set_pack(None)
    own = net.config._attn_implementation
    net.set_attn_implementation("eager")
    try:
        for i, (ids, _) in docs.items():
            out[i] = _alone_one(net, embed, ids, device)
    finally:
        net.set_attn_implementation(own)
    return out


def _alone_one(net, embed, ids, device):
    ids_t = torch.as_tensor(ids, device=device)
    x = embed(ids_t[None]).detach().requires_grad_()
    logits = net(inputs_embeds=x, position_ids=torch.arange(len(ids), device=device)[None], use_cache=False).logits
    ce = F.cross_entropy(logits[0, :-1].float(), ids_t[1:], reduction="none")
    (grad,) = torch.autograd.grad(ce.sum(), x)
    return ce.detach(), grad[0].detach()


def _packed_errors(module, embed, docs, reference, sp, ctx, device) -> tuple[float, float, float]:
    """(relative loss error, relative input-gradient error, cross-document leak) of this rank's
    shard of the pack."""
    batch = collate_packs([np.arange(len(docs))], docs.__getitem__, sp=sp, meta=dict(loss_norm=1.0, level=0))
    total = batch["input_ids"].shape[1]
    if sp > 1:
        batch = shard(batch, sp, ctx.rank)
    batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}
    part = slice(ctx.rank * total // sp, (ctx.rank + 1) * total // sp) if sp > 1 else slice(0, total)
    bounds = np.r_[0, np.cumsum([len(ids) for ids, _ in docs.values()])]
    doc_of = torch.as_tensor(np.searchsorted(bounds, np.arange(total), side="right") - 1)[part].to(device)
    sp_context.activate(ctx)
    x = embed(batch["input_ids"]).detach().requires_grad_()
    loss, _, _ = module.packed_loss(batch, inputs_embeds=x, weights=1.0)
    (grad,) = torch.autograd.grad(loss, x, retain_graph=True)
    spread = []  # per document: largest gradient of its loss outside it, and inside it
    for j in range(len(docs)):
        mine = (doc_of == j).float()
        loss_j, _, _ = module.packed_loss(batch, inputs_embeds=x, weights=mine)
        (g,) = torch.autograd.grad(loss_j, x)
        spread.append([(g[0] * (1 - mine[:, None])).abs().max().item(), (g[0] * mine[:, None]).abs().max().item()])
    spread = _agree(np.array(spread), device)  # over the SP group's shards
    leak = float((spread[:, 0] / np.maximum(spread[:, 1], 1e-30)).max())
    sp_context.activate(None)
    # The same quantities from the documents alone, laid out like the pack, cut to this shard.
    ce_ref = torch.zeros(total, device=device, dtype=torch.float64)
    grad_ref = torch.zeros(total, grad.shape[-1], device=device, dtype=torch.float64)
    for i, (ids, _) in docs.items():
        ce, g = reference[i]
        ce_ref[bounds[i] : bounds[i] + len(ids) - 1] = ce.double()
        grad_ref[bounds[i] : bounds[i + 1]] = g.double()
    want_loss = ce_ref[part].sum()
    loss_err = abs(loss.item() - want_loss.item()) / max(abs(want_loss.item()), 1e-12)
    return loss_err, _errors(grad[0], grad_ref[part]), leak


def _agree(errors: np.ndarray, device) -> np.ndarray:
    """The largest errors over all ranks, so every rank reaches the same verdict."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.as_tensor(errors, dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.cpu().numpy()
    return errors


def _explain(module, n_docs, sp, loss_err, grad_err, leak, loss_tol, grad_tol, dtype) -> str:
    family = module.model.config.model_type
    if leak > LEAK_TOLERANCE:
        suspects = sorted({type(m).__name__ for m in module.model.modules() if _suspect(type(m).__name__)})
        cause = (
            "the documents of a pack influence each other: a layer ignores the document boundaries (a token "
            "mixer other than attention"
            + (f", e.g. {', '.join(suspects[:4])}" if suspects else "")
            + "; attention outside transformers' AttentionInterface; routing that depends on other tokens)"
        )
    elif sp > 1:
        cause = f"sequence parallelism {sp} changes the result, while the pack without it matches"
    else:
        cause = (
            "each document computes something else packed than alone: positions that do not restart per "
            "document, or an output head lit-hbp does not reproduce (logit scaling, soft-capping)"
        )
    return (
        f"self-check failed for model family {family!r} ({type(module.model).__name__}) in {dtype}: a pack of "
        f"{n_docs} short documents at sp {sp} differs from the documents trained one by one: "
        f"summed loss by {loss_err:.2e} (tolerance {loss_tol:.0e}), input gradients by {grad_err:.2e} of their "
        f"largest value (tolerance {grad_tol:.0e}), gradient of one document's loss on the others {leak:.2e} "
        f"(tolerance {LEAK_TOLERANCE:.0e}). Likely cause: {cause}. Training is refused rather than run silently "
        "wrong; use a family listed as exact in the README, or set self_check: false only if you know why this "
        "differs."
    )


def _suspect(name: str) -> bool:
    low = name.lower()
    return any(s in low for s in SUSPECTS) and "attention" not in low.replace("linearattention", "")
