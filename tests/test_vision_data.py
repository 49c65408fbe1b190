"""Records with images on the data side: chat records with image parts, LLaVA JSON and ShareGPT /
LLaMA-Factory ``images`` with ``<image>`` markers, rendered and expanded by the checkpoint's processor,
cached as ids and image files, decoded in the loader, packed exactly.

References are independent: the processor's own ``apply_chat_template`` for the ids, each record alone
through the unprepared model with eager attention for the loss and every gradient, the family's own
``get_rope_index`` for positions.
"""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import HANG_S, console_script
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
from vision_models import (
    assert_same_grads,
    build_ernie,
    build_idefics3,
    build_lfm2_vl,
    build_llava,
    build_pixtral,
    build_qwen,
    image,
    needs_torchvision,
    three_records,
)

from lit_hbp import HBPDataModule, packed_loss, prepare_model
from lit_hbp.data.media import image_token_id, rope_stand_in
from lit_hbp.data.media_batch import MRopePositions, media_of
from lit_hbp.data.sources import Source
from lit_hbp.data.tokenize import tokenize_source
from lit_hbp.errors import DataError

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"a.png": (30, 20), "b.png": (24, 40), "c.png": (16, 16)}  # (width, height)
ANSWERS = ["a cat on a mat", "the quick brown fox", "def f(x): return x", "hello world"]


def chat(content, answer):
    return [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]


