"""Records with videos on the data side: a video part (a folder of frames), LLaMA-Factory's ``videos``
with ``<video>`` markers (a list of frames, beside an image), LLaVA-Video's ``video`` beside ShareGPT
``conversations``; rendered and expanded by the checkpoint's processor, cached as ids and frame files,
decoded in the loader, planned with the tower's work, packed exactly.

Qwen's processors load a video processor, which needs torchvision: the CI's compatibility part runs
these (``needs_torchvision``). References are independent: the processor's own ``apply_chat_template``
(which loads a list of frame files itself) for ids and pixels, each record alone through the unprepared
model with eager attention for the loss and every gradient.
"""

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_vision_data import alone, chat, write
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
from vision_models import assert_same_grads, build_qwen, image, needs_torchvision

from lit_hbp import HBPDataModule, packed_loss, prepare_model
from lit_hbp.data.media import Image as ImageEntry
from lit_hbp.data.media import Video, vision_work
from lit_hbp.data.sources import Source
from lit_hbp.data.tokenize import tokenize_source
from lit_hbp.errors import DataError

# a folder of 4 frames whose names sort wrongly as text (f10 after f1): frame order is by number
CLIP = ["f1.png", "f2.png", "f3.png", "f10.png"]
ANSWERS = ["a cat walks", "the quick brown fox", "hello world", "def f(x): return x"]


def frames(root: Path) -> None:
    (root / "clip").mkdir()
    for k, name in enumerate(CLIP):
        image(10 + k, 24, 32).save(root / "clip" / name)
    (root / "short").mkdir()
    for k in range(2):
        image(20 + k, 16, 24).save(root / "short" / f"{k}.png")
    (root / "img").mkdir()
    image(1, 20, 30).save(root / "img" / "a.png")


