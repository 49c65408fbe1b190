"""The built wheel ships every subpackage (lit_hbp.callbacks, whose folder the checkout also shows at
its top level) and imports outside the source tree and, installed, from the checkout's root."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_callbacks_as_lit_hbp_callbacks(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(dist)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("lit_hbp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lit_hbp/callbacks/__init__.py" in names
    modules = ("packing/plan.py", "autoselect/search.py", "simulate/plots.py", "strategy.py", "costmodel.py")
    modules += ("attention/backends.py", "selfcheck.py", "causal_lm.py", "model_spec.py", "export.py", "meter.py")
    for module in modules:
        assert f"lit_hbp/{module}" in names, module
    assert not any(n.startswith("callbacks/") for n in names), "callbacks must live under lit_hbp/"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = "import lit_hbp.callbacks, lit_hbp.packing; print(lit_hbp.callbacks.__file__)"
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(site)), out.stdout
    # A plain install used from the checkout's root (train.py's folder), whose lit_hbp/ comes first.
    code = "from lit_hbp.callbacks import HBPCurriculum, HBPExport, HBPThroughputMonitor, PackingMetrics"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
