"""What a ``lit-hbp fit`` process costs outside its training: the command line's entry (``train.py``, the
console script, every rank Lightning's launcher or torchrun starts) beside the same run through
``lit_hbp.cli.app.main`` called without the entry's heap handling (``cli.command.heap_left_alone``).

    python bench/cli_start.py [--rounds 5] [--steps 2] [--demo-dir DIR]

Both modes run ``configs/tiny_cpu.yaml`` for ``--steps`` optimizer steps in one process (no self-check, no
progress bar) on the same demo data, each round once in turn, in a fresh folder each (so each tokenizes
the same way); the figure is each mode's median wall-clock seconds from start to exit, and their ratio.
Also printed: the seconds Python's cyclic garbage collector took in each mode's process (its ``gc``
callbacks, reported by a ``sitecustomize`` put on its path).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GC_TIMER = """
import atexit, gc, json, os, time
_spent, _start = [0.0], [0.0]
def _time(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        _spent[0] += time.perf_counter() - _start[0]
gc.callbacks.append(_time)
def _report():
    with open(os.environ["GC_SECONDS"], "w") as f:
        json.dump(_spent[0], f)
atexit.register(_report)
"""

MODES = {
    "entry": [str(ROOT / "train.py")],
    "app": ["-c", "import sys; from lit_hbp.cli.app import main; main()"],
}


def run_once(mode: str, demo: Path, steps: int, work: Path) -> tuple[float, float]:
    folder = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=work))
    (folder / "demo_data").symlink_to(demo)
    site = folder / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(GC_TIMER)
    gc_file = folder / "gc.json"
    args = ["fit", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--trainer.max_steps", str(steps),
            "--trainer.enable_progress_bar", "false", "--model.self_check", "false"]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "GC_SECONDS": str(gc_file),
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    start = time.perf_counter()
    out = subprocess.run([sys.executable, *MODES[mode], *args], cwd=folder, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{mode} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return seconds, json.loads(gc_file.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--demo-dir", default=str(ROOT / "demo_data"), help="built when missing")
    args = p.parse_args(argv)
    from lit_hbp.demo.text import ensure_demo

    ensure_demo(args.demo_dir)
    demo = Path(args.demo_dir).resolve()
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            for mode in list(MODES)[r % 2 :] + list(MODES)[: r % 2]:
                times[mode].append(run_once(mode, demo, args.steps, Path(work)))
    med = {m: statistics.median(s for s, _ in t) for m, t in times.items()}
    print(f"tiny_cpu.yaml, {args.steps} optimizer steps in one process, {args.rounds} rounds (median wall s)")
    for mode, t in times.items():
        gcs = statistics.median(g for _, g in t)
        print(f"  {mode:<6} {med[mode]:6.2f} s   gc {gcs:5.2f} s   rounds {', '.join(f'{s:.2f}' for s, _ in t)}")
    print(f"  entry / app: {med['entry'] / med['app']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
