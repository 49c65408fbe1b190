"""Backend choice against flash-attention installs as pip lays them out (``flash_installs``: the
upstream layouts, signatures and dist-info of flash-attn 2.8.3 with its preview ``flash_attn/cute``,
flash-attn-4 releases, flash-attn 3 source builds, broken builds) on a faked CUDA GPU. A backend is
taken only when its forward *and* backward run what the layer needs; every refusal says why; the
taken backend's forward and backward run (the fakes fail as their upstream release does)."""

import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import TINY_LLAMA
from flash_installs import INSTALLS, install
from transformers import AutoConfig, AutoModelForCausalLM

from lit_hbp import prepare_model
from lit_hbp.model import attention
from lit_hbp.model.attention import backends, dispatch, flash, kernel, torch_varlen
from lit_hbp.model.attention.backends import REGISTRY, choose
from lit_hbp.model.attention.kernel import AttnArgs
from lit_hbp.model.packed_call import record_of

FAKE_TOPS = ("flash_attn", "flash_attn_interface", "cutlass")
UNDEFINED_SYMBOL = "flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDeviceEi"


def counted(text: str) -> str:
    """Module source that first records its import in ``imports.log`` beside the site folder."""
    return (
        f"with open(__file__.split('/site/')[0] + '/imports.log', 'a') as _f:\n    _f.write(__name__ + '\\n')\n{text}"
    )


BROKEN = {
    "broken flash-attn 2": (
        "flash_attn",
        "2.7.4.post1",
        {"flash_attn/__init__.py": counted(f"raise ImportError({UNDEFINED_SYMBOL!r})")},
    ),
    "broken flash-attn 3": (
        "flash_attn_3",
        "3.0.0b1",
        {"flash_attn_interface.py": counted("raise OSError('libcudart.so.13: cannot open shared object file')")},
    ),
    "counted flash-attn 3": (
        "flash_attn_3",
        "3.0.0b1",
        {"flash_attn_interface.py": counted(INSTALLS["flash-attn 3 (2025-07)"][2]["flash_attn_interface.py"])},
    ),
    "counted flash-attn 2.8.3": (
        "flash_attn",
        "2.8.3",
        {
            **INSTALLS["flash-attn 2.8.3"][2],
            "flash_attn/__init__.py": counted(INSTALLS["flash-attn 2.8.3"][2]["flash_attn/__init__.py"]),
        },
    ),
}
ALL = {**INSTALLS, **BROKEN}


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty site folder on sys.path; the fake modules, the probe verdicts and the choices made from
    them are forgotten after."""
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    backends.reset_probes()
    yield path
    for name in [m for m in sys.modules if m.split(".")[0] in FAKE_TOPS]:
        del sys.modules[name]
    backends.reset_probes()


def prepared_model() -> torch.nn.Module:
    """A tiny prepared model: its packed calls' choices are logged, once per model, and kept on it."""
    cfg = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    return prepare_model(AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=64, **cfg)))


def fake_gpu(monkeypatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def imports(site: Path) -> list[str]:
    log = site.parent / "imports.log"
    return log.read_text().split() if log.exists() else []


def call(needs: frozenset[str] = frozenset()):
    """A layer's call (bf16, 4 query heads over 1 kv head, two documents) needing ``needs``, with its
    inputs and sinks as leaves."""
    q = torch.randn(1, 4, 10, 8, dtype=torch.bfloat16).requires_grad_()
    k, v = (x.requires_grad_() for x in torch.randn(2, 1, 1, 10, 8, dtype=torch.bfloat16))
    sinks = torch.zeros(4, dtype=torch.float32, requires_grad=True) if "sinks" in needs else None
    args = AttnArgs(
        torch.tensor([0, 3, 10], dtype=torch.int32),
        7,
        8**-0.5,
        window=4 if "window" in needs else None,
        softcap=30.0 if "softcap" in needs else None,
        sinks=sinks,
    )
    return (q, k, v), args


def trains(name: str, needs: frozenset[str] = frozenset()) -> None:
    """Backend ``name``'s forward and backward of such a call run (the fakes raise where their release
    does), the layout is kept, and every input gets a gradient (sinks included)."""
    (q, k, v), args = call(needs)
    out = REGISTRY[name].run(q, k, v, args)
    assert out.shape == q.shape
    out.float().sum().backward()
    leaves = [q, k, v] + ([args.sinks] if args.sinks is not None else [])
    assert all(x.grad is not None for x in leaves), f"{name} leaves a gradient out"


def lse_pair_trains(name: str, needs: frozenset[str] = frozenset()) -> None:
    """Backend ``name``'s forward keeping the LSE and its backward kernel run on such a call."""
    (q, k, v), args = call(needs)
    pair = REGISTRY[name].lse
    out, lse = pair.forward(q.detach(), k.detach(), v.detach(), args)
    grads = pair.backward(torch.ones_like(out), q.detach(), k.detach(), v.detach(), out, lse, args)
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]


