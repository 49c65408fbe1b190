"""Vision-language packs on sequence-parallel levels, on 2 gloo processes: each rank encodes its share of
the pack's images and gets the features of the placeholder tokens its shard holds. The summed
cross-entropy summed and every gradient (vision tower and projector included) averaged over the SP group
(as the data-parallel all-reduce averages it; a shard's loss carries the factor sp for it) equal
each record alone through the unprepared model with eager attention in one process (fp32): Ulysses
(sp 2) and context parallelism (sp 2 = cp 2)."""

import functools
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForImageTextToText
from vision_models import (
    BUILDERS,
    DEFAULT_BUILT,
    HYBRID_VLMS,
    MASKED_IMAGES,
    build_default,
    build_llava,
    counted_records,
    masked_records,
    needs_torchvision,
    patch_records,
    three_records,
    trained,
    video_records,
)

from lit_hbp.model.sp_media import Route, owners

EXACT = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next"]
RECORDS = {
    "images": three_records,
    "videos": video_records,
    "counted": counted_records,
    "sized": functools.partial(counted_records, sizes={1: (16, 32)}),  # a 32x32 and a 16x32 image
    "one image": lambda folder: counted_records(folder)[::2],  # an image's record and a text-only one
    "counted videos": functools.partial(counted_records, videos=True),  # and a 4-frame video's record
    "masked": masked_records,  # Idefics2/3, SmolVLM: a record's images padded to its largest, and their masks
    "patches": patch_records,  # LFM2-VL: an image's patches a row, padded to the record's most, and their masks
}
LAYOUTS = {"ulysses": (2, 1), "cp": (2, 2)}


@pytest.fixture
def pool(shared_pool2):
    """The session's two gloo workers (conftest's shared_pool2): starting a pool costs more than most runs."""
    return shared_pool2


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_sp")
    return {family: BUILDERS[family](root / family) for family in EXACT}


def collate(records, model, sp: int, cp: int, kind: str):
    """The whole pack of ``records`` (processor-style, with labels) padded for the layout."""
    from lit_hbp.data.collate import collate_packs
    from lit_hbp.data.media_batch import MRopePositions, media_of, pads_images

    tokens = [(r["input_ids"][0].numpy(), (r["labels"][0] != -100).numpy()) for r in records]
    media = [media_of(r, i, len(t[0])) for i, (r, t) in enumerate(zip(records, tokens))]
    return collate_packs([np.arange(len(records))], tokens.__getitem__, sp=sp, cp=cp, sp_kind=kind, loss_norm=1.0,
                         media=media.__getitem__, rope=MRopePositions.of(model),
                         pad_images=pads_images(model.config))  # fmt: skip


