"""The video demo: a tiny random Qwen2-VL checkpoint folder (config, weights, tokenizer, processor with its
video processor, as users' folders look) and chats generated offline that mix images and short videos,
each video a folder of drawn frames: which way a shape moves, what colour it turns, what moves, whether
a picture shows the shape of a video. Only the pixels decide the answers, and only across frames for
the motion and the colour change. Videos have 4 or 6 frames (2 or 3 temporal patches of 18 tokens),
pictures 4 to 16 tokens, and some records are text: packs mix lengths as real video data does.

Qwen2-VL's processor loads a video processor, which needs torchvision (as every video processor of
transformers 5 does): without it the demo stops with a one-line error (exit 2) before building anything.

    python -m lit_hbp.demo.video demo_video     # what configs/tiny_video_cpu.yaml reads
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lit_hbp.demo.text import at_least, byte_level_bpe, out_folder
from lit_hbp.demo.vision import COLORS, DATA_FILE, IMAGE_DIR, MODEL_DIR, SHAPES, ensure_built, paint, passed
from lit_hbp.errors import ConfigError

VERSION = "1"
VIDEO_DIR = "videos"
FRAME_SIZE = (48, 24)  # width, height: 6 x 3 merged patches of 8 pixels, 18 tokens a temporal patch of 2 frames
FRAME_COUNTS = (4, 6)
IMAGE_SIDES = (16, 24, 32)  # 4 to 16 tokens an image
RADIUS = 6
KINDS = ("move", "turn", "what", "same", "text")  # what a record asks (lit_hbp.demo.video.records)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]  # fmt: skip
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def require_torchvision() -> None:
    """Stop before building: Qwen2-VL's video processor (every video processor of transformers 5) needs
    torchvision, which a CPU-only torch install often lacks."""
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        import torch

        raise ConfigError(
            "the video demo needs torchvision (Qwen2-VL's video processor, like every video processor in "
            f"transformers, uses it): pip install the torchvision built for your torch {torch.__version__}; "
            "the image demo (python -m lit_hbp.demo.vision, configs/tiny_vlm_cpu.yaml) needs none"
        )


def frame(color: str, shape: str, x: int, y: int):
    """A white frame of ``FRAME_SIZE`` with one ``shape`` centred at (x, y)."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", FRAME_SIZE, (255, 255, 255))
    paint(ImageDraw.Draw(im), color, shape, (x, y), RADIUS)
    return im


