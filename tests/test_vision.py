"""Vision-language packs: records with images packed into one call train exactly as each record alone.

The reference is independent: each record alone through the unprepared model with eager attention,
fp32, its own forward computing its own positions (multimodal RoPE included) and image features. Tiny
checkpoint folders are written as users' folders look (``tests/vision_models.py``).
"""

import copy
import functools
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModelForImageTextToText
from vision_models import (
    BUILDERS,
    DEFAULT_BUILT,
    DEFAULT_BUILT_VIDEOS,
    HYBRID_VLMS,
    MASKED_IMAGES,
    assert_same_grads,
    build_default,
    counted_records,
    image,
    masked_records,
    patch_records,
    record,
    three_records,
    trained,
    video_records,
)

from lit_hbp import pack_inputs, pack_samples, packed_loss, prepare_model
from lit_hbp.model.packed_call import record_of

EXACT = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next"]
RECORDS = {"images": three_records, "videos": video_records}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return {family: build(root / family) for family, build in BUILDERS.items()}


def pair(folder, backend: str = "auto"):
    """(the unprepared model with eager attention, a prepared copy with the same weights), fp32."""
    reference = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").float()
    model = prepare_model(AutoModelForImageTextToText.from_pretrained(folder).float(), attn_backend=backend)
    model.load_state_dict(reference.state_dict())
    return reference, model


def alone_ce(reference, records) -> torch.Tensor:
    """Summed cross-entropy of each record alone (its own forward), image placeholders untrained."""
    ce = 0.0
    for rec in records:
        labels = rec["labels"][0]
        inputs = {k: v for k, v in rec.items() if k != "labels"}
        logits = reference(**inputs, use_cache=False).logits[0, :-1].float()
        ce = ce + F.cross_entropy(logits, labels[1:], reduction="sum", ignore_index=-100)
    return ce


CASES = [(f, "images") for f in EXACT] + [(f, "videos") for f in ("qwen2_vl", "qwen2_5_vl")]


@pytest.mark.parametrize(("family", "media"), CASES)
def test_a_pack_of_image_records_trains_like_each_record_alone(folders, family, media):
    """pack_samples over three processor-style records (images: one image; two images of other sizes; text
    only. videos: a video of 4 temporal patches; an image; a video of 2) and packed_loss(loss="sum") on the
    prepared model: the summed cross-entropy to 1e-5 and every parameter's gradient (vision tower and
    projector included) to 1e-4 of the records alone. A tensor whose gradient is zero in exact arithmetic
    (an attention's key bias: softmax ignores a shift) is held to 1e-4 of the layer-wide scale instead of
    its own float noise."""
    reference, model = pair(folders[family])
    records = [trained(r, reference.config) for r in RECORDS[media](folders[family])]
    want = alone_ce(reference, records)
    want.backward()
    batch = pack_samples(records, model=model)
    out = packed_loss(model, batch, "sum")
    out.loss.backward()
    assert float(out.ce_sum) == pytest.approx(float(want), rel=1e-5)
    assert assert_same_grads(model, reference) > 0, "the vision tower must train through the pack"


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_next"])
def test_a_level_that_checkpoints_checkpoints_the_vision_tower_too_and_stays_exact(folders, family):
    """A level with checkpointed layers checkpoints every vision tower block in its packed calls (a block
    keeps per patch what a decoder layer keeps per token): each block runs its forward again in the
    backward, what the tower keeps until then shrinks to the blocks' inputs, and the loss and every
    gradient stay the records alone's. A level without checkpointing runs each block once; outside the
    call the blocks' own flags are back."""
    from live_bytes import LiveBytes

    from lit_hbp.model.vision import vision_tower

    reference, model = pair(folders[family])
    records = [trained(r, reference.config) for r in three_records(folders[family])]
    want = alone_ce(reference, records)
    want.backward()
    blocks = record_of(model).blocks
    assert blocks and all(b in list(vision_tower(model).modules()) for b in blocks)
    runs = []  # a block's first linear layer counts its forwards (recomputation runs the block's forward again)
    first = [next(m for m in b.modules() if isinstance(m, torch.nn.Linear)) for b in blocks]
    hooks = [m.register_forward_hook(lambda *_: runs.append(1)) for m in first]
    kept = {}
    for ckpt in (0, 2):
        model.zero_grad(set_to_none=True)
        runs.clear()
        batch = pack_samples(records, model=model).replace(ckpt_layers=ckpt)
        meter = LiveBytes()
        meter.track(model.parameters())
        with meter:
            before = meter.now()
            out = packed_loss(model, batch, "sum")
            kept[ckpt] = meter.now() - before
        forwards = len(runs)
        out.loss.backward()
        assert float(out.ce_sum) == pytest.approx(float(want), rel=1e-5)
        assert assert_same_grads(model, reference) > 0
        assert forwards > 0 and len(runs) == (2 * forwards if ckpt else forwards), (ckpt, forwards, len(runs))
    for h in hooks:
        h.remove()
    assert kept[2] < kept[0], kept
    assert not any(b.gradient_checkpointing for b in blocks)


def test_the_tower_keeps_its_own_attention_in_a_packed_call_even_on_a_config_the_decoder_reads(folders):
    """The images are encoded inside the packed call (its blocks checkpoint with the level), forward and
    recomputation, with every config naming its own attention: a family whose tower read a config the
    decoder reads too (made so here by listing the tower's among the decoder's) still encodes with its
    own non-causal attention, the loss and every gradient the records alone's."""
    from lit_hbp.model.vision import vision_tower

    reference, model = pair(folders["qwen2_vl"])
    records = [trained(r, reference.config) for r in three_records(folders["qwen2_vl"])]
    want = alone_ce(reference, records)
    want.backward()
    from lit_hbp.model import calls

    record = record_of(model)
    tower = vision_tower(model).config
    record.configs.append((tower, tower._attn_implementation))
    calls.install(type(tower))  # as prepare_model routes each config the decoder reads
    try:
        for ckpt in (0, 1):  # the blocks' forward in the encoding; and run again in the checkpoint's recompute
            model.zero_grad(set_to_none=True)
            out = packed_loss(model, pack_samples(records, model=model).replace(ckpt_layers=ckpt), "sum")
            out.loss.backward()
            assert float(out.ce_sum) == pytest.approx(float(want), rel=1e-5)
            assert assert_same_grads(model, reference) > 0
    finally:
        record.configs.pop()


