"""`python -m lit_hbp.packing`: the command users run on their own lengths."""

import re
import subprocess
import sys

import numpy as np

from lit_hbp.packing.__main__ import main


def test_cli_prints_hbp_and_naive_metrics(tmp_path, capsys):
    rng = np.random.default_rng(0)
    lengths = np.r_[rng.integers(10, 1000, 3000), rng.integers(1000, 8000, 40)]
    path = tmp_path / "lengths.npy"
    np.save(path, lengths)
    assert main([str(path), "--levels", "1024:1", "8192:4", "--world", "8"]) == 0
    out = capsys.readouterr().out
    for row in ("HBP", "hierarchical, no balance sort", "naive isf 8192 sp4"):
        assert row in out
    assert "plan: 3040 samples, 3040 packed" in out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("plan ") and "dbr" in line)
    table = [re.split(r"\s{2,}", line.strip()) for line in lines[start:]]
    header = table[0]
    rows = {r[0]: dict(zip(header, r)) for r in table[2:]}
    hbp, naive = rows["HBP"], rows["naive isf 8192 sp4"]
    assert float(hbp["abr"]) < float(naive["abr"])
    assert float(hbp["cr"]) < float(naive["cr"]) == 1.0


def test_cli_reads_text_files_and_reports_bad_lines(tmp_path, capsys):
    good = tmp_path / "ok.txt"
    good.write_text("\n".join(str(x) for x in [100, 200, 300, 5000]) + "\n")
    assert main([str(good), "--levels", "512", "8K:2", "--world", "2"]) == 0
    bad = tmp_path / "bad.txt"
    bad.write_text("100\n2x0\n")
    assert main([str(bad), "--levels", "512", "--world", "2"]) == 2
    assert f"{bad}:2: not an integer length: '2x0'" in capsys.readouterr().err


def test_cli_reports_over_length_samples(tmp_path, capsys):
    path = tmp_path / "l.npy"
    np.save(path, np.array([10, 20, 5000]))
    assert main([str(path), "--levels", "1024", "--world", "1"]) == 2
    assert "1 sample(s) longer than the largest level (1024 tokens): index 2 = 5000" in capsys.readouterr().err
    assert main([str(path), "--levels", "1024", "--world", "1", "--over-length", "drop"]) == 0
    assert "1 sample(s) dropped (over length): index 2 = 5000" in capsys.readouterr().out


def test_module_entry_point_runs(tmp_path):
    path = tmp_path / "l.npy"
    np.save(path, np.arange(1, 500))
    out = subprocess.run(
        [sys.executable, "-m", "lit_hbp.packing", str(path), "--levels", "512:1", "--world", "4"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "naive isf 512 sp1" in out.stdout
