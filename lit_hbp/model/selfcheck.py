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

A vision-language run adds the shortest samples with images from its own data (``media_docs``: the
run's processor, images and vision tower) to the pack of every layout (at sp > 1 the SP group splits
their encoding, ``lit_hbp.model.sp_media``), and compares the gradient with respect to their pixels
too (it reaches the vision tower and the projector).

A mixture-of-experts model in bf16 or fp16 may send a token to other experts packed than alone: its
router's scores for two experts tie within rounding, and the pack's other matmul shapes round them
otherwise (an H100 did so for one of 143 tokens of a tiny Mixtral, moving its expert gradients 31%).
That token's document then differs by tens of percent with nothing wrong in the packing, so the experts
each token chose are recorded in both runs (transformers' experts modules take them as ``top_k_index``)
and a document where a token or two chose differently is left out of the comparison and counted; more
rerouting, more than half of the documents, or any in fp32 is compared (a packing error moves most
tokens) and named in the failure. The leak check keeps every document.

The summed cross-entropy and the gradient with respect to the input embeddings (which reaches
every layer) must agree within the dtype's tolerance, and the packed path must use exactly the
trainable weights the family's own forward uses (a weight it skips would never train; one only it
uses computes something the documents alone do not). And in the
pack, the loss of each document must have exactly no gradient on the other documents' embeddings:
isolation is structural, so this part holds to the last bit in any dtype and catches leaks far
below bf16 noise. A model that fails on a packed batch at all (an unsupported attention feature, a
layer that needs a mask) is refused the same way, with the error it raised. Every rank runs the same forwards (ZeRO-3
gathers and SP all-to-alls stay matched), and the ranks agree on the verdict before anyone raises.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from lit_hbp.data.collate import collate_packs
from lit_hbp.data.media_batch import TOKEN_KEYS, MRopePositions, collate_media, pads_images
from lit_hbp.model.build import SPECIAL_TOKEN_IDS
from lit_hbp.model.mixers import zero3_partitioned
from lit_hbp.model.sp_media import KINDS
from lit_hbp.parallel.context import SPCall
from lit_hbp.parallel.kind import resolve_sp_kind

DOC_LENGTHS = (9, 23, 5, 100, 31, 14)  # about 200 tokens in all: block-wise mechanisms (compression) engage
# (loss, input-gradient) tolerances, relative: bf16/fp16 noise against cross-document leakage,
# which moves input gradients by tens of percent.
# float64: the loss as tight as before; input gradients within 1e-5, since transformers' RMSNorms compute in fp32
# whatever the model's dtype (a float64 Llama's agree to ~1e-7, fp32's rounding).
TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.float64: (1e-8, 1e-5)}
LOW_PRECISION = (2e-2, 1.5e-1)
LEAK_TOLERANCE = 1e-6  # gradient of one document's loss on the others, relative to its own
PIXELS = tuple(kind.pixels for kind in KINDS)  # the media inputs gradients are taken for
SUSPECTS = ("mamba", "ssm", "recurrent", "linearattention", "lightning", "deltanet", "conv", "rwkv", "xlstm")


ROUTE_ARGS = ("top_k_index", "router_indices")  # transformers' experts modules: each token's chosen experts


class SelfCheckError(RuntimeError):
    """The model does not train a pack as it trains its documents one by one."""


class LayoutResult(NamedTuple):
    """One layout's verdict: relative errors of the summed loss and the input gradients, the leak, and
    how many documents were left out of the comparison because a rounding tie sent a token of theirs to
    other experts packed than alone."""

    loss: float
    grads: float
    leak: float
    left_out: int = 0


def _documents(vocab: int, config, max_len: int | None) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    lengths = list(DOC_LENGTHS)
    windows = [getattr(config, k, None) for k in ("sliding_window", "attention_chunk_size")]
    windows = [int(w) for w in windows if isinstance(w, int) and w > 0]
    if windows and (max_len is None or min(windows) < max_len):
        lengths.insert(2, min(windows) + 8)
    rng = np.random.default_rng(1234)
    docs = {i: rng.integers(0, vocab, n) for i, n in enumerate(lengths)}
    marked = _marker_ids(config, vocab)
    if marked.size:  # a placeholder in a text document asks the model for an image it does not have
        allowed = np.setdiff1d(np.arange(vocab), marked)
        for ids in docs.values():
            hit = np.isin(ids, marked)
            ids[hit] = allowed[ids[hit] % allowed.size]
    return {i: (ids, np.ones(ids.size, bool)) for i, ids in docs.items()}