# The same kinds of records in each format a user has: (record, its messages as the processor takes them)
def records(folder: Path) -> list[tuple[dict, list]]:
    img = {name: Image.open(folder / "img" / name).convert("RGB") for name in SIZES}

    def parts(*names, text):
        return [*({"type": "image", "image": img[n]} for n in names), {"type": "text", "text": text}]

    def reference(user_parts, answer):
        answer_parts = [{"type": "text", "text": answer}]
        return [{"role": "user", "content": user_parts}, {"role": "assistant", "content": answer_parts}]

    return [
        (  # OpenAI-style content parts
            {"messages": chat([{"type": "image", "image": "img/a.png"},
                               {"type": "text", "text": "describe the image."}], ANSWERS[0])},
            reference(parts("a.png", text="describe the image."), ANSWERS[0]),
        ),
        (  # LLaVA JSON: one image, <image> in the first human turn
            {"id": "llava-1", "image": "img/b.png",
             "conversations": [{"from": "human", "value": "<image>what is packing?"},
                               {"from": "gpt", "value": ANSWERS[1]}]},
            reference(parts("b.png", text="what is packing?"), ANSWERS[1]),
        ),
        (  # LLaMA-Factory: messages with <image> markers and an images list (two images, absolute path too)
            {"messages": chat("<image><image>hello world, what is packing?", ANSWERS[2]),
             "images": ["img/c.png", str(folder / "img" / "a.png")]},
            reference(parts("c.png", "a.png", text="hello world, what is packing?"), ANSWERS[2]),
        ),
        (  # text only, in the same file
            {"messages": chat("the quick brown fox", ANSWERS[3])},
            [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": ANSWERS[3]}],
        ),
    ]  # fmt: skip


def with_images_and_records(root: Path) -> Path:
    """``root`` with the images on disk and a JSON Lines file of records in three formats (``records``)."""
    (root / "img").mkdir()
    for k, (name, (w, h)) in enumerate(SIZES.items()):
        image(k, h, w).save(root / "img" / name)
    write(root / "d.jsonl", [r for r, _ in records(root)])
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny LLaVA-NeXT checkpoint folder (anyres: image sizes change the token count), images on disk
    and a JSON Lines file of records in three formats."""
    root = tmp_path_factory.mktemp("vlm_data")
    folder = build_llava(root / "llava_next", "llava_next")
    return with_images_and_records(root), folder


@pytest.fixture(scope="module")
def qwen_data(tmp_path_factory):
    """The same images and records beside a tiny Qwen2-VL checkpoint folder (multimodal RoPE, patches
    merged 2x2). Its processor loads a video processor, which needs torchvision: the compatibility part of
    the CI (torch 2.14.1 with its torchvision) runs these; the main environment's CPU torch has none."""
    needs_torchvision("qwen2_vl")
    root = tmp_path_factory.mktemp("qwen_data")
    folder = build_qwen(root / "qwen2_vl")
    return with_images_and_records(root), folder


@pytest.fixture(scope="module")
def onevision_data(tmp_path_factory):
    """The same images and records beside a tiny LLaVA-OneVision folder, whose processor reads a record's images
    together (anyres tiles for a record's one image, the base tile of each of several); it needs torchvision."""
    needs_torchvision("llava_onevision")
    root = tmp_path_factory.mktemp("onevision_data")
    folder = build_llava(root / "llava_onevision", "llava_onevision")
    return with_images_and_records(root), folder


@pytest.fixture(scope="module")
def pixtral_data(tmp_path_factory):
    """The same images and records beside a tiny Mistral 3 folder with its Pixtral processor: each image at its own
    size (a pack pads them to one, as the processor pads a batch); the processor needs torchvision."""
    needs_torchvision("mistral3")
    root = tmp_path_factory.mktemp("pixtral_data")
    folder = build_pixtral(root / "mistral3")
    return with_images_and_records(root), folder


@pytest.fixture(scope="module")
def ernie_data(tmp_path_factory):
    """The same images and records beside a tiny ERNIE 4.5-VL folder with its processor (multimodal RoPE; its
    experts routed by ``moe_mm_token_type_ids``, which mark each image's start and end tokens too); it needs
    torchvision."""
    needs_torchvision("ernie4_5_vl_moe")
    root = tmp_path_factory.mktemp("ernie_data")
    folder = build_ernie(root / "ernie4_5_vl_moe")
    return with_images_and_records(root), folder


@pytest.fixture(scope="module")
def idefics3_data(tmp_path_factory):
    """The same images and records beside a tiny Idefics3 folder with its processor (each image split into tiles
    and a global image: a record's images [1, images, C, H, W] with their pixel_attention_mask)."""
    root = tmp_path_factory.mktemp("idefics3_data")
    folder = build_idefics3(root / "idefics3")
    return with_images_and_records(root), folder


@pytest.fixture(scope="module")
def lfm2_vl_data(tmp_path_factory):
    """The same images and records beside a tiny LFM2-VL folder with its processor (an image's SigLIP 2 patches a
    row, with its pixel_attention_mask and spatial_shapes); its image processor needs torchvision."""
    needs_torchvision("lfm2_vl")
    root = tmp_path_factory.mktemp("lfm2_vl_data")
    folder = build_lfm2_vl(root / "lfm2_vl")
    return with_images_and_records(root), folder


FAMILY_DATA = {"llava_next": "data", "qwen2_vl": "qwen_data", "llava_onevision": "onevision_data",
               "mistral3": "pixtral_data", "ernie4_5_vl_moe": "ernie_data", "idefics3": "idefics3_data",
               "lfm2_vl": "lfm2_vl_data"}  # fmt: skip
# each toy template's turn end
TURN_END = {"llava_next": "<|end|>", "qwen2_vl": "<|im_end|>", "llava_onevision": "<|end|>", "mistral3": "<|end|>",
            "ernie4_5_vl_moe": "<|im_end|>", "idefics3": "<|end|>", "lfm2_vl": "<|end|>"}  # fmt: skip


def write(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.mark.parametrize("family", list(FAMILY_DATA))
def test_records_with_images_render_and_expand_as_the_processor_does(family, request, tmp_path):
    root, folder = request.getfixturevalue(FAMILY_DATA[family])
    processor = AutoProcessor.from_pretrained(folder)
    t = tokenize_source(Source(str(root / "d.jsonl")), processor.tokenizer, processor=processor, progress=False)
    assert len(t) == 4
    image_id = image_token_id(processor)
    for row, (_, msgs) in enumerate(records(root)):
        ref = processor.apply_chat_template(msgs, tokenize=True, return_dict=True)
        ids, mask = t.sample(row)
        assert ids.tolist() == list(ref["input_ids"][0]), row
        # the answer trains, nothing else (its first token carries the header's space: a token that
        # overlaps the turn trains, as for text records)
        assert processor.tokenizer.decode(ids[mask]).strip() == ANSWERS[row] + TURN_END[family]
        assert not mask[ids == image_id].any()
    if family == "llava_onevision":
        return  # the pixels of a record of several images are the base tiles, not each image's alone as below

    # The cache holds each image's file, size and the pixels its encoder sees, in order, never pixels themselves.
    def seen(name):  # the image processor's pixels of the image alone (each pixel once a frame), its tiles
        im = Image.open(root / "img" / name).convert("RGB")
        if family == "mistral3":  # its processor sizes an image in patches of the merged size, its image processor not
            (h, w) = processor(text=[processor.image_token], images=[[im]])["image_sizes"][0]
            return int(h) * int(w), 1
        pv = processor.image_processor(images=[im])["pixel_values"]
        shape = np.shape(pv)  # LLaVA-NeXT: [1, tiles, 3, h, w]; Qwen: [patches, 3 x frames x patch^2], one tile
        return int(np.prod(shape)) // 3, shape[1] if len(shape) == 5 else 1

    assert t.sample_media(0) == [(str(root / "img/a.png"), 30, 20, *seen("a.png"))]
    assert t.sample_media(2) == [(str(root / "img/c.png"), 16, 16, *seen("c.png")),
                                 (str(root / "img/a.png"), 30, 20, *seen("a.png"))]  # fmt: skip
    assert t.sample_media(3) == []


def test_the_token_cache_grows_with_samples_not_pixels(data, tmp_path):
    """The same records with images 64x larger in area: the same cache bytes (paths aside)."""
    root, folder = data
    processor = AutoProcessor.from_pretrained(folder)
    sizes = {}
    for scale in (1, 8):
        d = tmp_path / f"x{scale}"
        (d / "img").mkdir(parents=True)
        for k, (name, (w, h)) in enumerate(SIZES.items()):
            image(k, h * scale, w * scale).save(d / "img" / name)
        write(d / "d.jsonl", [r for r, _ in records(root)][:2])
        tokenize_source(Source(str(d / "d.jsonl")), processor.tokenizer, cache_dir=d / "cache", processor=processor,
                        progress=False)  # fmt: skip
        (cache,) = (d / "cache").glob("d-*")
        sizes[scale] = {p.name: p.stat().st_size for p in cache.iterdir() if p.name not in ("meta.json", "media.json")}
        assert sum(p.stat().st_size for p in d.glob("img/*")) > 10 * sum(sizes[scale].values()) or scale == 1
    assert sizes[1] == sizes[8]  # (anyres: the tiny model's token count depends on the tiles, not the pixels)


def test_an_edit_of_the_processors_own_settings_tokenizes_again(data, tmp_path):
    """``num_additional_image_tokens`` 1 -> 0 in processor_config.json (LLaVA-NeXT: one token fewer per tile):
    the same cache_dir re-tokenizes, and the records' image tokens are the edited processor's (the cache kept the
    old ones and the pack trained; the unprepared model refuses them)."""
    import shutil

    root, source = data
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    img_id = AutoProcessor.from_pretrained(folder).tokenizer.convert_tokens_to_ids("<image>")

    def tokens() -> int:
        dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                           cache_dir=str(tmp_path / "cache"))  # fmt: skip
        dm.setup("fit")
        (batch,) = list(dm.train_dataloader())
        return int((batch.input_ids == img_id).sum())

    def processors() -> int:
        processor = AutoProcessor.from_pretrained(folder)
        return sum(
            int((processor.apply_chat_template(msgs, tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
                 == img_id).sum())
            if isinstance(msgs[0]["content"], list) else 0
            for _, msgs in records(root)
        )  # fmt: skip

    before = tokens()
    assert before == processors()
    config = json.loads((folder / "processor_config.json").read_text())
    assert config["num_additional_image_tokens"] == 1
    (folder / "processor_config.json").write_text(json.dumps({**config, "num_additional_image_tokens": 0}))
    assert processors() < before
    assert tokens() == processors()
    assert len(list((tmp_path / "cache").glob("d-*"))) == 2  # a cache of its own, the first one kept


def alone(reference, encoded: list) -> torch.Tensor:
    """Summed cross-entropy of each record alone through the unprepared model: (the processor's own
    encoding of the record, its labels)."""
    return sum(
        F.cross_entropy(
            reference(**{k: v for k, v in enc.items() if k != "attention_mask"}, use_cache=False).logits[0, :-1],
            labels[1:],
            reduction="sum",
            ignore_index=-100,
        )
        for enc, labels in encoded
    )


@pytest.mark.parametrize("family", list(FAMILY_DATA))
def test_a_data_module_pack_of_image_records_trains_like_each_record_alone(family, request, tmp_path):
    """HBPDataModule over the records (images decoded by the loader; Qwen's 3-D positions numbered there):
    its pack through packed_loss on the prepared model gives the summed cross-entropy of the records
    alone (1e-5) and every gradient, the vision tower's included (1e-4)."""
    root, folder = request.getfixturevalue(FAMILY_DATA[family])
    dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup("fit")
    (batch,) = list(dm.train_dataloader())
    per_image = {"qwen2_vl": "image_grid_thw", "ernie4_5_vl_moe": "image_grid_thw", "lfm2_vl": "spatial_shapes"}.get(
        family, "image_sizes"
    )
    if family == "idefics3":  # a row per record with images, its images (tiles and a global image each) padded
        assert batch.mm["pixel_values"].shape[0] == 3 and batch.mm["pixel_attention_mask"].shape[:2] == (3, 10)
    else:
        assert batch.mm is not None and batch.mm[per_image].shape[0] == 4  # four images in the pack
    if family == "llava_onevision":  # each record's images read together, as its processor does: 1, 1, 2, none
        assert batch.mm["batch_num_images"].tolist() == [1, 1, 2]
    if family == "ernie4_5_vl_moe":  # its experts' routing: each record's as its processor marks it, in pack order
        processor = AutoProcessor.from_pretrained(folder)
        routes = [processor.apply_chat_template(m, tokenize=True, return_dict=True)["moe_mm_token_type_ids"][0]
                  for _, m in records(root)]  # fmt: skip
        assert batch.mm["moe_mm_token_type_ids"][0, : sum(map(len, routes))].tolist() == sum(routes, [])
    if family == "mistral3":  # the records' images at 32x32, 48x32 and 32x32 (16x16 padded beside it): one size
        assert batch.mm["image_sizes"].tolist() == [[32, 32], [48, 32], [16, 16], [32, 32]]
        assert tuple(batch.mm["pixel_values"].shape) == (4, 3, 48, 32)
    reference = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").float()
    model = prepare_model(AutoModelForImageTextToText.from_pretrained(folder).float())
    processor = AutoProcessor.from_pretrained(folder)
    refs = []
    for row, (_, msgs) in enumerate(records(root)):
        enc = processor.apply_chat_template(msgs, tokenize=True, return_dict=True, return_tensors="pt")
        ids, mask = dm.store.sources[0].sample(row)
        refs.append((enc, torch.where(torch.as_tensor(mask), enc["input_ids"][0], -100)))
    want = alone(reference, refs)
    want.backward()
    out = packed_loss(model, batch, "sum")
    out.loss.backward()
    assert float(out.ce_sum.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    assert assert_same_grads(model, reference) > 0


def test_the_self_check_packs_the_runs_own_images_and_catches_a_leak_between_them(data, tmp_path, monkeypatch):
    """The data module hands the self-check its shortest samples with images exactly as the processor
    encodes them alone; packed beside the text documents they pass (loss, embedding and pixel gradients,
    no leak); an encoder that lets one image see another (a thousandth of the pack's mean pixel added to
    each image) leaks only through the pixels, and the self-check refuses it."""
    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.model import causal_lm
    from lit_hbp.model.selfcheck import SelfCheckError, run_self_check

    root, folder = data
    dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup("fit")
    docs = dm.self_check_samples()
    processor = AutoProcessor.from_pretrained(folder)
    encoded = [processor.apply_chat_template(m, tokenize=True, return_dict=True, return_tensors="pt")
               for _, m in records(root)[:3]]  # fmt: skip
    by_length = sorted(range(3), key=lambda r: encoded[r]["input_ids"].shape[1])[:2]
    assert len(docs) == 2
    for (ids, mm), row in zip(docs, by_length):
        assert ids.tolist() == encoded[row]["input_ids"][0].tolist()
        assert torch.equal(mm["pixel_values"], encoded[row]["pixel_values"])
        assert torch.equal(mm["image_sizes"], encoded[row]["image_sizes"])

    torch.manual_seed(0)
    module = HBPLitModule(model=str(folder), loss="sum")
    module.configure_model()
    module.model.float()
    loss_err, grad_err, leak, _ = run_self_check(module, [1], media_docs=docs)[1]
    assert loss_err < 1e-5 and grad_err < 1e-4 and leak == 0.0

    encode = causal_lm.encoder_outputs

    def leaky(inner, mm):
        pv = mm["pixel_values"]
        return encode(inner, {**mm, "pixel_values": pv + 1e-3 * pv.mean(0, keepdim=True)})

    monkeypatch.setattr(causal_lm, "encoder_outputs", leaky)
    with pytest.raises(SelfCheckError, match="influence each other"):
        run_self_check(module, [1], media_docs=docs)
    run_self_check(module, [1])  # the text documents alone do not see it: the images are what catches it


def test_the_self_check_packs_the_runs_idefics3_images_with_their_masks(idefics3_data):
    """The run's shortest samples with images (Idefics3's: a record's tiles and global image with their
    pixel_attention_mask) pass the self-check packed beside the text documents: the loss, every gradient, the pixels'
    gradients laid out as the pack pads them, no leak."""
    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.model.selfcheck import run_self_check

    root, folder = idefics3_data
    dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                       cache_dir=str(root / "cache_self_check"))  # fmt: skip
    dm.setup("fit")
    docs = dm.self_check_samples()
    assert len(docs) == 2 and all(
        mm["pixel_attention_mask"].shape == mm["pixel_values"][:, :, 0].shape for _, mm in docs
    )
    torch.manual_seed(0)
    module = HBPLitModule(model=str(folder), loss="sum")
    module.configure_model()
    module.model.float()
    loss_err, grad_err, leak, _ = run_self_check(module, [1], media_docs=docs)[1]
    assert loss_err < 1e-5 and grad_err < 1e-4 and leak == 0.0


@pytest.mark.parametrize("family", list(FAMILY_DATA))
def test_loader_workers_decode_the_images_as_the_main_process_does(family, request, tmp_path):
    """A worker decodes the images (and, for Qwen, numbers the 3-D positions and token types) as the main
    process does."""
    root, folder = request.getfixturevalue(FAMILY_DATA[family])
    batches = []
    for workers in (0, 1):
        dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                           cache_dir=str(tmp_path / "cache"), num_workers=workers)  # fmt: skip
        dm.setup("fit")
        (batch,) = list(dm.train_dataloader())
        batches.append(batch)
    a, b = batches
    assert torch.equal(a.input_ids, b.input_ids) and set(a.mm) == set(b.mm)
    assert all(torch.equal(a.mm[k], b.mm[k]) for k in a.mm)
    assert torch.equal(a.position_ids, b.position_ids)


def test_multimodal_rope_positions_in_the_loader_are_the_models_own(tmp_path):
    """The loader numbers Qwen2-VL positions from the checkpoint's config alone (no weights in the
    worker): the same as the model's own get_rope_index."""
    folder = build_qwen(tmp_path / "qwen2_vl")
    model = AutoModelForImageTextToText.from_pretrained(folder)
    mine, theirs = MRopePositions(rope_stand_in(AutoConfig.from_pretrained(folder))), MRopePositions.of(model)
    for rec in three_records(folder):
        ids = rec["input_ids"][0].numpy()
        media = media_of(rec, 0, ids.size)  # as pack_samples and the loader hand them over
        assert torch.equal(mine.rows(ids, media), theirs.rows(ids, media))
    assert rope_stand_in(AutoConfig.from_pretrained(build_llava(tmp_path / "llava"))) is None


@pytest.mark.parametrize(
    "record, error",
    [
        ({"messages": chat([{"type": "image", "image": "img/missing.png"}, {"type": "text", "text": "hi"}], "x")},
         r"d.jsonl:2: image .*img/missing.png does not exist"),
        ({"messages": chat("<image> hi", "x"), "images": ["img/a.png", "img/b.png"]},
         r"d.jsonl:2: 2 image\(s\) in 'images' but 1 <image> marker\(s\) in the text"),
        ({"messages": chat([{"type": "image", "image": "img/broken.png"}, {"type": "text", "text": "hi"}], "x")},
         r"d.jsonl:2: image .*img/broken.png cannot be read"),
        ({"messages": chat([{"type": "image", "image": "https://example.com/a.png"}, {"type": "text", "text": "x"}],
                           "x")},
         r"d.jsonl:2: messages\[0\].content\[0\]: 'https://example.com/a.png' is not a local file"),
        ({"messages": chat([{"type": "video", "video": "v.mp4"}, {"type": "text", "text": "x"}], "x")},
         r"d.jsonl:2: the record has 1 video\(s\) and the checkpoint's LlavaNextProcessor takes no videos"),
        ({"messages": chat("<image> what is this?", "x")},
         r"d.jsonl:2: the text holds the image token '<image>' but the record has no images"),
        ({"messages": chat([{"type": "image", "image": "img/a.png", "detail": "high"}, {"type": "text", "text": "x"}],
                           "x")},
         r"d.jsonl:2: messages\[0\].content\[0\]: an image part's \['detail'\] is not read"),
        # OpenAI's image_url object: its detail (a size the API would resize to) was dropped without a word
        ({"messages": chat([{"type": "image_url", "image_url": {"url": "img/a.png", "detail": "low"}},
                            {"type": "text", "text": "x"}], "x")},
         r"d.jsonl:2: messages\[0\].content\[0\]: an image_url's \['detail'\] is not read .*data.processor_kwargs"),
        # an image over PIL's pixel limit: PIL's DecompressionBombError escaped with no file or record named
        ({"messages": chat([{"type": "image", "image": "img/a.png"}, {"type": "text", "text": "hi"}], "x"),
          "pixel_limit": 10},
         r"d.jsonl:2: image .*img/a.png cannot be read \(Image size .* raise PIL.Image.MAX_IMAGE_PIXELS"),
    ],
    ids=["missing", "markers", "corrupt", "url", "video", "marker without images", "unread key", "unread url key",
         "over PIL's limit"],
)  # fmt: skip
def test_a_bad_image_record_stops_with_its_file_and_line(data, tmp_path, record, error, monkeypatch):
    root, folder = data
    d = tmp_path / "bad"
    (d / "img").mkdir(parents=True)
    for name in SIZES:
        (d / "img" / name).write_bytes((root / "img" / name).read_bytes())
    (d / "img" / "broken.png").write_bytes((root / "img" / "a.png").read_bytes()[:60])  # truncated
    record = dict(record)
    limit = record.pop("pixel_limit", None)
    write(d / "d.jsonl", [records(root)[3][0], record])
    processor = AutoProcessor.from_pretrained(folder)
    if limit is not None:  # PIL refuses an image over twice its limit (a decompression bomb)
        from PIL import Image

        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    with pytest.raises(DataError, match=error):
        tokenize_source(Source(str(d / "d.jsonl")), processor.tokenizer, processor=processor, progress=False)


def test_a_pre_tokenized_record_holding_image_tokens_without_images_is_refused(data, tmp_path):
    """A ``tokens`` record whose ids hold the image token and no images was kept (a chat record's marker is refused):
    packed beside an image record, the first step stopped in transformers' "Image features and image tokens do not
    match", naming no record."""
    root, folder = data
    processor = AutoProcessor.from_pretrained(folder)
    image_id = image_token_id(processor)
    ids = processor.tokenizer("what is this?")["input_ids"]
    path = write(tmp_path / "d.jsonl", [{"input_ids": ids}, {"input_ids": [ids[0], image_id, *ids[1:]]}])
    with pytest.raises(DataError, match=r"d.jsonl:2: the text holds the image token '<image>' but the record has no"):
        tokenize_source(Source(str(path)), processor.tokenizer, processor=processor, progress=False)


def test_image_paths_of_a_source_given_relative_to_the_run_are_kept_by_the_data_files_folder(
    data, tmp_path, monkeypatch
):
    """``sources: [d.jsonl]`` from the data's folder kept ``./img/a.png`` in the token cache, which a run from another
    folder sharing the cache read there: another image of the same size (no word), or a path the record never named.
    The path is the data file's folder's."""
    root, folder = data
    processor = AutoProcessor.from_pretrained(folder)
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    for d, k in ((home, 0), (elsewhere, 3)):  # elsewhere: a decoy of the same size
        (d / "img").mkdir(parents=True)
        for name, (w, h) in SIZES.items():
            image(k, h, w).save(d / "img" / name)
    write(home / "d.jsonl", [r for r, _ in records(root)][:1])
    monkeypatch.chdir(home)
    first = tokenize_source(Source("d.jsonl"), processor.tokenizer, cache_dir=tmp_path / "cache", processor=processor,
                            progress=False)  # fmt: skip
    monkeypatch.chdir(elsewhere)
    again = tokenize_source(Source(str(home / "d.jsonl")), processor.tokenizer, cache_dir=tmp_path / "cache",
                            processor=processor, progress=False)  # fmt: skip
    assert again.from_cache and first.sample_media(0) == again.sample_media(0)
    assert all(Path(m.file).is_absolute() and Path(m.file).parent.parent == home for m in again.sample_media(0))


def test_a_folder_whose_tokenizer_has_another_template_renders_as_its_processor_does(data, tmp_path):
    """A checkpoint folder may carry one chat template for its processor (chat_template.json) and another for its
    tokenizer (tokenizer_config.json): what trains is what the processor's own ``apply_chat_template`` renders."""
    import shutil

    from lit_hbp.lightning.datamodule import load_renderers

    root, folder = data
    copy = tmp_path / "two_templates"
    shutil.copytree(folder, copy)
    template = (copy / "chat_template.jinja").read_text()
    (copy / "chat_template.jinja").unlink()
    (copy / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    processor = AutoProcessor.from_pretrained(copy)
    assert processor.tokenizer.chat_template != processor.chat_template  # the folder as described
    msgs = records(root)[3][1]
    tokenizer, *_ = load_renderers(str(copy))
    assert tokenizer.apply_chat_template(msgs, tokenize=False) == processor.apply_chat_template(msgs, tokenize=False)


def test_a_photo_turned_by_its_exif_orientation_is_read_upright_as_transformers_loads_it(data, tmp_path):
    """A phone's JPEG stored 40x24 with EXIF orientation 6 shows 24x40: transformers' ``load_image`` (what the
    processor's ``apply_chat_template`` reads a path with) turns it upright, and so does the data path."""
    from transformers.image_utils import load_image

    root, folder = data
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to show
    image(7, 24, 40).save(tmp_path / "p.jpg", exif=exif.tobytes(), quality=95)
    msgs = [{"role": "user", "content": [{"type": "image", "image": "p.jpg"}, {"type": "text", "text": "what?"}]},
            {"role": "assistant", "content": "a cat"}]  # fmt: skip
    write(tmp_path / "d.jsonl", [{"messages": msgs}])
    processor = AutoProcessor.from_pretrained(folder)
    upright = [{"role": "user", "content": [{"type": "image", "image": load_image(str(tmp_path / "p.jpg"))},
                                            {"type": "text", "text": "what?"}]},
               {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}]  # fmt: skip
    ref = processor.apply_chat_template(upright, tokenize=True, return_dict=True, return_tensors="pt")
    dm = HBPDataModule(sources=[str(tmp_path / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup("fit")
    (batch,) = list(dm.train_dataloader())
    assert dm.store.sources[0].sample(0)[0].tolist() == ref["input_ids"][0].tolist()
    assert batch.mm["image_sizes"].tolist() == ref["image_sizes"].tolist() == [[40, 24]]  # height 40, width 24


def test_records_with_images_need_the_checkpoints_processor(data, tmp_path):
    root, folder = data
    from transformers import AutoTokenizer

    no_processor = r"d.jsonl:1: the record has 1 image\(s\) and the tokenizer folder has no processor"
    with pytest.raises(DataError, match=no_processor):
        tokenize_source(Source(str(root / "d.jsonl")), AutoTokenizer.from_pretrained(folder), progress=False)
    write(tmp_path / "v.jsonl", [{"messages": chat("<video>what happens?", "x"), "videos": [["a.png", "b.png"]]}])
    no_processor = r"v.jsonl:1: the record has 1 video\(s\) and the tokenizer folder has no processor"
    with pytest.raises(DataError, match=no_processor):
        tokenize_source(Source(str(tmp_path / "v.jsonl")), AutoTokenizer.from_pretrained(folder), progress=False)


def test_truncating_a_sample_with_images_is_refused(data, tmp_path):
    root, folder = data
    dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["64:1"],
                       cache_dir=str(tmp_path / "cache"), over_length="truncate")  # fmt: skip
    refused = r"sample\(s\) with images or videos longer than the largest level \(64 tokens\).*d.jsonl:1"
    with pytest.raises(DataError, match=refused):
        dm.setup("fit")


@pytest.mark.slow
def test_the_cli_stops_on_a_missing_image_with_exit_2(data, tmp_path):
    root, folder = data
    d = tmp_path / "cli"
    d.mkdir()
    write(d / "d.jsonl", [records(root)[3][0], {"messages": chat("<image> hi", "x"), "images": ["nowhere.png"]}])
    cmd = [console_script("lit-hbp"), "fit", "--model.model", str(folder), "--data.tokenizer", str(folder),
           "--data.sources", json.dumps([str(d / "d.jsonl")]), "--data.levels", '["512:1"]', "--trainer.max_steps", "1",
           "--trainer.accelerator", "cpu", "--data.cache_dir", str(d / "cache")]  # fmt: skip
    out = subprocess.run(cmd, cwd=d, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 2, out.stderr[-3000:]
    error = out.stderr.strip().splitlines()[-2]  # the error, then the traceback tip
    assert error.startswith("error: ") and "d.jsonl:2: image" in error and "nowhere.png does not exist" in error


def test_preview_shows_where_each_image_stands_and_its_tokens(data, tmp_path):
    import io

    from lit_hbp.cli.preview import preview

    root, folder = data
    dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    out = io.StringIO()
    assert preview(dm, 2, as_json=False, out=out) == 2
    processor = AutoProcessor.from_pretrained(folder)
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    text = out.getvalue()
    # the processor's own count of the image's tokens: its encoding alone
    msgs = records(root)[0][1]
    alone = processor.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"][0]
    want = int((np.asarray(alone) == image_id).sum())
    assert f"[image 1: {root / 'img/a.png'} 30x20 -> {want} tokens]" in text
    assert "<image>" not in text  # each image's tokens are one line, not its placeholders
    js = io.StringIO()
    preview(dm, 1, as_json=True, out=js)
    assert json.loads(js.getvalue())["images"] == [{"file": str(root / "img/a.png"), "width": 30, "height": 20}]


def test_the_guides_example_records_read_as_it_says(data, tmp_path):
    """docs/vision.md's JSON Lines block: each record reads, with its images where the guide says."""
    import re

    root, folder = data
    block = re.findall(r"```json\n(.*?)```", (ROOT / "docs" / "vision.md").read_text(), re.S)[0]  # images
    (tmp_path / "img").mkdir()
    for k, name in enumerate(("cat.png", "a.png", "b.png")):
        image(k, 20, 20).save(tmp_path / "img" / name)
    (tmp_path / "d.jsonl").write_text(block)
    processor = AutoProcessor.from_pretrained(folder)
    t = tokenize_source(Source(str(tmp_path / "d.jsonl")), processor.tokenizer, processor=processor, progress=False)
    files = [[Path(m[0]).name for m in t.sample_media(row)] for row in range(len(t))]
    assert files == [["cat.png"], ["cat.png"], ["a.png", "b.png"]]
    assert [processor.tokenizer.decode(t.sample(row)[0][t.sample(row)[1]]).strip() for row in range(3)] == [
        "A cat.<|end|>", "A cat.<|end|>", "The first.<|end|>"
    ]  # fmt: skip


def test_a_vision_demo_the_user_built_is_kept_and_a_bad_count_refused(tmp_path, capsys):
    """``python -m lit_hbp.demo.vision D --n 3`` builds 3 records; the data module's ``demo_dir: D`` then finds the
    demo built (docs/vision.md: built "when it is missing", as the text demo's ``ensure_demo(d)`` keeps any complete
    build) and rebuilds nothing; a size asked for by name still rebuilds; ``--n -4`` stops in one line (exit 2)."""
    from lit_hbp.demo import ensure_kind, vision

    out = tmp_path / "demo_vlm"
    assert vision.main([str(out), "--n", "3"]) == 0
    stamp = (out / "model" / "config.json").stat().st_mtime_ns
    ensure_kind(out, "vision")
    assert len((out / "chat.jsonl").read_text().splitlines()) == 3
    assert (out / "model" / "config.json").stat().st_mtime_ns == stamp
    assert vision.ensure_vlm_demo(out, n=2)["records"] == len((out / "chat.jsonl").read_text().splitlines()) == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        vision.main([str(tmp_path / "other"), "--n", "-4"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "argument --n: must be a whole number >= 1, got -4" in err.splitlines()[-1]
    assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_the_tiny_vlm_config_trains_and_exports_a_folder_that_answers_from_an_image(tmp_path):
    """configs/tiny_vlm_cpu.yaml as a new user runs it (the demo built on first use): the loss falls,
    and the export loads with AutoModelForImageTextToText + AutoProcessor and generates from an image.
    12 steps, each one's loss logged, one validation of 2 batches at the end; the export is the module's
    ``main`` in this process (what its command runs)."""
    import shutil

    from test_train import scalars

    from lit_hbp import export

    shutil.copy(ROOT / ".gitignore", tmp_path / ".gitignore")  # a checkout: the run leaves git status clean
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", ".gitignore"], cwd=tmp_path, check=True)
    subprocess.run(["git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-q", "-m", "checkout"],
                   cwd=tmp_path, check=True)  # fmt: skip
    run = subprocess.run(
        [console_script("lit-hbp"), "fit", "--config", str(ROOT / "configs" / "tiny_vlm_cpu.yaml"),
         "--trainer.max_steps", "12", "--trainer.log_every_n_steps", "1", "--trainer.val_check_interval", "12",
         "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "self-check passed (a pack equals its documents alone, 2 of them with images)" in run.stderr
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=tmp_path,
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert status == "", status
    losses = [v for _, v in scalars(tmp_path / "runs")["train/loss"]]
    assert len(losses) >= 6 and np.mean(losses[-3:]) < 0.75 * np.mean(losses[:3]), losses
    (ckpt,) = (tmp_path / "runs").glob("tiny_vlm_cpu/version_0/checkpoints/last.ckpt")
    assert export.main([str(ckpt), str(tmp_path / "hf")]) == 0
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf")
    processor = AutoProcessor.from_pretrained(tmp_path / "hf")
    trained = torch.load(ckpt, weights_only=True, map_location="cpu")["state_dict"]
    exported = model.state_dict()
    assert {f"model.{k}" for k in exported} == set(trained)  # every trained weight, the vision tower's included
    assert all(torch.equal(v, trained[f"model.{k}"]) for k, v in exported.items())
    picture = Image.open(next((tmp_path / "demo_vlm" / "images").glob("*.png"))).convert("RGB")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is the shape?"}]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=[picture], return_tensors="pt", add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape == (1, enc["input_ids"].shape[1] + 6)
    assert processor.image_processor.crop_size == {"height": 32, "width": 32}  # the run's processor, not a default


def test_the_vision_tower_trains_or_stays_as_the_config_says_and_lora_targets_the_language_model(data):
    """freeze_vision: the tower's weights get no gradient and no optimizer state, the projector and the
    language model train; LoRA by default adapts the language model's linear layers only."""
    from transformers import AutoModelForCausalLM

    from lit_hbp import HBPLitModule, pack_samples

    root, folder = data
    processor = AutoProcessor.from_pretrained(folder)
    _, msgs = records(root)[0]
    enc = dict(processor.apply_chat_template(msgs, tokenize=True, return_dict=True, return_tensors="pt"))
    enc.pop("attention_mask")
    enc["labels"] = torch.where(enc["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<image>"), -100,
                                enc["input_ids"])  # fmt: skip
    trained = {}
    for freeze in (False, True):
        module = HBPLitModule(model=str(folder), freeze_vision=freeze, self_check=False)
        module.configure_model()
        packed_loss(module.model, pack_samples([enc]), "sum").loss.backward()
        tower = {n for n, p in module.model.named_parameters() if ".vision_tower." in f".{n}"}
        trained[freeze] = {n for n, p in module.model.named_parameters() if p.grad is not None}
        assert all(p.requires_grad is not (freeze and n in tower) for n, p in module.model.named_parameters())
    assert trained[False] & tower and trained[True] == trained[False] - tower  # the rest trains as before
    # A fit step: the tower's weights are where they were, the rest moved; the optimizer holds no tower weight.
    import lightning as L

    dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                       cache_dir=str(root / "cache_freeze"))  # fmt: skip
    module = HBPLitModule(model=str(folder), freeze_vision=True, self_check=False, lr=1e-2)
    before = {n: p.detach().clone() for n, p in AutoModelForImageTextToText.from_pretrained(folder).named_parameters()}
    quiet = dict(enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, **quiet)
    trainer.fit(module, dm)
    held = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    for name, p in module.model.named_parameters():
        assert (id(p) in held) is (name not in tower), name
        if name in tower:
            assert torch.equal(p.detach(), before[name]), name
    assert any(not torch.equal(p.detach(), before[n]) for n, p in module.model.named_parameters() if n not in tower)
    lora = HBPLitModule(model=str(folder), lora={"rank": 4}, self_check=False)
    lora.configure_model()
    adapted = {n.split(".lora_A")[0] for n, _ in lora.model.named_parameters() if ".lora_A." in n}
    assert adapted and all(".language_model." in n for n in adapted), sorted(adapted)[:5]
    text = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2, vocab_size=64))  # fmt: skip
    from lit_hbp.model.build import freeze_vision

    with pytest.raises(ValueError, match="freeze_vision: LlamaForCausalLM has no vision tower"):
        freeze_vision(text)


# the tower's layers in the FLOP counter's names: CLIP's encoder, Qwen's blocks (not its merger)
QWEN_BLOCKS = r"\.blocks\.\d+$"
TOWER_LAYERS = {"llava_next": r"^CLIPVisionModel\.encoder$", "qwen2_vl": QWEN_BLOCKS, "qwen2_5_vl": QWEN_BLOCKS}


@pytest.mark.parametrize("family", list(TOWER_LAYERS))
def test_the_encoders_work_is_what_torch_counts(tmp_path, family):
    """encoder_flops against torch's FLOP counter on the tower's own layers (eager attention, so its
    matmuls are counted), for images of three sizes: within 15% for CLIP (the counter also sees its CLS
    token), 5% for the Qwen towers (Qwen2.5-VL's windowed layers attend within 16 of the largest image's
    64 patches: counted as full attention, it was 12% over)."""
    import re

    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoImageProcessor

    from lit_hbp.data.media import encoded_pixels, encoder_flops

    build = build_llava if family.startswith("llava") else build_qwen
    folder = build(tmp_path / family, family)
    model = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").eval()
    images = AutoImageProcessor.from_pretrained(folder)
    for k, (h, w) in enumerate([(16, 16), (32, 24), (32, 32)]):
        picture = image(k, h, w)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model.model.get_image_features(**images(images=[picture], return_tensors="pt"))
        counts = counter.get_flop_counts().items()
        want = sum(sum(v.values()) for name, v in counts if re.search(TOWER_LAYERS[family], name))
        pixels, tiles = encoded_pixels(images, picture)
        got = float(encoder_flops(np.array([pixels]), np.array([tiles]), model.config)[0])
        tolerance = 0.15 if family.startswith("llava") else 0.05
        assert (1 - tolerance) * want <= got <= (1 + tolerance) * want, (family, (h, w), got, want)


def test_the_data_modules_plan_weighs_each_samples_image_encoding(data, tmp_path):
    """HBPDataModule plans with its images' encoder work (the checkpoint's vision config), zero for a
    text-only record, more for more pixels."""
    from lit_hbp.data.media import vision_work
    from lit_hbp.packing import plan_hbp

    root, folder = data
    dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup("fit")
    extra = dm.vision_work(dm.store)
    images = [len(dm.store.media(i)) for i in range(dm.store.lengths.size)]
    assert [bool(e) for e in extra] == [bool(k) for k in images]  # work exactly where there are images
    two = images.index(2)
    assert extra[two] > max(e for e, k in zip(extra, images) if k == 1)
    assert np.allclose(extra, vision_work(dm.store.media_pixels(), AutoConfig.from_pretrained(folder)))
    want = plan_hbp(dm.store.lengths, dm.levels, 1, 1, dm.seed, dm.packer, loss_tokens=dm.store.loss_tokens,
                    extra_work=extra)  # fmt: skip
    assert np.array_equal(dm.plan_for_epoch(0).members, want.members)


def test_level_selection_at_fit_start_counts_the_runs_images(data, tmp_path):
    """A fit whose levels an AnalyticSelector chooses hands it its data's images: per sample the patches
    the processor cut (the encoded pixels of each image of the record, counted from the processor's own
    output here, over the tower's 4x4 patches) and their encoding's work (what the plan balances), and
    trains on what it chose. A selector of one's own that takes no ``vision`` is refused at set-up, naming
    it."""
    from conftest import quiet_trainer

    from lit_hbp.autoselect import AnalyticSelector
    from lit_hbp.errors import ConfigError
    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.packing.levels import LevelSelector

    class Recording(AnalyticSelector):
        def levels_for(self, lengths, trainer, vision=None):
            self.seen = (np.asarray(lengths).copy(), vision)
            return super().levels_for(lengths, trainer, vision)

    class OwnSelector(LevelSelector):
        def levels_for(self, lengths, trainer):
            return (1024,)

    root, folder = data
    processor = AutoProcessor.from_pretrained(folder)
    want = []  # each record's images through the processor alone: 3 x 4 x 4 values a patch
    for _, messages in records(root):
        images = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"]
                  if p["type"] == "image"]  # fmt: skip
        want.append(sum(processor.image_processor(images=[im], return_tensors="np")["pixel_values"].size // 48
                        for im in images))  # fmt: skip
    selector = Recording(candidates=[1024, 2048])
    dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=selector,
                       cache_dir=str(tmp_path / "cache"), val_fraction=0)  # fmt: skip
    trainer = quiet_trainer(max_steps=1)
    module = HBPLitModule(model=str(folder))
    trainer.fit(module, datamodule=dm)
    lengths, vision = selector.seen
    assert sorted(vision.patches.tolist()) == sorted(want) and vision.patches_per_token(lengths) > 0
    assert np.allclose(vision.work, dm.vision_work(dm.store)) and trainer.global_step == 1
    cost, _ = module.cost_model(80 * 2**30)  # the fit-start memory check's model (on a GPU) counts them too
    assert cost.vision_trained and cost.vision_patches_per_token == vision.patches_per_token(dm.store.lengths)
    assert cost.model.vision is not None and cost.memory_parts(1024, 1, 0)["vision"] > 0
    dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=OwnSelector(),
                       cache_dir=str(tmp_path / "cache"), val_fraction=0)  # fmt: skip
    with pytest.raises(ConfigError, match="OwnSelector.levels_for takes no vision argument"):
        quiet_trainer(max_steps=1).fit(HBPLitModule(model=str(folder)), datamodule=dm)


@pytest.mark.slow
def test_the_tiny_vlm_config_trains_its_images_on_sp_2_levels_under_hbp_strategy(tmp_path):
    """configs/tiny_vlm_cpu.yaml on 2 processes with both levels at sp 2 (HBPStrategy, ZeRO 2): the
    self-check passes at sp 2 with the run's own images (each against the records alone, eager), the
    SP group splits their encoding, and training and validation (one batch) run. Its demo is built here
    at 200 records (the build on first use at the default size is the one-process test's): what sp 2
    does with images does not depend on how many records the run reads."""
    from lit_hbp.demo.vision import ensure_vlm_demo

    ensure_vlm_demo(tmp_path / "demo_vlm", n=200)
    run = subprocess.run(
        [console_script("lit-hbp"), "fit", "--config", str(ROOT / "configs" / "tiny_vlm_cpu.yaml"),
         "--trainer.devices", "2",
         "--trainer.strategy", "{class_path: lit_hbp.lightning.strategy.HBPStrategy, init_args: {stage: 2}}",
         "--data.levels", "[{pack_len: 1024, sp: 2}, {pack_len: 2048, sp: 2}]", "--trainer.max_steps", "2",
         "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
         "--trainer.enable_progress_bar", "false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("self-check passed")]
    assert "2 of them with images" in line and ", sp 2: loss" in line, line
    assert "epoch 0 summary: 2 of the plan's" in run.stderr and "world 2" in run.stderr


def test_zero_3_with_image_samples_is_refused_before_the_first_step(data, tmp_path):
    """ZeRO-3 gathers a module's weights when its forward runs; the vision tower runs only where a pack
    holds images and LLaVA-NeXT reads image_newline outside any forward (partitioned: a shape error, or
    a rank left waiting): refused at the start of fit, naming what to use."""
    from conftest import quiet_trainer

    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.lightning.strategy import HBPStrategy

    root, folder = data
    dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                       cache_dir=str(tmp_path / "cache"), val_fraction=0)  # fmt: skip
    trainer = quiet_trainer(strategy=HBPStrategy(stage=3), devices=1, max_steps=1)
    refused = r"trainer.strategy: HBPStrategy\(stage=3\) with samples that have images: .* stage 2"
    with pytest.raises(ValueError, match=refused):
        trainer.fit(HBPLitModule(model=str(folder)), datamodule=dm)


@pytest.mark.slow
def test_gemma3_records_render_as_its_processor_does_and_fit_stops_naming_its_attention(tmp_path):
    """Gemma 3's processor replaces its rendered <start_of_image> with the image's whole sequence (its
    own newlines and soft tokens): the record reads as apply_chat_template gives it, answer trained; fit
    then stops with exit 2 before the first step, naming why (its image tokens attend both ways)."""
    from vision_models import build_gemma3

    folder = build_gemma3(tmp_path / "gemma3")
    image(1, 20, 30).save(tmp_path / "a.png")
    write(tmp_path / "d.jsonl", [{"messages": chat([{"type": "image", "image": "a.png"},
                                                    {"type": "text", "text": "describe"}], "a cat")}])  # fmt: skip
    processor = AutoProcessor.from_pretrained(folder)
    t = tokenize_source(Source(str(tmp_path / "d.jsonl")), processor.tokenizer, processor=processor, progress=False)
    picture = Image.open(tmp_path / "a.png").convert("RGB")
    msgs = chat([{"type": "image", "image": picture}, {"type": "text", "text": "describe"}], "a cat")
    ref = processor.apply_chat_template(msgs, tokenize=True, return_dict=True)
    ids, mask = t.sample(0)
    assert ids.tolist() == list(ref["input_ids"][0])
    assert processor.tokenizer.decode(ids[mask]).strip() == "a cat<end_of_turn>"
    cmd = [console_script("lit-hbp"), "fit", "--model.model", str(folder), "--data.tokenizer", str(folder),
           "--data.sources", json.dumps([str(tmp_path / "d.jsonl")]), "--data.levels", '["512:1"]',
           "--trainer.max_steps", "1", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
           "--data.cache_dir", str(tmp_path / "cache")]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "attend to each other both ways" in out.stderr.strip().splitlines()[-2], out.stderr[-2000:]


@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=40),
    patches=st.lists(st.integers(0, 90), min_size=40, max_size=40),
    pack_len=st.integers(1, 200),
)
@settings(max_examples=200, deadline=None)
def test_the_densest_probe_pack_holds_whole_samples_and_leaves_no_room_a_sample_fits(lengths, patches, pack_len):
    """A measured probe's first pack (``densest_members``): whole samples the level holds, each once, within
    the pack, with no sample left out that would still fit; with samples all one length, the ones with the
    most patches (brute force: the best any choice of that many samples reaches)."""
    from lit_hbp.autoselect.measured import densest_members

    lengths, patches = np.array(lengths), np.array(patches[: len(lengths)])
    take = densest_members(lengths, patches, pack_len)
    assert len(set(take.tolist())) == take.size and lengths[take].sum() <= pack_len
    left = np.setdiff1d(np.arange(lengths.size), take)
    assert not (lengths[left] <= pack_len - lengths[take].sum()).any()
    same = np.full(lengths.size, lengths[0])
    take = densest_members(same, patches, pack_len)
    k = min(lengths.size, pack_len // lengths[0])
    assert take.size == k and patches[take].sum() == np.sort(patches)[::-1][:k].sum()


@pytest.mark.slow
def test_a_measured_level_search_packs_the_runs_own_images_into_its_probes(tmp_path, monkeypatch, capsys):
    """``MeasuredSelector`` on data with images (the image-chat demo, a tiny LLaVA-NeXT): its probes train packs
    of the run's own records, each probe's first the densest in image patches, the others drawn from the
    records the level holds; every probe pack's images are its records' own files (their sizes read off
    the files), and the run trains on the levels it chose."""
    from conftest import quiet_trainer

    from lit_hbp.autoselect import MeasuredSelector, measured
    from lit_hbp.autoselect.measured import densest_members
    from lit_hbp.demo.vision import ensure_vlm_demo
    from lit_hbp.errors import ConfigError
    from lit_hbp.lightning.module import HBPLitModule

    demo = tmp_path / "demo"
    ensure_vlm_demo(demo, n=160)
    lines = (demo / "chat.jsonl").read_text().splitlines()
    seen = []
    real = measured.sample_batch

    def recording(samples, members, level, sp_rank):
        batch = real(samples, members, level, sp_rank)
        seen.append((level.pack_len, np.asarray(members), batch))
        return batch

    monkeypatch.setattr(measured, "sample_batch", recording)
    selector = MeasuredSelector(candidates=[256, 512], steps=1)
    dm = HBPDataModule(sources=[str(demo / "chat.jsonl")], tokenizer=str(demo / "model"), levels=selector,
                       cache_dir=str(tmp_path / "cache"), val_fraction=0)  # fmt: skip
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(HBPLitModule(model=str(demo / "model")), datamodule=dm)
    assert trainer.global_step == 1 and {lv.pack_len for lv in dm.levels} <= {256, 512}
    store, patches = dm.store, dm.vision_load(dm.store).patches
    assert {pack_len for pack_len, _, _ in seen} == {256, 512}
    for pack_len in (256, 512):
        probes = [(members, batch) for n, members, batch in seen if n == pack_len]
        first = probes[0][0]  # each probe's first pack: the densest in patches the level can hold
        assert first.tolist() == densest_members(store.lengths, patches, pack_len).tolist() and patches[first].sum() > 0
        for members, batch in probes:
            assert store.lengths[members].sum() <= pack_len and (store.lengths[members] <= pack_len).all()
            sizes = []
            for i in members.tolist():
                line = int(store.where(i).rsplit(":", 1)[1])
                for name in json.loads(lines[line - 1]).get("images", []):
                    w, h = Image.open(demo / name).size
                    sizes.append([h, w])
            assert batch.mm["image_sizes"].tolist() == sizes
    with pytest.raises(ConfigError, match="without the samples"):  # the images' work without the images
        MeasuredSelector().select(store.lengths, None, dm.vision_load(store))
    config = tmp_path / "c.yaml"  # the command line tool: the same probes, in the processes it starts
    config.write_text(json.dumps({"data": {"tokenizer": str(demo / "model"), "sources": [str(demo / "chat.jsonl")],
                                           "cache_dir": str(tmp_path / "cache")},
                                  "model": {"model": str(demo / "model")}}))  # fmt: skip
    from lit_hbp.autoselect.__main__ import main as autoselect  # its main here; its probes in a process it starts

    capsys.readouterr()
    assert autoselect(["--config", str(config), "--measured", "--candidates", "256", "512"]) == 0
    stdout = capsys.readouterr().out
    assert "measured on 1 x CPU" in stdout and "levels:\n  - {pack_len: " in stdout, stdout


def test_image_records_tokenized_by_workers_in_small_chunks_give_the_same_cache(tmp_path):
    """Records with images are tokenized in chunks 64 times smaller than text's (so a source of a few MB
    keeps every worker busy): the image-chat demo's records through two worker processes give the ids,
    supervised tokens, rows and images of the main process alone."""
    from lit_hbp.data import sources as sources_module
    from lit_hbp.demo.vision import ensure_vlm_demo

    demo = tmp_path / "demo"
    ensure_vlm_demo(demo, n=200)  # about 40 KB: three chunks
    processor = AutoProcessor.from_pretrained(demo / "model")
    chunks = []
    real = sources_module.iter_chunks

    def counted(*args, **kwargs):
        for chunk in real(*args, **kwargs):
            chunks.append(chunk)
            yield chunk

    got = {}
    for n in (1, 2):
        kwargs = dict(cache_dir=tmp_path / f"c{n}", progress=False, num_proc=n, processor=processor)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("lit_hbp.data.tokenize.iter_chunks", counted)
            got[n] = tokenize_source(Source(str(demo / "chat.jsonl")), processor.tokenizer, **kwargs)
    assert len(chunks) >= 2 * 3  # a 1 MB text chunk would hold the whole source: one worker's work
    one, two = got[1], got[2]
    assert np.array_equal(one.ids, two.ids) and np.array_equal(one.offsets, two.offsets)
    assert np.array_equal(one.supervised, two.supervised) and np.array_equal(one.rows, two.rows)
    assert [one.sample_media(i) for i in range(len(one))] == [two.sample_media(i) for i in range(len(two))]
    assert len(one) == 200 and any(one.sample_media(i) for i in range(len(one)))


def test_a_pack_whose_images_cannot_be_joined_names_their_records():
    """Images of different sizes that a family's forward takes as one [images, C, H, W] tensor (Mistral 3's, a
    processor that resizes each image to its own size) are refused at the pack: the refusal named no record, now
    each shape's first record as ``where`` names it (the loader passes its store's file:line)."""
    from lit_hbp.data.collate import collate_packs

    sizes = {0: 32, 1: 32, 2: 16}
    media = lambda i: {"pixel_values": torch.zeros(1, 3, sizes[i], sizes[i])}  # noqa: E731
    tokens = lambda i: (np.array([5, 500, 6, 7]), np.array([0, 0, 1, 1], bool))  # noqa: E731
    where = lambda i: f"d.jsonl:{i + 1}"  # noqa: E731
    with pytest.raises(DataError) as refused:
        collate_packs([np.array([0, 1, 2])], tokens, media=media, where=where)
    assert str(refused.value) == (
        "a pack's records give pixel_values of different shapes: [3, 32, 32] (d.jsonl:1), [3, 16, 16] (d.jsonl:3), "
        "which cannot be joined"
    )
    batch = collate_packs([np.array([0, 1])], tokens, media=media, where=where)  # one size: joined, in pack order
    assert tuple(batch.mm["pixel_values"].shape) == (2, 3, 32, 32)
