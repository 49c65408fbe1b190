"""Backend choice against flash-attn installs as pip lays them out, built on disk: the upstream package
layouts, kernel signatures and ``*.dist-info`` folders of flash-attn 2.8.3 (with its preview
``flash_attn/cute/`` that needs the uninstalled ``cutlass``), flash-attn 3 (hopper build), flash-attn 4
(``flash-attn-4``) and broken builds, on a faked CUDA GPU. The choice must never crash a run."""

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lit_hbp import attention
from lit_hbp.attention import backends
from lit_hbp.attention.backends import REGISTRY, AttnArgs, choose

FAKE_TOPS = ("flash_attn", "flash_attn_interface", "cutlass")
KERNEL_BODY = "    import torch\n\n    return torch.zeros_like(q)\n"

FA2_INTERFACE = (
    "def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,\n"
    "        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,\n"
    "        deterministic=False, return_attn_probs=False, block_table=None):\n" + KERNEL_BODY
)
FA3_INTERFACE = (
    "def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,\n"
    "        seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,\n"
    "        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,\n"
    "        deterministic=False, sm_margin=0):\n" + KERNEL_BODY
)
FA4_INTERFACE = (
    "def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,\n"
    "        max_seqlen_k=None, seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False,\n"
    "        softcap=0.0, window_size=(None, None), learnable_sink=None, num_splits=1, pack_gqa=None):\n"
    "    import torch\n\n    return torch.zeros_like(q), None\n\n\n"
    "def flash_attn_func(q, k, v, softmax_scale=None, causal=False, softcap=0.0, window_size=(None, None)):\n"
    "    return flash_attn_varlen_func(q, k, v)\n"
)
CUTE_INIT = "import cutlass.cute as cute\n\nfrom .interface import flash_attn_func, flash_attn_varlen_func\n"
FA_CUTE = {"flash_attn/cute/__init__.py": CUTE_INIT, "flash_attn/cute/interface.py": FA4_INTERFACE}
UNDEFINED_SYMBOL = "flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDeviceEi"


def counted(text: str) -> str:
    """Module source that first records its import in ``imports.log`` beside the site folder."""
    return (
        f"with open(__file__.split('/site/')[0] + '/imports.log', 'a') as _f:\n    _f.write(__name__ + '\\n')\n{text}"
    )


# (distribution name, version, {path: source}) as each wheel installs them.
INSTALLS = {
    "flash-attn 2.8.3": (
        "flash_attn",
        "2.8.3",
        {
            "flash_attn/__init__.py": counted(
                '__version__ = "2.8.3"\n\nfrom flash_attn.flash_attn_interface import flash_attn_varlen_func\n'
            ),
            "flash_attn/flash_attn_interface.py": FA2_INTERFACE,
            **FA_CUTE,
        },
    ),
    "flash-attn 3": ("flash_attn_3", "3.0.0b1", {"flash_attn_interface.py": counted(FA3_INTERFACE)}),
    "flash-attn 4": ("flash-attn-4", "4.0.0b4", FA_CUTE),
    "cutlass": ("nvidia-cutlass-dsl", "4.2.1", {"cutlass/__init__.py": "", "cutlass/cute.py": ""}),
    "broken flash-attn 2": (
        "flash_attn",
        "2.7.4.post1",
        {
            "flash_attn/__init__.py": counted(f"raise ImportError({UNDEFINED_SYMBOL!r})"),
        },
    ),
    "broken flash-attn 3": (
        "flash_attn_3",
        "3.0.0b1",
        {"flash_attn_interface.py": counted("raise OSError('libcudart.so.13: cannot open shared object file')")},
    ),
}


def install(site: Path, *names: str) -> None:
    """Write the packages and a dist-info (METADATA, RECORD, top_level.txt) per distribution."""
    for key in names:
        dist, version, files = INSTALLS[key]
        for path, text in files.items():
            (site / path).parent.mkdir(parents=True, exist_ok=True)
            (site / path).write_text(text)
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "RECORD").write_text("".join(f"{path},,\n" for path in files))
        (info / "top_level.txt").write_text(
            "\n".join(sorted({path.split("/")[0].removesuffix(".py") for path in files}))
        )


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty site folder on sys.path; the fake modules and the probe verdicts are forgotten after."""
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    backends._probe.cache_clear()
    attention.set_backend("auto")
    yield path
    for name in [m for m in sys.modules if m.split(".")[0] in FAKE_TOPS]:
        del sys.modules[name]
    backends._probe.cache_clear()
    attention.set_backend("auto")


def fake_gpu(monkeypatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def imports(site: Path) -> list[str]:
    log = site.parent / "imports.log"
    return log.read_text().split() if log.exists() else []


def first_forward(name: str) -> None:
    """The chosen backend's kernel adapter runs (the fakes return zeros) and keeps the layout."""
    q = torch.randn(1, 4, 10, 8, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, 2, 10, 8, dtype=torch.bfloat16)
    args = AttnArgs(torch.tensor([0, 3, 10], dtype=torch.int32), 7, 8**-0.5)
    assert REGISTRY[name].run(q, k, v, args).shape == q.shape