HOPPER_CASES = [
    # (installed in this order, what the layer needs, the backend taken, the refusal of flash-attn 4)
    (("flash-attn 2.8.3",), frozenset(), "flash_attn", "is flash-attn 2.8.3's preview of flash-attn 4"),
    # nvidia-cutlass-dsl importable (left by a flash-attn-4): 2.8.3's cute/ imports, and is still no flash-attn 4.
    (
        ("nvidia-cutlass-dsl", "flash-attn 2.8.3"),
        frozenset(),
        "flash_attn",
        "whose varlen backward raises NotImplementedError",
    ),
    (
        ("nvidia-cutlass-dsl", "flash-attn-4 4.0.0b3"),  # published as the "fa4" distribution
        frozenset(),
        "torch_varlen",
        "flash-attn-4 4.0.0b3 on SM90: its backward asserts 'varlen backward is not yet supported on sm90'",
    ),
    (
        ("nvidia-cutlass-dsl", "flash-attn-4 4.0.0b4"),
        frozenset(),
        "torch_varlen",
        "'varlen backward is not yet supported on sm90'",
    ),
    (("nvidia-cutlass-dsl", "flash-attn-4 4.0.0b20"), frozenset(), "flash_attn_4", None),
    (
        ("nvidia-cutlass-dsl", "flash-attn-4 4.0.0b20"),
        frozenset({"softcap"}),
        "flex",
        "no softcap in the backward: flash-attn-4 4.0.0b20",
    ),
    (("nvidia-cutlass-dsl", "flash-attn-4 4.0.0b25"), frozenset({"softcap"}), "flash_attn_4", None),
    (
        ("nvidia-cutlass-dsl", "flash-attn-4 4.0.0b25"),
        frozenset({"sinks"}),
        "flex",
        "no sinks in the backward: flash-attn-4 4.0.0b25",
    ),
    (("nvidia-cutlass-dsl", "flash-attn-4 4.0.0b27"), frozenset({"sinks", "window"}), "flash_attn_4", None),
    (("nvidia-cutlass-dsl", "flash-attn-4 4.0.0b40"), frozenset({"sinks", "window", "softcap"}), "flash_attn_4", None),
    (
        ("flash-attn 2.8.3", "nvidia-cutlass-dsl", "flash-attn-4 4.0.0b4"),
        frozenset({"window"}),
        "flash_attn",
        "'varlen backward",
    ),
    # The last install wins flash_attn/cute/: flash-attn-4 first, then flash-attn 2.8.3 over it.
    (
        ("nvidia-cutlass-dsl", "flash-attn-4 4.0.0b27", "flash-attn 2.8.3"),
        frozenset(),
        "flash_attn",
        "preview of flash-attn 4",
    ),
    (("flash-attn 2.8.3", "nvidia-cutlass-dsl", "flash-attn-4 4.0.0b27"), frozenset(), "flash_attn_4", None),
]


@pytest.mark.parametrize("installed, needs, expected, fa4_refusal", HOPPER_CASES)
def test_a_backend_is_taken_only_when_its_backward_runs_what_the_layer_needs(
    monkeypatch, site, installed, needs, expected, fa4_refusal
):
    install(site, *installed)
    fake_gpu(monkeypatch, (9, 0))
    name, skipped = choose("cuda", torch.bfloat16, needs)
    assert name == expected, skipped
    if fa4_refusal is not None:
        assert fa4_refusal in skipped["flash_attn_4"], skipped
    if name.startswith("flash_attn"):
        trains(name, needs)
        lse_pair_trains(name, needs)


