"""`python -m lit_hbp.packing`: the command users run on their own lengths."""

import re
import subprocess
import sys

import numpy as np
import pytest

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


def test_every_tool_refuses_a_lengths_file_it_cannot_plan_with_one_line(tmp_path, capsys):
    """The level search read a lengths ``.npy`` unchecked: a negative or fractional length chose levels (exit 0,
    "longest 5,000 tokens" for 5000.9), a 2-D array ended in an IndexError traceback, an empty file in numpy's
    "zero-size array" words. Each tool now says what is wrong with which file, exit status 2."""
    from lit_hbp.autoselect.__main__ import main as autoselect_main
    from lit_hbp.simulate.__main__ import main as simulate_main

    config = tmp_path / "train.yaml"
    config.write_text("model:\n  model:\n    model_type: llama\n    hidden_size: 64\n    num_hidden_layers: 2\n")
    bad = {"neg.npy": np.array([100, -5]), "frac.npy": np.array([100.0, 5000.9]), "flat.npy": np.ones((2, 3))}
    for name, value in bad.items():
        np.save(tmp_path / name, value)
    (tmp_path / "empty.txt").write_text("\n")
    says = {
        "neg.npy": "must be >= 0: negative at index 1 = -5",
        "frac.npy": "must be integers: index 1 = 5000.9",
        "flat.npy": "must be a 1-D array of token counts, got shape (2, 3)",
        "empty.txt": "holds no sample lengths",
    }
    tools = {
        "packing": lambda path: main([path, "--levels", "1024", "--world", "1"]),
        "simulate": lambda path: simulate_main([path, "--no-auto", "--levels", "1024:1", "--gpus", "1"]),
        "autoselect": lambda path: autoselect_main(["--config", str(config), "--lengths", path, "--analytic"]),
    }
    for tool, run in tools.items():
        for name, said in says.items():
            assert run(str(tmp_path / name)) == 2, (tool, name)
            err = capsys.readouterr().err
            assert f"{tmp_path / name}" in err and said in err and "Traceback" not in err, (tool, name, err)


def test_every_tool_refuses_a_folder_or_a_file_of_neither_lengths_form_naming_it(tmp_path, capsys):
    """A folder as the lengths file ended in an IsADirectoryError traceback (exit 1); an .npz or a text file not
    in UTF-8 in ``error: 'utf-8' codec can't decode byte ...``, naming neither the file nor what it should be; an
    .npy numpy cannot read in numpy's words (no file, and advice to unpickle it). Each tool now names the path and
    the two forms a lengths file takes, exit status 2."""
    from lit_hbp.simulate.__main__ import main as simulate_main

    (tmp_path / "adir").mkdir()
    (tmp_path / "latin.txt").write_bytes(b"12\n\xff\xfe\n")
    np.savez(tmp_path / "z.npz", a=np.arange(3))
    (tmp_path / "text.npy").write_text("12\n")
    (tmp_path / "empty.npy").write_bytes(b"")  # numpy's EOFError: a traceback
    says = {
        "empty.npy": ": not a .npy array of lengths that numpy reads without pickle",
        "adir": " is a folder, not a lengths file (.npy, or one integer a line)",
        "latin.txt": ": not a text file of lengths (.npy, or one integer a line)",
        "z.npz": ": not a text file of lengths (.npy, or one integer a line)",
        "text.npy": ": not a .npy array of lengths that numpy reads without pickle",
    }
    tools = {
        "packing": lambda path: main([path, "--levels", "1024", "--world", "1"]),
        "simulate": lambda path: simulate_main([path, "--no-auto", "--levels", "1024:1", "--gpus", "1"]),
    }
    for tool, run in tools.items():
        for name, said in says.items():
            assert run(str(tmp_path / name)) == 2, (tool, name)
            err = capsys.readouterr().err
            assert err == f"error: {tmp_path / name}{said}\n", (tool, name, err)


def test_a_bad_level_spec_is_refused_with_its_reason(tmp_path, capsys):
    """``--levels 1024:1:0:0`` said only ``invalid parse value: '1024:1:0:0'`` (argparse drops a ``type``'s
    ValueError message); it now says what ``Level`` says, as ``python -m lit_hbp.simulate`` does for the same spec."""
    path = tmp_path / "l.npy"
    np.save(path, np.arange(1, 200))
    for spec, reason in {
        "1024:1:0:0": "Level.packs_per_rank must be >= 1, got 0",
        "1024:x": "bad level spec '1024:x': 'x' is not a non-negative integer",
    }.items():
        with pytest.raises(SystemExit) as stop:
            main([str(path), "--levels", spec, "--world", "1"])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err == f"python -m lit_hbp.packing: error: argument --levels: {reason}", err