@pytest.mark.parametrize(
    "installed, expected",
    [
        (("flash-attn 2.8.3",), "flash_attn"),
        ((), "torch_varlen"),
        (("flash-attn 2.8.3", "flash-attn 3"), "flash_attn_3"),
        (("flash-attn 2.8.3", "cutlass"), "flash_attn_4"),
        (("flash-attn 4", "cutlass"), "flash_attn_4"),  # its dependency nvidia-cutlass-dsl comes along
    ],
)
def test_what_pip_installs_is_chosen_on_a_hopper_without_crashing(monkeypatch, site, installed, expected):
    install(site, *installed)
    fake_gpu(monkeypatch, (9, 0))
    name, skipped = choose("cuda", torch.bfloat16, frozenset())
    assert name == expected, skipped
    if expected != "torch_varlen":
        first_forward(name)
    if installed == ("flash-attn 2.8.3",):
        # flash-attn 2.8's wheel ships flash_attn/cute/ but not the cutlass it imports.
        assert skipped["flash_attn_4"] == (
            "flash_attn.cute (from flash_attn 2.8.3) (flash-attn 4 is the flash-attn-4 distribution) "
            "does not import: ModuleNotFoundError: No module named 'cutlass'"
        )
    if installed == ("flash-attn 4", "cutlass"):
        assert skipped == {"flash_attn_3": "flash-attn 3 (hopper build) is not installed"}
        # flash-attn 4 installs flash_attn/cute/ only: the flash_attn namespace it leaves is no flash-attn 2.
        _, skipped = choose("cuda", torch.bfloat16, frozenset({"dropout"}))
        assert skipped["flash_attn"] == "flash_attn (from flash-attn-4 4.0.0b4) has no flash_attn_varlen_func"
    if not installed:
        assert skipped == {name: f"{what} is not installed" for name, (_, what) in backends.FLASH_MODULES.items()}


def test_each_flash_attn_runs_only_on_the_gpus_it_is_built_for(monkeypatch, site):
    install(site, "flash-attn 2.8.3", "flash-attn 3", "cutlass")
    fake_gpu(monkeypatch, (8, 0))
    name, skipped = choose("cuda", torch.bfloat16, frozenset())
    assert name == "flash_attn"
    assert skipped["flash_attn_3"] == "flash-attn 3 (hopper build) runs on SM90 (Hopper) only, this GPU is SM80"
    assert skipped["flash_attn_4"] == (
        "flash-attn 4 (flash_attn.cute) runs on SM90/SM100 (Hopper, Blackwell) only, this GPU is SM80"
    )
    fake_gpu(monkeypatch, (10, 0))
    assert choose("cuda", torch.bfloat16, frozenset())[0] == "flash_attn_4"
    fake_gpu(monkeypatch, (7, 5))  # a T4: no flash-attn at all, fp16 or bf16
    name, skipped = choose("cuda", torch.float16, frozenset())
    assert name == "torch_varlen"
    assert skipped["flash_attn"] == "flash-attn 2 runs on SM80 or newer (Ampere, Ada, Hopper), this GPU is SM75"
    assert imports(site) == ["flash_attn"]  # flash-attn 3 was never imported where it cannot run


@pytest.mark.parametrize(
    "installed, expected, rejected, reason",
    [
        (("broken flash-attn 2",), "torch_varlen", "flash_attn", f"ImportError: {UNDEFINED_SYMBOL}"),
        (
            ("flash-attn 2.8.3", "broken flash-attn 3"),
            "flash_attn",
            "flash_attn_3",
            "OSError: libcudart.so.13: cannot open shared object file",
        ),
    ],
)
def test_a_broken_install_is_rejected_with_its_error_and_probed_once(
    monkeypatch, site, installed, expected, rejected, reason
):
    install(site, *installed)
    fake_gpu(monkeypatch, (9, 0))
    lines = []
    monkeypatch.setattr(attention, "rank_zero_info", lines.append)
    for _ in range(2):
        assert attention.backend_for("cuda", torch.bfloat16) == expected
    (line,) = lines
    module, _ = backends.FLASH_MODULES[rejected]
    dist, version, _ = INSTALLS[installed[-1]]
    assert f"not {rejected}: {module} (from {dist} {version}) does not import: {reason}" in line
    attention.backend_for("cuda", torch.float16, frozenset({"window"}))
    assert len(lines) == 2 and reason in lines[1]
    assert imports(site).count(module) == 1


def test_importing_lit_hbp_imports_no_flash_attn(site):
    install(site, "flash-attn 2.8.3", "flash-attn 3")
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(site)!r})
        import lit_hbp, lit_hbp.attention, lit_hbp.attention.backends
        print(sorted(m for m in sys.modules if m.split(".")[0] in {FAKE_TOPS!r}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]" and imports(site) == []