@pytest.mark.parametrize(
    "installed, needs, failure",
    [
        (("flash-attn 2.8.3", "nvidia-cutlass-dsl"), frozenset(), "max_seqlen_q"),  # 2.8.3's cute forward
        (("nvidia-cutlass-dsl", "flash-attn-4 4.0.0b4"), frozenset(), "varlen backward is not yet supported on sm90"),
        (("nvidia-cutlass-dsl", "flash-attn-4 4.0.0b20"), frozenset({"softcap"}), "varlen + score_mod"),
    ],
)
def test_what_was_refused_fails_as_upstream_does(monkeypatch, site, installed, needs, failure):
    """The refusals above are real: forced onto flash_attn.cute, these installs crash as their releases do."""
    install(site, *installed)
    fake_gpu(monkeypatch, (9, 0))
    with pytest.raises((TypeError, AssertionError), match=re.escape(failure)):
        trains("flash_attn_4", needs)


def test_flash_attn_4_before_4_0_0b26_would_freeze_the_sinks(monkeypatch, site):
    install(site, "nvidia-cutlass-dsl", "flash-attn-4 4.0.0b25")
    fake_gpu(monkeypatch, (9, 0))
    (q, k, v), args = call(frozenset({"sinks"}))
    args = AttnArgs(**{**args.__dict__, "sinks": args.sinks.detach().bfloat16().requires_grad_()})
    REGISTRY["flash_attn_4"].run(q, k, v, args).float().sum().backward()
    assert args.sinks.grad is None  # what training on it would do, which the choice above refuses


def test_blackwell_runs_flash_attn_4_releases_whose_backward_refuses_hopper(monkeypatch, site):
    install(site, "nvidia-cutlass-dsl", "flash-attn-4 4.0.0b4")
    fake_gpu(monkeypatch, (10, 0))
    name, skipped = choose("cuda", torch.bfloat16, frozenset({"window"}))
    assert name == "flash_attn_4", skipped
    trains(name, frozenset({"window"}))


def test_a_flash_attn_3_build_is_called_with_every_required_argument(monkeypatch, site):
    """A source build of 2025-07 (hopper c7697bbf..5e114d53): 25 required parameters in its forward,
    17 in its backward. Those annotated Optional are passed None, so both passes run."""
    install(site, "flash-attn 3 (2025-07)")
    fake_gpu(monkeypatch, (9, 0))
    name, skipped = choose("cuda", torch.bfloat16, frozenset({"window", "softcap"}))
    assert name == "flash_attn_3", skipped
    trains(name, frozenset({"window", "softcap"}))
    assert backends.lse_why_not(name, "cuda", frozenset({"window"})) is None
    lse_pair_trains(name, frozenset({"window"}))


def test_a_flash_attn_3_build_whose_required_arguments_are_unknown_is_refused(monkeypatch, site):
    """A build from before 2025-02-16 (hopper fa445ff6): seqused_q and seqused_k are required, before
    max_seqlen_q, without an annotation that says None is theirs to take."""
    install(site, "flash-attn 3 (2025-02)")
    fake_gpu(monkeypatch, (9, 0))
    name, skipped = choose("cuda", torch.bfloat16, frozenset())
    assert name == "torch_varlen"
    assert skipped["flash_attn_3"] == (
        "flash_attn_interface.flash_attn_varlen_func requires seqused_q, seqused_k, which lit-hbp does not pass"
    )
    # Its private pair predates the names lit-hbp calls: context parallelism recomputes instead.
    assert "takes no" in flash._flash_lse_problem("flash_attn_3")


def test_each_refusal_is_logged_once_with_its_reason(monkeypatch, site):
    install(site, "flash-attn 2.8.3", "nvidia-cutlass-dsl", "flash-attn-4 4.0.0b20")
    fake_gpu(monkeypatch, (9, 0))
    lines = []
    monkeypatch.setattr(dispatch, "rank_zero_info", lines.append)
    model = prepared_model()
    owner = record_of(model).owner  # what the model's packed calls carry
    for _ in range(2):
        assert attention.backend_for("cuda", torch.bfloat16, frozenset({"softcap"}), owner=owner) == "flash_attn"
    (line,) = lines  # once per model
    assert [c["backend"] for c in attention.choices(model)] == ["flash_attn"]
    other = prepared_model()
    attention.backend_for("cuda", torch.bfloat16, frozenset({"softcap"}), owner=record_of(other).owner)
    assert len(lines) == 2  # another model's calls are said again
    assert (
        "flash_attn backend" in line and "not flash_attn_4: no softcap in the backward: flash-attn-4 4.0.0b20" in line
    )