def _marker_ids(config, vocab: int) -> np.ndarray:
    """The ids a config gives a role (``*_token_id``, ``*_token_index``: an image or video placeholder, a
    boundary) other than BOS, EOS and padding, in the model's and its parts' configs."""
    holders = [config, *(getattr(config, k, None) for k in ("text_config", "vision_config", "audio_config"))]
    ids = {
        value
        for holder in holders if holder is not None
        for name, value in vars(holder).items()
        if name.endswith(("_token_id", "_token_index")) and name not in SPECIAL_TOKEN_IDS
        and isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab
    }  # fmt: skip
    return np.array(sorted(ids), dtype=np.int64)


def _errors(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    return (got.double() - want.double()).abs().max().item() / max(scale, 1e-12)


def layout_key(layout: int | tuple[int, int]) -> int | tuple[int, int]:
    """A degree (Ulysses) stays a number; (sp, cp) with cp > 1 stays a pair; (sp, 1) becomes sp."""
    sp, cp = (layout, 1) if isinstance(layout, int) else (int(layout[0]), int(layout[1]))
    return sp if cp == 1 else (sp, cp)


def layout_name(layout: int | tuple[int, int]) -> str:
    key = layout_key(layout)
    return f"sp {key}" if isinstance(key, int) else f"sp {key[0]} (ulysses {key[0] // key[1]} x cp {key[1]})"


def run_self_check(
    module,
    sp_degrees,
    sp_groups=None,
    autocast=contextlib.nullcontext,
    max_len: int | None = None,
    media_docs=(),
) -> dict:
    """Compare packed and alone for each SP layout in ``sp_degrees`` (a degree, Ulysses, or
    (sp, cp)); returns a ``LayoutResult`` per layout (``layout_key``) and raises
    SelfCheckError (after every rank agrees) when one is out of tolerance. ``module`` is an
    HBPLitModule after configure_model; ``autocast`` the run's precision context; ``max_len`` the
    longest pack (a longer sliding window never matters); ``media_docs`` (ids, the processor's tensors)
    of samples with images, packed beside the text documents (the same on every rank)."""
    net = module.model
    embed = net.get_input_embeddings()
    device = next(net.parameters()).device
    docs = _documents(_vocab(net), net.config, max_len)
    media = {}
    for ids, mm in media_docs:
        media[len(docs)] = dict(mm)
        docs[len(docs)] = (np.asarray(ids, dtype=np.int64), np.ones(len(ids), bool))
    was_training = net.training
    net.eval()  # dropout and router jitter off: the comparison is between two deterministic runs
    try:
        with autocast():
            on = device.type
            dtype = torch.get_autocast_dtype(on) if torch.is_autocast_enabled(on) else next(net.parameters()).dtype
            layouts = sorted({layout_key(x) for x in sp_degrees}, key=lambda k: (k, 1) if isinstance(k, int) else k)
            rope = MRopePositions.of(net) if media else None
            pad = pads_images(net.config)
            packs = {key: _pack(docs, media, key, sp_groups, device, rope, pad) for key in layouts}
            leaks = {sp: _leak(module, embed, pack, device) for sp, pack in packs.items()}  # cheapest verdict first
            for sp, leak in leaks.items():
                if leak > LEAK_TOLERANCE:
                    raise SelfCheckError(_explain(module, len(docs), sp, np.nan, np.nan, leak, np.nan, np.nan, dtype))
            reference = _alone(net, embed, docs, media, device)
            excuse = dtype not in TOLERANCE  # rounding ties of routers: bf16 and fp16 only
            results, wheres = {}, {}
            for sp, pack in packs.items():
                used_packed: set[int] = set()
                loss_err, grad_err, left_out, rerouted, wheres[sp] = _packed_errors(
                    module, embed, reference, pack, device, used_packed, excuse
                )
                results[sp] = (loss_err, grad_err, leaks[sp], left_out, rerouted)
                used_alone = set().union(*(reference[i]["used"] for i in pack["docs"]))
                _check_same_weights(net, used_alone, used_packed, sp)
    except SelfCheckError:
        raise
    except Exception as e:
        raise SelfCheckError(
            f"self-check: model family {net.config.model_type!r} ({type(net).__name__}) fails on a packed batch of "
            f"short documents, so it cannot train with lit-hbp: {type(e).__name__}: {e}"
        ) from e
    finally:
        net.train(was_training)
    loss_tol, grad_tol = TOLERANCE.get(dtype, LOW_PRECISION)
    worst = _agree(np.array([results[sp] for sp in results], dtype=np.float64), device)
    for (loss_err, grad_err, leak, _, rerouted), sp in zip(worst, results):
        if loss_err > loss_tol or grad_err > grad_tol or leak > LEAK_TOLERANCE:
            errors = (loss_err, grad_err, leak, loss_tol, grad_tol)
            raise SelfCheckError(_explain(module, len(docs), sp, *errors, dtype, int(rerouted), wheres[sp]))
    return {sp: LayoutResult(*e[:3], int(e[3])) for sp, e in zip(results, worst.tolist())}


def _vocab(net) -> int:
    """Token ids both the input embedding and the output head know."""
    head, embedding = _unwrapped(net.get_output_embeddings()), _unwrapped(net.get_input_embeddings())
    sizes = [embedding.num_embeddings, getattr(head, "out_features", None)]
    return min(s for s in sizes if s)


def _unwrapped(module):
    """The layer peft wrapped: LoRA's ``base_layer``, trainable tokens' ``token_adapter.base_layer``."""
    while (inner := getattr(module, "token_adapter", None) or getattr(module, "base_layer", None)) is not None:
        module = inner
    return module


def _weights_in_graph(loss: torch.Tensor, into: set[int]) -> None:
    """Add the ids of the trainable tensors ``loss`` depends on (its graph's leaves): no gradient
    is computed, so this costs nothing where weights are partitioned."""
    stack, seen = [loss.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            into.add(id(fn.variable))
        stack.extend(f for f, _ in fn.next_functions)


def _check_same_weights(net, used_alone: set[int], used_packed: set[int], sp) -> None:
    names = {id(p): n for n, p in net.named_parameters()}
    only_alone = sorted(names[i] for i in used_alone - used_packed if i in names)
    only_packed = sorted(names[i] for i in used_packed - used_alone if i in names)
    if only_alone or only_packed:
        raise SelfCheckError(
            f"self-check failed for model family {net.config.model_type!r} ({type(net).__name__}) at "
            f"{layout_name(sp)}: the packed path and the family's own forward on each document use different "
            f"trainable weights: only alone {only_alone[:4]} (they would never train), only packed "
            f"{only_packed[:4]} (a computation over the whole pack, e.g. compression across documents). "
            "Training is refused."
        )


@contextlib.contextmanager
def _embedding_leaves(embed):
    """While active, every output of the input embedding is replaced by a leaf tensor (collected),
    so gradients are taken with respect to it. The embedding runs inside the model's own forward,
    where ZeRO-3 gathers and releases its weight. The forward goes on with a copy of the leaf: a family
    that scales its embeddings in place (CTRL's ``inputs_embeds *= sqrt(d)``) cannot write into a leaf."""
    leaves = []

    def hook(module, args, out):
        leaves.append(out.detach().requires_grad_())
        return leaves[-1].clone()

    handle = embed.register_forward_hook(hook)
    try:
        yield leaves
    finally:
        handle.remove()


def _pixel_leaves(mm: dict | None) -> dict[str, torch.Tensor]:
    """The pixel inputs of ``mm`` as leaves that take a gradient (through the vision tower and the
    projector into the language model), replaced in ``mm``."""
    leaves = {k: mm[k].detach().float().requires_grad_() for k in PIXELS if mm and mm.get(k) is not None}
    if mm:
        mm.update(leaves)
    return leaves


def _alone(net, embed, docs, media, device) -> dict[int, dict]:
    """Per document: CE per position [n - 1], d(its CE) / d(its embeddings) [n, H], d(its CE) / d(its
    pixels) and the trainable weights it used, through the family's own forward, output head and
    masks, with transformers' eager attention (its vision tower's too); a document with images
    gets the model's own positions for them."""
    from lit_hbp.model.build import model_configs

    out = {}
    own = [(config, config._attn_implementation_internal) for config in model_configs(net)]
    net.set_attn_implementation("eager")
    try:
        for i, (ids, _) in docs.items():
            out[i] = _alone_one(net, embed, ids, media.get(i), device)
    finally:
        for config, name in own:
            config._attn_implementation_internal = name
    return out


def _alone_one(net, embed, ids, mm, device) -> dict:
    ids_t = torch.as_tensor(ids, device=device)
    if mm:  # the processor's tensors as the model takes them alone: per-token fields as a [1, L] row
        kw = {k: (v[None] if k in TOKEN_KEYS else v).to(device) for k, v in mm.items()}
        pixels = _pixel_leaves(kw)
    else:
        kw, pixels = {"position_ids": torch.arange(len(ids), device=device)[None]}, {}
    with _embedding_leaves(embed) as leaves, _routes(net) as routes:
        logits = net(input_ids=ids_t[None], use_cache=False, **kw).logits
    logits = logits[0, :-1]
    ce = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), ids_t[1:], reduction="none")
    used: set[int] = set()
    _weights_in_graph(ce.sum(), used)
    grads = torch.autograd.grad(ce.sum(), [leaves[-1], *pixels.values()])
    return dict(ce=ce.detach(), grad=grads[0][0].detach(), pixels=dict(zip(pixels, grads[1:])), used=used,
                routes=[r[0] if len(r) == 1 and len(r[0]) == len(ids) else None for r in routes])  # fmt: skip


