"""The GPU proof never rots: its CPU dry run (the same parts on the tiny config) runs here, from the shell
script a GPU machine runs, and what it writes is checked against what it measured from."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG_S

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_proof import PARTS, level_steps, pytest_counts, sp2_part  # noqa: E402
from peers import check_indices, max_diff, read_records  # noqa: E402


@pytest.mark.slow
def test_the_gpu_proof_dry_run_runs_every_part_and_writes_its_results(tmp_path, small_demo, vlm_demo):
    """The demos the parts train on are the suite's, built once (the dry run's own, the same sizes): the
    demo part finds its demo complete, and the vlm part its image demo in the work folder."""
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    (work / "demo_vlm").symlink_to(vlm_demo)
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "bench/gpu_proof.sh", "--dry-run", "--work", str(work), "--demo-dir", str(small_demo)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["proof.json", "proof.log", "proof.md"]
    report = json.loads((out / "proof.json").read_text())
    parts = report["parts"]
    assert list(parts) == list(PARTS) and report["dry_run"]
    assert parts["sp2"]["status"] == "skipped: 0 GPU(s), an sp 2 level needs 2"
    assert all(parts[p]["status"] == "passed" for p in PARTS if p != "sp2")

    versions = parts["env"]["result"]
    import torch
    import trl

    assert versions["torch"] == torch.__version__ and versions["trl"] == trl.__version__ and versions["gpus"] == []

    # pytest -m gpu on a CPU (a dry run: the first marked file): its GPU tests collected and skipped, none failed
    tests = parts["tests"]["result"]
    assert tests["skipped"] > 0 and tests["passed"] == tests["failed"] == tests["error"] == 0

    thr = parts["throughput"]["result"]
    modes = ["hbp_alone", "hf_sdpa", "trl_bfd"]  # each level alone; hbp, its levels mixed in one window: all only
    names = [f"{level} {mode}" for level in ("256:1", "1024:1") for mode in modes] + [
        f"all {mode}" for mode in ["hbp", *modes]
    ]
    assert [r["name"] for r in thr["throughput"]] == names
    assert thr["throughput"][-2]["vs_hf_sdpa"] == "1.00"  # the levels together, against hf_sdpa's
    assert all(float(r["tokens_per_s"]) > 0 for r in thr["throughput"])
    assert (work / "runs" / "tiny_cpu").is_dir()  # the config's logger writes to the work folder, not the checkout
    assert [m["name"] for m in thr["memory"]] == ["256:1", "1024:1"]
    assert all(m["measured_gib"] is None and m["error"] == "n/a (no CUDA)" for m in thr["memory"])
    # the 1K level holds 4x the 256 level's activations: the memory model's prediction grows with it
    assert thr["memory"][1]["predicted_gib"] > thr["memory"][0]["predicted_gib"] > 0
    assert {(c["device"], c["dtype"]) for c in thr["attention"]} == {("cpu", "float32")}

    vlm = parts["vlm"]["result"]  # the tiny vision-language run: its self-check packed the run's images
    assert "2 of them with images" in vlm["self_check"] and sum(r["steps"] for r in vlm["levels"]) == 2
    assert vlm["tower"] == "vision tower attention in packed calls: its own for torch.float32 on cpu", vlm["tower"]

    peers = parts["peers"]["result"]
    assert (work / "peers" / "runs" / "config.yaml").is_file()  # its lit-hbp mode ran in the work folder
    records = [json.loads(line) for line in (work / "peers" / "data.jsonl").read_text().splitlines()]
    tokens = sum(len(r["input_ids"]) for r in records)
    assert peers["data"]["tokens"] == tokens and peers["data"]["samples"] == len(records) == 12
    for mode in ("lit-hbp", "trl-bfd", "trl-nopack", "hf-padding"):
        row = peers["modes"][mode]
        assert row["real_tokens"] == tokens, mode  # one pass over every sample, whatever the batching
        assert row["apart"] is True and row["check_max_diff"] < 1e-4, mode
    assert peers["modes"]["trl-nopack"]["padding"] > 0 and peers["modes"]["trl-bfd"]["padding"] == 0
    assert peers["control_max_diff"] > 1e-2  # a mode that lets samples see each other is caught

    md = (out / "proof.md").read_text()
    for head in (
        "| part | status | seconds |",
        "## Throughput",
        "| level | predicted GiB",
        "## Vision-language",
        "## Peers",
    ):
        assert head in md


def test_a_level_alone_is_the_plans_steps_of_that_level_in_their_order():
    """``gpu_throughput.only_level``: what hbp_alone trains of a level is what the whole plan trains of it."""
    import numpy as np
    from gpu_throughput import only_level

    from lit_hbp.packing.levels import Level
    from lit_hbp.packing.plan import plan_hbp

    rng = np.random.default_rng(0)
    lengths = np.r_[rng.integers(20, 250, 300), rng.integers(300, 1000, 40)]
    plan = plan_hbp(lengths, (Level(256), Level(1024, packs_per_rank=2)), 2, 3, seed=1)
    for level in (0, 1):
        alone = only_level(plan, level)
        want = [mb for rank in (0, 1) for mb in plan.micro_batches(rank) if mb.level == level]
        got = [mb for rank in (0, 1) for mb in alone.micro_batches(rank)]
        assert len(got) == len(want) > 0
        for a, b in zip(got, want):
            assert (a.level, a.micro, a.loss_norm) == (b.level, b.micro, b.loss_norm)
            assert [p.tolist() for p in a.packs] == [p.tolist() for p in b.packs]


def test_the_check_samples_fit_one_pack_and_are_supervised():
    records = [{"input_ids": [1] * n, "labels": [-100] * n if n == 7 else [1] * n} for n in (5, 7, 900, 3, 200, 4) * 3]
    picked = check_indices(records, 1024)
    assert len(picked) == 8 and 7 not in [len(records[i]["input_ids"]) for i in picked]
    assert sum(len(records[i]["input_ids"]) for i in picked) <= 1024
    assert max_diff([1.0, 2.0], [1.0, 2.5]) == 0.5 and max_diff([1.0], [1.0, 2.0]) is None


def test_pytest_counts_read_a_cut_off_verbose_log():
    log = (
        "tests/test_a.py::test_x PASSED [ 10%]\n"
        "tests/test_a.py::test_y[bf16] FAILED [ 20%]\n"
        "tests/test_b.py::test_z SKIPPED (needs CUDA) [ 30%]\n"
    )
    counts = pytest_counts(log)
    assert (counts["passed"], counts["failed"], counts["skipped"], counts["error"]) == (1, 1, 1, 0)
    assert counts["failed_tests"] == ["tests/test_a.py::test_y[bf16]"]


def test_the_sp2_part_runs_train_py_on_every_gpu_and_reads_the_level_table(tmp_path):
    """The sp2 part cannot run here (it needs 2 GPUs); its command is train.py's (``python -m
    lit_hbp.cli.command`` did nothing before it had a main guard) and its check reads the table a fit prints."""
    import argparse

    args = argparse.Namespace(gpus=2, demo_dir=tmp_path)
    assert sp2_part(argparse.Namespace(gpus=1, demo_dir=tmp_path), tmp_path).startswith("skipped")
    cmd = sp2_part(args, tmp_path)["cmd"]
    assert cmd[1:3] == ["train.py", "fit"] and "--data.levels=[{pack_len: 16384, sp: 2}]" in cmd
    assert "--trainer.devices=2" in cmd
    printed = (  # the end of `python train.py fit --config configs/tiny_cpu_sp.yaml` with 2 levels, 3 steps
        "  level  pack_len  sp  steps  micro-batches  samples  tokens  seconds  tokens/s\n"
        "      0      2048   1      3              6       98   24555     2.83      8679\n"
        "      1      8192   2      0              0        0       0     0.00         0\n"
        "    all                    3              6       98   24555     2.83      8679\n"
    )
    assert level_steps(printed) == [
        {"level": 0, "pack_len": 2048, "sp": 1, "steps": 3, "tokens_per_s": 8679},
        {"level": 1, "pack_len": 8192, "sp": 2, "steps": 0, "tokens_per_s": 0},
    ]


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ({"input_ids": [1, 2], "labels": [1, 2], "weight": 0.5}, "not ['weight']"),
        ({"input_ids": [1, 2], "labels": [1]}, "same, non-zero length"),
        ({"input_ids": [1, 2], "labels": [-100, 3]}, "labels are the input ids"),
        ({"input_ids": [1, 2], "labels": [1, 2], "attention_mask": [1, 0]}, "without padding"),
    ],
)
def test_peers_refuses_a_record_the_modes_would_read_differently(tmp_path, record, says):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input_ids": [5, 6], "labels": [-100, 6]}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(SystemExit, match=rf"d.jsonl:2: .*{re.escape(says)}"):
        read_records(data)
    data.write_text(json.dumps({"input_ids": [5, 6], "labels": [-100, 6], "attention_mask": [1, 1]}) + "\n")
    assert read_records(data) == [{"input_ids": [5, 6], "labels": [-100, 6]}]


def test_the_gpu_checks_bring_back_at_most_the_eight_files_the_device_returns():
    """The device tool returns at most 8 files from $OUT: bench/gpu_checks.sh writes there no more (its scratch
    logs go to a temporary folder and are gathered at the end), step_profile.py's two included, and every
    script it runs exists."""
    script = (ROOT / "bench" / "gpu_checks.sh").read_text()
    names = set(re.findall(r"\$OUT/([\w.\-]+)", script))
    if re.search(r"step_profile\.py[^\n]*(\\\n[^\n]*)*--out \$OUT\b", script):
        names |= {"profile.txt", "trace.json.gz"}
    assert len(names) <= 8, sorted(names)
    assert {"env.txt", "tests.log", "throughput.log", "profile.txt", "bench.log"} <= names
    for used in set(re.findall(r"python3 (bench/[\w]+\.py)", script)):
        assert (ROOT / used).is_file(), used


@pytest.mark.parametrize("compile_layers", [False, True], ids=["eager", "layers_compiled"])
def test_the_peers_models_run_their_own_attention_and_the_run_keeps_lit_hbps(monkeypatch, compile_layers):
    """HF Trainer's and TRL's rows train a copy of the run's prepared model. A prepared copy took a
    padding-free batch (DataCollatorWithFlattening's restarting positions) for a pack and ran lit-hbp's
    varlen attention inside the peer's step: ``baseline_copy`` undoes the preparation on the copy only. Its
    loss is the family's own (each document alone through the model's eager attention, summed), and its decoder
    layers are compiled as the run's when asked."""
    import copy

    import torch
    from conftest import TINY_LLAMA
    from train_throughput import baseline_copy
    from transformers import DataCollatorWithFlattening

    import lit_hbp.model.attention as attention
    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.model.packed_call import record_of

    torch.manual_seed(0)
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=300)
    module.configure_model()
    reference = copy.deepcopy(module.model)  # outside a pack, a prepared model runs its own attention
    reference.set_attn_implementation("eager")
    ran = []
    real = attention._attend
    monkeypatch.setattr(attention, "_attend", lambda *a, **k: (ran.append(1), real(*a, **k))[1])
    peer = baseline_copy(module.model, "sdpa", compile_layers)
    assert record_of(peer) is None and record_of(module.model) is not None
    compiled = [type(layer).__name__ for layer in peer.model.layers if layer._compiled_call_impl is not None]
    assert len(compiled) == (len(peer.model.layers) if compile_layers else 0)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (7, 12, 5)]
    batch = DataCollatorWithFlattening(return_position_ids=True)([{"input_ids": d, "labels": d} for d in docs])
    loss = peer(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]).loss
    assert not ran, "the peer's padding-free call ran lit-hbp's attention"
    alone = sum(reference(input_ids=torch.tensor([d]), labels=torch.tensor([d])).loss * (len(d) - 1) for d in docs)
    torch.testing.assert_close(loss * sum(len(d) - 1 for d in docs), alone, atol=1e-5, rtol=1e-5)
    module.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
    assert ran, "the run's model lost its preparation"