def stand_in_flash(calls_seen: list):
    """A CPU stand-in for transformers' flash attention (its name has "flash", so Qwen's towers hand it
    their images' ``cu_seq_lens``): non-causal attention within each image, by sdpa, each call noted."""

    def attend(module, q, k, v, attention_mask=None, scaling=None, dropout=0.0, **kw):
        calls_seen.append(kw.get("cu_seq_lens_q"))
        cu = kw.get("cu_seq_lens_q")
        bounds = [(0, q.shape[2])] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist()))
        out = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=scaling)
                         for a, b in bounds], dim=2)  # fmt: skip
        return out.transpose(1, 2).contiguous(), None

    return attend


def exact_with_tower_calls(model, reference, records, seen: list):
    """On a level without and with checkpointing, the pack's loss and every gradient against the records alone
    (the vision tower's included); per level (ckpt, the tower calls ``seen`` noted in the forward, all of them)."""
    want = alone_ce(reference, records)
    want.backward()
    out = []
    for ckpt in (0, 1):
        model.zero_grad(set_to_none=True)
        seen.clear()
        result = packed_loss(model, pack_samples(records, model=model).replace(ckpt_layers=ckpt), "sum")
        forwards = len(seen)
        result.loss.backward()
        assert float(result.ce_sum) == pytest.approx(float(want), rel=1e-5)
        assert assert_same_grads(model, reference) > 0
        out.append((ckpt, forwards, list(seen)))
    return out


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_next"])
def test_a_tower_encodes_a_packs_images_with_the_calls_flash_attention_where_chosen(folders, family, monkeypatch):
    """Where the language model's packed calls run a flash kernel (a CUDA GPU, half precision), the tower's
    configs name transformers' flash implementation of it for the call's encoding only: Qwen's towers then
    take all the pack's images in one call per layer by their ``cu_seq_lens`` (forward and recomputation),
    and the loss and every gradient stay the records alone's. A CPU stand-in plays transformers' flash
    here (``backends.tower_attention`` chooses it); outside a packed call the tower's own attention runs."""
    from transformers import AttentionInterface

    from lit_hbp.model.attention import backends

    seen: list = []
    AttentionInterface.register("flash_stand_in", stand_in_flash(seen))
    monkeypatch.setattr(backends, "tower_attention", lambda backend, device, dtype: "flash_stand_in")
    reference, model = pair(folders[family])
    records = [trained(r, reference.config) for r in three_records(folders[family])]
    assert not seen
    for ckpt, forwards, calls in exact_with_tower_calls(model, reference, records, seen):
        # one call a layer (LLaVA's tiles in one batch), again in the recomputation
        assert forwards == len(record_of(model).blocks) and len(calls) == (2 if ckpt else 1) * forwards
        if family == "qwen2_vl":  # the pack's three images (one record of one, one of two) in one call a layer
            assert all(cu is not None and len(cu) == 4 for cu in calls), calls
    seen.clear()
    with torch.no_grad():
        model(**{k: v for k, v in records[0].items() if k != "labels"}, use_cache=False)
    assert not seen, "outside a packed call the tower runs its own attention"


def test_the_tower_runs_the_language_models_varlen_kernel_where_its_packed_calls_run_one(monkeypatch):
    """``tower_attention``: on a CUDA device, transformers' flash implementation of flash-attn 2 and 3 and
    lit-hbp's tower attention for the other one-kernel backends (flash-attn 4, torch's varlen, Flex: fp32
    too); the tower's own attention on a CPU and beside the per-document loops (sdpa, eager)."""
    from lit_hbp.model.attention import backends
    from lit_hbp.model.calls import TOWER_NAME

    for chosen, want in [("flash_attn", "flash_attention_2"), ("flash_attn_3", "flash_attention_3"),
                         ("flash_attn_4", TOWER_NAME), ("torch_varlen", TOWER_NAME), ("flex", TOWER_NAME),
                         ("sdpa", None), ("eager", None)]:  # fmt: skip
        monkeypatch.setattr(backends, "decide", lambda *a, chosen=chosen: (chosen, "forced"))
        assert backends.tower_attention("auto", "cuda", torch.bfloat16) == want
        assert backends.tower_attention("auto", "cpu", torch.bfloat16) is None


def counted_tower_calls(monkeypatch, backend: str) -> list:
    """The document offsets of every both-ways (tower) call of ``backend``'s kernel, noted as it runs."""
    import dataclasses

    from lit_hbp.model.attention import backends

    seen: list = []
    kernel = backends.REGISTRY[backend]

    def run(q, k, v, a):
        if not a.causal:
            seen.append(a.cu.tolist())
        return kernel.run(q, k, v, a)

    monkeypatch.setitem(backends.REGISTRY, backend, dataclasses.replace(kernel, run=run))
    return seen


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next"])
def test_lit_hbps_tower_attention_encodes_all_of_a_packs_images_in_one_kernel_call_a_layer(
    folders, family, backend, monkeypatch
):
    """lit-hbp's tower attention (what a tower runs on a GPU beside torch's varlen, Flex or flash-attn 4),
    forced here on CPU over the model's backend setting: every tower layer encodes all of the pack's images
    in one call of that backend's kernel, both ways inside each image (Qwen's by their ``cu_seqlens``,
    Qwen2.5-VL's windowed layers by their windows; LLaVA-NeXT's tiles one document each), again in the
    checkpoint's recomputation, and the loss and every gradient stay the records alone's."""
    from lit_hbp.model.attention import backends
    from lit_hbp.model.calls import TOWER_NAME

    monkeypatch.setattr(backends, "tower_attention", lambda *a: TOWER_NAME)
    seen = counted_tower_calls(monkeypatch, backend)
    folder = folders[family]
    reference = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").float()
    model = prepare_model(AutoModelForImageTextToText.from_pretrained(folder).float(), attn_backend=backend)
    model.load_state_dict(reference.state_dict())
    records = [trained(r, reference.config) for r in three_records(folder)]
    layers = len(record_of(model).blocks)
    for ckpt, forwards, calls in exact_with_tower_calls(model, reference, records, seen):
        assert forwards == layers and len(calls) == (2 if ckpt else 1) * forwards, (forwards, layers, len(calls))
        if family.startswith("qwen"):  # the pack's three images in one call (windows: at least as many)
            assert any(len(cu) == 4 for cu in calls) and all(len(cu) >= 4 for cu in calls), calls
        else:  # LLaVA(-NeXT): every image (tile) of the pack, one document each
            assert len(set(map(len, calls))) == 1 and len(calls[0]) >= 4, calls
    seen.clear()
    with torch.no_grad():
        model(**{k: v for k, v in records[0].items() if k != "labels"}, use_cache=False)
    assert not seen, "outside a packed call the tower runs its own attention"