def _pack(docs, media, key, sp_groups, device, rope, pad_images: bool = False) -> dict:
    """The documents packed, this rank's shard at SP layout ``key`` (the whole pack's images travel with
    every shard), with where its positions are and which document owns each row of its pixels."""
    sp, cp = (key, 1) if isinstance(key, int) else key
    kind = resolve_sp_kind("cp" if cp > 1 else "ulysses")
    ctx = sp_groups[(sp, cp)] if sp > 1 else None
    order = list(docs)
    batch = collate_packs(
        [np.asarray(order)], docs.__getitem__, sp=sp, cp=cp, sp_kind=kind.name, loss_norm=1.0,
        media=lambda i: media.get(i, {}), rope=rope, pad_images=pad_images,
    )  # fmt: skip
    total = batch.input_ids.shape[1]
    if sp > 1:
        batch = kind.shard(batch, sp, ctx.rank).replace(sp_group=SPCall.of(ctx, kind))
    part = batch.positions_in_pack().to(device)
    batch = batch.to(device)
    bounds = np.r_[0, np.cumsum([len(docs[i][0]) for i in order])]
    doc_of = torch.as_tensor(np.searchsorted(bounds, np.arange(total), side="right") - 1, device=device)[part]
    rows = {k: np.repeat(np.arange(len(order)), [media[i][k].shape[0] if i in media and k in media[i] else 0
                                                   for i in order]) for k in PIXELS}  # fmt: skip
    return dict(batch=batch, ctx=ctx, kind=kind, total=total, part=part, bounds=bounds, doc_of=doc_of, docs=order,
                pad_images=pad_images, sizes={i: {k: v for k, v in media.get(i, {}).items() if k in SIZED}
                                              for i in order},
                pixel_doc={k: torch.as_tensor(v, device=device) for k, v in rows.items()})  # fmt: skip


