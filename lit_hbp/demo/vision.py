"""The vision-language demo: a tiny random LLaVA-NeXT checkpoint folder (config, weights, tokenizer,
processor, as users' folders look) and an image-chat data set generated offline: drawn shapes whose
colour, kind and count the answers name, so the loss can fall only by looking at the pixels. Image
sizes vary, so an image becomes 17 to 68 tokens (anyres tiles), and some records hold two images or
none: packs mix lengths as real vision-language data does.

    python -m lit_hbp.demo.vision demo_vlm      # what configs/tiny_vlm_cpu.yaml reads (built when missing)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lit_hbp.demo.text import at_least, byte_level_bpe, out_folder

VERSION = "2"  # 2: the text demo's BPE settings (lit_hbp.demo.text.byte_level_bpe)
MODEL_DIR, DATA_FILE, IMAGE_DIR = "model", "chat.jsonl", "images"
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 205, 30),
          "purple": (140, 60, 190), "orange": (245, 135, 25)}  # fmt: skip
SHAPES = ("square", "circle", "triangle")
SIDES = (32, 48, 64)  # image widths and heights: 1 to 4 anyres tiles of 32 pixels
NUMBERS = ("zero", "one", "two", "three")
SPECIALS = ["<pad>", "<s>", "</s>", "<|end|>", "<image>"]
TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}<image>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT: {% endif %}"
)


def draw(rng: random.Random, shapes: list[tuple[str, str]], size: tuple[int, int]):
    """A white image of ``size`` with each (colour, shape) drawn in its own part of the width."""
    from PIL import Image, ImageDraw

    width, height = size
    im = Image.new("RGB", size, (255, 255, 255))
    pen = ImageDraw.Draw(im)
    slot = width // len(shapes)
    for k, (color, shape) in enumerate(shapes):
        r = max(4, min(slot, height) // 2 - rng.randint(1, 3))
        paint(pen, color, shape, (slot * k + slot // 2, height // 2 + rng.randint(-2, 2)), r)
    return im


def paint(pen, color: str, shape: str, center: tuple[int, int], r: int) -> None:
    """One filled ``shape`` of radius ``r`` at ``center`` (the image and the video demos' pen)."""
    cx, cy = center
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "square":
        pen.rectangle(box, fill=COLORS[color])
    elif shape == "circle":
        pen.ellipse(box, fill=COLORS[color])
    else:
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLORS[color])


def _chat(user: str, answer: str, images: list[str]) -> dict[str, Any]:
    """A record in LLaMA-Factory's form: the question with one <image> marker per image, and the list."""
    record = {"messages": [{"role": "user", "content": "<image>" * len(images) + user},
                           {"role": "assistant", "content": answer}]}  # fmt: skip
    if images:
        record["images"] = images
    return record


def records(rng: random.Random, n: int, image_dir: Path) -> list[dict[str, Any]]:
    """``n`` chat records and their images written into ``image_dir``: one, two or no images each."""
    out = []
    for i in range(n):
        kind = rng.choice(("color", "shape", "count", "which", "text"))
        size = (rng.choice(SIDES), rng.choice(SIDES))

        def image(shapes, k=0, i=i, size=size):
            name = f"{i:05d}_{k}.png"
            draw(rng, shapes, size).save(image_dir / name)
            return f"{IMAGE_DIR}/{name}"

        color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
        if kind == "color":
            out.append(_chat("What color is the shape?", f"It is {color}.", [image([(color, shape)])]))
        elif kind == "shape":
            out.append(_chat("What shape is this?", f"A {color} {shape}.", [image([(color, shape)])]))
        elif kind == "count":
            shapes = [(rng.choice(list(COLORS)), rng.choice(SHAPES)) for _ in range(rng.randint(1, 3))]
            out.append(_chat("How many shapes are there?", f"There are {NUMBERS[len(shapes)]}.", [image(shapes)]))
        elif kind == "which":
            other = rng.choice([c for c in COLORS if c != color])
            first = rng.random() < 0.5
            pair = [image([(color if first else other, shape)], 0), image([(other if first else color, shape)], 1)]
            answer = f"The {'first' if first else 'second'} one."
            out.append(_chat(f"Which image shows the {color} {shape}?", answer, pair))
        else:
            word = rng.choice([*COLORS, *SHAPES])
            out.append(_chat(f"Spell the word {word}.", " ".join(word) + ".", []))
    return out