def test_a_mode_that_fails_is_its_rows_and_the_others_still_measure(capsys):
    """``gpu_throughput.guarded``: a peer mode that cannot run on the machine (a kernel missing, a version
    mismatch) says so in its rows and on stderr, with its traceback; the run goes on."""
    import torch
    from gpu_throughput import guarded, overall

    def broken():
        raise RuntimeError("no kernel for this call")

    assert guarded("hf_flex_attention", broken, torch.device("cpu"), "level 4096") == "failed"
    err = capsys.readouterr().err
    assert "hf_flex_attention level 4096: failed" in err and "RuntimeError: no kernel for this call" in err
    rows = overall({"hbp": {"all": "failed"}, "hf_sdpa": {0: (2.0, 100.0, 1e3)}}, None)
    assert {"name": "all hbp", "tokens_per_s": "failed", "mfu": "", "vs_hf_sdpa": ""} in rows
    assert any(r["name"] == "all hf_sdpa" and r["tokens_per_s"] == "50" for r in rows)


def test_flash_attn_4_travels_in_two_calls_and_installs_whole(tmp_path):
    """flash-attn 4's CuTe DSL library is larger than one device call carries: bench/fa4_wheels.sh cuts its tar.xz
    in two, the gpu_checks part fa4stage keeps the first half on the machine, bench/fa4_install.sh joins both halves
    over the small wheels (a wheel and the library share a folder: both files must be there after)."""
    import lzma
    import shutil
    import tarfile
    import zipfile

    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    for script in ("gpu_checks.sh", "fa4_install.sh"):
        shutil.copy(ROOT / "bench" / script, tree / "bench" / script)
    library = tmp_path / "unpacked"
    (library / "pkg_dsl" / "lib").mkdir(parents=True)
    blob = os.urandom(300_000)  # incompressible: the archive is cut inside a member
    (library / "pkg_dsl" / "lib" / "compiler.so").write_bytes(blob)
    archive = tmp_path / "libs.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(library / "pkg_dsl", arcname="pkg_dsl")
    data = archive.read_bytes()
    (tree / ".whl_fa4" / "a").mkdir(parents=True)
    (tree / ".whl_fa4" / "b").mkdir(parents=True)
    (tree / ".whl_fa4" / "a" / "libs.tar.xz.00").write_bytes(data[:200_000])
    (tree / ".whl_fa4" / "b" / "libs.tar.xz.01").write_bytes(data[200_000:])
    wheel = tree / ".whl_fa4" / "b" / "pkg_dsl-1.0-py3-none-any.whl"
    files = {
        "pkg_dsl/__init__.py": "VERSION = '1.0'\n",
        # as nvidia-cutlass-dsl: the package users import sits in a folder that a .pth file puts on sys.path
        "pkg_dsl/dsl_packages/dslmod/__init__.py": "NAME = 'dslmod'\n",
        "pkg_dsl_packages.pth": "import sys, os, pkg_dsl; "
        "sys.path.insert(0, os.path.join(pkg_dsl.__path__[0], 'dsl_packages'))\n",
        "pkg_dsl-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: pkg-dsl\nVersion: 1.0\n",
        "pkg_dsl-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "pkg_dsl-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in {**files, "pkg_dsl-1.0.dist-info/RECORD": record}.items():
            zf.writestr(name, text)
    assert lzma.decompress(data)  # the two halves are one archive, not two

    env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    (tmp_path / "out").mkdir()
    staged = subprocess.run(
        ["bash", "bench/gpu_checks.sh", "fa4stage"], cwd=tree, env=env, capture_output=True, text=True
    )
    assert staged.returncode == 0, staged.stderr
    assert (tree / ".fa4_stage" / "libs.tar.xz.00").read_bytes() == data[:200_000]
    shutil.rmtree(tree / ".whl_fa4" / "a")  # the second call carries b/ alone
    target = tmp_path / "site"
    done = subprocess.run(
        ["bash", "bench/fa4_install.sh", str(target)], cwd=tree, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert (target / "pkg_dsl" / "__init__.py").is_file()  # the wheel's file and the library's, side by side
    assert (target / "pkg_dsl" / "lib" / "compiler.so").read_bytes() == blob
    # a PYTHONPATH folder runs no .pth file: the folders it adds are in .pythonpath for gpu_checks.sh's fa4 part
    pythonpath = (target / ".pythonpath").read_text().strip()
    imported = subprocess.run(
        [sys.executable, "-S", "-c", "import dslmod, pkg_dsl; print(dslmod.NAME, pkg_dsl.VERSION)"],
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
    )
    assert imported.stdout.split() == ["dslmod", "1.0"], imported.stderr
    assert "$(cat /tmp/site_fa4/.pythonpath)" in (ROOT / "bench" / "gpu_checks.sh").read_text()
    shutil.rmtree(tree / ".fa4_stage")
    missing = subprocess.run(
        ["bash", "bench/fa4_install.sh", str(target)], cwd=tree, env=env, capture_output=True, text=True
    )
    assert missing.returncode == 3 and "run the fa4stage part first" in missing.stderr