SIZED = ("image_sizes", "pixel_attention_mask")  # what says each image's own size, where the pack pads it


def _with_pixel_leaves(batch):
    """``batch`` with its pixels as leaves, and those leaves (empty for a text pack)."""
    if batch.mm is None:
        return batch, {}
    mm = dict(batch.mm)
    leaves = _pixel_leaves(mm)
    return batch.replace(mm=mm), leaves


def _leak(module, embed, pack, device) -> float:
    """Largest gradient of one document's loss on the other documents' embeddings, relative to its
    own, over the SP group; documents from the last (which sees every earlier one) back, stopping
    at the first leak (the ranks agree after each one, so they run the same passes)."""
    batch, pixels = _with_pixel_leaves(pack["batch"])
    embed_grad_max = 0.0
    for j, mine, loss_j, leaf, retain in _document_losses(module, embed, batch, pack, device):
        g, *gp = torch.autograd.grad(loss_j, [leaf, *pixels.values()], retain_graph=retain)
        outside = [(g[0] * (1 - mine[:, None])).abs().max().item()]
        inside = [(g[0] * mine[:, None]).abs().max().item()]
        for key, grad in zip(pixels, gp):  # another document's pixels: exactly no gradient either
            own = (pack["pixel_doc"][key] == j).reshape(-1, *[1] * (grad.dim() - 1))
            outside.append((grad * ~own).abs().max().item())
            inside.append((grad * own).abs().max().item())
        outside, inside = _agree(np.array([max(outside), max(inside)]), device)
        embed_grad_max = max(embed_grad_max, outside / max(inside, 1e-30))
        if embed_grad_max > LEAK_TOLERANCE:
            break
    return float(embed_grad_max)