def test_the_tower_attention_takes_a_padding_mask_as_flash_does_and_refuses_what_it_cannot_do():
    """Called as a tower calls a flash implementation: rows of patches, a [batch, patches] padding mask
    (each row's kept patches attend both ways among themselves, padded rows give zeros), against sdpa per
    row; a 4-D mask, weights asked back or an unknown keyword are refused by name."""
    from lit_hbp.model.attention.tower import tower_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 7, 8, generator=g) for _ in range(3))
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 1:] = False
    module = torch.nn.Module().eval()
    out, weights = tower_attention(module, q, k, v, mask, scaling=0.4, is_causal=False)
    assert weights is None and out.shape == (3, 7, 2, 8)
    for b in range(3):
        n = int(mask[b].sum())
        want = F.scaled_dot_product_attention(q[b : b + 1, :, :n], k[b : b + 1, :, :n], v[b : b + 1, :, :n], scale=0.4)
        torch.testing.assert_close(out[b, :n], want[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        assert not out[b, n:].any()
    whole, _ = tower_attention(module, q, k, v, None, scaling=0.4)
    torch.testing.assert_close(whole, F.scaled_dot_product_attention(q, k, v, scale=0.4).transpose(1, 2))
    with pytest.raises(NotImplementedError, match=r"\[batch, patches\]"):
        tower_attention(module, q, k, v, torch.zeros(3, 1, 7, 7))
    with pytest.raises(NotImplementedError, match="attention weights"):
        tower_attention(module, q, k, v, None, output_attentions=True)
    with pytest.raises(NotImplementedError, match="sliding_window"):
        tower_attention(module, q, k, v, None, sliding_window=4)


@pytest.mark.parametrize("tower", ["own", "lit-hbp"])
@pytest.mark.parametrize("family", DEFAULT_BUILT + HYBRID_VLMS)
def test_a_pack_of_a_default_built_familys_records_trains_like_each_record_alone(tmp_path, family, tower, monkeypatch):
    """Families built from transformers' default config (shrunk): two records with an image each and a
    text-only record (and a 4-frame video's record, for the video families), packed, give the records
    alone's summed cross-entropy (1e-5) and every gradient, the tower's included (1e-4); with the tower's own
    attention (a CPU's) and with lit-hbp's tower attention (a GPU's beside torch's varlen, Flex, flash-attn
    4; here on the CPU's kernel). Aya Vision and Cohere2-Vision: their forward leaves the Cohere 2 language
    model's logit_scale unapplied, and so does the pack's loss."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from lit_hbp.model.attention import backends
    from lit_hbp.model.calls import TOWER_NAME

    if tower == "lit-hbp":
        monkeypatch.setattr(backends, "tower_attention", lambda *a: TOWER_NAME)

    if family not in CONFIG_MAPPING_NAMES:  # the supported range starts at 5.10, which predates some families
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    reference, model = pair(build_default(tmp_path / family, family))
    records = counted_records(tmp_path / family, videos=family in DEFAULT_BUILT_VIDEOS)
    want = alone_ce(reference, records)
    want.backward()
    out = packed_loss(model, pack_samples(records, model=model), "sum")
    out.loss.backward()
    assert float(out.ce_sum) == pytest.approx(float(want), rel=1e-5)
    assert assert_same_grads(model, reference) > 0


@pytest.mark.parametrize("family", MASKED_IMAGES)
def test_images_with_their_masks_join_a_pack_padded_as_their_processor_pads_a_batch(tmp_path, family):
    """Idefics2/3, SmolVLM and Granite-Docling take a record's images as [1, images, C, H, W] with
    ``pixel_attention_mask`` (each image's valid pixels; Granite-Docling's: which tiles are real): refused by name
    before, now a pack's records are its rows, padded with zeros to the most images and, for Idefics2 (its perceiver
    resamples an image's valid patches to a fixed count), the largest size (a record of two 32x32 images, one of them
    16 rows padded; one of a 16x16 image; one of text), and the pack equals each record alone (loss 1e-5, every
    gradient 1e-4). A record without its masks is refused by name, and so are images of different sizes where the
    connector makes features of the padding (Idefics3's, SmolVLM's, Granite-Docling's)."""
    from lit_hbp.errors import DataError

    reference, model = pair(build_default(tmp_path / family, family))
    records = masked_records(tmp_path / family)
    want = alone_ce(reference, records)
    want.backward()
    batch = pack_samples(records, model=model)
    assert tuple(batch.mm["pixel_values"].shape) == (2, 2, 3, 32, 32)
    valid = [[32 * 32, 16 * 32], [16 * 16, 0]] if family == "idefics2" else [[32 * 32, 32 * 32], [32 * 32, 0]]
    mask = batch.mm["pixel_attention_mask"]
    assert (mask.long() * 32 * 32 if family == "granite_docling" else mask.sum((2, 3))).tolist() == valid
    out = packed_loss(model, batch, "sum")
    out.loss.backward()
    assert float(out.ce_sum.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    assert assert_same_grads(model, reference) > 0
    unmasked = [{k: v for k, v in r.items() if k != "pixel_attention_mask"} for r in records]
    with pytest.raises(DataError, match=r"sample 0: its pixel_values \[1, 2, 3, 32, 32\] and "
                                        r"pixel_attention_mask None are not one record's images"):  # fmt: skip
        pack_samples(unmasked[:1] + records[1:], model=model)
    if family != "idefics2":  # their connector shuffles padded patches into features: other sizes are refused
        small = {**records[1], "pixel_values": records[1]["pixel_values"][..., :16, :16],
                 "pixel_attention_mask": records[1]["pixel_attention_mask"][..., :16, :16]
                 if family != "granite_docling" else records[1]["pixel_attention_mask"]}  # fmt: skip
        with pytest.raises(DataError, match=r"images of different sizes: 32x32 \(sample 0\), 16x16 \(sample 1\); "
                                            r"this family's connector"):  # fmt: skip
            pack_samples([records[0], small], model=model)


def test_lfm2_vls_image_patches_join_a_pack_padded_with_their_masks(tmp_path):
    """LFM2-VL takes an image as a row of SigLIP 2 patches with its ``pixel_attention_mask`` and ``spatial_shapes``
    (refused by name before): a pack's images are rows padded to its most patches (records of 4x4 and 2x4 patches,
    of 4x2, of text), and the pack equals each record alone (loss 1e-5, every gradient 1e-4), its short convolution
    layer run document by document beside attention; a record without its shapes is refused by name."""
    from lit_hbp.errors import DataError

    reference, model = pair(build_default(tmp_path / "lfm2_vl", "lfm2_vl"))
    assert reference.config.get_text_config().layer_types == ["conv", "full_attention"]
    records = patch_records(tmp_path / "lfm2_vl")
    want = alone_ce(reference, records)
    want.backward()
    batch = pack_samples(records, model=model)
    assert tuple(batch.mm["pixel_values"].shape[:2]) == (3, 16)
    assert batch.mm["pixel_attention_mask"].sum(1).tolist() == [16, 8, 8]
    assert batch.mm["spatial_shapes"].tolist() == [[4, 4], [2, 4], [4, 2]]
    out = packed_loss(model, batch, "sum")
    out.loss.backward()
    assert float(out.ce_sum.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    assert assert_same_grads(model, reference) > 0
    shapeless = {k: v for k, v in records[1].items() if k != "spatial_shapes"}
    with pytest.raises(DataError, match=r"sample 1: its pixel_values \[1, 8, 192\] .* with spatial_shapes"):
        pack_samples([records[0], shapeless], model=model)


@pytest.mark.parametrize("family", ["mistral3", "lighton_ocr"])
def test_images_of_different_sizes_join_a_pack_where_the_tower_cuts_each_back(tmp_path, family):
    """Pixtral's tower (Mistral 3, LightOnOCR) cuts each image back to its ``image_sizes``, and its processor pads a
    batch's images to one size: a pack of a 32x32 and a 16x32 image pads the second likewise and equals each record
    alone (loss 1e-5, every gradient 1e-4); without the model, pack_samples cannot know it and refuses by name."""
    from lit_hbp.errors import DataError

    reference, model = pair(build_default(tmp_path / family, family))
    records = counted_records(tmp_path / family, sizes={1: (16, 32)})
    assert [tuple(r["pixel_values"].shape[2:]) for r in records[:2]] == [(32, 32), (16, 32)]
    want = alone_ce(reference, records)
    want.backward()
    batch = pack_samples(records, model=model)
    assert tuple(batch.mm["pixel_values"].shape) == (2, 3, 32, 32)
    assert not batch.mm["pixel_values"][1, :, 16:].any()  # padded below, as the processor pads
    out = packed_loss(model, batch, "sum")
    out.loss.backward()
    assert float(out.ce_sum) == pytest.approx(float(want), rel=1e-5)
    assert assert_same_grads(model, reference) > 0
    with pytest.raises(DataError, match=r"pixel_values of different shapes: \[3, 32, 32\] \(sample 0\), \[3, 16, 32\] "
                       r"\(sample 1\), .*image_sizes \(Pixtral's: pack_samples needs the model"):  # fmt: skip
        pack_samples(records)

    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.model.selfcheck import run_self_check

    torch.manual_seed(0)
    module = HBPLitModule(model=str(tmp_path / family), loss="sum")
    module.configure_model()
    module.model.float()
    docs = [(r["input_ids"][0], {k: r[k] for k in ("pixel_values", "image_sizes")}) for r in records[:2]]
    loss_err, grad_err, leak, _ = run_self_check(module, [1], media_docs=docs)[1]  # the run's images, padded alike
    assert loss_err < 1e-5 and grad_err < 1e-4 and leak == 0.0
    # its random text documents held the image placeholder (500 of 512 ids) twice: "tokens: 8, features: 384"
    from lit_hbp.model.selfcheck import _documents

    text = torch.cat([torch.as_tensor(ids) for ids, _ in _documents(512, module.model.config, None).values()])
    assert not (text == 500).any() and text.max() >= 500


PROJECTOR = {"qwen2_vl": "visual.merger.", "qwen2_5_vl": "visual.merger.", "qwen3_vl": "visual.merger.",
             "llava": "multi_modal_projector.", "llava_next": "multi_modal_projector."}  # fmt: skip


@pytest.mark.parametrize("family", list(PROJECTOR))
def test_freeze_vision_keeps_the_encoder_and_trains_the_projector_wherever_the_family_keeps_it(folders, family):
    """Qwen-VL keeps its projector (``merger``, Qwen3-VL's deepstack mergers too) inside its vision tower, LLaVA
    beside it: either way the projector trains, as docs/vision.md says, and the encoder is frozen."""
    from lit_hbp.model.build import freeze_vision

    net = AutoModelForImageTextToText.from_pretrained(folders[family])
    freeze_vision(net)
    trains = {n: p.requires_grad for n, p in net.named_parameters()}
    projector = [n for n in trains if PROJECTOR[family] in n or "deepstack_merger_list" in n]
    encoder = [n for n in trains if (".visual." in n or ".vision_tower." in n) and n not in projector]
    assert projector and encoder
    assert all(trains[n] for n in projector) and not any(trains[n] for n in encoder)


def test_a_qwen_record_with_images_but_no_token_types_is_refused_as_the_model_alone_refuses_it(folders):
    """Records saved by an older processor lack ``mm_token_type_ids``: the unprepared model refuses such a
    record, and a pack must not number its image tokens as text positions instead."""
    reference, model = pair(folders["qwen2_vl"])
    records = [trained(r, reference.config) for r in three_records(folders["qwen2_vl"])]
    stripped = [{k: v for k, v in r.items() if k != "mm_token_type_ids"} for r in records]
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        reference(**{k: v for k, v in stripped[0].items() if k != "labels"}, use_cache=False)
    with pytest.raises(ValueError, match="record 0 of the pack has images or videos but no mm_token_type_ids"):
        pack_samples(stripped, model=model)
    text_only = pack_samples(stripped[2:], model=model)  # a record without media needs none
    assert text_only.mm is None or "pixel_values" not in text_only.mm


@pytest.mark.parametrize("family", ["llava", "llava_next", "qwen2_vl", "qwen2_5_vl"])
def test_a_record_whose_image_is_in_another_record_of_the_pack_is_refused(folders, family):
    """Record A: two images' placeholders, one image's pixels; record B: no placeholder, the other image's pixels.
    Alone the unprepared model refuses each; the pack's totals agree, so the family's own check passed it and B's
    image trained in A's place (loss 322.61 = A with both images + B as text, LLaVA). Refused, naming the record:
    by its placeholders against its own images' encodings, or (Qwen) its patch rows against its grids."""
    reference, model = pair(folders[family])
    two = record(folders[family], [image(1, 24, 40), image(2, 24, 40)], "compare", "same")
    a, b = dict(two), dict(record(folders[family], [], "the quick brown fox", "a"))
    grid = "image_grid_thw" if family.startswith("qwen") else "image_sizes"
    cut = two["pixel_values"].shape[0] // 2 if family.startswith("qwen") else 1
    a["pixel_values"], b["pixel_values"] = two["pixel_values"][:cut], two["pixel_values"][cut:]
    if grid in two and family.startswith("llava"):
        a[grid], b[grid] = two[grid][:1], two[grid][1:]
    a, b = trained(a, reference.config), trained(b, reference.config)
    for alone in (a, b):
        with pytest.raises(Exception):  # noqa: B017  (each family refuses it its own way)
            reference(**{k: v for k, v in alone.items() if k != "labels"}, use_cache=False)
    expected = (
        "patch rows" if family.startswith("qwen") else "sample 0 of the pack: .* image placeholder tokens for its 1"
    )
    with pytest.raises(ValueError, match=expected):
        packed_loss(model, pack_samples([a, b], model=model), "sum")
    ok = trained(two, reference.config)  # the records as the processor gave them: trained, as alone
    got = packed_loss(model, pack_samples([ok, trained(record(folders[family], [], "hi", "a"), reference.config)],
                                          model=model), "sum").ce_sum  # fmt: skip
    want = alone_ce(reference, [ok, trained(record(folders[family], [], "hi", "a"), reference.config)])
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-4)


def test_a_pack_of_llava_onevision_records_trains_like_each_record_alone(tmp_path):
    """LLaVA-OneVision (anyres tiles for a record's single image, the base tile of each image of a record
    of several: ``batch_num_images`` kept per record in the pack): the loss to 1e-5 and every gradient to
    1e-4 of the records alone."""
    from vision_models import build_llava, needs_torchvision

    needs_torchvision("llava_onevision")
    reference, model = pair(build_llava(tmp_path / "llava_onevision", "llava_onevision"))
    records = [trained(r, reference.config) for r in three_records(tmp_path / "llava_onevision")]
    want = alone_ce(reference, records)
    want.backward()
    batch = pack_samples(records, model=model)
    assert batch.mm["batch_num_images"].tolist() == [1, 2]  # the text-only record has none
    out = packed_loss(model, batch, "sum")
    out.loss.backward()
    assert float(out.ce_sum) == pytest.approx(float(want), rel=1e-5)
    assert assert_same_grads(model, reference) > 0


FAMILIES_MD = Path(__file__).resolve().parents[1] / "docs" / "families.md"
# The image-text families the tests here build and train exactly (the compatibility part of the CI has
# LLaVA-OneVision: its processor needs torchvision), with what the tests cover.
VLM_TESTED = {
    "qwen2_vl": "images and videos, sp 1 and 2 (frames split over the SP group); the data path, videos at sp 2 too",
    "qwen2_5_vl": "images and videos, sp 1 and 2 (frames split over the SP group); the data path for videos, sp 2 too",
    "qwen3_vl": "images, sp 1 and 2 (deepstack features moved with the features); the data path for videos, sp 2 too",
    "llava": "images, sp 1 and 2",
    "llava_next": "images (anyres tiles), sp 1 and 2; the data path, the demo",
    "llava_onevision": "images, sp 1 and 2 (a record's images encoded together); videos of one frame count",
    **{family: "images, sp 1 and 2 (its default config, shrunk)" for family in DEFAULT_BUILT},
    **{family: "images and videos, sp 1 (its default config, shrunk)" for family in DEFAULT_BUILT_VIDEOS},
    **{family: "images, sp 1 and 2 (its default config, shrunk); images of different sizes in a pack"
       for family in ("mistral3", "lighton_ocr")},  # test_images_of_different_sizes_join_a_pack_..., test_vision_sp
    **{family: "images, sp 1 and Ulysses sp 2; its Gated DeltaNet layers run document by document beside full "
               "attention (its default config, shrunk)" for family in HYBRID_VLMS},
    "qwen3_vl_moe": "images, sp 1 and 2 (its default config, shrunk: a tower of no deepstack layer)",
    "video_llava": "images and videos, sp 1 and 2 (its default config, shrunk; a video's frames dealt together)",
    "llava_next_video": "images and videos, sp 1 and 2 (its default config, shrunk)",
    **{omni: "images, sp 1 and 2 (its default config, shrunk; numbered by its vision start tokens)"
       for omni in ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")},
    "lfm3_vl": "images, sp 1 and Ulysses sp 2; its short convolution layers run document by document beside full "
               "attention (its default config, shrunk)",
    "granite4_vision": "images, sp 1 and 2 (its default config, shrunk: deepstack (layer, features) pairs, no pooled "
                       "output)",
    "hunyuan_vl": "images, sp 1 and 2 (its default config, shrunk; its four multimodal RoPE axes handed to its "
                  "language model alone in a prepared model's packed call)",
    "lfm2_vl": "images, sp 1 and Ulysses sp 2 (its default config, shrunk, a short convolution layer beside "
               "attention; an image's patches with their pixel_attention_mask and spatial_shapes, padded to the pack's "
               "most); the data path with its processor",
    "idefics2": "images, sp 1 and 2 (its default config, shrunk; a record's images with their pixel_attention_mask, "
                "padded to the pack's most images and largest size)",
    **{family: "images, sp 1 and 2 (its default config, shrunk; a record's images with their pixel_attention_mask, "
               "padded to the pack's most images; images of different sizes refused)" + data
       for family, data in (("idefics3", "; the data path with its processor"), ("smolvlm", ""),
                            ("granite_docling", ""))},
    "ernie4_5_vl_moe": "images, sp 1 and 2 (its default config, shrunk; its text and vision experts routed by "
                       "moe_mm_token_type_ids); the data path with its processor",
    "ovis2_5": "images, sp 1 (its default config, shrunk); its image packs refused on SP levels (its forward checks a "
               "call's image start and end tokens against its feature blocks, which a shard does not keep)",
}  # fmt: skip


@functools.cache
def meta_model(family: str):
    """The family's model of its default config, built on the meta device with no weight initialization (its
    modules only: what the table reads off it), once per family (``vlm_families`` forgets them when it is done);
    None where the config or model cannot be built."""
    from transformers.initialization import no_init_weights

    with warnings.catch_warnings(), no_init_weights(), torch.device("meta"):
        warnings.simplefilter("ignore")
        try:
            return AutoModelForImageTextToText.from_config(AutoConfig.for_model(family))
        except Exception:  # noqa: BLE001 (left to the self-check, as the table says)
            return None


def read_meta(family: str, read, otherwise=None):
    """``read`` of the family's model (its default config, built on the meta device), warnings quiet; ``otherwise``
    where the model cannot be built or ``read`` fails (left to the self-check, as the table says)."""
    model = meta_model(family)
    if model is None:
        return otherwise
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        try:
            return read(model)
        except Exception:  # noqa: BLE001
            return otherwise


def stateful_mixer_kind(family: str) -> str | None:
    """The kind of the first token mixer in the family's language model that carries state across documents and
    that lit-hbp cannot run document by document, or None (none, or the config cannot be built)."""
    from lit_hbp.model.build import decoder_of
    from lit_hbp.model.mixers import stateful_mixers

    refused = [m for m in read_meta(family, lambda model: stateful_mixers(decoder_of(model)), []) if not m.per_document]
    return refused[0].kind if refused else None


SIDE_BY_SIDE = "its vision tower sits beside its language model on the top module, a layout lit-hbp does not run"


def unseen_refusal(family: str) -> str | None:
    """What ``prepare_model``'s family checks refuse in the family's language model, as the table says it: the
    message's reason, its family and ending cut; None where they pass or the model cannot be built."""
    from lit_hbp.model.build import decoder_of
    from lit_hbp.model.family_checks import refuse_unseen

    def refusal(model) -> str | None:
        try:
            refuse_unseen(model, decoder_of(model), family, set(), False)
        except ValueError as e:
            return str(e).removeprefix(f"{family}: ").split(", so a pack's documents")[0] + " (prepare_model)"
        return None

    return read_meta(family, refusal)


def tower_beside_language_model(family: str) -> bool:
    """Whether the family's model holds its vision tower on the top module beside its language model, with no inner
    model encoding images (False: it cannot be built)."""
    from lit_hbp.model.vision import tower_beside_language_model as beside

    return read_meta(family, lambda model: beside(model) is not None, False)


def vlm_families() -> dict[str, tuple[str, str]]:
    """Every image-text-to-text family transformers registers, with what lit-hbp does with a pack of its
    images: exact (tested here), refused (by ``prepare_model`` for a stateful token mixer in its language
    model or a vision tower beside it on the top module, by ``refuse_bidirectional`` or ``check_encoder_outputs``,
    the reason), or decided by the
    start-of-fit self-check on the run's own images (not built here)."""
    import inspect

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, MODEL_MAPPING_NAMES

    from lit_hbp.model.vision import BIDIRECTIONAL, unpacked_image_args

    out = {}
    for family in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        base = getattr(transformers, MODEL_MAPPING_NAMES.get(family) or "", None)
        forward = inspect.signature(base.forward).parameters if base is not None else {}
        if family in VLM_TESTED:
            out[family] = ("exact", VLM_TESTED[family])
        elif kind := stateful_mixer_kind(family):
            why = f"its language model holds {kind}, carrying state across documents (prepare_model)"
            out[family] = ("refused", why)
        elif family in BIDIRECTIONAL:
            out[family] = ("refused", BIDIRECTIONAL[family])
        elif base is not None and "mm_encoder_outputs" not in forward:
            out[family] = ("refused", "its forward takes no image features computed apart (mm_encoder_outputs)")
        elif base is not None and unpacked_image_args(base):
            out[family] = ("refused", unpacked_image_args(base))
        elif tower_beside_language_model(family):
            out[family] = ("refused", f"{SIDE_BY_SIDE} (prepare_model)")
        elif why := unseen_refusal(family):
            out[family] = ("refused", why)
        else:
            out[family] = ("self-check", "")
    meta_model.cache_clear()
    return out


@pytest.mark.slow
def test_the_vision_language_family_table_is_what_the_code_decides():
    """docs/families.md's table of image-text families is, row for row, what ``vlm_families`` finds in
    this transformers (a new family shows up as a missing row)."""
    section = FAMILIES_MD.read_text().split("## Vision-language families", 1)[1]
    rows = re.findall(r"^\| `([\w.-]+)` \| (exact|refused|self-check) \| (.*?) \|$", section, re.M)
    table = {family: (status, note) for family, status, note in rows}
    assert table == vlm_families()


@pytest.mark.parametrize("family", ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker", "qwen3_vl_moe", "hunyuan_vl"])
def test_a_loader_workers_stand_in_numbers_each_records_positions_as_the_model_does(tmp_path, family):
    """A DataLoader worker numbers multimodal positions without the model, on a stand-in built from the config
    (``media.rope_stand_in``): for the Qwen Omni thinkers it looked for a module named after the thinker's model type
    (ModuleNotFoundError) and lacked the merge size their model sets in ``__init__`` (AttributeError), so a data
    module's loader stopped. Each record's positions equal the built model's own numbering (HunYuan-VL's four axes
    too)."""
    from lit_hbp.data.media import rope_stand_in
    from lit_hbp.data.media_batch import MRopePositions, media_of

    folder = build_default(tmp_path / family, family)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    own, stand_in = MRopePositions.of(model), MRopePositions(rope_stand_in(AutoConfig.from_pretrained(folder)))
    for i, rec in enumerate(counted_records(folder)):
        ids = rec["input_ids"][0].numpy()
        media = media_of(rec, i, len(ids))
        assert torch.equal(stand_in.rows(ids, media), own.rows(ids, media))


def test_multimodal_rope_positions_need_the_model(folders):
    records = [trained(r, AutoConfig.from_pretrained(folders["qwen2_vl"])) for r in three_records(folders["qwen2_vl"])]
    with pytest.raises(
        ValueError, match=r"sample 0: records with image_grid_thw .*pack_samples\(samples, model=model\)"
    ):
        pack_samples(records)


def test_a_family_whose_image_tokens_attend_both_ways_is_refused_with_images(folders):
    """Gemma 3: an image's tokens attend to each other both ways, which a causal kernel per document
    does not compute: a pack with images is refused (packed_loss and a packed call alike); a pack of
    text-only records trains exactly."""
    reference, model = pair(folders["gemma3"])
    records = [trained(r, reference.config) for r in three_records(folders["gemma3"])]
    batch = pack_samples(records, model=model)
    with pytest.raises(ValueError, match=r"gemma3.*attend to each other both ways"):
        packed_loss(model, batch, "sum")
    with pytest.raises(ValueError, match=r"gemma3.*attend to each other both ways"):
        model(**pack_inputs(batch))
    text = [records[2], {**records[2], "token_type_ids": torch.zeros_like(records[2]["input_ids"])}]
    want = alone_ce(reference, text)
    out = packed_loss(model, pack_samples(text, model=model), "sum")
    assert float(out.ce_sum) == pytest.approx(float(want), rel=1e-5)


def test_a_model_whose_forward_takes_no_encoder_outputs_is_refused_with_images():
    """Images are encoded apart from the packed call and handed to the model's forward as
    ``mm_encoder_outputs`` (transformers 5.18 on); a forward without it (Kosmos-2's here; every family's on
    transformers 5.17, the GPU image's) would run the tower inside the packed call: refused, naming it."""
    from transformers import Kosmos2Config, Kosmos2Model

    from lit_hbp.model.vision import check_encoder_outputs

    config = Kosmos2Config(
        text_config={"embed_dim": 32, "layers": 1, "attention_heads": 2, "ffn_dim": 64, "vocab_size": 100},
        vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64},
        latent_query_num=4,
    )
    with pytest.raises(ValueError, match=r"Kosmos2Model.forward takes no mm_encoder_outputs .*cannot train on images"):
        check_encoder_outputs(Kosmos2Model(config))


@pytest.mark.parametrize(("family", "text_forward"), [("nemotron_h_omni", True), ("llama4", False)])
def test_a_vision_tower_beside_the_language_model_is_refused_for_that_layout_and_its_language_model_trains(
    family, text_forward
):
    """Nemotron-H Omni and Llama 4 hold ``language_model`` and ``vision_model`` on the top module (no inner
    ``model`` encoding images). ``prepare_model`` refuses that layout by name, the model left as it was; it used to
    say the tower ran between the decoder and the output layer, which Nemotron-H Omni's own text-only forward never
    does (a hook counts its calls; Llama 4's raises in transformers 5.24). Its language model, prepared alone as the
    refusal says, trains a pack as each document alone through the unprepared language model (Nemotron-H's
    Mamba2 run document by document)."""
    import numpy as np
    from conftest import separate_loss
    from vision_models import _TEXT, _VISION, _keep_layer_kinds, _shrink

    config = AutoConfig.for_model(family)
    text = config.get_text_config()
    _shrink(text, _TEXT)
    _keep_layer_kinds(text)
    for sub in (config.vision_config, getattr(config, "audio_config", None)):
        if sub is not None:
            _shrink(sub, _VISION)
    torch.manual_seed(0)
    net = AutoModelForImageTextToText.from_config(config).eval()
    calls = []
    net.vision_model.register_forward_hook(lambda *_: calls.append(1))
    if text_forward:
        with torch.no_grad():
            net(input_ids=torch.arange(3, 40)[None], use_cache=False)
    assert calls == []
    with pytest.raises(ValueError, match=rf"^{family}: its `vision_model` \(\w+\) sits beside its language model"):
        prepare_model(net)
    assert record_of(net) is None and not hasattr(net.language_model, "_hbp_prepared")
    message = str(pytest.raises(ValueError, prepare_model, net).value)
    assert "a vision-language layout lit-hbp does not run" in message and "prepare its `language_model`" in message
    language = net.language_model
    reference = copy.deepcopy(language)
    reference.set_attn_implementation("eager")
    rng = np.random.default_rng(0)
    docs = [(rng.integers(3, text.vocab_size, n), np.ones(n, bool)) for n in (37, 5, 30)]
    with torch.no_grad():
        want = float(separate_loss(reference, dict(enumerate(docs))))
        got = float(packed_loss(prepare_model(language).eval(), pack_samples(docs), "sum").ce_sum)
    assert abs(got - want) <= 1e-5 * abs(want)


def test_a_model_whose_image_encoder_lit_hbp_cannot_call_is_refused_with_images():
    """lit-hbp encodes a pack's images with the model's own ``get_image_features`` and the fields it packs:
    a model without one, or whose one needs another field (MiniCPM-V's ``target_sizes`` here), is refused
    by name, as the set-up of a run with images refuses it (``check_encoder_outputs``)."""
    from lit_hbp.model.vision import check_encoder_outputs

    class Needs(torch.nn.Module):
        def forward(self, input_ids, mm_encoder_outputs=None):
            return input_ids

        def get_image_features(self, pixel_values, target_sizes, image_sizes=None, **kwargs):
            return pixel_values

    class Without(Needs):
        get_image_features = None

    with pytest.raises(ValueError, match=r"Needs: its get_image_features needs \['target_sizes'\], which lit-hbp"):
        check_encoder_outputs(Needs())
    with pytest.raises(ValueError, match=r"Without: it has no get_image_features to encode images apart"):
        check_encoder_outputs(Without())


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_outside_a_pack_a_prepared_vlm_is_the_unprepared_one(folders, family):
    """A record with its images through the model's own forward, and greedy generate() from it: the
    unprepared model's logits and tokens; the vision tower keeps its own attention (only the language
    model's config is routed in a packed call)."""
    reference, model = pair(folders[family])
    reference.eval()
    model.eval()
    rec = three_records(folders[family])[1]
    record = record_of(model)
    assert record.runner is model.model and record.decoder is model.model.language_model
    assert all(config is not model.config.vision_config for config, _ in record.configs)
    with torch.no_grad():
        got, want = model(**rec).logits, reference(**rec).logits
        assert (got - want).abs().max().item() < 1e-5
        prompt = {k: v for k, v in rec.items()}
        greedy = dict(max_new_tokens=5, do_sample=False)
        assert torch.equal(model.generate(**prompt, **greedy), reference.generate(**prompt, **greedy))


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_pack_inputs_give_each_records_logits_prepared_or_not(folders, family):
    """``model(**pack_inputs(batch))`` on the prepared model, and on an unprepared teacher (transformers'
    own packed path: positions whose text row restarts, the cache off): each record's logits alone."""
    reference, model = pair(folders[family])
    teacher = AutoModelForImageTextToText.from_pretrained(folders[family]).float().eval()
    teacher.load_state_dict(reference.state_dict())
    records = three_records(folders[family])
    batch = pack_samples([trained(r, reference.config) for r in records], model=model)
    with torch.no_grad():
        alone = [reference(**r, use_cache=False).logits[0] for r in records]
        for m in (model.eval(), teacher):
            logits = m(**pack_inputs(batch)).logits[0]
            start = 0
            for want in alone:
                got = logits[start : start + want.shape[0]]
                assert (got - want).abs().max().item() < 1e-5, type(m).__name__
                start += want.shape[0]


def test_hunyuan_vls_language_model_gets_its_rope_axes_alone_in_a_prepared_packed_call(tmp_path):
    """HunYuan-VL numbers four multimodal RoPE axes (a sequence axis, then width, height, image index) and its
    language model takes a text row before them without stripping it: a packed call's [text row, axes] raised there
    (and a pack padded its positions with three rows: a shape error). On the prepared model, packed_loss and
    ``model(**pack_inputs(batch))`` hand it its axes alone (the boundaries travel with the call): each record's
    logits alone; the unprepared model, whose own packed path cannot keep them apart without the text row, still
    refuses the call."""
    folder = build_default(tmp_path / "hunyuan_vl", "hunyuan_vl")
    reference, model = pair(folder)
    records = counted_records(folder)
    batch = pack_samples(records, model=model)
    assert batch.mm["position_ids"].shape[0] == 4
    with torch.no_grad():
        alone = [reference(**{k: v for k, v in r.items() if k != "labels"}, use_cache=False).logits[0]
                 for r in records]  # fmt: skip
        logits = model.eval()(**pack_inputs(batch)).logits[0]
        start = 0
        for want in alone:
            assert (logits[start : start + want.shape[0]] - want).abs().max().item() < 1e-5
            start += want.shape[0]
        with pytest.raises(ValueError, match=r"Expected 4 multimodal RoPE channels, got position_ids with shape \(5,"):
            reference(**pack_inputs(batch))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("family", "backend"), [(f, "auto") for f in EXACT] + [("qwen2_vl", "flex"), ("llava_next", "flex")]
)
def test_a_pack_of_image_records_on_cuda_in_bf16_matches_each_record_alone(folders, family, backend):
    """On a GPU, fp32 weights under bf16 autocast with the backend chosen there and with Flex (the vision
    tower on the same kernel: transformers' flash beside flash-attn 2/3, lit-hbp's tower attention beside
    torch's varlen and Flex, its images in one call a layer): the packed loss and every gradient as close to
    the records alone through the unprepared model with eager attention in fp32 as that model's own bf16
    run of them is (1% or twice
    its error for the loss, 5% or twice for each gradient). On transformers before 5.18 (the GPU image's
    5.17) a pack with images is refused, naming the version to install."""
    import transformers
    from packaging.version import Version

    from lit_hbp.model.attention import backends

    assert backends.tower_attention(backend, "cuda", torch.bfloat16) is not None, "the tower on the call's kernel"
    reference, model = pair(folders[family], backend)
    records = [trained(r, reference.config) for r in three_records(folders[family])]
    batch = pack_samples(records, model=model).to("cuda")  # positions numbered on the host, then moved
    reference.cuda()
    model.cuda()
    if Version(transformers.__version__) < Version("5.18"):
        with pytest.raises(ValueError, match=r"takes no mm_encoder_outputs .*pip install 'transformers>=5.18'"):
            packed_loss(model, batch, "sum")
        return
    own16 = copy.deepcopy(reference)
    on_gpu = [{k: v.cuda() for k, v in r.items()} for r in records]
    want = alone_ce(reference, on_gpu)
    want.backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = packed_loss(model, batch, "sum")
        own = alone_ce(own16, on_gpu)
    out.loss.backward()
    own.backward()
    assert abs(float(out.ce_sum) - float(want)) < max(1e-2 * abs(float(want)), 2 * abs(float(own) - float(want)))
    scale = max(q.grad.abs().max().item() for q in reference.parameters() if q.grad is not None)
    for (name, p), q, o in zip(model.named_parameters(), reference.parameters(), own16.parameters()):
        if q.grad is not None:
            norm = max(q.grad.abs().max().item(), 1e-2 * scale)
            err, own_err = ((g - q.grad).abs().max().item() / norm for g in (p.grad, o.grad))
            assert err < max(5e-2, 2 * own_err), (family, name, err, own_err)
