"""The supported range, as pyproject.toml states it: no Lightning below 2.6.6 (the credential-stealing 2.6.2
and 2.6.3, the checkpoint code execution fixed in 2.6.6), torch from 2.10 (the weights-only unpickler's
memory corruption) through the newest release the index serves (2.14.1), every bound with its reason, the
Python versions the classifiers name; the environment running the tests is inside it; the GPU proof keeps
the image's torch and checks the image against the pins."""

import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REQUIRES = {Requirement(r).name: Requirement(r) for r in PROJECT["dependencies"]}


@pytest.mark.parametrize(
    "package, allowed, refused",
    [
        ("lightning", ["2.6.6", "2.6.7"], ["2.6.0", "2.6.2", "2.6.3", "2.6.5", "2.5.5", "2.7.0"]),
        ("torch", ["2.10.0", "2.11.0", "2.13.0", "2.14.0", "2.14.1", "2.15.0"], ["2.6.0", "2.8.0", "2.9.1"]),
        ("transformers", ["5.10.0", "5.17.0", "5.24.0", "5.25.0"], ["5.0.0", "5.2.0", "5.9.0", "5.26.0"]),
        ("deepspeed", ["0.19.2", "0.19.8"], ["0.19.0", "0.19.1", "0.20.0"]),
        ("pyarrow", ["23.0.1", "26.0.1"], ["15.0.0", "23.0.0"]),
        ("jinja2", ["3.1.6"], ["3.1.4", "3.1.5"]),
        ("pillow", ["11.3.0", "13.0.0"], ["10.2.0", "11.2.1"]),
    ],
)
def test_the_pins_allow_and_refuse_what_the_advisories_and_tests_say(package, allowed, refused):
    spec = REQUIRES[package].specifier
    assert [v for v in allowed if not spec.contains(v)] == [], spec
    assert [v for v in refused if spec.contains(v)] == [], spec


def test_every_bound_says_why():
    """A dependency with a bound past ``>=X`` for a floor nobody doubts has a comment above it naming the
    advisory, defect or test behind it (``numpy>=1.26`` and such, plain floors, need none)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = text[text.index("dependencies = [") : text.index("]\n", text.index("dependencies = ["))]
    comment = False
    for line in block.splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            comment = True
            continue
        name = Requirement(stripped.strip('",')).name
        spec = REQUIRES[name].specifier
        bounded = any(s.operator in ("<", "<=", "==", "~=") for s in spec)
        reasoned = ("torch", "lightning", "transformers", "deepspeed", "pyarrow", "jinja2", "pyyaml", "pillow")
        if bounded or name in reasoned:
            assert comment, f"{name}: its bounds {spec} need a comment saying why"
        comment = False


def test_python_versions_tested_are_the_classifiers_and_requires_python():
    classified = sorted(c.rsplit(" ", 1)[-1] for c in PROJECT["classifiers"] if re.search(r":: 3\.\d+$", c))
    assert classified == ["3.11", "3.12", "3.13"]
    requires = SpecifierSet(PROJECT["requires-python"])
    assert all(requires.contains(f"{v}.0") for v in classified) and not requires.contains("3.10.0")
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in classified, "tests run on an untested Python"


def test_this_environment_is_inside_the_pins():
    outside = []
    for name, req in REQUIRES.items():
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            outside.append(f"{name} missing")
            continue
        if not req.specifier.contains(version.split("+")[0], prereleases=True):
            outside.append(f"{name} {version} not in {req.specifier}")
    assert outside == []


def proof_copy(tmp_path: Path, pyproject: str | None = None) -> Path:
    """The GPU proof's launcher and pyproject.toml in a folder of their own (bench/gpu_proof.py absent:
    only what runs before it is exercised)."""
    (tmp_path / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "bench/gpu_proof.sh", tmp_path / "bench/gpu_proof.sh")
    (tmp_path / "pyproject.toml").write_text(pyproject or (ROOT / "pyproject.toml").read_text())
    return tmp_path


def run_proof(folder: Path) -> subprocess.CompletedProcess:
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable}
    return subprocess.run(["bash", "bench/gpu_proof.sh"], cwd=folder, env=env, capture_output=True, text=True)


@pytest.mark.parametrize("wheel", ["torch-2.15.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                                   "nvidia_cublas_cu12-12.8.4.1-py3-none-manylinux_2_27_x86_64.whl",
                                   "triton-3.5.0-cp312-cp312-manylinux_2_27_x86_64.whl"])  # fmt: skip
def test_the_gpu_proof_installs_nothing_that_replaces_the_images_torch(tmp_path, wheel):
    folder = proof_copy(tmp_path)
    (folder / ".whl").mkdir()
    (folder / ".whl" / wheel).write_bytes(b"")
    run = run_proof(folder)
    assert run.returncode == 3, run.stderr
    assert f".whl/{wheel} would replace the image's torch or its CUDA libraries" in run.stderr


@pytest.mark.slow
def test_the_gpu_proof_names_an_installed_package_outside_the_pins(tmp_path):
    text = (ROOT / "pyproject.toml").read_text().replace('"lightning>=2.6.6,<2.7"', '"lightning>=99"')
    run = run_proof(proof_copy(tmp_path, text))
    assert run.returncode == 3, run.stderr
    assert f"lightning {metadata.version('lightning')} (lit-hbp needs >=99)" in run.stderr, run.stderr
    run = run_proof(proof_copy(tmp_path / "ok"))
    assert "every installed dependency within lit-hbp's pins" in run.stdout, run.stdout + run.stderr