def _document_losses(module, embed, batch, pack, device):
    """(document, its positions, its loss, the embedding leaf, whether the graph is kept) from the last
    document back. One forward serves them all: the loss's gradient on per-position weights of 1 is each
    position's cross-entropy, still a function of the inputs, and a document's loss is its positions'
    share. Where a backward cannot run twice over one graph, each document runs a forward of its own."""
    order = reversed(range(len(pack["bounds"]) - 1))
    if not _graph_serves_twice(module):
        for j in order:
            mine = (pack["doc_of"] == j).float()
            with _embedding_leaves(embed) as leaves:
                loss_j, _, _ = module.packed_loss(batch, weights=mine, router_loss=False, recompute=False)
            yield j, mine, loss_j, leaves[-1], False
        return
    weight = torch.ones(pack["doc_of"].shape[0], device=device, requires_grad=True)
    with _embedding_leaves(embed) as leaves:
        total, _, _ = module.packed_loss(batch, weights=weight, router_loss=False, recompute=False)
    (token_ce,) = torch.autograd.grad(total, weight, create_graph=True, allow_unused=True)
    if token_ce is None:  # a shard without a supervised position: its loss (0) still runs the backward's collectives
        token_ce = total * weight.detach()
    for j in order:
        mine = (pack["doc_of"] == j).float()
        yield j, mine, (token_ce * mine).sum(), leaves[-1], True


def _graph_serves_twice(module) -> bool:
    """Whether a second backward over the forward's graph is exact: not under ZeRO-3, which frees the
    weights it gathered for a layer's backward, nor with Liger's kernels, whose SwiGLU backward writes its
    gradients into the tensors it saved, nor through compiled modules (``compile``), whose backward donates
    the buffers it saved and runs once, never under ``create_graph``."""
    if zero3_partitioned([module.model]):
        return False
    if any(getattr(m, "_compiled_call_impl", None) is not None for m in module.model.modules()):
        return False
    return not (getattr(module, "hparams", None) or {}).get("liger", False)


