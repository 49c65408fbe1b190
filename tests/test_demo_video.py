"""The video demo (``lit_hbp.demo.video``): its records and frames (answers that only the pixels decide, the
same files on every build) and its one-line refusal without torchvision, in the main run; with torchvision
(the CI's compatibility part: Qwen2-VL's video processor needs it) its records rendered token for token as
the checkpoint's own processor renders them, and configs/tiny_video_cpu.yaml trained as a new user runs it.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from vision_models import needs_torchvision

from lit_hbp.demo import video
from lit_hbp.demo.vision import COLORS, IMAGE_DIR
from lit_hbp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
N = 60  # records: every kind, a few of each


def generate(root: Path, n: int = N, seed: int = 0) -> list[dict]:
    (root / IMAGE_DIR).mkdir(parents=True)
    (root / video.VIDEO_DIR).mkdir()
    return video.records(random.Random(seed), n, root)


def frames_of(folder: Path) -> list[Path]:
    return sorted(folder.iterdir(), key=lambda p: int(p.stem))


def seen(path: Path) -> tuple[str, float]:
    """The colour name of the shape drawn in a picture or frame, and its centre's x (from its pixels)."""
    rgb = np.asarray(Image.open(path).convert("RGB")).astype(int)
    ink = (rgb != 255).any(-1)
    color = min(COLORS, key=lambda c: np.abs(rgb[ink] - COLORS[c]).sum())
    return color, float(np.nonzero(ink)[1].mean())


def test_the_video_demos_answers_are_what_its_frames_show(tmp_path):
    """Each record's answer read back off its files: a moving shape's direction from its frames' centres,
    a colour change from the first and last frames, a picture's colour against the video's; 4- or
    6-frame folders of one size; markers matching the lists; every kind present; a second build with
    the seed writes the same records and the same bytes."""
    recs = generate(tmp_path / "a")
    asked = set()
    for r in recs:
        user, answer = r["messages"][0]["content"], r["messages"][1]["content"]
        question = user.replace("<image>", "").replace("<video>", "")
        asked.add((" ".join(question.split()[:3]), len(r.get("images", [])), len(r.get("videos", []))))
        assert user.count("<image>") == len(r.get("images", [])) and user.count("<video>") == len(r.get("videos", []))
        clips = [frames_of(tmp_path / "a" / v) for v in r.get("videos", [])]
        for clip in clips:
            assert len(clip) in video.FRAME_COUNTS
            assert {Image.open(f).size for f in clip} == {video.FRAME_SIZE}
        shown = [[seen(f) for f in clip] for clip in clips]
        if question.startswith("Which way"):
            xs = [x for _, x in shown[0]]
            steps = np.diff(xs)
            assert (steps < 0).all() if answer == "Left." else (steps > 0).all() and answer == "Right.", (xs, answer)
        elif question.startswith("What color does"):
            assert answer == f"From {shown[0][0][0]} to {shown[0][-1][0]}." and shown[0][0][0] != shown[0][-1][0]
        elif question.startswith("What moves"):
            assert answer.startswith(f"A {shown[0][0][0]} ") and shown[0][0][1] != shown[0][-1][1]
        elif question.startswith("Is the shape"):
            same_color = seen(tmp_path / "a" / r["images"][0])[0] == shown[0][0][0]
            assert answer == "Yes." if same_color else answer == "No."
        else:
            assert "images" not in r and "videos" not in r and answer.startswith(" ".join(question.split()[-1][:-1]))
    assert asked == {("Which way does", 0, 1), ("What color does", 0, 1), ("What moves in", 0, 1),
                     ("Is the shape", 1, 1), ("Spell the word", 0, 0)}, asked  # fmt: skip
    assert generate(tmp_path / "b") == recs
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.png"))
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*.png"))
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)


