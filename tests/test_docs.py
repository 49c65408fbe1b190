# ruff: noqa: E501  (the table of commands keeps each test id on its line)
"""The README and the guides say what runs: every command they show is run by a test (named here,
and checked to exist) or says why it cannot run here (``# needs ...``); the cheap ones run here;
every link points to a file; the README stays short (a newcomer reads it in minutes)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG_S, NARROW, console_script

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 12_000
STARTS = ("python", "lit-hbp", "torchrun", "srun", "pip", "tensorboard", "bash")
# A command shown in the docs (its start) -> the test that runs it (with fewer steps where it trains).
RUN_BY = {
    "python3 -m venv .venv": ".ci/run",  # CI installs from nothing, as the README's set-up says
    "pip install torch==2.13.0": ".ci/run",
    "python -m pytest -q -n 2 --dist worksteal": ".ci/run",
    "python train.py fit --config configs/tiny_cpu.yaml": "tests/test_train.py::test_tiny_config_trains_and_logs",
    "python -m lit_hbp.export runs/": "tests/test_train.py::test_tiny_2d_config_trains_ulysses_x_cp_on_four_processes",
    "python -c": "tests/test_serving.py::test_a_fine_tuned_folder_exports_from_the_checkpoint_alone_and_stops_at_the_end_of_its_turn",
    "lit-hbp fit --config configs/own_model_cpu.yaml": "tests/test_pretrained.py::test_the_own_model_line_fine_tunes_a_4k_context_folder",
    "lit-hbp preview --config configs/tiny_cpu.yaml --n 2": "tests/test_docs.py::test_the_preview_command_of_the_guide",
    "lit-hbp preview --config my.yaml --json": "tests/test_chat_formats.py::test_the_console_script_previews_and_refuses_like_fit",
    "python -m lit_hbp.packing": "tests/test_packing_cli.py::test_module_entry_point_runs",
    "python -m lit_hbp.autoselect --config configs/llama3_8b_32gpu.yaml --analytic": "tests/test_autoselect.py::test_autoselect_command_writes_the_levels_block",
    "python -m lit_hbp.simulate": "tests/test_simulate.py::test_simulate_command_prints_the_table_and_writes_pictures",
    "lit-hbp fit --config configs/tiny_vlm_cpu.yaml": "tests/test_vision_data.py::test_the_tiny_vlm_config_trains_and_exports_a_folder_that_answers_from_an_image",
    "python train.py fit --config configs/tiny_cpu_sp.yaml": "tests/test_train.py::test_tiny_sp_config_trains_on_two_processes",
    "torchrun --standalone --nproc_per_node 2 train.py fit": "tests/test_docs.py::test_the_torchrun_line_of_the_cluster_guide",
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2": "tests/test_train.py::test_tiny_2d_config_trains_ulysses_x_cp_on_four_processes",
    "python examples/own_project/train.py": "tests/test_own_project.py::test_the_projects_script_runs_on_two_processes",
    'pip install -e ".[bench]"': ".ci/run",  # the dev extra CI installs holds the bench extra
    "python bench/peers.py": "tests/test_gpu_proof.py::test_the_gpu_proof_dry_run_runs_every_part_and_writes_its_results",
    "bash bench/gpu_proof.sh --dry-run": "tests/test_gpu_proof.py::test_the_gpu_proof_dry_run_runs_every_part_and_writes_its_results",
}  # fmt: skip


def bash_commands(path: Path) -> list[str]:
    """The command lines of a document's ```bash blocks (a fence closes only at a line's start;
    continued lines joined)."""
    out, inside, pending = [], False, ""
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash" if not inside else False
            continue
        if not inside:
            continue
        text = pending + line.strip()
        if text.endswith("\\"):
            pending = text[:-1] + " "
            continue
        pending = ""
        if text.startswith(STARTS):
            out.append(text)
    return out


def test_every_command_of_the_docs_is_run_by_a_test_or_says_why_not():
    seen = set()
    for doc in DOCS:
        for command in bash_commands(doc):
            if re.search(r"#\s*needs ", command):
                continue
            owner = [key for key in RUN_BY if command.startswith(key)]
            assert owner, f"{doc.name}: no test runs `{command}` (add it to RUN_BY, or say why not: # needs ...)"
            seen.update(owner)
    assert seen == set(RUN_BY), f"RUN_BY lists commands no document shows: {sorted(set(RUN_BY) - seen)}"
    tests = next(key for key in RUN_BY if key.startswith("python -m pytest"))
    assert f"\n{tests}\n" in (ROOT / ".ci/run").read_text(), f"CI runs the README's tests as it shows them: {tests}"
    for where in set(RUN_BY.values()):
        path, _, name = where.partition("::")
        assert (ROOT / path).is_file(), where
        assert not name or re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), where


def test_the_readme_is_short_and_every_link_resolves():
    assert len((ROOT / "README.md").read_text()) <= README_LIMIT
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name}: link to {target} goes nowhere"


@pytest.mark.slow
def test_the_preview_command_of_the_guide(tmp_path, small_demo):
    """``lit-hbp preview --config configs/tiny_cpu.yaml --n 2`` as docs/data.md shows it."""
    (tmp_path / "demo_data").symlink_to(small_demo)
    script = console_script("lit-hbp")
    out = subprocess.run([str(script), "preview", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--n", "2"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("━━ sample ") == 2 and "⟦" in out.stdout and "<|assistant|>" in out.stdout


@pytest.mark.slow
def test_the_torchrun_line_of_the_cluster_guide(tmp_path, small_demo):
    """``torchrun --standalone --nproc_per_node 2 train.py fit --config configs/tiny_cpu_sp.yaml``:
    Lightning inside sees the external launch, and the sp 2 level runs on the two processes: in the self-check
    (the step trained is the curriculum's warm-up at 2048 tokens, sp 1)."""
    (tmp_path / "demo_data").symlink_to(small_demo)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(ROOT / "train.py"),
         "fit", "--config", str(ROOT / "configs/tiny_cpu_sp.yaml"), "--trainer.max_steps", "1",
         "--trainer.enable_progress_bar", "false", *NARROW],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "HBPStrategy levels: 2048 tokens sp 1 ckpt 0, 8192 tokens sp 2 ckpt 2" in out.stderr + out.stdout
    assert re.search(r"self-check passed \(a pack equals its documents alone\): sp 1: .*, sp 2: loss ", out.stderr), (
        out.stderr[-3000:]
    )
    assert "`Trainer.fit` stopped: `max_steps=1` reached." in out.stderr + out.stdout
