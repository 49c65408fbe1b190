"""What the level search knows of a vision-language model's tower, against independent references: its
parameters counted on the model transformers builds (meta device), the bytes its blocks keep for the
backward measured op by op on CPU (``live_bytes``, checkpointed or not), and levels chosen for image-heavy
data that fit once the tower's activations are counted where the text-only search's would not."""

from functools import partial

import numpy as np
import pytest
import torch
from live_bytes import LiveBytes
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForImageTextToText

from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.hardware import HARDWARE
from lit_hbp.model_spec import ModelSpec

WIDTH, MLP = 128, 512  # the measured towers' width and MLP size


def tower_config(family: str, layers: int = 4):
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]})  # fmt: skip
    if family in ("clip", "siglip"):
        vision = dict(model_type=f"{family}_vision_model", hidden_size=WIDTH, intermediate_size=MLP,
                      num_hidden_layers=layers, num_attention_heads=2, image_size=448, patch_size=14)  # fmt: skip
        text = {**text, "model_type": "llama"}
        return AutoConfig.for_model("llava", vision_config=vision, text_config=text, image_token_index=5)
    vision = dict(depth=layers, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_vl":
        vision.update(embed_dim=WIDTH, hidden_size=64, mlp_ratio=MLP // WIDTH)
    elif family == "qwen2_5_vl":
        vision.update(hidden_size=WIDTH, out_hidden_size=64, intermediate_size=MLP, window_size=112,
                      fullatt_block_indexes=[3])  # fmt: skip
    else:
        vision.update(hidden_size=WIDTH, out_hidden_size=64, intermediate_size=MLP, num_position_embeddings=64,
                      deepstack_visual_indexes=[1])  # fmt: skip
    return AutoConfig.for_model(family, text_config=text, vision_config=vision, image_token_id=5, video_token_id=6)


def tower_kept(family: str, dtype, ckpt: bool) -> tuple[float, float]:
    """(bytes the tower keeps after its forward on a 448x448 image, the cost model's), 1024 patches."""
    torch.manual_seed(0)
    config = tower_config(family)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").to(dtype).train()
    tower = model.model.vision_tower if family in ("clip", "siglip") else model.model.visual
    blocks = [m for m in tower.modules() if type(m).__name__.endswith(("Block", "EncoderLayer"))]
    for b in blocks:
        b.gradient_checkpointing = ckpt
        b._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    if family in ("clip", "siglip"):
        pixels = torch.randn(1, 3, 448, 448, dtype=dtype)
        run = lambda: model.model.get_image_features(pixel_values=pixels)  # noqa: E731 (the projector too)
    else:
        grid = torch.tensor([[1, 32, 32]])
        pixels = torch.randn(32 * 32, 3 * 2 * 14 * 14, dtype=dtype)
        run = lambda: model.model.get_image_features(pixels, grid)  # noqa: E731
    meter = LiveBytes()
    meter.track(model.parameters())
    meter.track([pixels])
    with meter:
        before = meter.now()
        out = run()
        kept = meter.now() - before
    assert out is not None
    spec = ModelSpec.from_config(config.to_dict())
    bytes_ = 4 if dtype == torch.float32 else 2
    cost = CostModel(spec, HARDWARE["h100"], 1, dtype_bytes=bytes_, vision_patches_per_token=1.0)
    return kept, cost.vision_bytes(1024, 1 if ckpt else 0)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "clip", "siglip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_what_the_tower_keeps_is_within_12_percent_of_measured(family, dtype):
    """Per patch, the blocks' saved sets (their inputs alone when checkpointed) and what is kept outside
    them (projectors, rotary tables, window reordering): all 20 points were within 10% when written."""
    rows = {ckpt: tower_kept(family, dtype, ckpt) for ckpt in (False, True)}
    for ckpt, (measured, predicted) in rows.items():
        assert predicted == pytest.approx(measured, rel=0.12), (ckpt, measured, predicted)
    assert rows[True][0] < rows[False][0] / 2


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"])
def test_the_towers_parameters_are_what_transformers_builds(family):
    """transformers' default config of each family (a 7B-class model's tower: CLIP-L for LLaVA), built on
    the meta device: the tower and projectors' parameters within 3% of ``VisionSpec.params``."""
    config = AutoConfig.for_model(family)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    language = {id(p) for p in model.model.language_model.parameters()} | {id(model.lm_head.weight)}
    counted = sum(p.numel() for p in model.parameters() if id(p) not in language)
    spec = ModelSpec.from_config(config.to_dict())
    assert spec.vision.params(spec.hidden) == pytest.approx(counted, rel=0.03)


def test_a_frozen_tower_keeps_nothing_and_trains_no_states():
    """A run's settings say whether the tower trains (not under freeze_vision or LoRA); a frozen tower holds
    no gradients, Adam states or saved activations and runs its forward only."""
    from lit_hbp.cost.run_settings import settings_of
    from lit_hbp.model_spec import MODELS

    for module_args, trains in [({}, True), ({"freeze_vision": True}, False), ({"lora": {"r": 8}}, False)]:
        read = settings_of(HARDWARE["h100"], 8, None, module_args, spec=MODELS["llama3.1-8b"])
        assert read.vision_trained is trains
    spec = ModelSpec.from_config(AutoConfig.for_model("qwen2_vl").to_dict())
    trained = CostModel(spec, HARDWARE["h100"], 8, vision_patches_per_token=4.0)
    frozen = CostModel(spec, HARDWARE["h100"], 8, vision_patches_per_token=4.0, vision_trained=False)
    assert trained.vision_bytes(8192, 0) > trained.vision_bytes(8192, 1) > 0 == frozen.vision_bytes(8192, 0)
    tower = spec.vision.params(spec.hidden)
    # ZeRO-2 over 8 ranks: bf16 gradients and fp32 master + Adam of the trained parameters only
    assert trained.static_bytes() - frozen.static_bytes() == pytest.approx(tower * (2 + 12) / 8)
    # the tower's time: forward, backward (twice) and, checkpointed, the forward again; frozen: forward only
    one = frozen.vision_seconds(1e6, 1, 0)
    assert trained.vision_seconds(1e6, 1, 0) == pytest.approx(3 * one)
    assert trained.vision_seconds(1e6, 1, 4) == pytest.approx(4 * one)
    assert trained.vision_seconds(1e6, 2, 0) == pytest.approx(1.5 * one)  # split over the SP group
    assert frozen.vision_seconds(1e6, 1, 4) == pytest.approx(one)


QWEN2_VL_7B = {  # the published Qwen2-VL-7B-Instruct config's shape
    "model_type": "qwen2_vl", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "hidden_size": 3584,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "hidden_act": "quick_gelu"},
}  # fmt: skip


def image_mix(n: int = 4000, seed: int = 0):
    """Lengths and per-sample media of a mix where 60% of the samples carry an image of 256-4K tokens."""
    from lit_hbp.data.media import vision_load

    rng = np.random.default_rng(seed)
    tokens = np.where(rng.random(n) < 0.6, rng.integers(256, 4096, n), 0)
    lengths = rng.integers(100, 4000, n) + tokens
    media = [[(int(t) * 4 * 392, 1)] if t else [] for t in tokens]  # 4 patches a token, 2 x 14 x 14 pixels each
    return lengths, vision_load(media, AutoConfig.for_model(**QWEN2_VL_7B))


@pytest.mark.parametrize("trained", [True, False], ids=["tower-trained", "tower-frozen"])
def test_levels_chosen_for_image_data_fit_with_the_towers_memory_where_text_only_ones_would_not(trained):
    """On 8 H100s, the search that knows the images (``vision``) chooses levels that fit once what the
    tower keeps is counted; the same search blind to them chooses, for a trained tower, a level that does
    not (the tower's activations per patch are a decoder layer's per token, four patches a token). Every
    candidate's time counts the tower's encoding of the mean pack's images."""
    from lit_hbp.autoselect.profiler import AnalyticProfiler
    from lit_hbp.autoselect.search import analytic_levels, with_vision
    from lit_hbp.cost.sample_packs import pack_stats

    lengths, vision = image_mix()
    assert vision.patches_per_token(lengths) == pytest.approx(4 * 4095 / (4095 + 100), rel=0.02)
    cost = CostModel(ModelSpec.from_config(QWEN2_VL_7B), HARDWARE["h100"], 8, vision_trained=trained)
    seen = with_vision(cost, lengths, vision)
    fits = lambda lv: seen.fits(lv.pack_len, lv.sp, lv.ckpt_layers, 1, lv.offload, lv.mlp_tiles, lv.layout[1])  # noqa: E731
    chosen = analytic_levels(cost, lengths, vision=vision)
    assert all(fits(lv) for lv in chosen.levels), chosen.yaml()
    blind = analytic_levels(cost, lengths)
    assert all(fits(lv) for lv in blind.levels) is (not trained), blind.yaml()
    with_images, text_only = AnalyticProfiler(seen, lengths, vision=vision), AnalyticProfiler(seen, lengths)
    _, _, work = pack_stats(lengths, 8192, extra_work=vision.work)
    assert work > 0
    got = with_images.measure(8192, 2, 28).seconds - text_only.measure(8192, 2, 28).seconds
    assert got == pytest.approx(float(seen.vision_seconds(work, 2, 28)), rel=1e-9)


def test_data_with_images_on_a_model_without_a_tower_is_refused_by_the_search():
    from lit_hbp.autoselect.search import analytic_levels

    lengths, vision = image_mix(200)
    cost = CostModel(ModelSpec.from_config({k: v for k, v in QWEN2_VL_7B.items() if k != "vision_config"}),
                     HARDWARE["h100"], 8)  # fmt: skip
    with pytest.raises(ValueError, match="the data has images or videos but the model .* has no vision_config"):
        analytic_levels(cost, lengths, vision=vision)


def test_ernie_vls_experts_per_modality_are_priced_as_its_language_model_holds_and_runs_them(tmp_path):
    """ERNIE 4.5-VL's ``moe_intermediate_size`` is a list (its text experts' width, its vision experts'): the config's
    formula (the data side's, a config that cannot be built) stopped on it (TypeError). A text token passes its router,
    top-k text experts and the shared experts; the layer holds both sets and both routers. Both against the matrices of
    the built language model's layers (its routers' score-correction biases are no matmul)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from vision_models import build_default

    folder = build_default(tmp_path / "ernie", "ernie4_5_vl_moe")
    spec = ModelSpec.from_config(json.loads((folder / "config.json").read_text()))
    layers = AutoModelForImageTextToText.from_pretrained(folder).model.language_model.layers
    held = sum(
        p.numel() for layer in layers for n, p in layer.named_parameters() if p.dim() >= 2 and "statics" not in n
    )
    assert spec.layers * spec.held_layer_params == held
    top_k = layers[1].mlp.text_moe.top_k
    ran = 0
    for layer in layers:
        matrices = dict(layer.named_parameters())
        ran += sum(
            p.numel()
            for n, p in matrices.items()
            if p.dim() == 2 and "vision_moe" not in n and "text_moe.experts" not in n and "statics" not in n
        )
        if "mlp.text_moe.experts.down_proj" in matrices:  # top-k of the text experts, each of them alike
            ran += top_k * sum(matrices[f"mlp.text_moe.experts.{m}"][0].numel() for m in ("gate_up_proj", "down_proj"))
    assert spec.layers * spec.layer_params == ran