def clip(rng: random.Random, folder: Path, color: str, shape: str, move: int = 0, turn: str | None = None) -> None:
    """A folder of frames ``0.png``, ``1.png``, ...: the shape moving ``move`` (-1 left, +1 right, 0 in
    place) across the width, and, with ``turn``, in that colour from the second half of the frames on."""
    folder.mkdir()
    n = rng.choice(FRAME_COUNTS)
    width, height = FRAME_SIZE
    y = height // 2 + rng.randint(-2, 2)
    if move:
        lo, hi = RADIUS + rng.randint(0, 3), width - RADIUS - rng.randint(1, 4)
        xs = [lo + (hi - lo) * k // (n - 1) for k in range(n)][::move]
    else:
        xs = [rng.randint(RADIUS + 2, width - RADIUS - 2)] * n
    for k, x in enumerate(xs):
        frame(turn if turn and k >= n // 2 else color, shape, x, y).save(folder / f"{k}.png")


def record(question: str, answer: str, images: Sequence[str] = (), videos: Sequence[str] = ()) -> dict[str, Any]:
    """A record in LLaMA-Factory's form: an ``<image>`` and a ``<video>`` marker per picture and video
    (pictures first) before the question, and their lists; a video is a folder of frames."""
    markers = "<image>" * len(images) + "<video>" * len(videos)
    out: dict[str, Any] = {"messages": [{"role": "user", "content": markers + question},
                                        {"role": "assistant", "content": answer}]}  # fmt: skip
    if images:
        out["images"] = list(images)
    if videos:
        out["videos"] = list(videos)
    return out


def records(rng: random.Random, n: int, root: Path) -> list[dict[str, Any]]:
    """``n`` chat records, their frame folders and images written under ``root``: a video, a video and a
    picture, or text alone (so the shortest records with media, the ones fit's self-check packs, hold videos)."""
    from PIL import Image, ImageDraw

    out = []
    for i in range(n):
        kind = rng.choice(KINDS)
        color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
        video = f"{VIDEO_DIR}/{i:05d}"
        if kind == "move":
            move = rng.choice((-1, 1))
            clip(rng, root / video, color, shape, move=move)
            out.append(record(f"Which way does the {shape} move?", "Left." if move < 0 else "Right.", videos=[video]))
        elif kind == "turn":
            turn = rng.choice([c for c in COLORS if c != color])
            clip(rng, root / video, color, shape, move=rng.choice((-1, 0, 1)), turn=turn)
            out.append(record(f"What color does the {shape} turn?", f"From {color} to {turn}.", videos=[video]))
        elif kind == "what":
            clip(rng, root / video, color, shape, move=rng.choice((-1, 1)))
            out.append(record("What moves in the video?", f"A {color} {shape}.", videos=[video]))
        elif kind == "same":
            same = rng.random() < 0.5
            other = (color, shape) if same else rng.choice([(c, s) for c in COLORS for s in SHAPES if c != color])
            side = rng.choice(IMAGE_SIDES)
            picture = Image.new("RGB", (side, side), (255, 255, 255))
            paint(ImageDraw.Draw(picture), *other, (side // 2, side // 2), side // 2 - rng.randint(1, 3))
            name = f"{IMAGE_DIR}/{i:05d}.png"
            picture.save(root / name)
            clip(rng, root / video, color, shape, move=rng.choice((-1, 0, 1)))
            question = "Is the shape in the picture the one in the video?"
            out.append(record(question, "Yes." if same else "No.", images=[name], videos=[video]))
        else:
            word = rng.choice([*COLORS, *SHAPES])
            out.append(record(f"Spell the word {word}.", " ".join(word) + "."))
    return out


def _model(folder: Path, texts: list[str], seed: int) -> None:
    """A random tiny Qwen2-VL (a 2-block tower of 4-pixel patches merged 2 x 2, a 4-layer language model)
    and its processor: tokenizer, image processor and video processor."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, PreTrainedTokenizerFast, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(texts, 512, SPECIALS), pad_token="<|endoftext|>",
                                  eos_token="<|im_end|>")  # fmt: skip
    pixels = dict(patch_size=4, temporal_patch_size=2, merge_size=2)
    size = {"shortest_edge": 8 * 8, "longest_edge": 48 * 48}  # the fewest and most pixels a picture or frame keeps
    processor = Qwen2VLProcessor(
        Qwen2VLImageProcessorPil(size=size, **pixels), tokenizer=tok, chat_template=TEMPLATE,
        video_processor=Qwen2VLVideoProcessor(size=size, **pixels),
    )  # fmt: skip
    tokens = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
              "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}  # fmt: skip
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in tokens.items()}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}  # head_dim 32: 16 pairs
    text = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rope_parameters=rope,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)  # fmt: skip
    vision = dict(depth=2, num_heads=2, embed_dim=64, hidden_size=128, mlp_ratio=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2)  # fmt: skip
    config = AutoConfig.for_model("qwen2_vl", text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    processor.save_pretrained(folder)


def write_demo(tmp: Path, n: int, seed: int) -> dict[str, Any]:
    """The demo's files written into ``tmp``; what the manifest counts."""
    (tmp / IMAGE_DIR).mkdir()
    (tmp / VIDEO_DIR).mkdir()
    recs = records(random.Random(seed), n, tmp)
    (tmp / DATA_FILE).write_text("".join(json.dumps(r) + "\n" for r in recs))
    _model(tmp / MODEL_DIR, [m["content"] for r in recs for m in r["messages"]] * 4, seed)
    return {"records": len(recs), "images": sum(len(r.get("images", [])) for r in recs),
            "videos": sum(len(r.get("videos", [])) for r in recs)}  # fmt: skip


def ensure_video_demo(out_dir: str | os.PathLike[str], n: int | None = None, seed: int | None = None) -> dict[str, Any]:
    """The video demo in ``out_dir``, built when missing (``lit_hbp.demo.vision.ensure_built``): ``n``
    records (default 400) from ``seed`` (default 0), ``n`` or ``seed`` not given accepting any complete
    build; a ``ConfigError`` naming torchvision where it is missing."""
    require_torchvision()
    return ensure_built(out_dir, VERSION, passed(n=n, seed=seed), {"n": 400, "seed": 0}, write_demo)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_hbp.demo.video", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=out_folder, help="folder to write (model/, chat.jsonl, images/, videos/)")
    parser.add_argument("--n", type=at_least(1), default=400, help="records (default 400)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        manifest = ensure_video_demo(args.out_dir, args.n, args.seed)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out_dir}: {manifest['records']} records, {manifest['videos']} videos (frame folders), "
          f"{manifest['images']} images, model in {MODEL_DIR}/")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
