"""A run leaves the checkout as it found it: whatever ``train.py fit`` writes (the resolved config,
checkpoints, logs, the data report, the token cache, the demo data) lands in git-ignored folders, with
a logger and without one. Checked in a git repository with the checkout's own .gitignore."""

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import NARROW, SHORTER

from lit_hbp.cli.app import main

ROOT = Path(__file__).resolve().parents[1]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
@pytest.mark.parametrize("logger", ["true", "false"])
def test_the_main_job_leaves_git_status_clean(logger, tmp_path, small_demo, monkeypatch):
    repo = tmp_path / "checkout"
    repo.mkdir()
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")
    git(repo, "init", "-q")
    git(repo, "add", ".gitignore")
    git(repo, "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-q", "-m", "checkout")
    shutil.copytree(small_demo, repo / "demo_data")
    monkeypatch.chdir(repo)
    args = ["fit", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--trainer.max_steps", "2",
            "--trainer.enable_progress_bar", "false", "--trainer.logger", logger, *NARROW, *SHORTER]  # fmt: skip
    main(args)
    if logger == "true":  # the README's export line: its output folder (runs/tiny_hf) is git-ignored too
        from lit_hbp.export import main as export

        (ckpt,) = repo.rglob("last.ckpt")
        assert export([str(ckpt.relative_to(repo)), "runs/tiny_hf"]) == 0
        assert (repo / "runs/tiny_hf/config.json").is_file()
    assert git(repo, "status", "--porcelain", "--untracked-files=all") == ""
    written = {p.relative_to(repo).parts[0] for p in repo.rglob("*") if ".git" not in p.parts}
    assert written == {".gitignore", "demo_data", "data_cache", "runs"}, written
    if logger == "false":
        assert (repo / "runs" / "config.yaml").is_file() and (repo / "runs" / "checkpoints" / "last.ckpt").is_file()
