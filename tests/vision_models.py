"""Tiny vision-language checkpoints, written as users' folders look (save_pretrained: config, weights,
tokenizer, image processor or processor), built offline in seconds; and their records, as each family's
processor makes them.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL processors need torchvision in transformers 5.x (a video processor is
mandatory); without it their records are made as the processor makes them: the chat template, the
image processor's pixels and grids, each image's placeholder expanded to its grid's merged token
count, ``mm_token_type_ids`` 1 on image placeholders (the same ids, types and grids as the processor).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, what is packing?", "describe the image.",
          "a cat on a mat", "def f(x): return x"]  # fmt: skip

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]  # fmt: skip
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}<image>\n"
    "{% elif content['type'] == 'video' %}<video>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT: {% endif %}"
)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}<start_of_image>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
LLAMA_TEXT = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip


def toy_tokenizer(specials, pad, eos, bos=None, extra=None, chat_template=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, eos_token=eos, bos_token=bos, **(extra or {}))
    fast.chat_template = chat_template
    return fast


def _save(path: Path, config, *parts) -> Path:
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(path)
    for part in parts:
        part.save_pretrained(path)
    return Path(path)


def build_qwen(path: Path, family: str = "qwen2_vl") -> Path:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: patch 4, merge 2 (one language token per 8x8 pixels)."""
    from transformers import AutoConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = toy_tokenizer(QWEN_SPECIALS, pad="<|endoftext|>", eos="<|im_end|>", chat_template=QWEN_TEMPLATE)
    images = Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=32 * 32
    )
    ids = {
        name: tok.convert_tokens_to_ids(token)
        for name, token in [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                            ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]
    }  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_parameters=rope,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)  # fmt: skip
    vision = dict(depth=2, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
    elif family == "qwen2_5_vl":
        vision.update(
            hidden_size=32, out_hidden_size=64, intermediate_size=64, window_size=16, fullatt_block_indexes=[1]
        )
    else:
        text.update(head_dim=16, rope_parameters={**rope, "mrope_interleaved": True})
        vision.update(hidden_size=32, out_hidden_size=64, intermediate_size=64, num_position_embeddings=16,
                      deepstack_visual_indexes=[0])  # fmt: skip
    config = AutoConfig.for_model(family, text_config=text, vision_config=vision, **ids)
    return _save(path, config, tok, images)


def build_llava(path: Path, family: str = "llava") -> Path:
    """LLaVA (CLIP tower, 16 image tokens) or LLaVA-NeXT (anyres tiles and image_sizes)."""
    from transformers import AutoConfig, LlavaNextProcessor, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    specials = ["<pad>", "<s>", "</s>", "<|end|>", "<image>"] + (["<video>"] if family == "llava_onevision" else [])
    tok = toy_tokenizer(specials, pad="<pad>", eos="</s>", bos="<s>", chat_template=LLAVA_TEMPLATE)
    crop = {"height": 16, "width": 16}
    pinpoints = [[16, 16], [16, 32], [32, 16], [32, 32]]
    common = dict(tokenizer=tok, patch_size=4, vision_feature_select_strategy="default", num_additional_image_tokens=1,
                  chat_template=LLAVA_TEMPLATE)  # fmt: skip
    if family == "llava":
        processor = LlavaProcessor(CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size=crop), **common)
        extra = {}
    elif family == "llava_onevision":  # anyres for a record's single image, the base tile for a record of several
        # (its processor has a video processor, which needs torchvision: the CI's compatibility part)
        from transformers import LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil,
        )

        images = LlavaOnevisionImageProcessorPil(size={"height": 16, "width": 16}, image_grid_pinpoints=pinpoints)
        processor = LlavaOnevisionProcessor(
            images,
            tokenizer=tok,
            video_processor=LlavaOnevisionVideoProcessor(size={"height": 16, "width": 16}),
            num_image_tokens=17,
            vision_feature_select_strategy="default",
            chat_template=LLAVA_TEMPLATE,
        )  # fmt: skip  (num_image_tokens: the CLS token too; a video's 16x16 frames)
        extra = {"image_grid_pinpoints": pinpoints, "video_token_index": tok.convert_tokens_to_ids("<video>")}
    else:
        images = LlavaNextImageProcessorPil(size={"shortest_edge": 16}, crop_size=crop, image_grid_pinpoints=pinpoints)
        processor = LlavaNextProcessor(images, **common)
        extra = {"image_grid_pinpoints": pinpoints}
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=16, patch_size=4, projection_dim=32)  # fmt: skip
    text = {**LLAMA_TEXT, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id}  # fmt: skip
    config = AutoConfig.for_model(
        family, vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=16, vision_feature_layer=-1, vision_feature_select_strategy="default", **extra,
    )  # fmt: skip
    return _save(path, config, processor)