def records(root: Path) -> list[tuple[dict, list]]:
    """(record, its messages as the processor's apply_chat_template takes them: videos as frame lists)."""
    clip = [str(root / "clip" / n) for n in CLIP]
    short = [str(root / "short" / f"{k}.png") for k in range(2)]

    def reference(user_parts, answer):
        return [{"role": "user", "content": user_parts},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]}]  # fmt: skip

    picture = Image.open(root / "img" / "a.png").convert("RGB")
    return [
        (  # an OpenAI-style video part: a folder of frames
            {"messages": chat([{"type": "video", "video": "clip"}, {"type": "text", "text": "what happens?"}],
                              ANSWERS[0])},
            reference([{"type": "video", "video": clip}, {"type": "text", "text": "what happens?"}], ANSWERS[0]),
        ),
        (  # LLaMA-Factory: <image> and <video> markers, an images list and a videos list (a list of frames)
            {"messages": chat("<image><video>which is longer?", ANSWERS[1]), "images": ["img/a.png"],
             "videos": [["short/0.png", "short/1.png"]]},
            reference([{"type": "image", "image": picture}, {"type": "video", "video": short},
                       {"type": "text", "text": "which is longer?"}], ANSWERS[1]),
        ),
        (  # LLaVA-Video: one video beside ShareGPT conversations
            {"id": "v-1", "video": "clip",
             "conversations": [{"from": "human", "value": "<video>describe it"}, {"from": "gpt", "value": ANSWERS[2]}]},
            reference([{"type": "video", "video": clip}, {"type": "text", "text": "describe it"}], ANSWERS[2]),
        ),
        (  # text only, in the same file
            {"messages": chat("the quick brown fox", ANSWERS[3])},
            [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": ANSWERS[3]}],
        ),
    ]  # fmt: skip


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def video_data(request, tmp_path_factory):
    """A tiny Qwen2-VL or Qwen2.5-VL folder (Qwen2.5-VL's videos carry seconds per temporal patch into
    the positions), frames on disk and a JSON Lines file of records in three formats."""
    needs_torchvision(request.param)
    root = tmp_path_factory.mktemp(f"video_{request.param}")
    folder = build_qwen(root / request.param, request.param)
    frames(root)
    write(root / "d.jsonl", [r for r, _ in records(root)])
    return root, folder


def video_alone(processor, frames_list: list[str]) -> tuple[int, int]:
    """The pixels the tower encodes of a video (each frame's) and its temporal patches, from the
    processor's own encoding of the video alone."""
    enc = processor(text=["<|video_pad|>"], videos=[[Image.open(f).convert("RGB") for f in frames_list]])
    return int(np.prod(np.shape(enc["pixel_values_videos"]))) // 3, int(enc["video_grid_thw"][0][0])


def test_records_with_videos_render_and_expand_as_the_processor_does(video_data):
    root, folder = video_data
    processor = AutoProcessor.from_pretrained(folder)
    t = tokenize_source(Source(str(root / "d.jsonl")), processor.tokenizer, processor=processor, progress=False)
    assert len(t) == 4
    video_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for row, (_, msgs) in enumerate(records(root)):
        ref = processor.apply_chat_template(msgs, tokenize=True, return_dict=True)
        ids, mask = t.sample(row)
        assert ids.tolist() == list(ref["input_ids"][0]), row
        assert processor.tokenizer.decode(ids[mask]).strip() == ANSWERS[row] + "<|im_end|>"
        assert not mask[(ids == video_id) | (ids == image_id)].any()
    assert int((t.sample(0)[0] == video_id).sum()) == 2 * 3 * 4  # 4 frames of 32x24: 2 temporal patches of 3x4
    clip = [str(root / "clip" / n) for n in CLIP]
    short = [str(root / "short" / f"{k}.png") for k in range(2)]
    assert t.sample_media(0) == [Video(str(root / "clip"), 32, 24, *video_alone(processor, clip), 4)]
    (picture, video) = t.sample_media(1)
    assert isinstance(picture, ImageEntry) and picture[:3] == (str(root / "img/a.png"), 30, 20)
    assert video == Video(tuple(short), 24, 16, *video_alone(processor, short), 2)
    assert t.sample_media(2) == t.sample_media(0) and t.sample_media(3) == []


def test_a_data_module_pack_of_video_records_trains_like_each_record_alone(video_data, tmp_path):
    """HBPDataModule over the records (frames decoded in a loader worker, 3-D positions numbered there,
    Qwen2.5-VL's seconds per temporal patch from the processor): its pack through packed_loss equals the
    records alone through the unprepared model, the summed cross-entropy (1e-5) and every gradient, the
    vision tower's included (1e-4); a worker's batch is the main process's."""
    root, folder = video_data
    batches = []
    for workers in (0, 1):
        dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                           cache_dir=str(tmp_path / "cache"), num_workers=workers)  # fmt: skip
        dm.setup("fit")
        (batch,) = list(dm.train_dataloader())
        batches.append(batch)
    batch, other = batches
    assert torch.equal(batch.input_ids, other.input_ids) and set(batch.mm) == set(other.mm)
    assert all(torch.equal(batch.mm[k], other.mm[k]) for k in batch.mm)
    assert torch.equal(batch.position_ids, other.position_ids)
    assert batch.mm["video_grid_thw"].shape[0] == 3 and batch.mm["image_grid_thw"].shape[0] == 1

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


def test_the_plan_weighs_each_videos_encoding(video_data, tmp_path):
    """The planner's extra work per sample: the video's tower work (every frame's patches, attended per
    temporal patch), more for the 4-frame clip than the 2 small frames beside an image, none for text."""
    root, folder = video_data
    dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup("fit")
    work = dm.vision_work(dm.store)
    processor = AutoProcessor.from_pretrained(folder)
    clip = video_alone(processor, [str(root / "clip" / n) for n in CLIP])
    by_row = dict(zip(dm.store.row_of.tolist(), work.tolist()))
    config = AutoConfig.from_pretrained(folder)
    assert by_row[0] == pytest.approx(float(vision_work([[clip]], config)[0])) and by_row[0] > 0
    assert by_row[0] == by_row[2] and by_row[3] == 0


