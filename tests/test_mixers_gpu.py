"""A hybrid's mixers on a GPU: a pack's documents, run as the rows of a few batches, take the kernels the mixer's
own forward takes there (flash-linear-attention's for the gated delta rule, mamba_ssm's and causal-conv1d's
where installed, else transformers' PyTorch path on the GPU) and train like each document alone through the
unprepared model on the same device and kernels. CPU exactness of every family is tests/test_mixers.py's."""

import importlib.util

import pytest
import torch
from conftest import separate_loss
from test_mixers import gradient_error, reference_of, three_documents, tiny

from lit_hbp import pack_samples, packed_loss, prepare_model
from lit_hbp.model.packed_call import record_of

KERNELS = {"qwen3_next": "fla", "bamba": "mamba_ssm", "mamba": "mamba_ssm", "lfm2": "causal_conv1d"}


def assert_pack_like_each_alone(family: str, device: str, ce_rel: float, grad_rel: float) -> None:
    """The public-core check on ``device`` in fp32: CE sum and every gradient against each document alone."""
    net = tiny(family).to(device).eval()
    ref = reference_of(net)
    prepare_model(net)
    net.eval()
    assert record_of(net).mixers
    docs = three_documents(net.config.vocab_size, (37, 5, 70, 9, 9, 8))  # the short ones run as one batch
    out = packed_loss(net, pack_samples(docs).to(device), "sum")
    out.loss.backward()
    want = separate_loss(ref, dict(enumerate(docs)), device)
    want.backward()
    assert float(out.ce_sum.detach()) == pytest.approx(float(want.detach()), rel=ce_rel)
    worst, where = gradient_error(net, ref)
    assert worst < grad_rel, f"{family} on {device}: gradient of {where} off by {worst:.1e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", sorted(KERNELS))
def test_a_hybrid_pack_on_the_gpu_trains_like_each_document_alone(family):
    """fp32 on the GPU (TF32 off: the kernels' own rounding is all that differs), 1e-4 on the CE sum and 1e-3
    on every gradient; the kernel package the mixer would take is reported with the test's outcome."""
    installed = importlib.util.find_spec(KERNELS[family]) is not None
    print(f"{family}: {KERNELS[family]} {'installed' if installed else 'not installed: transformers PyTorch path'}")
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        assert_pack_like_each_alone(family, "cuda", 1e-4, 1e-3)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
