"""The GPU kinds the cost model prices: one GPU and its links (``Hardware``), and the presets of whole DGX
nodes (``HARDWARE``) with where each number comes from."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
"""Bytes of a GiB: memory is counted as devices report it (``torch.cuda.get_device_properties().total_memory``)."""


@dataclass(frozen=True)
class Hardware:
    """One GPU kind and its links. Memory in bytes as the device reports it; bandwidths per GPU and per
    direction in bytes/s, and FLOP/s, as the vendors' decimal numbers.

    eff_dense / eff_attn: achieved share of peak bf16 FLOP/s for large matmuls and for flash
    attention; eff_link: achieved share of link bandwidth in all-to-all and ring collectives.
    accelerator: "cuda", or "cpu" for a measured search on CPU processes (Liger needs CUDA).
    """

    name: str
    peak_flops: float
    memory_bytes: float
    intra_node_bw: float
    inter_node_bw: float
    gpus_per_node: int = 8
    eff_dense: float = 0.60
    eff_attn: float = 0.50
    eff_link: float = 0.70
    link_latency_s: float = 20e-6
    host_bw: float = 0.0
    host_memory_bytes: float = 0.0
    source: str = ""
    accelerator: str = "cuda"


# Peak dense bf16 FLOP/s from NVIDIA's datasheets (H100 SXM5 and H200 SXM: 989 TFLOP/s; A100 SXM4 80GB:
# 312 TFLOP/s). Memory: what ``torch.cuda.get_device_properties(i).total_memory`` reports, less than the
# datasheets' decimal 80 / 141 GB: NVIDIA H100 80GB HBM3 81,559 MiB (79.6 GiB), NVIDIA H200 143,771 MiB
# (140.4 GiB), NVIDIA A100-SXM4-80GB 81,251 MiB (79.3 GiB). NVLink: 900 GB/s (H100/H200, NVLink 4) and
# 600 GB/s (A100, NVLink 3) total per GPU, i.e. half per direction. InfiniBand: one 400 Gb/s NDR NIC per
# GPU (DGX H100/H200) = 50 GB/s, one 200 Gb/s HDR NIC per GPU (DGX A100) = 25 GB/s. Host: PCIe Gen5 x16
# (Gen4 on the A100) per GPU, and the DGX's 2 TB of memory as the OS reports it (MemTotal ~2,000 GiB).
# Efficiencies: ~60% of peak is what tuned bf16 GEMMs of LLM-sized matrices sustain in Megatron/DeepSpeed
# reports (MFU 40-55% end to end), ~50% what flash-attention 2/3 reaches on long causal sequences, ~70% of
# the link rate what NCCL all-to-all and ring collectives reach.
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "H100-80GB",
        989e12,
        81559 * 2**20,
        450e9,
        50e9,
        host_bw=50e9,
        host_memory_bytes=2000 * GIB,
        source="NVIDIA H100 SXM5 datasheet; DGX H100 (8x NVLink 4, 8x ConnectX-7 NDR 400, PCIe Gen5 x16, 2 TB)",
    ),
    "h200": Hardware(
        "H200-141GB",
        989e12,
        143771 * 2**20,
        450e9,
        50e9,
        host_bw=50e9,
        host_memory_bytes=2000 * GIB,
        source="NVIDIA H200 SXM datasheet; DGX H200 (NVLink 4, ConnectX-7 NDR 400, PCIe Gen5 x16, 2 TB)",
    ),
    "a100": Hardware(
        "A100-80GB",
        312e12,
        81251 * 2**20,
        300e9,
        25e9,
        host_bw=25e9,
        host_memory_bytes=2000 * GIB,
        source="NVIDIA A100 SXM4 80GB datasheet; DGX A100 (NVLink 3, ConnectX-6 HDR 200, PCIe Gen4 x16, 2 TB)",
    ),
}