def sp_step(folder: str, weights: str, sp: int, cp: int, media: str = "images", fail_rank: int | None = None) -> dict:
    """This rank's shard of the pack through packed_loss; CE summed and gradients averaged over the SP group
    (``fail_rank``: that rank's image encoder runs out of memory)."""
    import torch.distributed as dist

    from lit_hbp import packed_loss, prepare_model
    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.groups import SPGroups
    from lit_hbp.parallel.kind import resolve_sp_kind

    kind = resolve_sp_kind("cp" if cp > 1 else "ulysses")
    ctx = SPGroups([(sp, cp)], dist.get_world_size(), dist.get_rank())[(sp, cp)]
    model = prepare_model(AutoModelForImageTextToText.from_pretrained(folder).float())
    model.load_state_dict(torch.load(weights, weights_only=True))
    records = [trained(r, model.config) for r in RECORDS[media](Path(folder))]
    batch = collate(records, model, sp, cp, kind.name)
    encoded = []  # how many images each call of the tower on this rank encoded
    videos = []  # the (t, h, w) of each video (or frame of one) this rank encoded
    own, own_videos = model.model.get_image_features, getattr(model.model, "get_video_features", None)

    @functools.wraps(own)
    def counted(pixel_values, *args, **kwargs):
        if dist.get_rank() == fail_rank:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        grid = kwargs.get("image_grid_thw", args[0] if args else None)
        encoded.append(int(grid.shape[0]) if grid is not None and grid.dim() == 2 else int(pixel_values.shape[0]))
        return own(pixel_values, *args, **kwargs)

    def counted_videos(pixel_values_videos, *args, **kwargs):
        grid = kwargs.get("video_grid_thw", args[0] if args else None)  # Qwen's (t, h, w) rows, else [videos, frames]
        frames = [[int(pixel_values_videos.shape[1])]] * len(pixel_values_videos)
        videos.extend(grid.tolist() if grid is not None else frames)
        return own_videos(pixel_values_videos, *args, **kwargs)

    model.model.get_image_features = counted
    if own_videos is not None:
        model.model.get_video_features = functools.wraps(own_videos)(counted_videos)
    shard = kind.shard(batch, sp, ctx.rank).replace(sp_group=SPCall.of(ctx, kind))
    try:
        out = packed_loss(model, shard, "sum")
    except ValueError as e:
        return {"error": str(e)}
    except torch.OutOfMemoryError as e:
        return {"crash": f"{type(e).__name__}: {e}"}
    out.loss.backward()
    ce = out.ce_sum.detach().clone()
    dist.all_reduce(ce, group=ctx.group)
    # A tensor has a gradient where any rank's shard gave it one (a rank that encoded no image has none for the tower)
    params = list(model.named_parameters())
    has = torch.tensor([float(p.grad is not None) for _, p in params])
    dist.all_reduce(has, group=ctx.group)
    grads = {}
    for (name, p), any_rank in zip(params, has.tolist()):
        if any_rank:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=ctx.group)
            grads[name] = grad.numpy() / sp  # averaged, as the data-parallel all-reduce does (the loss carries sp)
    return {"ce": float(ce), "grads": grads, "encoded": encoded, "videos": videos}


def reference(folder: Path, weights: Path, media: str = "images"):
    """CE summed over the records alone (eager, unprepared, one process) and its gradients."""
    import torch.nn.functional as F

    ref = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").float()
    torch.save(ref.state_dict(), weights)
    records = [trained(r, ref.config) for r in RECORDS[media](folder)]
    ce = 0.0
    for rec in records:
        labels = rec["labels"][0]
        inputs = {k: v for k, v in rec.items() if k != "labels"}
        logits = ref(**inputs, use_cache=False).logits[0, :-1]
        ce = ce + F.cross_entropy(logits, labels[1:], reduction="sum", ignore_index=-100)
    ce.backward()
    return float(ce.detach()), {n: p.grad.numpy() for n, p in ref.named_parameters() if p.grad is not None}


def assert_like_one_process(results: list[dict], want_ce: float, want: dict) -> None:
    """Every rank's summed CE to 1e-5 and every averaged gradient to 1e-4 (of its own scale, floored at
    1e-3 of the largest) of the records alone in one process."""
    scale = max(np.abs(g).max() for g in want.values())
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["ce"] == pytest.approx(want_ce, rel=1e-5)
        assert set(r["grads"]) == set(want)
        for name, ref in want.items():
            bound = 1e-4 * max(np.abs(ref).max(), 1e-3 * scale)
            assert np.abs(r["grads"][name] - ref).max() <= bound, name


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", EXACT)
def test_an_image_pack_on_an_sp_level_trains_like_each_record_alone(pool, folders, tmp_path, family, layout):
    want_ce, want = reference(folders[family], tmp_path / "weights.pt")
    sp, cp = LAYOUTS[layout]
    results = pool.run(sp_step, str(folders[family]), str(tmp_path / "weights.pt"), sp, cp)
    scale = max(np.abs(g).max() for g in want.values())
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["ce"] == pytest.approx(want_ce, rel=1e-5)
        assert set(r["grads"]) == set(want)
        assert any("vision" in n or "visual" in n for n in r["grads"])
        for name, ref in want.items():
            bound = 1e-4 * max(np.abs(ref).max(), 1e-3 * scale)
            assert np.abs(r["grads"][name] - ref).max() <= bound, name
    # the three images were encoded once in all, split over the two ranks (two on one, one on the other)
    assert sorted(sum(r["encoded"], 0) for r in results) == [1, 2] and all(len(r["encoded"]) == 1 for r in results)


