"""The built wheel ships every subpackage (lit_hbp.callbacks, whose folder the checkout also shows at
its top level) and imports outside the source tree and, installed, from the checkout's root."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import console_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_ships_callbacks_as_lit_hbp_callbacks(tmp_path):
    # Built from a copy of the sources the wheel needs: setuptools builds in the source's build/ folder and
    # keeps what an earlier build left there (a module deleted or moved since would still ship).
    source = tmp_path / "source"
    shutil.copytree(ROOT / "lit_hbp", source / "lit_hbp", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(dist)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("lit_hbp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lit_hbp/callbacks/__init__.py" in names
    assert not any(n.startswith("callbacks/") for n in names), "callbacks must live under lit_hbp/"
    # Every module of the source tree ships (pyproject.toml lists the subpackages by name), and nothing else.
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "lit_hbp").rglob("*.py")}
    assert {n for n in names if n.endswith(".py")} == modules
    assert "lit_hbp/demo/corpus/stdlib.json.gz" in names  # the demo's corpus (package data)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = "import lit_hbp.callbacks, lit_hbp.packing; print(lit_hbp.callbacks.__file__)"
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(site)), out.stdout
    # The installed package reads the demo's corpus from its own folder.
    code = "from lit_hbp.demo import text; print(len(text._load_modules()), text._corpus_file())"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["448", str(site / "lit_hbp/demo/corpus/stdlib.json.gz")], out.stdout
    # A plain install used from the checkout's root (train.py's folder), whose lit_hbp/ comes first.
    code = "from lit_hbp.callbacks import HBPCurriculum, HBPExport, HBPThroughputMonitor, PackingMetrics"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_console_script_runs_the_cli(tmp_path):
    """``pip install`` puts ``lit-hbp`` in the environment's scripts folder (declared in the wheel's entry points);
    it is the CLI: its help lists the subcommands, and a user's mistake ends with exit status 2."""
    script = console_script("lit-hbp")  # pip install -e . installs it
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert all(f"  {name} " in out.stdout for name in ("fit", "validate", "preview")), out.stdout
    assert not any(f"  {name} " in out.stdout for name in ("test", "predict")), out.stdout  # HBPLitModule has neither
    out = subprocess.run([str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2 and "usage: lit-hbp SUBCOMMAND" in out.stderr, out.stderr
    out = subprocess.run([str(script), "test", "--config", "x.yaml"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("error: no 'test' subcommand: HBPLitModule has no test loop")
    missing = tmp_path / "my_modle"
    (tmp_path / "my_model").mkdir()
    config = ROOT / "configs" / "tiny_cpu.yaml"
    out = subprocess.run([str(script), "fit", "--config", str(config), "--model.model", str(missing)],
                         capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert f"'{missing}' is neither a checkpoint folder (did you mean 'my_model'?)" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "demo_data").exists() and not (tmp_path / "data_cache").exists()  # nothing built first


def test_the_help_imports_nothing_heavy():
    """``lit-hbp --help`` answers without importing torch, Lightning or transformers (seconds on a busy
    machine); a subcommand's own ``--help`` is LightningCLI's."""
    code = (
        "import sys\nfrom lit_hbp.cli.command import entry_point\ntry:\n    entry_point(['--help'])\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lightning', 'transformers', 'numpy'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[]"), out.stdout[-300:]
    # python -m lit_hbp.cli.command is the console script too (it returned at once, doing nothing, before)
    out = subprocess.run([sys.executable, "-m", "lit_hbp.cli.command"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "preview" in out.stderr, out.stderr[-500:]


HEAP = """
import gc
from lit_hbp.cli.command import heap_left_alone

before = gc.get_freeze_count()
with heap_left_alone():
    off = not gc.isenabled()
    import lit_hbp.cli.app
frozen = gc.get_freeze_count()
cycle = []
cycle.append(cycle)
del cycle
print(off, gc.isenabled(), before, frozen, gc.collect())
"""


def test_the_entry_imports_with_the_collector_off_and_leaves_what_they_built_frozen():
    """``cli.command.heap_left_alone`` (every rank's ``lit-hbp`` process): the imports run without the cyclic
    collector, whose walks over their objects took about 2 s of a process (bench/RESULTS.md); after them it is
    on again, for the run's own garbage, and never walks the frozen import heap."""
    out = subprocess.run([sys.executable, "-c", HEAP], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    off, on, before, frozen, collected = out.stdout.split()
    assert off == on == "True" and before == "0" and int(frozen) > 100_000, out.stdout
    assert int(collected) >= 1, "a cycle made after the imports is collected"


def test_public_names_import():
    import lit_hbp

    for name in lit_hbp.__all__:
        assert getattr(lit_hbp, name) is not None, name
    assert lit_hbp.PackedBatch.__name__ == "PackedBatch" and issubclass(lit_hbp.DataError, lit_hbp.UserInputError)