def test_without_torchvision_the_video_demo_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """Without torchvision (the main CI's CPU torch has none) ``python -m lit_hbp.demo.video`` prints one
    line naming it and exits 2, building nothing; the data module's ``demo: video`` stops with the same
    ConfigError (exit 2 from the CLI)."""
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_torchvision_available", lambda: False)
    assert video.main([str(tmp_path / "demo_video")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the video demo needs torchvision"), err
    assert "Traceback" not in err and not (tmp_path / "demo_video").exists()
    from lit_hbp.demo import ensure_kind

    with pytest.raises(ConfigError, match="needs torchvision"):
        ensure_kind(tmp_path / "demo_video", "video")


def test_a_video_demo_the_user_built_is_kept_and_a_bad_count_refused(tmp_path, monkeypatch, capsys):
    """The video demo built at another size than the default (``--n 3``) is what the data module's ``demo_dir``
    finds and keeps (built "when missing", as the text and image demos keep theirs); a seed asked for by name
    rebuilds; ``--n 0`` stops in one line (exit 2). The build stands in for the real one (no torchvision needed)."""
    from lit_hbp.demo import ensure_kind

    builds = []

    def write(tmp, n, seed):
        builds.append((n, seed))
        (tmp / "model").mkdir()
        (tmp / "model" / "config.json").write_text("{}")
        return {"records": n, "images": 0, "videos": n}

    monkeypatch.setattr(video, "require_torchvision", lambda: None)
    monkeypatch.setattr(video, "write_demo", write)
    out = tmp_path / "demo_video"
    assert video.main([str(out), "--n", "3"]) == 0
    ensure_kind(out, "video")
    assert video.ensure_video_demo(out)["records"] == 3 and builds == [(3, 0)]
    assert video.ensure_video_demo(out, n=3, seed=0)["records"] == 3 and len(builds) == 1
    # Arguments asked for by name and not as built rebuild; those not asked for take their defaults (400, 0).
    assert video.ensure_video_demo(out, seed=1)["args"] == {"n": 400, "seed": 1} and builds[1:] == [(400, 1)]
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        video.main([str(tmp_path / "other"), "--n", "0"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "argument --n: must be a whole number >= 1, got 0" in err.splitlines()[-1]


@pytest.mark.slow
def test_the_video_config_without_torchvision_stops_in_one_line_before_building_anything(tmp_path):
    """``lit-hbp fit --config configs/tiny_video_cpu.yaml`` in a fresh folder without torchvision: exit 2, the
    reason in one line (and the CLI's debug tip), no traceback, no demo folder (with torchvision the config
    trains: the compatibility part's test below)."""
    import transformers.utils
    from conftest import HANG_S, console_script

    if transformers.utils.is_torchvision_available():
        pytest.skip("torchvision is installed here: the config trains (the end-to-end test)")
    run = subprocess.run([console_script("lit-hbp"), "fit", "--config", str(ROOT / "configs" / "tiny_video_cpu.yaml")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)  # fmt: skip
    assert run.returncode == 2, run.stderr[-3000:]
    lines = run.stderr.splitlines()
    assert lines[0].startswith("error: the video demo needs torchvision") and lines[1:] == [
        "tip: LIT_HBP_DEBUG=1 prints the traceback"
    ], run.stderr
    assert not (tmp_path / "demo_video").exists()


def test_the_video_demos_records_render_as_its_processor_renders_them(tmp_path):
    """The built folder as users' folders look (AutoProcessor loads its Qwen2-VL processor with the video
    processor it was saved with), and every record through lit-hbp's data path equal, token for token,
    to the processor's own ``apply_chat_template`` of the same chat (pictures as images, frame folders
    as frame lists): 18 video tokens a temporal patch of 2 frames, the answers the trained tokens; a
    second call finds the demo built."""
    needs_torchvision("qwen2_vl")
    from transformers import AutoProcessor

    from lit_hbp.data.sources import Source
    from lit_hbp.data.tokenize import tokenize_source

    out = tmp_path / "demo_video"
    manifest = video.ensure_video_demo(out, n=N)
    recs = [json.loads(line) for line in (out / "chat.jsonl").read_text().splitlines()]
    assert manifest["records"] == len(recs) == N and manifest["videos"] == sum(len(r.get("videos", [])) for r in recs)
    stamp = (out / "model" / "config.json").stat().st_mtime_ns
    assert video.ensure_video_demo(out, n=N) == manifest and (out / "model" / "config.json").stat().st_mtime_ns == stamp
    processor = AutoProcessor.from_pretrained(out / "model")
    videos = processor.video_processor
    assert type(videos).__name__ == "Qwen2VLVideoProcessor" and videos.patch_size == 4  # the demo's, not a default
    t = tokenize_source(Source(str(out / "chat.jsonl")), processor.tokenizer, processor=processor, progress=False)
    video_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    for row, r in enumerate(recs):
        user, answer = r["messages"][0]["content"], r["messages"][1]["content"]
        clips = [[str(f) for f in frames_of(out / v)] for v in r.get("videos", [])]
        parts = [{"type": "image", "image": Image.open(out / name).convert("RGB")} for name in r.get("images", [])]
        parts += [{"type": "video", "video": clip} for clip in clips]
        parts.append({"type": "text", "text": user.replace("<image>", "").replace("<video>", "")})
        reply = [{"type": "text", "text": answer}]
        chat = [{"role": "user", "content": parts}, {"role": "assistant", "content": reply}]
        ref = processor.apply_chat_template(chat, tokenize=True, return_dict=True)
        ids, mask = t.sample(row)
        assert ids.tolist() == list(ref["input_ids"][0]), row
        assert processor.tokenizer.decode(ids[mask]).strip() == answer + "<|im_end|>"
        assert int((ids == video_id).sum()) == sum(18 * len(clip) // 2 for clip in clips)


@pytest.mark.slow
def test_the_tiny_video_config_trains_on_the_demo_as_a_new_user_runs_it(tmp_path):
    """``lit-hbp fit --config configs/tiny_video_cpu.yaml`` in a fresh folder (fewer steps), building the demo
    itself: exit 0, the self-check passed with the run's media, the loss falls, and the folder (a checkout
    with the repo's .gitignore) keeps ``git status`` clean: the demo, its cache and the run are ignored."""
    needs_torchvision("qwen2_vl")
    import shutil

    from conftest import HANG_S, console_script
    from test_train import scalars

    shutil.copy(ROOT / ".gitignore", tmp_path / ".gitignore")  # a checkout: the run leaves git status clean
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", ".gitignore"], cwd=tmp_path, check=True)
    subprocess.run(["git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-q", "-m", "checkout"],
                   cwd=tmp_path, check=True)  # fmt: skip
    run = subprocess.run(
        [console_script("lit-hbp"), "fit", "--config", str(ROOT / "configs" / "tiny_video_cpu.yaml"),
         "--trainer.max_steps", "16", "--trainer.val_check_interval", "8", "--trainer.enable_progress_bar", "false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "self-check passed (a pack equals its documents alone, 2 of them with videos)" in run.stderr
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=tmp_path,
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert status == "", status
    losses = [v for _, v in scalars(tmp_path / "runs")["train/loss"]]
    assert len(losses) >= 6 and np.mean(losses[-3:]) < 0.75 * np.mean(losses[:3]), losses
    assert (tmp_path / "runs" / "tiny_video_cpu" / "version_0" / "checkpoints" / "last.ckpt").is_file()