def test_the_store_counts_each_samples_images_and_videos_apart(video_data, tmp_path):
    """What a plan-time SP refusal of one kind reads (Ovis2's images, not its videos): per sample, the media of the
    kinds asked, read off the records as written (a video; an image and a video; a video; text only) and against
    the store's own entries by brute force."""
    root, folder = video_data
    dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup("fit")
    store = dm.store
    written = {0: (0, 1), 1: (1, 1), 2: (0, 1), 3: (0, 0)}  # row: (images, videos)
    for kinds, want in ((("image",), 0), (("video",), 1)):
        assert {r: int(c) for r, c in zip(store.row_of, store.media_counts(kinds))} == {
            r: n[want] for r, n in written.items()
        }
        brute = [
            sum(isinstance(m, Video) == (kinds == ("video",)) for m in store.media(i))
            for i in range(len(store.lengths))
        ]
        assert store.media_counts(kinds).tolist() == brute
    assert {r: int(c) for r, c in zip(store.row_of, store.media_counts())} == {r: sum(n) for r, n in written.items()}


def test_preview_shows_where_each_video_stands_and_its_tokens(video_data, tmp_path):
    from lit_hbp.cli.preview import preview

    root, folder = video_data
    dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    out = io.StringIO()
    assert preview(dm, 2, as_json=False, out=out) == 2
    text = out.getvalue()
    assert f"[video 1: {root / 'clip'} 4 frames 32x24 -> 24 tokens]" in text
    assert f"[image 1: {root / 'img/a.png'} 30x20 -> " in text
    assert f"[video 1: {root / 'short/0.png'} ... (2 files) 2 frames 24x16 -> 6 tokens]" in text
    assert "<|video_pad|>" not in text
    js = io.StringIO()
    preview(dm, 1, as_json=True, out=js)
    assert json.loads(js.getvalue())["videos"] == [{"source": str(root / "clip"), "width": 32, "height": 24,
                                                    "frames": 4}]  # fmt: skip


def _bad(root: Path) -> None:
    (root / "empty").mkdir()
    (root / "mixed").mkdir()
    image(1, 24, 32).save(root / "mixed" / "0.png")
    image(2, 16, 32).save(root / "mixed" / "1.png")
    (root / "v.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")


@pytest.mark.parametrize(
    "record, error",
    [
        ({"messages": chat([{"type": "video", "video": "nowhere"}, {"type": "text", "text": "hi"}], "x")},
         r"d.jsonl:2: video .*nowhere does not exist"),
        ({"messages": chat([{"type": "video", "video": "empty"}, {"type": "text", "text": "hi"}], "x")},
         r"d.jsonl:2: video .*empty is a folder without image files"),
        ({"messages": chat([{"type": "video", "video": "mixed"}, {"type": "text", "text": "hi"}], "x")},
         r"d.jsonl:2: video .*mixed's frames differ in size"),
        ({"messages": chat([{"type": "video", "video": ["clip/f1.png", "clip/f9.png"]},
                            {"type": "text", "text": "hi"}], "x")},
         r"d.jsonl:2: video frame 1: image .*clip/f9.png does not exist"),
        ({"messages": chat("<video> hi", "x"), "videos": ["clip", "clip"]},
         r"d.jsonl:2: 2 video\(s\) in 'videos' but 1 <video> marker\(s\) in the text"),
        ({"messages": chat("<|vision_start|><|video_pad|><|vision_end|> hi", "x")},
         r"d.jsonl:2: the text holds the video token '<\|video_pad\|>' but the record has no videos"),
        ({"messages": chat([{"type": "video", "video": "v.mp4"}, {"type": "text", "text": "hi"}], "x")},
         r"d.jsonl:2: video .*v.mp4 (is a video file and the processor cannot decode it here .*torchcodec"
         r"|cannot be read)"),
        ({"messages": chat([{"type": "video", "video": []}, {"type": "text", "text": "hi"}], "x")},
         r"d.jsonl:2: messages\[0\].content\[0\] is a video part without a file"),
        ({"messages": chat([{"type": "video", "video": "clip", "fps": "2"}, {"type": "text", "text": "hi"}], "x")},
         r"d.jsonl:2: messages\[0\].content\[0\]: a video part's fps must be a positive number .*'2'"),
        ({"messages": chat([{"type": "video", "video": "clip", "fps": 0}, {"type": "text", "text": "hi"}], "x")},
         r"d.jsonl:2: messages\[0\].content\[0\]: a video part's fps must be a positive number .*got 0"),
        ({"messages": chat([{"type": "video", "video": "v.mp4", "fps": 2}, {"type": "text", "text": "hi"}], "x")},
         r"d.jsonl:2: video .*v.mp4 is a video file, which has a frame rate of its own: 'fps' is the rate of frames"),
        ({"messages": chat([{"type": "image", "image": "img/a.png", "fps": 2}, {"type": "text", "text": "hi"}], "x")},
         r"d.jsonl:2: messages\[0\].content\[0\]: an image part's \['fps'\] is not read"),
    ],
    ids=["missing", "empty-folder", "sizes-differ", "missing-frame", "markers", "bare-token", "video-file",
         "no-frames", "fps-text", "fps-zero", "fps-of-a-file", "fps-of-an-image"],
)  # fmt: skip
def test_a_bad_video_record_stops_with_its_file_and_line(video_data, tmp_path, record, error):
    root, folder = video_data
    d = tmp_path / "bad"
    d.mkdir()
    frames(d)
    _bad(d)
    write(d / "d.jsonl", [records(d)[3][0], record])
    processor = AutoProcessor.from_pretrained(folder)
    with pytest.raises(DataError, match=error):
        tokenize_source(Source(str(d / "d.jsonl")), processor.tokenizer, processor=processor, progress=False)


