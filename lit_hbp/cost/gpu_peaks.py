"""Dense peak FLOP/s per GPU variant, the denominator of MFU.

Lightning's ``get_available_flops`` knows GPU families rather than the parts of a family: it has no
entry for "NVIDIA H200" (only for names containing "sxm1"/"nvl1"), and gives "NVIDIA H100 NVL" a
peak twice its datasheet's dense one. The cost model's presets are whole DGX nodes, not parts. This
table is keyed by the exact ``torch.cuda.get_device_name()`` string of each variant; other names
fall back to Lightning's table.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from lightning.fabric.utilities.throughput import get_available_flops


class Peaks(NamedTuple):
    """Dense (no 2:4 sparsity) FLOP/s of one GPU variant."""

    bf16: float
    fp16: float
    tf32: float
    """fp32 matmuls on tensor cores (``torch.set_float32_matmul_precision`` "high" or "medium")."""
    fp32: float
    """fp32 without tensor cores (matmul precision "highest")."""


# NVIDIA's datasheets give tensor-core rates with sparsity; the dense rates are half of them.
# - H100 SXM5 / PCIe / NVL: H100 datasheet (nvidia.com/en-us/data-center/h100, 2023/2024 editions)
#   and the Hopper architecture whitepaper (989.4 TFLOP/s bf16 for SXM5 at its boost clock);
#   SXM5: bf16 1,979 sparse -> 989.4, tf32 989 -> 494.7, fp32 66.9; PCIe: 1,513 -> 756, 756 -> 378,
#   fp32 51.2; NVL (per GPU): 1,671 -> 835, 835 -> 417.5, fp32 60.
# - H200 SXM / NVL: H200 datasheet (nvidia.com/en-us/data-center/h200): the same GH100 compute as
#   H100 SXM5 / NVL (bf16 1,979 / 1,671 sparse, tf32 989 / 835 sparse, fp32 67 / 60).
# - B200 (HGX B200, 1,000 W): HGX/DGX B200 datasheet, per GPU: bf16 4.5 PFLOP/s sparse -> 2,250,
#   tf32 2.2 PFLOP/s sparse -> 1,100, fp32 75.
# - A100 SXM4 and PCIe, 40 and 80 GB: A100 datasheet: bf16 312, tf32 156, fp32 19.5 (dense).
_H100_SXM = Peaks(989.4e12, 989.4e12, 494.7e12, 66.9e12)
_H100_PCIE = Peaks(756e12, 756e12, 378e12, 51.2e12)
_HOPPER_NVL = Peaks(835e12, 835e12, 417.5e12, 60e12)
_A100 = Peaks(312e12, 312e12, 156e12, 19.5e12)

GPU_PEAKS: dict[str, Peaks] = {
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 PCIe": _H100_PCIE,
    "NVIDIA H100 NVL": _HOPPER_NVL,
    "NVIDIA H200": _H100_SXM,
    "NVIDIA H200 NVL": _HOPPER_NVL,
    "NVIDIA B200": Peaks(2250e12, 2250e12, 1100e12, 75e12),
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
}


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of ``device`` for matmuls in ``dtype`` (the compute dtype of the precision
    plugin), from this table by CUDA device name, else from Lightning's; None when neither knows
    the device (then no MFU is reported)."""
    device = torch.device(device)
    if device.type == "cuda":
        peaks = GPU_PEAKS.get(torch.cuda.get_device_name(device).strip())
        if peaks is not None:
            if dtype is torch.bfloat16:
                return peaks.bf16
            if dtype is torch.float16:
                return peaks.fp16
            if dtype is torch.float32:
                return peaks.fp32 if torch.get_float32_matmul_precision() == "highest" else peaks.tf32
    flops = get_available_flops(device, dtype)
    return None if flops is None else float(flops)