def build_pixtral(path: Path, family: str = "mistral3") -> Path:
    """Mistral 3 (or LightOnOCR) with its Pixtral processor: each image resized to its own size within 48 pixels,
    a row of [IMG] tokens per two patches of 8 pixels, [IMG_BREAK] between rows, [IMG_END] last; the processor pads
    a batch's images to one size and says each one's ``image_sizes``. Its processor needs torchvision."""
    from transformers import AutoConfig, PixtralProcessor
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    template = LLAVA_TEMPLATE.replace("<image>", "[IMG]")
    specials = ["<pad>", "<s>", "</s>", "<|end|>", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    tok = toy_tokenizer(specials, pad="<pad>", eos="</s>", bos="<s>", chat_template=template)
    images = PixtralImageProcessorPil(patch_size=8, size={"longest_edge": 48})  # the records' images: 16 to 48 high
    processor = PixtralProcessor(images, tokenizer=tok, patch_size=8, spatial_merge_size=2, chat_template=template)
    build_default(path, family)  # its default config shrunk (ids 0, 1, 2: padding, BOS, EOS, as the tokenizer's)
    config = AutoConfig.from_pretrained(path)
    config.image_token_id = tok.convert_tokens_to_ids("[IMG]")
    config.vision_config.image_size = 48
    return _save(path, config, processor)


ERNIE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|IMAGE_START|>", "<|IMAGE_END|>",
                  "<|IMAGE_PLACEHOLDER|>", "<|VIDEO_START|>", "<|VIDEO_END|>", "<|VIDEO_PLACEHOLDER|>"]  # fmt: skip


def build_ernie(path: Path) -> Path:
    """ERNIE 4.5-VL with its processor: patch 4, merge 2, each image between its start and end tokens (which its
    experts' routing, ``moe_mm_token_type_ids``, counts as the image's); video frames drawn on without a font. Its
    processor needs torchvision."""
    from transformers import AutoConfig, Ernie4_5_VLMoeProcessor, Ernie4_5_VLMoeVideoProcessor
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeImageProcessorPil,
    )

    template = QWEN_TEMPLATE.replace(
        "<|vision_start|><|image_pad|><|vision_end|>", "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
    )
    names = ["image", "image_start", "image_end", "video", "video_start", "video_end"]
    tokens = ["<|IMAGE_PLACEHOLDER|>", "<|IMAGE_START|>", "<|IMAGE_END|>", "<|VIDEO_PLACEHOLDER|>", "<|VIDEO_START|>",
              "<|VIDEO_END|>"]  # fmt: skip
    mm = {f"{n}_token": t for n, t in zip(names, tokens)}
    tok = toy_tokenizer(ERNIE_SPECIALS, pad="<|endoftext|>", eos="<|im_end|>", extra={"extra_special_tokens": mm},
                        chat_template=template)  # fmt: skip
    images = Ernie4_5_VLMoeImageProcessorPil(patch_size=4, merge_size=2, min_pixels=8 * 8, max_pixels=32 * 32)
    videos = Ernie4_5_VLMoeVideoProcessor(patch_size=4, merge_size=2, draw_on_frames=False,
                                          size={"shortest_edge": 8 * 8, "longest_edge": 32 * 32})  # fmt: skip
    processor = Ernie4_5_VLMoeProcessor(images, tok, videos, chat_template=template)
    build_default(path, "ernie4_5_vl_moe")
    config = AutoConfig.from_pretrained(path)
    for name, token in zip(names, tokens):
        setattr(config, f"{name}_token_id", tok.convert_tokens_to_ids(token))
    config.vision_config.patch_size = 4
    return _save(path, config, processor)


def build_idefics3(path: Path) -> Path:
    """Idefics3 with its processor: an image of up to 64 pixels split into 32-pixel tiles (a row and column token
    each) and a global 32-pixel image, each of 4 placeholders (patch 8, pixel-shuffled 2x2) between
    ``<fake_token_around_image>`` tokens; its pixels ``[1, images, C, H, W]`` with ``pixel_attention_mask``."""
    from transformers import AutoConfig, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tiles = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    specials = ["<pad>", "<s>", "</s>", "<|end|>", "<fake_token_around_image>", "<image>", "<end_of_utterance>",
                "<global-img>", *tiles]  # fmt: skip
    tok = toy_tokenizer(specials, pad="<pad>", eos="</s>", bos="<s>", chat_template=LLAVA_TEMPLATE)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(images, tok, image_seq_len=4, chat_template=LLAVA_TEMPLATE)
    build_default(path, "idefics3")  # its default config shrunk (ids 0, 1, 2: padding, BOS, EOS, as the tokenizer's)
    config = AutoConfig.from_pretrained(path)
    config.image_token_id = tok.convert_tokens_to_ids("<image>")
    return _save(path, config, processor)


