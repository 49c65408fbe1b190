"""The built wheel ships `callbacks/` as `lit_hbp.callbacks` and imports outside the source tree."""

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
    for module in ("packing/plan.py", "autoselect/search.py", "simulate/plots.py", "strategy.py", "costmodel.py"):
        assert f"lit_hbp/{module}" in names, module
    assert not any(n.startswith("callbacks/") for n in names), "callbacks must live under lit_hbp/"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = "import lit_hbp.callbacks, lit_hbp.packing; print(lit_hbp.callbacks.__file__)"
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(site)), out.stdout