def _packed_errors(
    module, embed, reference, pack, device, used: set[int], excuse: bool
) -> tuple[float, float, int, int, str]:
    """(relative loss error, relative input-gradient error: embeddings, and pixels when the pack has
    images; documents left out, documents rerouted, where this shard's embedding gradients differ most)
    of this rank's shard of the pack. With ``excuse``, the documents a rounding tie sent a token or two of
    to other experts (``_rerouted``) are left out while they are at most half of them: the pack runs
    again with their loss weighted 0."""
    n_docs = len(pack["docs"])
    loss, grad, grad_pixels, routes = _packed_run(module, embed, pack, 1.0, used)
    counts = _agree(_rerouted(reference, pack, routes), device)  # every rank decides alike (ZeRO-3 gathers)
    rerouted = counts > 0
    ties = rerouted & (counts <= np.maximum(_TIE_TOKENS, _TIE_SHARE * _decisions(reference, pack, len(routes))))
    keep = torch.ones(n_docs + 1, device=device)  # the last: positions past the documents (padding)
    left_out = int(ties.sum()) if excuse and ties.any() and ties.sum() <= n_docs // 2 else 0
    if left_out:
        keep[:n_docs][torch.as_tensor(ties, device=device)] = 0
        loss, grad, grad_pixels, _ = _packed_run(module, embed, pack, keep[pack["doc_of"]], set())
    # The same quantities from the documents alone, laid out like the pack, cut to this shard.
    total, bounds, part = pack["total"], pack["bounds"], pack["part"]
    ce_ref = torch.zeros(total, device=device, dtype=torch.float64)
    grad_ref = torch.zeros(total, grad.shape[-1], device=device, dtype=torch.float64)
    for k, i in enumerate(pack["docs"]):
        if keep[k]:
            ce, g = reference[i]["ce"], reference[i]["grad"]
            ce_ref[bounds[k] : bounds[k + 1] - 1] = ce.double()
            grad_ref[bounds[k] : bounds[k + 1]] = g.double()
    want_loss = ce_ref[part].sum()
    loss_err = abs(loss.item() - want_loss.item()) / max(abs(want_loss.item()), 1e-12)
    errors = [_errors(grad[0], grad_ref[part])]
    row = int((grad[0].double() - grad_ref[part]).abs().amax(-1).argmax())
    k, at = int(pack["doc_of"][row]), int(part[row])
    where = (
        f", most at token {at - bounds[k]} of document {k} ({bounds[k + 1] - bounds[k]} tokens long)"
        if k < n_docs else ""
    )  # fmt: skip
    for key, got in grad_pixels.items():  # laid out (and tile- or size-padded) as the pack lays out the pixels
        parts = [
            {key: reference[i]["pixels"][key].cpu() * float(keep[k]), **pack["sizes"].get(i, {})}
            for k, i in enumerate(pack["docs"]) if key in reference[i]["pixels"]
        ]  # fmt: skip
        want = collate_media(parts, [0] * len(parts), 0, pad_images=pack["pad_images"])[key].to(device)
        errors.append(_errors(got, want))
    return loss_err, max(errors), left_out, int(rerouted.sum()), where


# A rounding tie reroutes a token or two of a document (in one layer or the next); a packing error, most.
_TIE_TOKENS, _TIE_SHARE = 2, 0.02


def _packed_run(module, embed, pack, weights, used: set[int]):
    """The pack's loss (``weights``: one number or one per position of this shard), the gradients with
    respect to its embeddings and pixels (summed over the SP group's encoders), and each experts layer's
    chosen experts per row of this shard."""
    batch, pixels = _with_pixel_leaves(pack["batch"])
    with _embedding_leaves(embed) as leaves, _routes(module.model) as routes:
        loss, _, _ = module.packed_loss(batch, weights=weights, router_loss=False, recompute=False)
    _weights_in_graph(loss, used)
    grad, *grad_pixels = torch.autograd.grad(loss, [leaves[-1], *pixels.values()])
    if pack["ctx"] is not None:  # under SP a rank's pixels get the gradient of the images it encoded
        for g in grad_pixels:
            torch.distributed.all_reduce(g, group=pack["ctx"].group)
    return loss, grad, dict(zip(pixels, grad_pixels)), routes


def _rerouted(reference, pack, routes) -> np.ndarray:
    """Per document of the pack, how many (token, experts layer) choices differ from the document alone,
    summed over the SP group (each rank sees its shard's rows). Layers whose rows do not line up with the
    pack's (a family routing another layout) are not compared."""
    n_docs, part, doc_of = len(pack["docs"]), pack["part"], pack["doc_of"]
    counts = torch.zeros(n_docs + 1, dtype=torch.float64, device=doc_of.device)
    for layer, seen in enumerate(routes):
        alone = [reference[i]["routes"][layer] if layer < len(reference[i]["routes"]) else None for i in pack["docs"]]
        if len(seen) != 1 or any(a is None for a in alone) or seen[0].shape[0] != len(part):
            continue
        want = torch.cat(alone)
        pad = torch.full((pack["total"] - want.shape[0], want.shape[1]), -1, dtype=want.dtype, device=want.device)
        want = torch.cat([want, pad])[part]
        if want.shape != seen[0].shape:
            continue
        differ = (want != seen[0]).any(-1) & (want[:, 0] >= 0)
        counts += torch.bincount(doc_of[differ], minlength=n_docs + 1).double()
    if pack["ctx"] is not None:
        torch.distributed.all_reduce(counts, group=pack["ctx"].group)
    return counts[:n_docs].cpu().numpy()