def build_lfm2_vl(path: Path) -> Path:
    """LFM2-VL with its processor: patch 8, 2x2 patches a token, an image of 4 to 16 tokens (larger ones split into
    32-pixel tiles beside a thumbnail), each image's patches a row padded to the processor's most, with its
    ``pixel_attention_mask`` and ``spatial_shapes``; a short convolution layer beside attention. Its image processor
    needs torchvision."""
    from transformers import AutoConfig, Lfm2VlImageProcessor, Lfm2VlProcessor

    specials = ["<pad>", "<s>", "</s>", "<|end|>", "<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>",
                *(f"<|img_row_{i}_col_{j}|>" for i in range(1, 5) for j in range(1, 5))]  # fmt: skip
    tok = toy_tokenizer(specials, pad="<pad>", eos="</s>", bos="<s>", chat_template=LLAVA_TEMPLATE)
    images = Lfm2VlImageProcessor(encoder_patch_size=8, tile_size=32, min_image_tokens=4, max_image_tokens=16,
                                  max_tiles=4)  # fmt: skip
    processor = Lfm2VlProcessor(images, tok, chat_template=LLAVA_TEMPLATE)
    build_default(path, "lfm2_vl")
    config = AutoConfig.from_pretrained(path)
    config.image_token_id = tok.convert_tokens_to_ids("<image>")
    return _save(path, config, processor)


def needs_torchvision(family: str):
    """Skip where torchvision is missing (the main CI's CPU torch has none; Qwen's and LLaVA-OneVision's
    processors load a video processor that needs it), except in the CI's compatibility part
    (``LIT_HBP_WITH_TORCHVISION``), where a missing torchvision fails."""
    import os

    import pytest

    if os.environ.get("LIT_HBP_WITH_TORCHVISION"):
        import torchvision  # noqa: F401
    pytest.importorskip("torchvision", reason=f"{family}'s processor needs torchvision (the CI's compatibility part)")


def build_gemma3(path: Path) -> Path:
    """Gemma 3: image tokens that attend to each other both ways (a sliding and a full layer)."""
    from transformers import AutoConfig, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    mm = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    specials = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", *mm.values()]
    tok = toy_tokenizer(
        specials,
        pad="<pad>",
        eos="<eos>",
        bos="<bos>",
        extra={"extra_special_tokens": mm},
        chat_template=GEMMA3_TEMPLATE,
    )
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 16, "width": 16}), tokenizer=tok, image_seq_length=4,
        chat_template=GEMMA3_TEMPLATE,
    )  # fmt: skip
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                  patch_size=4, vision_use_head=False)  # fmt: skip
    names = [("boi_token_index", "boi_token"), ("eoi_token_index", "eoi_token"), ("image_token_index", "image_token")]
    ids = {k: tok.convert_tokens_to_ids(mm[v]) for k, v in names}
    config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4, **ids)
    return _save(path, config, processor)


BUILDERS = {
    "qwen2_vl": lambda p: build_qwen(p, "qwen2_vl"),
    "qwen2_5_vl": lambda p: build_qwen(p, "qwen2_5_vl"),
    "qwen3_vl": lambda p: build_qwen(p, "qwen3_vl"),
    "llava": lambda p: build_llava(p, "llava"),
    "llava_next": lambda p: build_llava(p, "llava_next"),
    "gemma3": build_gemma3,
}


def image(seed: int, height: int, width: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


def messages(images: list, question: str, answer: str) -> list[dict]:
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": question}]
    return [{"role": "user", "content": content}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]


def record(folder: Path, images: list, question: str, answer: str) -> dict:
    """One record as the family's processor returns it (``return_tensors="pt"``), without its mask."""
    from transformers import AutoConfig

    msgs = messages(images, question, answer)
    if AutoConfig.from_pretrained(folder).model_type.startswith("qwen"):
        return _qwen_record(folder, images, msgs)
    from transformers import AutoProcessor

    out = dict(AutoProcessor.from_pretrained(folder).apply_chat_template(
        msgs, tokenize=True, return_dict=True, return_tensors="pt"
    ))  # fmt: skip
    out.pop("attention_mask")
    return out


def _qwen_record(folder: Path, images: list, msgs: list[dict]) -> dict:
    from transformers import AutoImageProcessor, AutoTokenizer

    tok, processor = AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)
    text = tok.apply_chat_template(msgs, tokenize=False)
    out = {}
    if images:
        pixels = processor(images=images, return_tensors="pt")
        for grid in pixels["image_grid_thw"]:
            count = int(grid.prod()) // processor.merge_size**2
            text = text.replace("<|image_pad|>", "<|placeholder|>" * count, 1)
        text = text.replace("<|placeholder|>", "<|image_pad|>")
        out.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
    ids = tok(text, return_tensors="pt")["input_ids"]
    out.update(input_ids=ids, mm_token_type_ids=(ids == tok.convert_tokens_to_ids("<|image_pad|>")).long())
    return out