def _tokenizer(texts: list[str]):
    from transformers import PreTrainedTokenizerFast

    tok = byte_level_bpe(texts, 512, SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<|end|>")
    fast.chat_template = TEMPLATE
    return fast


def _model(folder: Path, tok, seed: int) -> None:
    """A random tiny LLaVA-NeXT (CLIP tower of 32-pixel tiles, 4-layer Llama) and its processor."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    crop = {"height": 32, "width": 32}
    pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size=crop, image_grid_pinpoints=pinpoints)
    processor = LlavaNextProcessor(
        images, tokenizer=tok, patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=TEMPLATE,
    )  # fmt: skip
    vision = dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8, projection_dim=64)  # fmt: skip
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    text = dict(model_type="llama", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, vocab_size=len(tok),
                **ids)  # fmt: skip
    config = AutoConfig.for_model(
        "llava_next", vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=16, vision_feature_layer=-1, vision_feature_select_strategy="default",
        image_grid_pinpoints=pinpoints, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    processor.save_pretrained(folder)


def write_demo(tmp: Path, n: int, seed: int) -> dict[str, Any]:
    """The demo's files written into ``tmp``; what the manifest counts."""
    (tmp / IMAGE_DIR).mkdir()
    recs = records(random.Random(seed), n, tmp / IMAGE_DIR)
    (tmp / DATA_FILE).write_text("".join(json.dumps(r) + "\n" for r in recs))
    texts = [m["content"] for r in recs for m in r["messages"]] * 4
    _model(tmp / MODEL_DIR, _tokenizer(texts), seed)
    return {"records": len(recs), "images": sum(len(r.get("images", [])) for r in recs)}


def build(out: Path, version: str, args: dict[str, Any], write: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """Write a demo into ``out`` (its lock held): ``write`` fills a hidden folder inside it, whose parts
    move into place one by one, the manifest last (what says the demo is complete)."""
    (out / "manifest.json").unlink(missing_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".build-"))
    try:
        counts = write(tmp)
        for part in sorted(tmp.iterdir()):
            if (out / part.name).is_dir():
                shutil.rmtree(out / part.name)
            os.replace(part, out / part.name)
        manifest = {"version": version, "args": args, **counts}
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def ensure_built(
    out_dir: str | os.PathLike[str],
    version: str,
    requested: dict[str, Any],
    defaults: dict[str, Any],
    write: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    """The demo ``write(tmp, **args)`` makes in ``out_dir``, built only when missing, built by another
    version, or built with other values of the ``requested`` arguments; arguments not requested are not
    compared (a folder the user built at another size is kept, as the text demo's ``ensure_demo`` keeps
    it) and a build takes them from ``defaults``. Concurrent callers (ranks, nodes) wait for one build on a
    file lock."""
    from filelock import FileLock

    out = Path(out_dir)

    def complete() -> dict[str, Any] | None:
        try:
            manifest = json.loads((out / "manifest.json").read_text())
        except (OSError, ValueError):
            return None
        built = manifest.get("args") or {}
        ok = manifest.get("version") == version and all(built.get(k) == v for k, v in requested.items())
        return manifest if ok and (out / MODEL_DIR / "config.json").exists() else None

    if (manifest := complete()) is not None:
        return manifest
    out.mkdir(parents=True, exist_ok=True)
    args = {**defaults, **requested}
    with FileLock(str(out / ".demo.lock")):
        return complete() or build(out, version, args, lambda tmp: write(tmp, **args))


def passed(**kwargs: Any) -> dict[str, Any]:
    """The arguments given a value (not None): those ``ensure_built`` compares with a folder's build."""
    return {k: v for k, v in kwargs.items() if v is not None}


def ensure_vlm_demo(out_dir: str | os.PathLike[str], n: int | None = None, seed: int | None = None) -> dict[str, Any]:
    """The image demo in ``out_dir``, built when missing (``ensure_built``): ``n`` records (default 1200)
    from ``seed`` (default 0); ``n`` or ``seed`` not given accepts any complete build."""
    return ensure_built(out_dir, VERSION, passed(n=n, seed=seed), {"n": 1200, "seed": 0}, write_demo)


# HBPDataModule's ``demo``: lit_hbp.demo.text's, this module's, or lit_hbp.demo.video's (torchvision needed)
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_hbp.demo.vision", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=out_folder, help="folder to write (model/, chat.jsonl, images/)")
    parser.add_argument("--n", type=at_least(1), default=1200, help="records (default 1200)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    manifest = ensure_vlm_demo(args.out_dir, args.n, args.seed)
    print(f"{args.out_dir}: {manifest['records']} records, {manifest['images']} images, model in {MODEL_DIR}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