def test_each_flash_attn_runs_only_on_the_gpus_it_is_built_for(monkeypatch, site):
    install(
        site,
        "counted flash-attn 2.8.3",
        "counted flash-attn 3",
        "nvidia-cutlass-dsl",
        "flash-attn-4 4.0.0b27",
        installs=ALL,
    )
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


def test_with_no_flash_attn_installed_torch_varlen_is_taken(monkeypatch, site):
    fake_gpu(monkeypatch, (9, 0))
    name, skipped = choose("cuda", torch.bfloat16, frozenset())
    assert name == "torch_varlen"
    assert skipped == {name: f"{what} is not installed" for name, (_, what) in backends.FLASH_MODULES.items()}


def test_flash_attn_4_alone_leaves_no_flash_attn_2(monkeypatch, site):
    """flash-attn-4 installs flash_attn/cute/ only: the flash_attn namespace it leaves is no flash-attn 2."""
    install(site, "nvidia-cutlass-dsl", "flash-attn-4 4.0.0b27")
    fake_gpu(monkeypatch, (9, 0))
    _, skipped = choose("cuda", torch.bfloat16, frozenset({"dropout"}))
    assert skipped["flash_attn"] == "flash_attn (from flash-attn-4 4.0.0b27) has no flash_attn_varlen_func"
    assert skipped["flash_attn_4"] == "does not support dropout"


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
    install(site, *installed, installs=ALL)
    fake_gpu(monkeypatch, (9, 0))
    lines = []
    monkeypatch.setattr(dispatch, "rank_zero_info", lines.append)
    model = prepared_model()  # kept: the choices live on it
    owner = record_of(model).owner
    for _ in range(2):
        assert attention.backend_for("cuda", torch.bfloat16, owner=owner) == expected
    (line,) = lines
    module, _ = backends.FLASH_MODULES[rejected]
    dist, version, _ = ALL[installed[-1]]
    assert f"not {rejected}: {module} (from {dist} {version}) does not import: {reason}" in line
    attention.backend_for("cuda", torch.float16, frozenset({"window"}), owner=owner)
    assert len(lines) == 2 and reason in lines[1]
    assert imports(site).count(module) == 1