def _decisions(reference, pack, n_layers: int) -> np.ndarray:
    """Per document of the pack, its (token, experts layer) choices: its length times the layers."""
    return np.array([len(reference[i]["ce"]) + 1 for i in pack["docs"]], dtype=np.float64) * max(n_layers, 1)


def _experts_calls(net) -> list[tuple[torch.nn.Module, str, int]]:
    """transformers' experts modules of ``net``: (module, the argument with each token's chosen experts, its
    position among the forward's arguments)."""
    found = []
    for m in net.modules():
        try:
            names = list(inspect.signature(type(m).forward).parameters)[1:]
        except (TypeError, ValueError):
            continue
        arg = next((n for n in ROUTE_ARGS if n in names), None)
        if arg is not None:
            found.append((m, arg, names.index(arg)))
    return found


@contextlib.contextmanager
def _routes(net):
    """While active, each experts call adds its tokens' chosen experts ([rows, k], sorted per row) to its
    layer's list; yields the lists (one per experts module, empty for a dense model)."""
    calls = _experts_calls(net)
    seen: list[list[torch.Tensor]] = [[] for _ in calls]

    def recorder(layer: int, arg: str, pos: int):
        def hook(module, args, kwargs):
            idx = kwargs.get(arg, args[pos] if len(args) > pos else None)
            if isinstance(idx, torch.Tensor):
                seen[layer].append(idx.detach().reshape(-1, idx.shape[-1]).sort(-1).values)

        return hook

    handles = [
        m.register_forward_pre_hook(recorder(layer, arg, pos), with_kwargs=True)
        for layer, (m, arg, pos) in enumerate(calls)
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _agree(errors: np.ndarray, device) -> np.ndarray:
    """The largest errors over all ranks, so every rank reaches the same verdict."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.as_tensor(errors, dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.cpu().numpy()
    return errors


def _explain(
    module, n_docs, sp, loss_err, grad_err, leak, loss_tol, grad_tol, dtype, rerouted: int = 0, where: str = ""
) -> str:
    family = module.model.config.model_type
    if leak > LEAK_TOLERANCE:
        suspects = sorted({type(m).__name__ for m in module.model.modules() if _suspect(type(m).__name__)})
        cause = (
            "the documents of a pack influence each other: a layer ignores the document boundaries (a token "
            "mixer other than attention"
            + (f", e.g. {', '.join(suspects[:4])}" if suspects else "")
            + "; attention outside transformers' AttentionInterface; routing that depends on other tokens)"
        )
    elif sp != 1:
        cause = f"sequence parallelism at {layout_name(sp)} changes the result, while the pack without it matches"
    else:
        cause = (
            "each document computes something else packed than alone: positions that do not restart per "
            "document, or an output head lit-hbp does not reproduce (logit scaling, soft-capping)"
        )
    measured = [f"gradient of one document's loss on the others {leak:.2e} (tolerance {LEAK_TOLERANCE:.0e})"]
    if not np.isnan(loss_err):  # a leak stops the check before the comparison with the documents alone
        measured[:0] = [
            f"summed loss by {loss_err:.2e} (tolerance {loss_tol:.0e})",
            f"input gradients by {grad_err:.2e} of their largest value (tolerance {grad_tol:.0e}){where}",
        ]
    if rerouted:
        measured.append(f"tokens of {rerouted} of the {n_docs} documents chose other experts packed than alone")
    return (
        f"self-check failed for model family {family!r} ({type(module.model).__name__}) in {dtype}: a pack of "
        f"{n_docs} short documents at {layout_name(sp)} differs from the documents trained one by one: "
        f"{', '.join(measured)}. Likely cause: {cause}. Training is refused rather than run silently "
        "wrong; use a family listed as exact in docs/families.md, or set self_check: false only if you know why this "
        "differs."
    )


def _suspect(name: str) -> bool:
    low = name.lower()
    return any(s in low for s in SUSPECTS) and "attention" not in low.replace("linearattention", "")
