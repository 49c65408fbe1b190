"""``data.processor_kwargs``: a vision-language checkpoint's image processor settings set for the run (how many
tokens an image becomes), as ``AutoProcessor.from_pretrained(folder, **kwargs)`` sets them; transformers drops a
setting no part of the processor has (LLaVA-NeXT's ``max_pixels`` changed nothing, unsaid): lit-hbp refuses it.
The reference is the processor transformers loads with the same settings, applied to each record alone."""

import warnings

import pytest
from test_vision_data import records, with_images_and_records
from transformers import AutoProcessor
from vision_models import build_gemma3, build_llava, build_qwen, image_token_id, needs_torchvision

from lit_hbp import HBPDataModule
from lit_hbp.errors import ConfigError

PINPOINTS = [[32, 32]]  # one anyres shape instead of the folder's four
PAN_AND_SCAN = dict(  # Gemma 3's crops: more tokens for a wide image (taken at load, read by its processor's call)
    do_pan_and_scan=True, pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=2,
    pan_and_scan_min_ratio_to_activate=1.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("processor_kwargs")
    return with_images_and_records(root), build_llava(root / "llava_next", "llava_next")


def module(root, folder, tmp_path, **kwargs) -> HBPDataModule:
    return HBPDataModule(
        sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"], cache_dir=str(tmp_path), **kwargs
    )


def test_the_settings_decide_the_image_tokens_as_the_processor_loaded_with_them_does(tmp_path):
    """Gemma 3's pan-and-scan: its processor's call reads the settings from the tokenizer it was loaded with, so a
    run's tokenizer takes them too; the folder a checkpoint's files make (the export's) loads a processor that
    renders the same ids."""
    (tmp_path / "data").mkdir()
    root = with_images_and_records(tmp_path / "data")
    folder = build_gemma3(root / "gemma3")
    reference = AutoProcessor.from_pretrained(folder, **PAN_AND_SCAN)
    plain = AutoProcessor.from_pretrained(folder)
    dm = module(root, folder, tmp_path / "set", processor_kwargs=PAN_AND_SCAN)
    dm.setup("fit")
    files = dm.state_dict()["processor_files"]
    exported = tmp_path / "export"
    exported.mkdir()
    for name, data in files.items():
        (exported / name).write_bytes(data)
    reloaded = AutoProcessor.from_pretrained(exported)
    changed = 0
    for row, (_, msgs) in enumerate(records(root)):
        want = reference.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"][0]
        ids, _ = dm.store.sources[0].sample(row)
        assert ids.tolist() == list(want), row
        assert list(reloaded.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"][0]) == list(want)
        changed += len(want) != len(plain.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"][0])
    assert changed > 0, "the settings changed no record's tokens: the test would pass without them"
    before = module(root, folder, tmp_path / "plain")  # a resume with other settings is said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.load_state_dict(dm.state_dict())
        assert not [w for w in caught if "processor settings" in str(w.message)]
        before.load_state_dict(dm.state_dict())
    assert [w for w in caught if "other processor settings" in str(w.message)]


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"max_pixels": 50_000}, r"processor_kwargs\.max_pixels: .* does not hold it \(loading with it changed none"),
        ({"image_grid_pinpoint": PINPOINTS}, r"pinpoint: .* does not hold it .*; it has .*image_grid_pinpoints"),
        ("max_pixels=5", r"data\.processor_kwargs must be a mapping"),
        ({"image_grid_pinpoints": PINPOINTS}, r"pinpoints: the model.s config\.json in .* holds \[\[.* forward reads"),
        # the processor's own (from_pretrained sets it): refused as "loading with it changed none of its settings"
        ({"num_additional_image_tokens": 0}, r"num_additional_image_tokens: a setting of .*'s processor itself"),
    ],
)  # fmt: skip
def test_a_setting_the_processor_does_not_hold_is_refused_naming_it(data, tmp_path, kwargs, says):
    root, folder = data
    with pytest.raises(ConfigError, match=says):
        module(root, folder, tmp_path, processor_kwargs=kwargs)


def test_a_record_whose_images_the_processor_cannot_stack_is_refused_naming_it(data, tmp_path):
    """LLaVA-NeXT with ``do_pad: false``: a record of two images of different tile counts is a ragged list that
    its own processor cannot make a tensor of (the reference, below); lit-hbp said numpy's "inhomogeneous shape"
    with no record, now a DataError naming the file and line."""
    from lit_hbp.errors import DataError

    root, folder = data
    reference = AutoProcessor.from_pretrained(folder, do_pad=False)
    ragged = []
    for row, (_, msgs) in enumerate(records(root)):
        try:
            reference.apply_chat_template(msgs, tokenize=True, return_dict=True, return_tensors="pt")
        except ValueError:
            ragged.append(row)
    assert ragged, "no record the unpadded processor cannot stack: the test would pass without the check"
    dm = module(root, folder, tmp_path, processor_kwargs={"do_pad": False})
    with pytest.raises(DataError, match=rf"d\.jsonl:{ragged[0] + 1}: .* pixel_values of different shapes .* do_pad"):
        dm.setup("fit")


def test_settings_for_a_text_checkpoint_are_refused(small_demo, tmp_path):
    with pytest.raises(ConfigError, match=r"data\.processor_kwargs: .* has no image processor \(a text checkpoint\)"):
        HBPDataModule(
            sources=[str(small_demo / "short.jsonl")], tokenizer=str(small_demo / "tokenizer"), levels=["1024:1"],
            cache_dir=str(tmp_path), processor_kwargs={"max_pixels": 50_000},
        )  # fmt: skip


def test_qwen2_vls_max_pixels_becomes_its_size_and_shrinks_the_images_as_its_processor_does(tmp_path):
    """Qwen2-VL's ``max_pixels`` is taken at construction and held as ``size["longest_edge"]``: set, not refused;
    each record's tokens are those of the processor loaded with it (its video processor needs torchvision: the
    CI's compatibility part)."""
    needs_torchvision("qwen2_vl")
    (tmp_path / "data").mkdir()
    root = with_images_and_records(tmp_path / "data")
    folder = build_qwen(root / "qwen2_vl")
    reference = AutoProcessor.from_pretrained(folder, max_pixels=16 * 16)
    assert reference.image_processor.size["longest_edge"] == 16 * 16
    dm = module(root, folder, tmp_path / "cache", processor_kwargs={"max_pixels": 16 * 16})
    dm.setup("fit")
    plain = AutoProcessor.from_pretrained(folder)
    image_id, changed = image_token_id(reference), 0
    for row, (_, msgs) in enumerate(records(root)):
        want = reference.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"][0]
        ids, _ = dm.store.sources[0].sample(row)
        assert ids.tolist() == list(want), row
        before = plain.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"][0]
        changed += (ids == image_id).sum() != sum(i == image_id for i in before)
    assert changed > 0, "max_pixels changed no image's token count: the test would pass without it"