@pytest.mark.slow
def test_importing_lit_hbp_imports_no_flash_attn(site):
    install(site, "counted flash-attn 2.8.3", "counted flash-attn 3", installs=ALL)
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(site)!r})
        import lit_hbp, lit_hbp.model.attention, lit_hbp.model.attention.backends
        print(sorted(m for m in sys.modules if m.split(".")[0] in {FAKE_TOPS!r}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]" and imports(site) == []


def test_an_editable_flash_attn_4_is_read_by_its_distribution(monkeypatch, site):
    """``pip install -e`` of flash-attn-4: its RECORD lists no module file; its distribution still
    says which release it is."""
    install(site, "nvidia-cutlass-dsl", "flash-attn-4 4.0.0b27")
    record = next(site.glob("flash_attn_4-*.dist-info")) / "RECORD"
    record.write_text("__editable__.flash_attn_4-4.0.0b27.pth,,\n")
    fake_gpu(monkeypatch, (9, 0))
    assert choose("cuda", torch.bfloat16, frozenset({"sinks"}))[0] == "flash_attn_4"


def test_a_cute_folder_two_wheels_claim_without_hashes_is_nobodys_flash_attn_4(monkeypatch, site):
    """flash-attn 2.8.3 and flash-attn-4 both list flash_attn/cute/ and neither RECORD has hashes (an
    installer that writes none): which one is on disk is unknown, so it is not trained on."""
    install(site, "flash-attn 2.8.3", "nvidia-cutlass-dsl", "flash-attn-4 4.0.0b27")
    for record in site.glob("*.dist-info/RECORD"):
        record.write_text("".join(line.split(",")[0] + ",,\n" for line in record.read_text().splitlines()))
    fake_gpu(monkeypatch, (9, 0))
    name, skipped = choose("cuda", torch.bfloat16, frozenset())
    assert name == "flash_attn"
    assert skipped["flash_attn_4"] == "flash_attn.cute is not a release of flash-attn 4 (the flash-attn-4 distribution)"


def test_required_parameters_that_accept_none_are_told_apart_however_annotated():
    namespace: dict = {}
    exec(  # annotations as text, as in a module with ``from __future__ import annotations``
        "from __future__ import annotations\n"
        "def kernel(q, k, v, a: Optional[int], b: int | None, c: Union[int, None], d: None | int, e: int, f,"
        " g: int = 0, *, h: Optional[int]): ...",
        namespace,
    )
    none, other = kernel.unsupplied(namespace["kernel"], 3, {"f"})
    assert none == ["a", "b", "c", "d", "h"] and other == ["e"]


# torch 2.14's choice between cuDNN's and flash's varlen kernels, as torch/nn/attention/varlen.py of 2.14.1
# writes it (``_should_use_cudnn`` there: ROCm no, cuDNN >= 9.18, SM90/SM100; 2.13's always says no). The
# test below runs torch's own function where the installed torch has it (2.14), else this copy.
def _can_use_cudnn_214(query, key, value, max_q, window_size, enable_gqa=False, seqused_k=None, block_table=None,
                       num_splits=None):  # fmt: skip
    if not query.is_cuda or not _should_use_cudnn_on_an_h100(query.device.index):
        return False
    if max_q <= 128:
        return False
    if query.dtype not in (torch.float16, torch.bfloat16):
        return False
    if query.shape[-1] % 8 != 0 or value.shape[-1] % 8 != 0:
        return False
    if window_size != [-1, -1]:
        return False
    if enable_gqa or query.size(-2) != key.size(-2):
        return False
    return not (num_splits is not None or (block_table is not None and seqused_k is None))


def _should_use_cudnn_on_an_h100(device_index) -> bool:
    return True


class _OnCuda:
    """A [T, H, D] tensor's face as ``_can_use_cudnn`` reads it, on GPU 0 (no CUDA needed)."""

    def __init__(self, heads: int, dtype=torch.bfloat16):
        self._t = torch.zeros(4, heads, 64, dtype=dtype)
        self.is_cuda, self.dtype, self.shape = True, dtype, self._t.shape
        self.device = type("Device", (), {"index": 0})()

    def size(self, dim):
        return self._t.size(dim)


def _cudnn_choosers():
    import torch.nn.attention.varlen as varlen_module

    choosers = {"torch 2.14.1's source (copy)": _can_use_cudnn_214}
    if hasattr(varlen_module, "_can_use_cudnn"):
        choosers[f"torch {torch.__version__}'s own"] = varlen_module._can_use_cudnn
    return choosers


@pytest.mark.parametrize("which", list(_cudnn_choosers()))
def test_torch_214_runs_cudnn_only_for_full_windows_so_lit_hbps_causal_calls_run_flash(monkeypatch, which):
    """torch 2.14 picks cuDNN's varlen kernel on an H100 in forward and backward alike by the window it is
    called with: never for a causal window ``[left, 0]``, the only kind lit-hbp passes; so the LSE pair's
    output, LSE and gradients are flash's, as its backward needs (a full window would run cuDNN)."""
    import torch.nn.attention.varlen as varlen_module

    chooser = _cudnn_choosers()[which]
    if chooser is not _can_use_cudnn_214:
        monkeypatch.setattr(varlen_module, "_should_use_cudnn", _should_use_cudnn_on_an_h100)
    q, kv = _OnCuda(8), _OnCuda(8)
    assert chooser(q, kv, kv, 4096, [-1, -1]), "eligible: a full window, equal heads, bf16, long documents"
    for window in ([-1, 0], [511, 0], [0, 0]):
        assert not chooser(q, kv, kv, 4096, window), window
    assert torch_varlen._torch_varlen_cudnn_problem() is None
    assert torch_varlen._torch_varlen_lse_problem() is None, "this torch's varlen LSE pair is usable as it is"


def test_a_torch_that_could_run_cudnn_for_causal_calls_unpinned_is_refused_for_the_lse_pair(monkeypatch):
    import torch.nn.attention.varlen as varlen_module

    monkeypatch.setattr(varlen_module, "_can_use_cudnn", lambda query, key, value, max_q: True, raising=False)
    monkeypatch.setattr(torch_varlen, "_torch_varlen_picks_backend", lambda: False)
    why = torch_varlen._torch_varlen_lse_problem()
    assert (
        why == f"torch {torch.__version__}'s varlen_attn may run cuDNN's kernel for causal calls and cannot be pinned"
    )
    monkeypatch.setattr(torch_varlen, "_torch_varlen_picks_backend", lambda: True)  # the op takes ``backend``: pinned
    assert torch_varlen._torch_varlen_cudnn_problem() is None