def three_records(folder: Path) -> list[dict]:
    """One image; two images of other sizes; text only."""
    return [
        record(folder, [image(1, 24, 40)], "describe the image.", "a cat on a mat"),
        record(folder, [image(2, 32, 16), image(3, 16, 24)], "what is packing?", "hello world"),
        record(folder, [], "the quick brown fox", "jumps over the lazy dog"),
    ]


def video_record(folder: Path, grid: tuple[int, int, int], question: str, answer: str, seed: int = 0) -> dict:
    """A Qwen-family record with one video as its processor returns it, made without the video processor
    (it needs torchvision): ``grid`` (temporal patches, height and width in patches), random pixel rows
    in the family's patch layout (3 channels x 2 frames x 4 x 4 pixels a row), the placeholder expanded
    to one token per 2x2 merged patches, video tokens of media type 2."""
    from transformers import AutoConfig, AutoTokenizer

    tok, config = AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder)
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]}]  # fmt: skip
    t, h, w = grid
    text = tok.apply_chat_template(msgs, tokenize=False).replace("<|video_pad|>", "<|video_pad|>" * (t * h * w // 4))
    ids = tok(text, return_tensors="pt")["input_ids"]
    vision = config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    g = torch.Generator().manual_seed(seed)
    out = {
        "input_ids": ids,
        "pixel_values_videos": torch.randn(t * h * w, width, generator=g),
        "video_grid_thw": torch.tensor([[t, h, w]]),
        "mm_token_type_ids": 2 * (ids == tok.convert_tokens_to_ids("<|video_pad|>")).long(),
    }
    if config.model_type == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.tensor([1.0])
    return out


def video_records(folder: Path) -> list[dict]:
    """A video of 4 temporal patches (16 tokens); one image; a shorter video (2 temporal patches)."""
    return [
        video_record(folder, (4, 4, 4), "what happens?", "a cat walks", seed=1),
        record(folder, [image(1, 24, 40)], "describe the image.", "a cat on a mat"),
        video_record(folder, (2, 4, 6), "and here?", "hello world", seed=2),
    ]


def image_token_id(config) -> int:
    return getattr(config, "image_token_id", None) or config.image_token_index


TOWER_NAMES = ("vision", "visual", "image_tower")  # LLaVA's vision_tower, Qwen's visual, Video-LLaVA's image_tower


def assert_same_grads(model, reference) -> int:
    """Every parameter's gradient after the pack (``model``) against the records alone (``reference``, the
    same weights): both absent, or within 1e-4 of the reference's largest entry of that tensor (at least
    1e-3 of the largest over all tensors: an attention's key bias has zero gradient in exact arithmetic,
    float noise otherwise). Returns how many of the vision tower's tensors had a gradient."""
    scale = max(q.grad.abs().max().item() for q in reference.parameters() if q.grad is not None)
    tower = 0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            tower += any(part in name for part in TOWER_NAMES)
            assert (p.grad - q.grad).abs().max().item() <= 1e-4 * max(q.grad.abs().max().item(), 1e-3 * scale), name
    return tower


def trained(rec: dict, config) -> dict:
    """The record with labels: every token but the image and video placeholders (never trained)."""
    ids = rec["input_ids"][0]
    media = (ids == image_token_id(config)) | (ids == getattr(config, "video_token_id", -1))
    return {**rec, "labels": torch.where(media, -100, ids)[None]}


# Families built from transformers' own default config, shrunk (``build_default``): their records are made
# by counting what the tower gives for an image (``counted_records``), as their processor expands it.
DEFAULT_BUILT = ("aya_vision", "cohere2_vision", "cosmos3_omni", "deepseek_vl", "got_ocr2", "internvl",
                 "glm46v", "glm4v", "glm4v_moe", "glm_ocr", "glmga", "lighton_ocr", "llava_next_video", "mistral3",
                 "pp_chart2table", "qianfan_ocr", "qwen3_vl_moe", "video_llava", "vipllava", "llava_onevision1_5",
                 "ovis2_5", "granite4_vision", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker", "cosmos3_edge",
                 "hyperclovax_vision_v2", "exaone4_5", "lfm3_vl", "cohere_compass", "janus", "muse_glimmer",
                 "muse_spark", "minimax_m3_vl", "kimi_k25", "paddleocr_vl", "ernie4_5_vl_moe", "idefics2", "idefics3",
                 "smolvlm", "granite_docling", "hunyuan_vl")  # fmt: skip
DEFAULT_BUILT_VIDEOS = ("llava_next_video", "video_llava")  # and a record with a video
# Hybrid language models among them: Qwen3.5's Gated DeltaNet layer (run document by document) beside its full
# attention layer (``_keep_layer_kinds`` keeps one of each).
HYBRID_VLMS = ("qwen3_5", "qwen3_5_moe")
_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=512, max_position_embeddings=512, moe_intermediate_size=32, num_experts=4,
             num_experts_per_tok=2)  # fmt: skip
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, depth=2, num_heads=2,
               out_hidden_size=64, image_size=32, patch_size=8, head_dim=16)  # fmt: skip