@pytest.mark.parametrize("family", HYBRID_VLMS)
def test_a_hybrid_vlms_image_pack_at_ulysses_sp_2_trains_like_each_record_alone(pool, tmp_path, family):
    """Qwen3.5 (a Gated DeltaNet layer beside a full attention layer): a pack of two image records and a
    text-only one at Ulysses sp 2 (each rank runs every document of the linear-attention layer whole, from
    inputs gathered over the group, and encodes its share of the images), against each record alone in one
    process (loss 1e-5, every gradient 1e-4, the tower's and the Gated DeltaNet's ``A_log`` included)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if family not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    folder = build_default(tmp_path / family, family)
    want_ce, want = reference(folder, tmp_path / "weights.pt", "counted")
    assert any("A_log" in n for n in want) and any("self_attn" in n for n in want)  # both kinds of layer
    results = pool.run(sp_step, str(folder), str(tmp_path / "weights.pt"), 2, 1, "counted")
    assert_like_one_process(results, want_ce, want)
    assert sum(sum(r["encoded"], 0) for r in results) == 2  # the pack's two images, each encoded once


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", ["mistral3", "lighton_ocr"])
def test_pixtral_images_of_different_sizes_are_padded_and_split_on_an_sp_level(pool, tmp_path, family, layout):
    """Mistral 3 and LightOnOCR (Pixtral's tower cuts each image back to its ``image_sizes``): a pack of a 32x32 and
    a 16x32 image and a text record, the second image padded to the first's size as its processor pads a batch, at
    sp 2: each rank encodes one image (its own ``image_sizes`` row beside it), and the loss and every gradient equal
    each record alone in one process."""
    folder = build_default(tmp_path / family, family)
    want_ce, want = reference(folder, tmp_path / "weights.pt", "sized")
    sp, cp = LAYOUTS[layout]
    results = pool.run(sp_step, str(folder), str(tmp_path / "weights.pt"), sp, cp, "sized")
    assert_like_one_process(results, want_ce, want)
    assert sorted(n for r in results for n in r["encoded"]) == [1, 1]  # one image on each rank


@pytest.mark.parametrize("family", ["internvl", "video_llava"])
def test_a_family_whose_encoder_hands_back_one_tensor_gets_one_on_an_sp_level(pool, tmp_path, family):
    """InternVL, Video-LLaVA (and 7 more) read their image encoder's ``pooler_output`` as one tensor (``.to``,
    ``.reshape``): at sp 2 the rows a shard's placeholders take came back as a tuple (an AttributeError in the
    family's forward). One tensor, as the family's own encoder gives, trains like each record alone."""
    folder = build_default(tmp_path / family, family)
    want_ce, want = reference(folder, tmp_path / "weights.pt", "counted")
    results = pool.run(sp_step, str(folder), str(tmp_path / "weights.pt"), 2, 1, "counted")
    assert_like_one_process(results, want_ce, want)
    assert sum(sum(r["encoded"], 0) for r in results) == 2


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_tower_of_no_deepstack_layer_trains_on_an_sp_level(pool, tmp_path, layout):
    """Qwen3-VL-MoE's tower with no deepstack layer (a 2-block tower: the config's deepstack indexes past it)
    returns an empty ``deepstack_features``, which the SP exchange dropped: the family's forward then stopped in an
    AttributeError at sp 2 (sp 1 trained). Kept empty, the pack trains like each record alone."""
    folder = build_default(tmp_path / "qwen3_vl_moe", "qwen3_vl_moe")
    want_ce, want = reference(folder, tmp_path / "weights.pt", "counted")
    sp, cp = LAYOUTS[layout]
    results = pool.run(sp_step, str(folder), str(tmp_path / "weights.pt"), sp, cp, "counted")
    assert_like_one_process(results, want_ce, want)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", ["qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"])
def test_an_omni_thinkers_image_pack_trains_on_an_sp_level_like_each_record_alone(pool, tmp_path, family, layout):
    """The Qwen Omni thinkers number a record's multimodal positions by the token after each vision start, from
    ``get_rope_index(..., attention_mask, use_audio_in_video, audio_seqlens, second_per_grids)`` (no token types):
    lit-hbp passed ``mm_token_type_ids`` to it, a TypeError for every record, text too, at any sp. Numbered with
    the arguments the family takes, a pack trains like each record alone (given the processor's attention mask, which
    the family's forward needs to number images at all), at sp 2 too."""
    folder = build_default(tmp_path / family, family)
    want_ce, want = reference(folder, tmp_path / "weights.pt", "counted")
    sp, cp = LAYOUTS[layout]
    results = pool.run(sp_step, str(folder), str(tmp_path / "weights.pt"), sp, cp, "counted")
    assert_like_one_process(results, want_ce, want)


@pytest.mark.parametrize("media", ["counted", "one image"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_tower_of_no_pooled_output_whose_deepstack_comes_in_layer_pairs_trains_on_an_sp_level(
    pool, tmp_path, layout, media
):
    """Granite 4 Vision's encoder gives no pooled output, only deepstack (language layer, blocks) pairs, the first
    pair's blocks being what its placeholders take: at sp 2 the exchange read ``.shape`` off a layer index (an
    AttributeError on the ranks that encoded, while a rank of no image waited in a collective). The pairs come back
    as pairs, each pair's rows moved alike: like each record alone, with an image on each rank or on one only."""
    folder = build_default(tmp_path / "granite4_vision", "granite4_vision")
    want_ce, want = reference(folder, tmp_path / "weights.pt", media)
    sp, cp = LAYOUTS[layout]
    results = pool.run(sp_step, str(folder), str(tmp_path / "weights.pt"), sp, cp, media)
    assert_like_one_process(results, want_ce, want)
    assert sorted(sum(r["encoded"], 0) for r in results) == ([1, 1] if media == "counted" else [0, 1])


# Default-built families a test of their own runs on SP levels (Ovis2.5's images refused there)
OWN_SP_TESTS = {"qwen3_vl_moe", "granite4_vision", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker", "mistral3",
                "lighton_ocr", "ovis2_5"}  # fmt: skip


# LFM3-VL's language model is a hybrid: its short convolutions run document by document on Ulysses levels, and a CP
# level is refused for them (as Qwen3.5's Gated DeltaNet)
HYBRID = {"lfm3_vl"}


@pytest.mark.parametrize(
    ("family", "layout"),
    [
        (f, layout)
        for f in sorted(set(DEFAULT_BUILT) - OWN_SP_TESTS)
        for layout in sorted(LAYOUTS)
        if not (f in HYBRID and layout == "cp")
    ],  # fmt: skip
)
def test_a_default_built_familys_image_pack_on_an_sp_level_trains_like_each_record_alone(
    pool, tmp_path, family, layout
):
    """Every family built from transformers' default config (tested at sp 1 in test_vision.py), its pack of two image
    records and a text-only one split over 2 ranks (Ulysses and CP): each image encoded once, on one rank, and the
    pack trains like each record alone (Kimi-K2.5's DeepSeek-V3 latent attention, value heads narrower than its
    query-key heads, stopped the CP attention's kernel: padded there)."""
    folder = build_default(tmp_path / family, family)
    want_ce, want = reference(folder, tmp_path / "weights.pt", "counted")
    sp, cp = LAYOUTS[layout]
    results = pool.run(sp_step, str(folder), str(tmp_path / "weights.pt"), sp, cp, "counted")
    assert_like_one_process(results, want_ce, want)
    assert sorted(sum(r["encoded"], 0) for r in results) == [1, 1]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", MASKED_IMAGES)
def test_images_of_different_counts_and_sizes_with_their_masks_train_on_an_sp_level(pool, tmp_path, family, layout):
    """Idefics2/3 and SmolVLM: a record's images with their ``pixel_attention_mask`` (a record of two images, one
    padded below, and a record of one smaller image), the pack's rows padded to the most images and the largest size
    as their processor pads a batch; split over 2 ranks, each record's images encoded on one rank (the model reads
    them per record): like each record alone."""
    folder = build_default(tmp_path / family, family)
    want_ce, want = reference(folder, tmp_path / "weights.pt", "masked")
    sp, cp = LAYOUTS[layout]
    results = pool.run(sp_step, str(folder), str(tmp_path / "weights.pt"), sp, cp, "masked")
    assert_like_one_process(results, want_ce, want)
    assert sorted(sum(r["encoded"], 0) for r in results) == [1, 1]


def test_lfm2_vls_image_patches_train_on_a_ulysses_level(pool, tmp_path):
    """LFM2-VL's images as rows of patches with their masks and spatial shapes (two records' images of different
    patch counts), split over 2 ranks on a Ulysses level (its short convolutions refuse CP): each image encoded on
    one rank, like each record alone."""
    folder = build_default(tmp_path / "lfm2_vl", "lfm2_vl")
    want_ce, want = reference(folder, tmp_path / "weights.pt", "patches")
    results = pool.run(sp_step, str(folder), str(tmp_path / "weights.pt"), *LAYOUTS["ulysses"], "patches")
    assert_like_one_process(results, want_ce, want)
    assert sorted(sum(r["encoded"], 0) for r in results) == [1, 2]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_encoder_failing_on_one_rank_stops_every_rank_of_the_sp_group(pool, tmp_path, layout):
    """One rank's share of the images failed in its encoder (out of memory on the rank dealt the largest image, the
    tower's own check of an input): that rank raised, and the other waited for it in a collective until the process
    group's timeout (30 minutes). Now the failing rank raises its own error and every other rank a ValueError saying
    a peer failed, at once."""
    folder = build_default(tmp_path / "vipllava", "vipllava")
    reference(folder, tmp_path / "weights.pt", "counted")
    sp, cp = LAYOUTS[layout]
    results = pool.run(sp_step, str(folder), str(tmp_path / "weights.pt"), sp, cp, "counted", 1, timeout=120)
    assert results[1] == {"crash": "OutOfMemoryError: CUDA out of memory (injected)"}
    assert results[0] == {
        "error": "another rank of the SP group failed encoding its share of this pack's images (its error names why)"
    }


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_family_that_checks_a_calls_image_boundaries_is_refused_on_an_sp_level(pool, tmp_path, layout):
    """Ovis2.5's forward checks a call's image start and end tokens against its feature blocks: a shard holding two
    image starts and one end stopped in transformers' "Expected 1 visual boundary tokens", not naming SP (a lucky
    split ran). Refused on every rank, whatever the split, naming sp 1; its sp 1 pack is exact (the reference)."""
    folder = build_default(tmp_path / "ovis2_5", "ovis2_5")
    reference(folder, tmp_path / "weights.pt", "counted")
    sp, cp = LAYOUTS[layout]
    results = pool.run(sp_step, str(folder), str(tmp_path / "weights.pt"), sp, cp, "counted")
    for r in results:
        assert re.match(
            r"ovis2_5's forward checks a call's image .* train its samples with images or videos on sp 1", r["error"]
        )


def test_a_plan_putting_ovis_images_on_an_sp_level_is_refused_when_planned():
    """The level search (and given levels) put Ovis2.5's image samples on SP levels, whose packed call refuses them
    (above): the run stopped at such a level's first micro-batch, after the levels before it trained. The plan is
    refused as it is made, naming the level; text-only samples there, images on sp 1 levels, or another family pass.
    The reference: each sample's level read off the plan's packs by brute force."""
    from lit_hbp.model.sp_media import whole_items_problem
    from lit_hbp.packing import Level, plan_hbp

    levels = [Level(64), Level(256, 2)]
    lengths = np.array([30, 40, 200, 50, 180, 20])
    plan = plan_hbp(lengths, levels, 2)
    level_of = {int(m): int(plan.pack_level[p]) for p in range(len(plan.offsets) - 1) for m in plan.pack(p)}
    on_sp = [i for i in range(lengths.size) if levels[level_of[i]].sp > 1]
    assert on_sp and len(on_sp) < lengths.size
    for imaged in range(lengths.size):
        media = np.zeros(lengths.size, np.int64)
        media[imaged] = 1
        said = whole_items_problem("ovis2_5", plan, media, levels)
        indicators = whole_items_problem("ovis2", plan, media, levels)
        if imaged in on_sp:
            assert said.startswith("data.levels[1] (pack_len 256, sp 2) holds samples with images or videos, and "
                                   "ovis2_5's forward checks")  # fmt: skip
            assert indicators.startswith("data.levels[1] (pack_len 256, sp 2) holds samples with images, and "
                                         "ovis2's image encoder also returns its visual indicator")  # fmt: skip
        else:
            assert said is None and indicators is None
        assert whole_items_problem("qwen2_vl", plan, media, levels) is None
    assert whole_items_problem("ovis2_5", plan, np.zeros(lengths.size, np.int64), levels) is None


def test_a_validation_plan_putting_ovis_images_on_an_sp_level_is_refused_when_planned():
    """The training plan's check of Ovis2.5's media on SP levels (above) was not made of the validation plan: the
    first validation on such a level stopped in the packed call, after steps trained. ``HBPDataModule.val_plan``
    (the data module's own method, on a stand-in holding a validation store of these samples) refuses it as it is
    planned, naming the validation set; a plan with its images on sp 1 levels only, or another family, is made. The
    reference: each sample's level read off the plan by brute force."""
    import functools
    import types

    from lit_hbp.errors import ConfigError
    from lit_hbp.lightning.datamodule import HBPDataModule
    from lit_hbp.packing import Level, plan_hbp

    lengths = np.array([30, 40, 200, 50, 180, 20])
    levels = (Level(64), Level(256, 2))
    plan = plan_hbp(lengths, levels, 2, 1, 0, "greedy", loss_tokens=lengths // 2, over_length="error")
    level_of = {int(m): int(plan.pack_level[p]) for p in range(len(plan.offsets) - 1) for m in plan.pack(p)}
    refused = []
    for imaged, family in (([2, 4], "ovis2_5"), ([5], "ovis2_5"), ([2, 4], "qwen2_vl")):
        media = np.zeros(lengths.size, np.int64)
        media[imaged] = 1
        store = types.SimpleNamespace(lengths=lengths, loss_tokens=lengths // 2, has_media=True,
                                      media_counts=lambda kinds, m=media: m)  # fmt: skip
        module = types.SimpleNamespace(val_store=store, levels=levels, seed=0, packer="greedy", _val_plan=None,
                                       model_config=types.SimpleNamespace(model_type=family),
                                       _world=lambda epoch=None: (2, 0, 1), vision_work=lambda s: None)  # fmt: skip
        module._refuse_split_items = functools.partial(HBPDataModule._refuse_split_items, module)
        split = family == "ovis2_5" and any(levels[level_of[i]].sp > 1 for i in imaged)
        if split:
            said = r"^the validation set: data.levels\[1\] \(pack_len 256, sp 2\) holds samples with images or videos"
            with pytest.raises(ConfigError, match=said):
                HBPDataModule.val_plan(module)
            assert module._val_plan is None
        else:
            assert HBPDataModule.val_plan(module).pack_level.tolist() == plan.pack_level.tolist()
        refused.append(split)
    assert refused == [True, False, False]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_a_videos_frames_are_split_over_the_sp_group_and_train_like_each_record_alone(
    pool, folders, tmp_path, family, layout
):
    """A pack of a 4-frame video, an image and a 2-frame video (frames: temporal patches) at sp 2: the
    ranks encode the videos frame by frame between them (these towers attend within a frame), no frame
    twice, and the loss and every gradient equal each record alone in one process."""
    want_ce, want = reference(folders[family], tmp_path / "weights.pt", "videos")
    sp, cp = LAYOUTS[layout]
    results = pool.run(sp_step, str(folders[family]), str(tmp_path / "weights.pt"), sp, cp, "videos")
    assert_like_one_process(results, want_ce, want)
    frames = [grid for r in results for grid in r["videos"]]
    assert sorted(frames) == sorted([[1, 4, 4]] * 4 + [[1, 4, 6]] * 2)  # six frames, each encoded once
    assert all(r["videos"] for r in results)  # by both ranks: a long video's encoding is split


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", ["video_llava", "llava_next_video"])
def test_a_video_encoded_frame_by_frame_trains_on_an_sp_level(pool, tmp_path, family, layout):
    """Video-LLaVA's video encoder hands back one tensor of a block per frame ([videos x frames, patches, hidden]):
    at sp 2 its videos were refused ("does not return one block of feature rows per video"), sp 1 trained them. A
    video's frames are dealt to one rank and their rows read as its block: like each record alone, as
    LLaVA-NeXT-Video's (a block per video) already were."""
    folder = build_default(tmp_path / family, family)
    want_ce, want = reference(folder, tmp_path / "weights.pt", "counted videos")
    sp, cp = LAYOUTS[layout]
    results = pool.run(sp_step, str(folder), str(tmp_path / "weights.pt"), sp, cp, "counted videos")
    assert_like_one_process(results, want_ce, want)
    assert sum(len(r["videos"]) for r in results) == 1


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_llava_onevisions_images_of_one_record_are_encoded_together_on_an_sp_level(pool, tmp_path, layout):
    """LLaVA-OneVision reads a record's images together (``batch_num_images``: a record of several images
    gets the base tile of each, a single image its anyres tiles): at sp 2 the two images of one record are
    encoded by one rank in one call, and the loss and every gradient equal each record alone."""
    needs_torchvision("llava_onevision")
    folder = build_llava(tmp_path / "llava_onevision", "llava_onevision")
    want_ce, want = reference(folder, tmp_path / "weights.pt")
    sp, cp = LAYOUTS[layout]
    results = pool.run(sp_step, str(folder), str(tmp_path / "weights.pt"), sp, cp)
    scale = max(np.abs(g).max() for g in want.values())
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["ce"] == pytest.approx(want_ce, rel=1e-5)
        for name, ref in want.items():
            bound = 1e-4 * max(np.abs(ref).max(), 1e-3 * scale)
            assert np.abs(r["grads"][name] - ref).max() <= bound, name
    calls = sorted(n for r in results for n in r["encoded"])
    assert calls == [1, 2]  # record 0's image on one rank, record 1's two images together on the other


def test_items_are_dealt_largest_first_and_a_records_images_stay_together():
    """Brute force over small cases: the dealing is the greedy largest-first one (every rank computes
    the same), each group on one rank, and no rank holds more than the lightest plus the largest group."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, size = int(rng.integers(1, 9)), int(rng.integers(1, 5))
        weights = rng.integers(1, 100, n).astype(float)
        groups = np.sort(rng.integers(0, max(1, n // 2), n))
        got = owners(weights, groups, size)
        for g in np.unique(groups):
            assert len(set(got[groups == g])) == 1
        per_group = {g: weights[groups == g].sum() for g in np.unique(groups)}
        load = np.bincount(got, weights=weights, minlength=size)
        assert load.max() <= load.min() + max(per_group.values())
        assert np.array_equal(got, owners(weights, groups, size))


def test_every_feature_row_reaches_the_rank_of_its_placeholder_in_order():
    """The routes of all ranks, simulated as all_to_all moves the rows (brute force over random
    layouts: who encoded each row, whose shard holds its placeholder): every rank gets exactly the
    rows of its placeholders, in their order."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        size, n = int(rng.integers(1, 5)), int(rng.integers(0, 40))
        holder, needer = rng.integers(0, size, n), rng.integers(0, size, n)
        routes = [Route.of(holder, needer, r, size) for r in range(size)]
        for r in range(size):
            own = np.flatnonzero(holder == r)
            assert len(routes[r].take) == own.size and sum(routes[r].send) == own.size
        for dst in range(size):
            arrived = []
            for src in range(size):  # all_to_all: dst gets src's chunk number dst, senders in rank order
                sent = np.flatnonzero(holder == src)[routes[src].take]
                start = sum(routes[src].send[:dst])
                arrived.extend(sent[start : start + routes[src].send[dst]])
                assert routes[dst].recv[src] == routes[src].send[dst]
            assert np.array_equal(np.asarray(arrived, dtype=int)[routes[dst].order], np.flatnonzero(needer == dst))
