"""A hybrid's mixers on a GPU: a pack's documents, run as the rows of a few batches, take the kernels the mixer's
own forward takes there (flash-linear-attention's for the gated delta rule, mamba_ssm's and causal-conv1d's
where installed, else transformers' PyTorch path on the GPU) and train like each document alone through the
unprepared model on the same device and kernels. CPU exactness of every family is tests/test_mixers.py's."""

import importlib
import importlib.util
import inspect
import re

import pytest
import torch
from conftest import separate_loss
from test_mixers import gradient_error, reference_of, three_documents, tiny

from lit_hbp import pack_samples, packed_loss, prepare_model
from lit_hbp.model.packed_call import record_of

# a kernel package's own refusal of this GPU and Triton (flash-linear-attention 0.6.0's chunk_bwd_dqkwg)
PLATFORM_REFUSAL = re.compile(r"Triton .* produces incorrect results")
KERNELS = {"qwen3_next": "fla", "bamba": "mamba_ssm", "mamba": "mamba_ssm", "lfm2": "causal_conv1d"}


def assert_pack_like_each_alone(
    family: str, device: str, ce_rel: float, grad_rel: float, torch_path: pytest.MonkeyPatch | None = None
) -> None:
    """The public-core check on ``device`` in fp32: CE sum and every gradient against each document alone;
    ``torch_path`` (a monkeypatch): the gated delta rule on transformers' PyTorch kernel where a kernel package is
    installed."""
    net = tiny(family).to(device).eval()
    if torch_path is not None:
        on_torch(net, torch_path)
    ref = reference_of(net)
    prepare_model(net)
    net.eval()
    assert record_of(net).mixers
    docs = three_documents(net.config.vocab_size, (37, 5, 70, 9, 9, 8))  # the short ones run as one batch
    out = packed_loss(net, pack_samples(docs).to(device), "sum")
    try:
        out.loss.backward()
    except RuntimeError as e:
        if not PLATFORM_REFUSAL.search(str(e)):
            raise
        # the kernel package refuses this platform (flash-linear-attention 0.6 on Hopper with Triton < 3.7.1):
        # the unprepared model stops the same way, so the packed call did what it would do
        with pytest.raises(RuntimeError, match=PLATFORM_REFUSAL.pattern):
            separate_loss(ref, {0: docs[0]}, device).backward()
        pytest.skip(f"{family}: its kernel package refuses this platform, the unprepared model too: {e}")
    want = separate_loss(ref, dict(enumerate(docs)), device)
    want.backward()
    assert float(out.ce_sum.detach()) == pytest.approx(float(want.detach()), rel=ce_rel)
    worst, where = gradient_error(net, ref)
    assert worst < grad_rel, f"{family} on {device}: gradient of {where} off by {worst:.1e}"


def on_torch(net: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every gated delta rule mixer of ``net`` on transformers' PyTorch chunk kernel. Transformers 5.x before 5.17
    kept the kernel it picked as the mixer's ``chunk_gated_delta_rule``; 5.17-5.24 pick it when the module is
    imported (``use_kernel_func_from_hub_with_fallback`` over ``torch_chunk_gated_delta_rule``, the PyTorch
    function kept as its ``__wrapped__``), so the module's name is pointed at the PyTorch function for the test.
    5.25, which installs ``kernels``, keeps that wrapper inside a module of ``kernels`` (``Func``, whose forward
    calls it): the wrapper is read from its forward's closure."""
    mixers = [m for m in net.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    assert mixers, "no gated delta rule mixer in the model"
    module = importlib.import_module(type(mixers[0]).__module__)
    picked = module.torch_chunk_gated_delta_rule
    if isinstance(picked, torch.nn.Module):
        picked = inspect.getclosurevars(type(picked).forward).nonlocals["func"]
    if all(hasattr(m, "chunk_gated_delta_rule") for m in mixers):
        for m in mixers:
            m.chunk_gated_delta_rule = picked
    elif hasattr(picked, "__wrapped__"):
        monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", inspect.unwrap(picked))
    else:
        pytest.fail(f"{module.__name__}: no way found to put its gated delta rule on the PyTorch kernel")


def fp32_on_cuda(check) -> None:
    """``check()`` with TF32 off (the kernels' own rounding is all that differs from the CPU's fp32)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        check()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", sorted(KERNELS))
def test_a_hybrid_pack_on_the_gpu_trains_like_each_document_alone(family):
    """fp32 on the GPU, 1e-4 on the CE sum and 1e-3 on every gradient; the kernel package the mixer would take is
    reported with the test's outcome."""
    installed = importlib.util.find_spec(KERNELS[family]) is not None
    print(f"{family}: {KERNELS[family]} {'installed' if installed else 'not installed: transformers PyTorch path'}")
    fp32_on_cuda(lambda: assert_pack_like_each_alone(family, "cuda", 1e-4, 1e-3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gated_delta_rule_pack_on_transformers_pytorch_kernel_on_the_gpu_trains_like_each_document_alone(
    monkeypatch,
):
    """Qwen3-Next's mixers on transformers' PyTorch kernel on the GPU, where flash-linear-attention is installed
    too (on an H200 with Triton 3.6 that package refuses its backward: this is the path that trains there)."""
    fp32_on_cuda(lambda: assert_pack_like_each_alone("qwen3_next", "cuda", 1e-4, 1e-3, torch_path=monkeypatch))


def test_the_gpu_tests_can_put_the_gated_delta_rule_on_transformers_pytorch_kernel(monkeypatch):
    """On CPU: ``on_torch`` finds the installed transformers' PyTorch chunk kernel and puts every mixer of a tiny
    Qwen3-Next on it (the GPU test above skipped on the H200 of 2026-11-30: transformers 5.17 picks the kernel when
    the module is imported, where the test looked for it on the mixer)."""
    net = tiny("qwen3_next")
    module = importlib.import_module(type(next(m for m in net.modules() if hasattr(m, "A_log"))).__module__)
    on_torch(net, monkeypatch)
    kernel = inspect.unwrap(module.torch_chunk_gated_delta_rule)
    assert module.torch_chunk_gated_delta_rule is kernel and kernel.__module__ == module.__name__
    assert all(getattr(m, "chunk_gated_delta_rule", kernel) is kernel for m in net.modules())