def _granite4_vision(config) -> None:
    """Granite 4 Vision's default has no deepstack map, and its Q-Former takes a head per 64 of the tower's width:
    a 64-wide tower, one deepstack projector per tower layer and the four spatial projectors over a 6-layer language
    model (each language layer adds one projector's features), dropout off in the Q-Former too."""
    config.vision_config.hidden_size = 64
    qformer = config.qformer_config
    qformer.hidden_size = qformer.encoder_hidden_size = qformer.intermediate_size = 64
    qformer.num_attention_heads = qformer.num_hidden_layers = 1
    qformer.attention_probs_dropout_prob = qformer.hidden_dropout_prob = 0.0
    config.downsample_rate = "1/2"
    config.deepstack_layer_map = [(1, 0), (2, 1)]
    config.get_text_config().num_hidden_layers = 6
    config.spatial_target_layers = [2, 3, 4, 5]


def _omni_thinker(config) -> None:
    """A Qwen Omni thinker's audio tower shrunk too, its vision start token (its multimodal positions find an
    image by the token after a vision start) in the small vocabulary, its RoPE sections fitting the heads."""
    audio = config.audio_config
    _shrink(audio, dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, output_dim=64,
                        downsample_hidden_size=32))  # fmt: skip
    config.vision_start_token_id = 506
    _mrope(config.get_text_config())


def _one_kv_head_tower(config) -> None:
    """EXAONE 4.5's and LFM3-VL's towers name 8 key-value heads, beyond the shrunk 2 heads."""
    config.vision_config.num_key_value_heads = 1


def _cohere_compass(config) -> None:
    """Rotary settings per layer kind (its default: none) with sections fitting the heads; one deepstack layer."""
    config.get_text_config().rope_parameters = {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
    }
    config.vision_config.deepstack_visual_indexes = [0]


def _janus(config) -> None:
    """The aligner's output feeds the language model; the VQ model (image generation only) shrunk too."""
    text, vision, vq = config.get_text_config(), config.vision_config, config.vq_config
    vision.projection_dim = text.hidden_size
    vision.num_image_tokens = (vision.image_size // vision.patch_size) ** 2
    vq.projection_dim = vq.image_token_embed_dim = text.hidden_size
    vq.num_embeddings, vq.base_channels, vq.latent_channels, vq.channel_multiplier = 64, 32, 32, [1, 1]


def _muse(config) -> None:
    """Muse Glimmer's and Muse Spark's towers: 3 channels, their temporal patch under the name the records read, the
    adapter's input the pixel-shuffled tower width, a window that bites within a record; Muse Spark's experts and
    audio tower shrunk."""
    text, vision = config.get_text_config(), config.vision_config
    vision.num_channels = 3
    vision.temporal_patch_size = vision.patch_temporal
    config.out_hidden_size = vision.hidden_size * vision.merge_size**2
    config.projector_hidden_size = 64
    text.sliding_window = 8
    if getattr(config, "audio_config", None) is not None:
        text.moe_hidden_size, text.num_local_experts = 32, 4
        config.audio_config.out_hidden_size = text.hidden_size
        config.audio_config.hidden_sizes, config.audio_config.depths = [8, 8, 16, 16], [1, 1, 1, 1]
        config.audio_token_id = 503


def _minimax_m3_vl(config) -> None:
    """Its merged width is computed from the full-size language model; experts, rotary and indexer sizes shrunk."""
    text, vision = config.get_text_config(), config.vision_config
    config.merged_hidden_size = text.hidden_size * vision.spatial_merge_size**2
    config.projector_hidden_size = 64
    text.num_local_experts, text.rotary_dim = 4, 8
    text.dense_intermediate_size, text.shared_intermediate_size = 128, 32
    text.index_head_dim, text.index_n_heads, text.index_block_size, text.index_topk_blocks = 16, 2, 4, 2


def _kimi_k25(config) -> None:
    """Its tower names no channels; the projector's pre-norm width; its DeepSeek-V3 language model's latent
    attention and experts shrunk."""
    text, vision = config.get_text_config(), config.vision_config
    vision.num_channels = 3
    config.projection_hidden_size = vision.hidden_size
    text.q_lora_rank = text.kv_lora_rank = 32
    text.qk_nope_head_dim = text.qk_rope_head_dim = text.v_head_dim = text.head_dim = 16
    text.qk_head_dim = 32
    text.num_key_value_heads = text.num_attention_heads
    text.n_routed_experts, text.n_group, text.topk_group, text.first_k_dense_replace = 4, 1, 1, 1


def _ernie4_5_vl(config) -> None:
    """ERNIE 4.5-VL's text and vision experts (a width each, told apart) shrunk, its RoPE sections fitting the heads."""
    text = config.get_text_config()
    text.moe_intermediate_size, text.moe_num_experts, text.moe_k, text.moe_num_shared_experts = [32, 16], 4, 2, 1
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [3, 3, 2]}


