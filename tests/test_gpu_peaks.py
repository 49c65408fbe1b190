"""MFU's denominator is the dense peak of the exact GPU variant, with no GPU needed to check it."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.trainer.states import RunningStage

from lit_hbp.callbacks import HBPThroughputMonitor
from lit_hbp.cost.gpu_peaks import peak_flops

CUDA = torch.device("cuda", 0)

# Dense bf16 TFLOP/s from NVIDIA's datasheets (half the "with sparsity" figures).
DATASHEET_BF16 = {
    "NVIDIA H100 80GB HBM3": 989.4,  # SXM5
    "NVIDIA H100 PCIe": 756,
    "NVIDIA H100 NVL": 835,
    "NVIDIA H200": 989.4,  # SXM: 1,979 sparse
    "NVIDIA H200 NVL": 835,
    "NVIDIA B200": 2250,
    "NVIDIA A100-SXM4-80GB": 312,
    "NVIDIA A100-SXM4-40GB": 312,
    "NVIDIA A100 80GB PCIe": 312,
    "NVIDIA A100-PCIE-40GB": 312,
}

BF16_PLUGINS = {
    "bf16-mixed": lambda: MixedPrecision("bf16-mixed", "cuda"),
    "bf16-true": lambda: HalfPrecision("bf16-true"),
    "deepspeed-bf16-mixed": lambda: DeepSpeedPrecision("bf16-mixed"),
    "deepspeed-bf16-true": lambda: DeepSpeedPrecision("bf16-true"),
}


@pytest.fixture
def gpu_named(monkeypatch):
    """Pretend device 0 is the named GPU."""

    def name(gpu: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)

    return name


@pytest.mark.parametrize("plugin", BF16_PLUGINS)
@pytest.mark.parametrize("gpu", DATASHEET_BF16)
def test_each_variant_has_its_datasheet_bf16_peak(gpu_named, gpu, plugin):
    gpu_named(gpu)
    dtype = _plugin_to_compute_dtype(BF16_PLUGINS[plugin]())
    assert peak_flops(CUDA, dtype) == pytest.approx(DATASHEET_BF16[gpu] * 1e12, rel=1e-12)


@pytest.mark.parametrize(
    ("gpu", "fp16", "tf32", "fp32"),
    [
        ("NVIDIA H100 PCIe", 756, 378, 51.2),
        ("NVIDIA H200", 989.4, 494.7, 66.9),
        ("NVIDIA A100-PCIE-40GB", 312, 156, 19.5),
    ],
)
def test_fp16_and_fp32_peaks_follow_the_matmul_precision(gpu_named, gpu, fp16, tf32, fp32):
    gpu_named(gpu)
    assert peak_flops(CUDA, _plugin_to_compute_dtype(MixedPrecision("16-mixed", "cuda"))) == pytest.approx(
        fp16 * 1e12, rel=1e-12
    )
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert peak_flops(CUDA, _plugin_to_compute_dtype(Precision())) == pytest.approx(tf32 * 1e12, rel=1e-12)
        torch.set_float32_matmul_precision("highest")
        assert peak_flops(CUDA, torch.float32) == pytest.approx(fp32 * 1e12, rel=1e-12)
    finally:
        torch.set_float32_matmul_precision(old)


def test_other_gpus_fall_back_to_lightnings_table(gpu_named):
    gpu_named("NVIDIA L4")
    assert peak_flops(CUDA, torch.bfloat16) == 121e12


def test_no_peak_when_neither_table_knows_the_device(gpu_named):
    gpu_named("NVIDIA Imaginary 9000")
    with pytest.warns(UserWarning, match="FLOPs not found"):
        assert peak_flops(CUDA, torch.bfloat16) is None
    assert peak_flops(torch.device("cpu"), torch.bfloat16) is None


@pytest.mark.parametrize(("gpu", "peak"), [("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989.4e12), ("Unknown", None)])
def test_the_throughput_monitor_uses_the_variant_peak(gpu_named, gpu, peak):
    gpu_named(gpu)
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=CUDA),
        precision_plugin=DeepSpeedPrecision("bf16-mixed"),
        state=SimpleNamespace(stage=RunningStage.TRAINING),
        enable_validation=True,
        world_size=8,
    )
    monitor = HBPThroughputMonitor()
    with warnings.catch_warnings():
        warnings.simplefilter("error" if peak else "ignore")  # a known GPU: no "FLOPs not found"
        monitor.setup(trainer, None, "fit")
    assert monitor.available_flops == peak
    assert set(monitor._throughputs) == {RunningStage.TRAINING, RunningStage.VALIDATING}
    assert all(t.available_flops == peak for t in monitor._throughputs.values())


@pytest.mark.parametrize(
    ("script", "function"), [("gpu_throughput", "peak_flops"), ("train_throughput", "_peak_flops")]
)
def test_the_benches_use_the_variant_peak(gpu_named, script, function):
    gpu_named("NVIDIA H100 PCIe")
    path = Path(__file__).resolve().parents[1] / "bench" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{script}", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = (None,) if script == "gpu_throughput" else ()
    assert getattr(bench, function)(CUDA, *args) == 756e12
    assert getattr(bench, function)(torch.device("cpu"), *args) is None