def test_a_video_whose_frames_changed_since_tokenizing_is_refused_in_the_loader(video_data, tmp_path):
    root, folder = video_data
    d = tmp_path / "changed"
    d.mkdir()
    frames(d)
    write(d / "d.jsonl", [records(d)[0][0]])
    dm = HBPDataModule(sources=[str(d / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup("fit")
    image(99, 24, 32).save(d / "clip" / "f11.png")
    with pytest.raises(DataError, match=r"d.jsonl:1: video .*clip is 32x24, 5 frames now, 32x24, 4 frames when the "
                                         r"source was tokenized: remove the token cache"):  # fmt: skip
        list(dm.train_dataloader())


def test_a_video_part_gives_its_frames_their_rate(video_data, tmp_path):
    """``{"type": "video", "video": <frames>, "fps": 2}``: the frames at 2 a second, as the processor encodes
    frames a decoder reports at that rate (Qwen2.5-VL's seconds per temporal patch, Qwen3-VL's timestamps
    in the text), against the same frames with no rate (the processor's default); kept in the cache and
    shown by the preview."""
    from transformers.video_utils import VideoMetadata

    from lit_hbp.cli.preview import preview

    root, folder = video_data
    processor = AutoProcessor.from_pretrained(folder)
    clip = [Image.open(root / "clip" / n).convert("RGB") for n in CLIP]
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[0]}]}]  # fmt: skip
    text = processor.apply_chat_template(msgs, tokenize=False)
    meta = VideoMetadata(total_num_frames=4, fps=2.0, duration=2.0, frames_indices=[0, 1, 2, 3], height=24, width=32)
    with_rate = processor(text=[text], videos=[clip], video_metadata=[meta], return_tensors="pt")
    without = processor(text=[text], videos=[clip], return_tensors="pt")
    got = {}
    for fps in (2, None):
        d = tmp_path / f"fps{fps}"
        d.mkdir()
        frames(d)
        part = {"type": "video", "video": "clip", **({"fps": fps} if fps else {})}
        write(d / "d.jsonl", [{"messages": chat([part, {"type": "text", "text": "what happens?"}], ANSWERS[0])}])
        dm = HBPDataModule(sources=[str(d / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                           cache_dir=str(tmp_path / "cache"))  # fmt: skip
        dm.setup("fit")
        (batch,) = list(dm.train_dataloader())
        got[fps] = (batch, dm.store.media(0)[0], dm)
    for fps, ref in ((2, with_rate), (None, without)):
        batch, entry, _ = got[fps]
        n = ref["input_ids"].shape[1]
        assert batch.input_ids[0, :n].tolist() == ref["input_ids"][0].tolist() and int(batch.n_tokens) == n
        assert torch.equal(batch.mm["pixel_values_videos"], ref["pixel_values_videos"])
        if "second_per_grid_ts" in ref:
            assert torch.allclose(batch.mm["second_per_grid_ts"].float(), ref["second_per_grid_ts"].float())
        assert entry.fps == (2.0 if fps else 0.0)
    if "second_per_grid_ts" in with_rate:  # Qwen2.5-VL: two frames a temporal patch at 2 fps: one second
        assert with_rate["second_per_grid_ts"].tolist() == [1.0] != without["second_per_grid_ts"].tolist()
    if folder.name == "qwen3_vl":  # the timestamps in its text follow the rate
        assert with_rate["input_ids"].tolist() != without["input_ids"].tolist()
    out = io.StringIO()
    preview(got[2][2], 1, as_json=True, out=out)
    assert json.loads(out.getvalue().splitlines()[0])["videos"][0]["fps"] == 2.0
    out = io.StringIO()
    preview(got[2][2], 1, as_json=False, out=out)
    assert f"[video 1: {tmp_path / 'fps2' / 'clip'} 4 frames at 2 fps 32x24 -> " in out.getvalue()


def check_video_file(folder: Path, d: Path, clip, meta, tmp_path: Path) -> list:
    """A record of the video file ``d / v.mp4`` through the data module: its batch against the processor's
    own encoding of the decoded frames ``clip`` with the decoder's metadata ``meta``; the cache's entry."""
    processor = AutoProcessor.from_pretrained(folder)
    write(d / "d.jsonl", [{"messages": chat([{"type": "video", "video": "v.mp4"}, {"type": "text", "text": "hi"}],
                                            "a cat walks")}])  # fmt: skip
    dm = HBPDataModule(sources=[str(d / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup("fit")
    (batch,) = list(dm.train_dataloader())
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a cat walks"}]}]  # fmt: skip
    text = processor.apply_chat_template(msgs, tokenize=False)
    ref = processor(text=[text], videos=[clip], video_metadata=[meta], return_tensors="pt")
    assert batch.input_ids[0, : ref["input_ids"].shape[1]].tolist() == ref["input_ids"][0].tolist()
    assert torch.equal(batch.mm["pixel_values_videos"], ref["pixel_values_videos"])
    if "second_per_grid_ts" in ref:  # seconds per temporal patch from the file's own frame rate (2 fps)
        assert batch.mm["second_per_grid_ts"].tolist() == [1.0] == ref["second_per_grid_ts"].tolist()
    return dm.store.media(0)


def test_a_video_file_goes_through_the_processors_own_loader(video_data, tmp_path, monkeypatch):
    """A video file is decoded by the video processor's own ``fetch_videos`` (here a fake with its signature
    and torchcodec's return: frames [T, C, H, W] as a tensor and the decoder's metadata at 2 fps) and encoded
    with that metadata, as the processor encodes a decoded video: ids, pixels and (Qwen2.5-VL) seconds per
    temporal patch from the file's own frame rate; the cache keeps the file, its frame size and count."""
    from transformers.video_utils import VideoMetadata

    root, folder = video_data
    processor = AutoProcessor.from_pretrained(folder)
    clip = np.stack([np.asarray(Image.open(root / "clip" / n).convert("RGB")) for n in CLIP])
    clip = torch.from_numpy(clip).permute(0, 3, 1, 2).contiguous()  # torchcodec's layout
    d = tmp_path / "file"
    d.mkdir()
    (d / "v.mp4").write_bytes(b"mp4")
    decoded = []
    meta = VideoMetadata(total_num_frames=4, fps=2.0, width=32, height=24, duration=2.0,
                         video_backend="torchcodec", frames_indices=[0, 1, 2, 3])  # fmt: skip

    def fetch_videos(self, video_url_or_urls, sample_indices_fn=None):
        decoded.append(video_url_or_urls)
        return clip.clone(), meta

    monkeypatch.setattr(type(processor.video_processor), "fetch_videos", fetch_videos)
    entry = check_video_file(folder, d, clip, meta, tmp_path)
    assert decoded == [str(d / "v.mp4")] * len(decoded) and len(decoded) >= 2  # tokenizing, then the loader
    assert entry == [Video(str(d / "v.mp4"), 32, 24, *video_alone(processor, [
        str(root / "clip" / n) for n in CLIP]), 4)]  # fmt: skip


def test_a_real_video_file_is_decoded_by_torchcodec_as_the_processor_decodes_it(video_data, tmp_path):
    """A real MP4 (the clip's frames encoded by torchcodec at 2 fps) through the data module: decoded by the
    processor's own loader with torchcodec and FFmpeg installed (the CI's compatibility part installs both,
    ``LIT_HBP_WITH_TORCHCODEC``; elsewhere skipped where torchcodec cannot load), the batch equal to the
    processor's encoding of the frames torchcodec's own decoder reads back with its metadata."""
    import os

    if os.environ.get("LIT_HBP_WITH_TORCHCODEC"):
        from torchcodec.decoders import VideoDecoder
    else:
        decoders = pytest.importorskip("torchcodec.decoders", reason="no torchcodec (the CI's compatibility part)")
        VideoDecoder = decoders.VideoDecoder
    from torchcodec.encoders import VideoEncoder
    from transformers.video_utils import VideoMetadata

    root, folder = video_data
    d = tmp_path / "real"
    d.mkdir()
    frames_ = np.stack([np.asarray(Image.open(root / "clip" / n).convert("RGB")) for n in CLIP])
    VideoEncoder(torch.from_numpy(frames_).permute(0, 3, 1, 2).contiguous(), frame_rate=2.0).to_file(str(d / "v.mp4"))
    decoder = VideoDecoder(str(d / "v.mp4"))
    clip = decoder.get_frames_at(list(range(decoder.metadata.num_frames))).data  # lossy: what the file holds
    meta = VideoMetadata(total_num_frames=clip.shape[0], fps=decoder.metadata.average_fps, width=32, height=24,
                         duration=clip.shape[0] / decoder.metadata.average_fps, video_backend="torchcodec",
                         frames_indices=list(range(clip.shape[0])))  # fmt: skip
    assert tuple(clip.shape) == (4, 3, 24, 32) and meta.fps == 2.0
    (entry,) = check_video_file(folder, d, clip, meta, tmp_path)
    assert (entry.source, entry.width, entry.height, entry.frames) == (str(d / "v.mp4"), 32, 24, 4)


def test_a_videos_encoder_work_is_what_torch_counts(video_data):
    """encoder_flops of a video (its frames' patches, attention within each temporal patch) against
    torch's FLOP counter on the tower's own blocks encoding it (eager attention), within 5%: a 4-frame
    clip is twice the 2-frame one's frames, not four times its attention."""
    import re

    from test_vision_data import QWEN_BLOCKS
    from torch.utils.flop_counter import FlopCounterMode

    from lit_hbp.data.media import encoder_flops

    root, folder = video_data
    model = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").eval()
    processor = AutoProcessor.from_pretrained(folder)
    for names in ([root / "clip" / n for n in CLIP], [root / "clip" / n for n in CLIP[:2]]):
        pil = [Image.open(f).convert("RGB") for f in names]
        enc = processor.video_processor(videos=[pil], return_tensors="pt")
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model.model.get_video_features(enc["pixel_values_videos"], enc["video_grid_thw"])
        want = sum(sum(v.values()) for name, v in counter.get_flop_counts().items() if re.search(QWEN_BLOCKS, name))
        pixels, tiles = video_alone(processor, [str(f) for f in names])
        got = float(encoder_flops(np.array([pixels]), np.array([tiles]), model.config)[0])
        assert 0.95 * want <= got <= 1.05 * want, (len(names), got, want)


def test_the_guides_example_video_records_read_as_it_says(video_data, tmp_path):
    """docs/vision.md's second JSON Lines block: each record reads, with its videos where the guide says
    (the first at the 2 frames a second its part gives)."""
    import re

    root, folder = video_data
    guide = (Path(__file__).resolve().parents[1] / "docs" / "vision.md").read_text()
    block = re.findall(r"```json\n(.*?)```", guide, re.S)[1]
    (tmp_path / "clips" / "walk").mkdir(parents=True)
    for k in range(4):
        image(k, 24, 32).save(tmp_path / "clips" / "walk" / f"{k}.png")
        image(k, 24, 32).save(tmp_path / "clips" / f"f{k}.png")
    (tmp_path / "img").mkdir()
    image(9, 20, 20).save(tmp_path / "img" / "cat.png")
    (tmp_path / "d.jsonl").write_text(block)
    processor = AutoProcessor.from_pretrained(folder)
    t = tokenize_source(Source(str(tmp_path / "d.jsonl")), processor.tokenizer, processor=processor, progress=False)
    kinds = [[(type(m).__name__, m.frames if isinstance(m, Video) else 1) for m in t.sample_media(r)] for r in range(3)]
    assert kinds == [[("Video", 4)], [("Video", 4)], [("Image", 1), ("Video", 2)]]
    assert [m.fps for r in range(3) for m in t.sample_media(r) if isinstance(m, Video)] == [2.0, 0.0, 0.0]
    answers = [processor.tokenizer.decode(t.sample(r)[0][t.sample(r)[1]]).strip() for r in range(3)]
    assert answers == ["A cat walks.<|im_end|>", "A cat walks.<|im_end|>", "Yes.<|im_end|>"]


def test_the_self_check_packs_the_runs_own_videos(video_data, tmp_path):
    """The start-of-fit self-check gets the run's two shortest samples with media as the processor
    encodes them alone (a video among them) and passes with them: loss, embedding and pixel gradients
    (the videos' included) equal each alone, and no leak between them."""
    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.model.selfcheck import run_self_check

    root, folder = video_data
    dm = HBPDataModule(sources=[str(root / "d.jsonl")], tokenizer=str(folder), levels=["1024:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup("fit")
    docs = dm.self_check_samples()
    processor = AutoProcessor.from_pretrained(folder)
    encoded = [processor.apply_chat_template(m, tokenize=True, return_dict=True, return_tensors="pt")
               for _, m in records(root)[:3]]  # fmt: skip
    by_length = sorted(range(3), key=lambda r: encoded[r]["input_ids"].shape[1])[:2]
    assert len(docs) == 2 and any("pixel_values_videos" in mm for _, mm in docs)
    for (ids, mm), row in zip(docs, by_length):
        assert ids.tolist() == encoded[row]["input_ids"][0].tolist()
        for key in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "pixel_values"):
            assert (key in mm) == (key in encoded[row]), key
            assert key not in mm or torch.allclose(mm[key].float(), torch.as_tensor(encoded[row][key]).float())
    torch.manual_seed(0)
    module = HBPLitModule(model=str(folder), loss="sum")
    module.configure_model()
    module.model.float()
    loss_err, grad_err, leak, _ = run_self_check(module, [1], media_docs=docs)[1]
    assert loss_err < 1e-5 and grad_err < 1e-4 and leak == 0.0


def test_llava_onevision_videos_train_like_each_record_alone_and_frame_counts_must_agree(tmp_path):
    """LLaVA-OneVision's videos (each frame through the tower as an image, pooled): the data module's pack
    of two 4-frame clips and a text record equals them alone (loss and every gradient); a pack whose
    videos differ in frame count is refused naming the fix, since its forward takes one frames tensor."""
    from vision_models import build_llava

    needs_torchvision("llava_onevision")
    folder = build_llava(tmp_path / "ov", "llava_onevision")
    frames(tmp_path)
    every = records(tmp_path)
    same = [every[0], every[2], every[3]]
    write(tmp_path / "d.jsonl", [r for r, _ in same])
    dm = HBPDataModule(sources=[str(tmp_path / "d.jsonl")], tokenizer=str(folder), levels=["2048:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup("fit")
    (batch,) = list(dm.train_dataloader())
    assert tuple(batch.mm["pixel_values_videos"].shape[:2]) == (2, 4)
    assert [m.tiles for m in dm.store.media(0)] == [4]  # a frame is a tile: attended apart
    processor = AutoProcessor.from_pretrained(folder)
    reference = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").float()
    model = prepare_model(AutoModelForImageTextToText.from_pretrained(folder).float())
    refs = []
    for row, (_, msgs) in enumerate(same):
        enc = processor.apply_chat_template(msgs, tokenize=True, return_dict=True, return_tensors="pt")
        ids, mask = dm.store.sources[0].sample(row)
        assert ids.tolist() == enc["input_ids"][0].tolist()
        refs.append((enc, torch.where(torch.as_tensor(mask), enc["input_ids"][0], -100)))
    want = alone(reference, refs)
    want.backward()
    out = packed_loss(model, batch, "sum")
    out.loss.backward()
    assert float(out.ce_sum.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    assert assert_same_grads(model, reference) > 0

    write(tmp_path / "e.jsonl", [r for r, _ in every])  # a 2-frame video beside the 4-frame clips
    dm = HBPDataModule(sources=[str(tmp_path / "e.jsonl")], tokenizer=str(folder), levels=["2048:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup("fit")
    each = r"\[\d, 3, \d+, \d+\] \(.*e\.jsonl:\d\)"  # a shape, and the first record of it
    with pytest.raises(DataError, match=rf"pixel_values_videos of different shapes: {each}, {each}, .* frame count"):
        list(dm.train_dataloader())


def test_the_cli_trains_video_records_and_its_self_check_packs_them(video_data, tmp_path):
    """``lit-hbp fit`` on a folder of video records, as a user runs it: exit 0, the self-check packed the
    run's videos; a record whose frames are missing stops it with exit 2 naming its file and line."""
    import re
    import subprocess

    from conftest import HANG_S, console_script

    root, folder = video_data
    write(root / "cli.jsonl", [r for r, _ in records(root)] * 3)  # beside the frames its paths name
    cmd = [console_script("lit-hbp"), "fit", "--model.model", str(folder), "--data.tokenizer", str(folder),
           "--data.levels", '["512:1"]', "--trainer.max_steps", "2", "--trainer.accelerator", "cpu",
           "--trainer.logger", "false", "--data.cache_dir", str(tmp_path / "cache")]  # fmt: skip
    out = subprocess.run([*cmd, "--data.sources", json.dumps([str(root / "cli.jsonl")])], cwd=tmp_path,
                         capture_output=True, text=True, timeout=HANG_S)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    # the run's two shortest samples with media: Qwen3-VL's clips are longer (a timestamp per frame pair)
    assert re.search(r"self-check passed \(a pack equals its documents alone, 2 of them with (images or )?videos\)",
                     out.stderr), out.stderr[-2000:]  # fmt: skip
    bad = {"messages": chat([{"type": "video", "video": "gone"}, {"type": "text", "text": "hi"}], "x")}
    write(root / "cli_bad.jsonl", [records(root)[3][0], bad])
    out = subprocess.run([*cmd, "--data.sources", json.dumps([str(root / "cli_bad.jsonl")])], cwd=tmp_path,
                         capture_output=True, text=True, timeout=HANG_S)  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    assert "cli_bad.jsonl:2: video" in out.stderr and "gone does not exist" in out.stderr


@pytest.mark.slow
def test_the_cli_trains_video_records_on_an_sp_2_level(video_data, tmp_path):
    """``lit-hbp fit`` on 2 processes with the level at sp 2 (HBPStrategy, ZeRO 2), the data module's video
    path end to end: its self-check packs the run's own videos at sp 2 (the SP group splitting their
    encoding, Qwen3-VL's deepstack features moved with them) against each alone through the model's
    forward, and training runs."""
    import subprocess

    from conftest import HANG_S, console_script

    root, folder = video_data
    write(root / "sp.jsonl", [r for r, _ in records(root)] * 3)
    cmd = [console_script("lit-hbp"), "fit", "--model.model", str(folder), "--data.tokenizer", str(folder),
           "--data.sources", json.dumps([str(root / "sp.jsonl")]), "--data.levels", '[{"pack_len": 512, "sp": 2}]',
           "--trainer.devices", "2", "--trainer.accelerator", "cpu",
           "--trainer.strategy", "{class_path: lit_hbp.lightning.strategy.HBPStrategy, init_args: {stage: 2}}",
           "--trainer.max_steps", "2", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
           "--data.cache_dir", str(tmp_path / "cache")]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("self-check passed")]
    assert "with videos" in line or "with images or videos" in line, line
    assert ", sp 2: loss" in line, line