def _idefics2(config) -> None:
    """Idefics2's perceiver resampler at the shrunk language model's width, fewer latents and heads."""
    perceiver = config.perceiver_config
    perceiver.hidden_size = config.get_text_config().hidden_size
    perceiver.resampler_depth, perceiver.resampler_n_latents, perceiver.resampler_n_heads = 1, 8, 2
    perceiver.resampler_head_dim, perceiver.num_key_value_heads = 16, 1


def _hunyuan_vl(config) -> None:
    """HunYuan-VL's four multimodal RoPE axes (a sequence axis before width, height and image index) fitting the
    shrunk heads, its tower's output at the language model's width, its image boundary and row-end tokens in the
    small vocabulary."""
    text = config.get_text_config()
    text.head_dim = 16
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [2, 2, 2, 2]}
    config.vision_config.text_hidden_size = config.vision_config.out_hidden_size = text.hidden_size
    config.im_start_id, config.im_end_id, config.im_newline_id = 502, 503, 504


# Families whose processor gives each patch of an image as a (channels, patch, patch) image, not a flat row
PATCH_IMAGES = ("paddleocr_vl", "kimi_k25")


_FIXES = {  # what a family's default needs beyond the sizes above
    "vipllava": lambda c: setattr(c, "vision_feature_layers", [-1, -2]),
    **{f: lambda c: (setattr(c.vision_config, "image_size", [32, 32]), setattr(c.vision_config, "patch_size", [8, 8]))
       for f in ("internvl", "qianfan_ocr")},
    **{glm: lambda c: _mrope(c.get_text_config()) for glm in ("glm4v", "glm46v", "glm4v_moe", "glm_ocr", "glmga")},
    "granite4_vision": _granite4_vision,
    **{omni: _omni_thinker for omni in ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")},
    **{f: _one_kv_head_tower for f in ("exaone4_5", "lfm3_vl")},
    **{f: _muse for f in ("muse_glimmer", "muse_spark")},
    "cohere_compass": _cohere_compass,
    "janus": _janus,
    "minimax_m3_vl": _minimax_m3_vl,
    "kimi_k25": _kimi_k25,
    "paddleocr_vl": lambda c: _mrope(c.get_text_config()),
    "ernie4_5_vl_moe": _ernie4_5_vl,
    "idefics2": _idefics2,
    "hunyuan_vl": _hunyuan_vl,
    "lfm2_vl": lambda c: setattr(c.get_text_config(), "layer_types", ["conv", "full_attention"]),  # as LFM2-VL's
}  # fmt: skip


def _mrope(text) -> None:
    """Multimodal RoPE sections that fit the shrunk heads (a family reading them with a default for its full size)."""
    rope = dict(text.rope_parameters)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    half = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    text.rope_parameters = {**rope, "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}


def _keep_layer_kinds(config) -> None:
    """Per-layer lists (``layer_types``, MiniMax's ``mlp_layer_types``, Muse's ``layer_rope_theta``) cut to the
    shrunk layer count, keeping the first layer of each kind (a hybrid's linear attention or convolution beside its
    full attention), the same layers in every list."""
    n = getattr(config, "num_hidden_layers", None)
    lists = {
        k: v
        for k, v in vars(config).items()
        if (k.endswith("layer_types") or k.startswith("layer_")) and isinstance(v, list)
    }
    if not n or "layer_types" not in lists or len(lists["layer_types"]) <= n:
        return
    kinds = lists["layer_types"]
    firsts = sorted({kinds.index(kind) for kind in kinds})[:n]
    keep = sorted(firsts + [i for i in range(len(kinds)) if i not in firsts][: n - len(firsts)])
    for key, value in lists.items():
        if len(value) == len(kinds):
            setattr(config, key, [value[i] for i in keep])


def _shrink(config, sizes: dict) -> None:
    for key, value in sizes.items():
        if isinstance(getattr(config, key, None), (int, float)) and not isinstance(getattr(config, key), bool):
            setattr(config, key, value)


def build_default(path: Path, family: str) -> Path:
    """A tiny ``family`` checkpoint folder: transformers' default config for it with a 2-layer language
    model (vocabulary 512, the image token 500) and a 2-layer tower on 32-pixel images; random weights."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(family)
    text = config.get_text_config()
    _shrink(text, _TEXT)
    _shrink(config.vision_config, _VISION)
    for holder in (text, config.vision_config):  # Ovis2.5's tower lists its layers' kinds too
        _keep_layer_kinds(holder)
    for key, value in (("bos_token_id", 1), ("eos_token_id", 2), ("pad_token_id", 0)):
        for holder in {id(text): text, id(config): config}.values():
            if getattr(holder, key, None) is not None:
                setattr(holder, key, value)
    rope = getattr(text, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("mrope_section"):  # Qwen3-VL-MoE: sections of the smaller heads
        text.rope_parameters = {**rope, "mrope_section": [2, 3, 3]}
    for key in ("image_token_id", "image_token_index"):
        if getattr(config, key, None) is not None:
            setattr(config, key, 500)
    for key in ("video_token_id", "video_token_index"):
        if getattr(config, key, None) is not None:
            setattr(config, key, 501)
    boundaries = ("image_start_token_id", "image_end_token_id", "video_start_token_id", "video_end_token_id")
    for i, key in enumerate(boundaries):
        if getattr(config, key, None) is not None:  # Ovis2.5's boundaries of an image or a video
            setattr(config, key, 502 + i)
    if getattr(config, "image_grid_pinpoints", None):  # anyres: one 32-pixel tile beside the base image
        config.image_grid_pinpoints = [[32, 32]]
    for holder in (config, text, config.vision_config):  # the reference runs in eval mode, the pack in train mode
        for key, value in list(vars(holder).items()):
            if ("dropout" in key or "drop_path" in key) and isinstance(value, float):
                setattr(holder, key, 0.0)
    _FIXES.get(family, lambda c: None)(config)
    return _save(path, config)


def counted_records(folder: Path, videos: bool = False, sizes: dict | None = None) -> list[dict]:
    """Two records with one image each (random pixels, the placeholder repeated as many times as the
    tower gives features for it) and a text-only record, labelled (image tokens untrained); with
    ``videos``, a record with a 4-frame video too (its placeholder repeated as the tower's video features);
    ``sizes``: record -> (height, width) of its image, for a tower that takes ``image_sizes``."""
    import inspect

    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder)
    config, vision = model.config, model.config.vision_config
    out = []
    kinds = [(1, "image"), (2, "image"), (3, None)] + ([(4, "video")] if videos else [])
    for seed, kind in kinds:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(10, 200, (1, 20), generator=g)
        rec: dict = {}
        if kind is not None:
            encode = getattr(model.model, f"get_{kind}_features")
            takes = inspect.signature(encode).parameters
            pixels = "pixel_values" if kind == "image" else "pixel_values_videos"
            grid = f"{kind}_grid_thw"
            frames = 1 if kind == "image" else 4
            if grid in takes:  # Qwen-style towers take patch rows and their grid
                temporal = getattr(vision, "temporal_patch_size", 1)  # LLaVA-OneVision-1.5's tower: images only
                rows = getattr(vision, "in_channels", None) or vision.num_channels
                rows *= temporal * vision.patch_size**2
                t = max(1, frames // temporal)  # an image: one temporal patch
                rec[pixels] = torch.randn(16 * t, rows, generator=g)
                if config.model_type in PATCH_IMAGES:
                    rec[pixels] = rec[pixels].reshape(16 * t, -1, vision.patch_size, vision.patch_size)
                rec[grid] = torch.tensor([[t, 4, 4]])
            else:
                size = vision.image_size if isinstance(vision.image_size, int) else vision.image_size[0]
                # anyres images: base + one tile; a video: its frames
                tiles = (2,) if kind == "image" and getattr(config, "image_grid_pinpoints", None) else ()
                tiles = (frames,) if kind == "video" else tiles
                shape = (sizes or {}).get(len(out), (size, size))
                rec[pixels] = torch.randn(1, *tiles, getattr(vision, "num_channels", 3), *shape, generator=g)
                if "pixel_attention_mask" in takes:  # Idefics2/3, SmolVLM: [1, images, ...], each image's valid part
                    rec[pixels] = rec[pixels][:, None]
                    rec["pixel_attention_mask"] = torch.ones(1, 1, *shape, dtype=torch.long)
                    if config.model_type == "granite_docling":  # its mask says which tiles are real
                        rec["pixel_attention_mask"] = torch.ones(1, 1, dtype=torch.bool)
            if "image_sizes" in takes:
                rec["image_sizes"] = torch.tensor([list(shape)])
            with torch.no_grad():
                encoded = encode(**rec, return_dict=True)
            # Granite 4 Vision's tower gives no pooler output: its features are deepstack (layer, blocks) pairs
            features = encoded.pooler_output if encoded.pooler_output is not None else encoded.deepstack_features[0][1]
            n = sum(f.reshape(-1, f.shape[-1]).shape[0] for f in features)
            token = image_token_id(config) if kind == "image" else video_token_id(config)
            block = torch.full((1, n), token)
            start, end = getattr(config, f"{kind}_start_token_id", None), getattr(config, f"{kind}_end_token_id", None)
            if start is not None and end is not None:  # Ovis2.5's: each image between boundary tokens of its own
                block = torch.cat([torch.tensor([[start]]), block, torch.tensor([[end]])], 1)
            numbering = getattr(model.model, "get_rope_index", None)
            if numbering is not None and "mm_token_type_ids" not in inspect.signature(numbering).parameters:
                block = torch.cat([torch.tensor([[config.vision_start_token_id]]), block], 1)  # the Omni thinkers'
            ids = torch.cat([ids[:, :5], block, ids[:, 5:]], 1)
            if grid in rec:
                rec["mm_token_type_ids"] = (ids == token).long() * (1 if kind == "image" else 2)
            if "moe_mm_token_type_ids" in inspect.signature(model.forward).parameters:  # ERNIE 4.5-VL's experts'
                # routing: the processor marks the image's boundary tokens too
                rec["moe_mm_token_type_ids"] = torch.isin(ids, block).long() * (1 if kind == "image" else 2)
        rec["input_ids"] = ids
        rec["attention_mask"] = torch.ones_like(ids)  # as a processor gives it (the Omni thinkers number by it)
        out.append(trained(rec, config))
    return out


# A record's images [1, images, C, H, W] with pixel_attention_mask (Granite-Docling's: [1, images], its real tiles)
MASKED_IMAGES = ("idefics2", "idefics3", "smolvlm", "granite_docling")


def masked_records(folder: Path) -> list[dict]:
    """Idefics2/3 and SmolVLM records as their processor gives them: a record's images padded with zeros to its
    largest (``pixel_attention_mask`` 0 there): two images, one image, text only; Idefics2's of different sizes
    (32x32 and 16x32 padded below, 16x16), which its perceiver resamples to a fixed count of features; Idefics3's and
    SmolVLM's 32x32 (their processor resizes every image to tiles of one size). Each image's placeholders as many as
    the tower gives features for it."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder)
    config = model.config
    out = []
    sized = config.model_type == "idefics2"
    for seed, sizes in ((1, [(32, 32), (16 if sized else 32, 32)]), (2, [(16, 16) if sized else (32, 32)]), (3, [])):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(10, 200, (1, 20), generator=g)
        rec: dict = {}
        if sizes:
            height, width = max(h for h, _ in sizes), max(w for _, w in sizes)
            rec["pixel_values"] = torch.zeros(1, len(sizes), 3, height, width)
            rec["pixel_attention_mask"] = torch.zeros(1, len(sizes), height, width, dtype=torch.long)
            for i, (h, w) in enumerate(sizes):
                rec["pixel_values"][0, i, :, :h, :w] = torch.randn(3, h, w, generator=g)
                rec["pixel_attention_mask"][0, i, :h, :w] = 1
            if config.model_type == "granite_docling":  # its mask says which tiles are real
                rec["pixel_attention_mask"] = torch.ones(1, len(sizes), dtype=torch.bool)
            with torch.no_grad():
                features = model.model.get_image_features(**rec, return_dict=True).pooler_output
            n = sum(f.reshape(-1, f.shape[-1]).shape[0] for f in features)
            ids = torch.cat([ids[:, :5], torch.full((1, n), image_token_id(config)), ids[:, 5:]], 1)
        rec["input_ids"] = ids
        out.append(trained(rec, config))
    return out


def patch_records(folder: Path) -> list[dict]:
    """LFM2-VL records as its processor gives them (SigLIP 2's patches): a record's images as rows of flat patches,
    each padded with zeros to the record's most (``pixel_attention_mask`` 0 there), with ``spatial_shapes`` (rows,
    columns of patches): two images (4x4 and 2x4 patches), one of 4x2, text only; each image's placeholders as many
    as the tower gives features for it."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder)
    config = model.config
    row = config.vision_config.num_channels * config.vision_config.patch_size**2
    out = []
    for seed, shapes in ((1, [(4, 4), (2, 4)]), (2, [(4, 2)]), (3, [])):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(10, 200, (1, 20), generator=g)
        rec: dict = {}
        if shapes:
            most = max(h * w for h, w in shapes)
            rec["pixel_values"] = torch.zeros(len(shapes), most, row)
            rec["pixel_attention_mask"] = torch.zeros(len(shapes), most, dtype=torch.long)
            for i, (h, w) in enumerate(shapes):
                rec["pixel_values"][i, : h * w] = torch.randn(h * w, row, generator=g)
                rec["pixel_attention_mask"][i, : h * w] = 1
            rec["spatial_shapes"] = torch.tensor(shapes)
            with torch.no_grad():
                features = model.model.get_image_features(**rec, return_dict=True).pooler_output
            n = sum(f.reshape(-1, f.shape[-1]).shape[0] for f in features)
            ids = torch.cat([ids[:, :5], torch.full((1, n), image_token_id(config)), ids[:, 5:]], 1)
        rec["input_ids"] = ids
        out.append(trained(rec, config))
    return out


def video_token_id(config) -> int:
    return getattr(config, "video_token_id", None) or config.video_token_index
