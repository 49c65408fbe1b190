"""Analytic cost model of one HBP micro-step on a GPU cluster (numpy arithmetic).

It prices what a rank does for one micro-step of a level (pack length, sp, checkpointed layers):
dense matmul FLOPs, causal attention FLOPs (sum of squared document lengths), the SP kind's
communication bytes (``SPKind.comm_bytes_per_layer``; Ulysses: all-to-alls) over NVLink or
InfiniBand, and the recomputation of checkpointed layers; and what it holds:
ZeRO-partitioned parameters, gradients and Adam states plus activations of the non-checkpointed
layers. Every constant is written here with where it comes from.

Time of a rank for a micro-step (seconds):
    dense        = tokens * 2 * (layer_params * (3 + c / L) + lm_head_params * 3) / (peak * eff_dense)
    attention    = 2 * hidden * sum(len^2) / sp * (3.5 * L + c) / (peak * eff_attn)
    ulysses_comm = all-to-all bytes per layer * (2 * L + c) / link bandwidth      (ulysses > 1)
    cp_comm      = what the K/V all-gathers and dK/dV reduce-scatters add to attention (cp > 1)
    sp_comm      = ulysses_comm + cp_comm
with tokens = the rank's share of its SP group's packs, c = checkpointed layers, sp = ulysses x cp.
Backward costs twice the forward for matmuls and 2.5 times for flash attention; a checkpointed
layer runs its forward once more, collectives included. The Ulysses all-to-alls sit on the critical
path of their layer and are priced in full. Context parallelism moves a layer's K/V in S kv-head
slices (``topology.cp_slices``), the transfer of slice j + 1 in flight while slice j's attention
runs: a pass exposes its first slice's transfer and, after that, whatever of each transfer the
slice's attention does not cover (``exposed``). The forward (and a checkpointed layer's second
forward) gathers K/V once; the backward gathers again and reduce-scatters dK/dV in fp32 (three times
the forward's bytes)
beside 2.5 times the forward's attention, and runs the kernel's backward from the forward's saved
output and LSE, so nothing is recomputed (the flash-attention backends; Flex would recompute).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing.context_split import split_micro_batch
from lit_hbp.parallel.kind import resolve_sp_kind
from lit_hbp.parallel.topology import cp_slices

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One GPU kind and its links. Bandwidths are per GPU and per direction, in bytes/s.

    eff_dense / eff_attn: achieved share of peak bf16 FLOP/s for large matmuls and for flash
    attention; eff_link: achieved share of link bandwidth in all-to-all and ring collectives.
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
    source: str = ""


# Peak dense bf16 FLOP/s and memory from NVIDIA's datasheets (H100 SXM5: 989 TFLOP/s, 80 GB;
# H200 SXM: 989 TFLOP/s, 141 GB; A100 SXM4 80GB: 312 TFLOP/s). NVLink: 900 GB/s (H100/H200,
# NVLink 4) and 600 GB/s (A100, NVLink 3) total per GPU, i.e. half per direction. InfiniBand: one
# 400 Gb/s NDR NIC per GPU (DGX H100/H200) = 50 GB/s, one 200 Gb/s HDR NIC per GPU (DGX A100) =
# 25 GB/s. Efficiencies: ~60% of peak is what tuned bf16 GEMMs of LLM-sized matrices sustain in
# Megatron/DeepSpeed reports (MFU 40-55% end to end), ~50% what flash-attention 2/3 reaches on
# long causal sequences, ~70% of the link rate what NCCL all-to-all and ring collectives reach.
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "H100-80GB",
        989e12,
        80 * GB,
        450 * GB,
        50 * GB,
        source="NVIDIA H100 SXM5 datasheet; DGX H100 (8x NVLink 4, 8x ConnectX-7 NDR 400)",
    ),
    "h200": Hardware(
        "H200-141GB",
        989e12,
        141 * GB,
        450 * GB,
        50 * GB,
        source="NVIDIA H200 SXM datasheet; DGX H200 (NVLink 4, ConnectX-7 NDR 400)",
    ),
    "a100": Hardware(
        "A100-80GB",
        312e12,
        80 * GB,
        300 * GB,
        25 * GB,
        source="NVIDIA A100 SXM4 80GB datasheet; DGX A100 (NVLink 3, ConnectX-6 HDR 200)",
    ),
}

# Activation memory, calibrated on the paper's Table 4 (LLaMA3.1-8B, H100-80GB, the minimum number
# of checkpointed layers that fits ~78 GB at 32K/64K/128K and sp 2-16): a least-squares fit gives
# 598 KB per token per non-checkpointed layer, which is 2.75 x the bf16 tensors a decoder layer
# saves for backward (24*hidden + 8*intermediate + 4*kv_heads*head_dim bytes: norm inputs, q/k/v,
# RoPE operands, attention output, MLP gate/up/act/product); the rest is fp32 norm copies,
# temporaries and allocator fragmentation. A checkpointed layer keeps its bf16 input (2*hidden
# bytes) plus the residual stream (2*hidden). The same fit puts 1.0 MB per token outside the
# layers, which is vocab * 8 bytes: fp32 logits and their gradient. lit-hbp's chunked
# cross-entropy never holds those; its LM head keeps one chunk of logits instead.
ACTIVATION_FACTOR = 2.75
FULL_LOGITS_BYTES_PER_VOCAB = 8
MEMORY_RESERVE_BYTES = 2 * GB  # CUDA context, NCCL buffers, allocator reserve
FLASH_BACKWARD = 2.5  # flash-attention backward FLOPs / forward FLOPs


@dataclass(frozen=True)
class CostModel:
    """Prices micro-steps of a model on a cluster. ``world`` ranks, ZeRO ``zero_stage`` over the
    whole world (HBP never gives DeepSpeed an SP mpu), bf16 compute, Adam with fp32 states.

    logits: "chunked" (lit-hbp: the LM head runs in chunks of ``ce_chunk`` tokens) or "full"
    (the whole [tokens, vocab] logits in fp32, as the paper's framework held them).
    sp_kind: how levels with sp > 1 and no context parallelism split a pack
        (``lit_hbp.parallel.kind``), for its traffic; levels with cp > 1 run the ``cp`` kind."""

    model: ModelSpec
    hardware: Hardware
    world: int
    zero_stage: int = 2
    logits: str = "chunked"
    ce_chunk: int = 2048
    grad_sync_overlap: float = 0.5
    sp_kind: str = "ulysses"

    # ----------------------------------------------------------------------------- time

    def dense_seconds(self, tokens: float, ckpt: int) -> float:
        m = self.model
        recompute = ckpt * 2.0 * m.layer_params * tokens  # the checkpointed layers' second forward
        flops = m.train_flops(tokens, 0.0, tokens) + recompute
        return flops / (self.hardware.peak_flops * self.hardware.eff_dense)

    def attention_forward_seconds(self, sum_sq, sp: int):
        """One layer's attention forward on a rank holding 1/sp of the work of ``sum_sq``."""
        return (
            2.0 * self.model.heads * self.model.dim * sum_sq / sp / (self.hardware.peak_flops * self.hardware.eff_attn)
        )

    def attention_seconds(self, sum_sq: float, sp: int, ckpt: int) -> float:
        layers = self.model.layers
        return self.attention_forward_seconds(sum_sq, sp) * ((1 + FLASH_BACKWARD) * layers + ckpt)

    def _link_seconds(self, nbytes, peers: int, local: int):
        """Seconds to send ``nbytes`` to ``peers`` - 1 others of which ``local`` - 1 share the node
        (NVLink) and the rest are across InfiniBand; the slower side bounds."""
        hw = self.hardware
        intra = nbytes * (local - 1) / (peers - 1)
        inter = nbytes * (peers - local) / (peers - 1)
        return np.maximum(intra / hw.intra_node_bw, inter / hw.inter_node_bw) / hw.eff_link

    def comm_parts(self, tokens, sp: int, ckpt: int, cp: int = 1, sum_sq=None) -> dict:
        """Seconds of one rank's SP communication in a micro-step, by collective family:
        ``ulysses_comm`` (all-to-alls inside the Ulysses group of sp / cp contiguous ranks) and
        ``cp_comm`` (K/V all-gathers and dK/dV reduce-scatters over the CP group, strided across
        the Ulysses groups: its peers share a node only while a Ulysses group is smaller than one),
        as much of them as the attention of the layer's ``sum_sq`` does not hide (all of them
        without ``sum_sq``)."""
        zero = 0.0 * tokens
        if sp == 1:
            return dict(ulysses_comm=zero, cp_comm=zero)
        hw, layers = self.hardware, self.model.layers
        kind = resolve_sp_kind("cp" if cp > 1 else self.sp_kind)
        u = sp // cp
        if cp == 1:
            per_layer = kind.comm_bytes_per_layer(self.model, tokens, sp)
            ulysses = self._link_seconds(per_layer, sp, min(sp, hw.gpus_per_node))
            return dict(ulysses_comm=(2 * layers + ckpt) * (ulysses + 4 * hw.link_latency_s), cp_comm=zero)
        parts = kind.comm_breakdown(self.model, tokens, sp, cp)
        out = dict(ulysses_comm=zero)
        if u > 1:
            ulysses = self._link_seconds(parts["ulysses"], u, min(u, hw.gpus_per_node))
            out["ulysses_comm"] = (2 * layers + ckpt) * (ulysses + 4 * hw.link_latency_s)
        local = 1 if u >= hw.gpus_per_node else min(cp, hw.gpus_per_node // u)
        slices = cp_slices(self.model.kv_heads, u, cp)
        gather = self._link_seconds(parts["cp"], cp, local) + 2 * slices * hw.link_latency_s  # K and V per slice
        compute = zero if sum_sq is None else self.attention_forward_seconds(sum_sq, sp)
        forward = exposed(gather, compute, slices)
        backward = exposed(3 * gather, FLASH_BACKWARD * compute, slices)
        out["cp_comm"] = (layers + ckpt) * forward + layers * backward
        return out

    def sp_comm_seconds(self, tokens, sp: int, ckpt: int, cp: int = 1, sum_sq=None):
        return sum(self.comm_parts(tokens, sp, ckpt, cp, sum_sq).values())

    def micro_step(self, tokens, sum_sq, sp: int, ckpt: int, cp: int = 1) -> dict:
        """Seconds of one rank for a micro-step: dense, attention, sp_comm (with its parts
        ulysses_comm and cp_comm) and the total. ``tokens`` and ``sum_sq`` may be numpy arrays
        (one entry per rank or SP group); ``cp`` is the level's context-parallel degree."""
        comm = self.comm_parts(tokens, sp, ckpt, cp, sum_sq)
        parts = dict(
            dense=self.dense_seconds(tokens, ckpt),
            attention=self.attention_seconds(sum_sq, sp, ckpt),
            sp_comm=comm["ulysses_comm"] + comm["cp_comm"],
        )
        parts["total"] = sum(parts.values())
        return {**parts, **comm}

    def grad_sync_seconds(self) -> float:
        """Per optimizer step: reduce-scatter of bf16 gradients and all-gather of bf16 parameters
        over the world (ring), on the slowest link, minus the part overlapped with backward."""
        if self.world == 1:
            return 0.0
        hw = self.hardware
        bw = hw.inter_node_bw if self.world > hw.gpus_per_node else hw.intra_node_bw
        per_collective = 2.0 * self.model.params * (self.world - 1) / self.world
        return 2 * per_collective / (bw * hw.eff_link) * (1 - self.grad_sync_overlap)

    # --------------------------------------------------------------------------- memory

    def static_bytes(self) -> float:
        """Parameters (bf16), gradients (bf16) and Adam states (fp32 master, m, v) per rank."""
        p, n, z = self.model.params, self.world, self.zero_stage
        params = 2 * p / (n if z >= 3 else 1)
        grads = 2 * p / (n if z >= 2 else 1)
        states = 12 * p / (n if z >= 1 else 1)
        return params + grads + states

    def activation_bytes_per_token_layer(self) -> float:
        m = self.model
        saved = 24 * m.hidden + 8 * m.intermediate + 4 * m.kv_heads * m.dim
        return ACTIVATION_FACTOR * saved

    def memory_bytes(self, pack_len: int, sp: int, ckpt: int, packs_per_rank: int = 1) -> float:
        """Peak bytes per rank training packs of ``pack_len`` tokens at this sp and checkpointing."""
        m = self.model
        tokens = pack_len * packs_per_rank / sp
        layers = tokens * ((m.layers - ckpt) * self.activation_bytes_per_token_layer() + ckpt * 4 * m.hidden)
        if self.logits == "full":
            head = tokens * m.vocab * FULL_LOGITS_BYTES_PER_VOCAB
        else:
            head = min(tokens, self.ce_chunk) * m.vocab * FULL_LOGITS_BYTES_PER_VOCAB + tokens * 4 * m.hidden
        return self.static_bytes() + layers + head + MEMORY_RESERVE_BYTES

    def fits(self, pack_len: int, sp: int, ckpt: int, packs_per_rank: int = 1) -> bool:
        return self.memory_bytes(pack_len, sp, ckpt, packs_per_rank) <= self.hardware.memory_bytes


def exposed(comm, compute, pieces: int):
    """Seconds a pass's collective adds to its compute when both run in ``pieces`` equal parts, part
    j + 1's transfer in flight while part j computes: the first part's transfer waits in full, each
    later one for what its part of the compute does not cover."""
    return comm / pieces + (pieces - 1) / pieces * np.maximum(comm - compute, 0.0)


def synthetic_pack(lengths: np.ndarray, pack_len: int, rng: np.random.Generator) -> np.ndarray:
    """Sample lengths of one pack of ``pack_len`` drawn from the data's length distribution, filled
    the way the planner fills packs: draws that do not fit the space left are skipped, until the
    pack is full or no drawn sample fits (samples longer than the pack are cut to it)."""
    lengths = np.minimum(np.asarray(lengths, dtype=np.int64), pack_len)
    lengths = lengths[lengths > 0]
    room, take = pack_len, []
    for n in rng.choice(lengths, size=4 * pack_len // max(int(lengths.min()), 1) + 1).tolist():
        if n <= room:
            take.append(n)
            room -= n
            if room < lengths.min():
                break
    return np.asarray(take, dtype=np.int64)


def pack_stats(
    lengths, pack_len: int, seed: int = 0, max_packs: int = 64, sp: int = 1, cp: int = 1
) -> tuple[float, float]:
    """Mean tokens and mean sum of squared lengths of a pack of ``pack_len`` filled from the data's
    length distribution: what a level's packs hold. With ``cp`` > 1 the sum of squares is priced at
    the busiest CP rank (times its max / mean area under the split training uses at degree ``sp``,
    ``split_micro_batch``), as the simulator prices CP groups."""
    rng = np.random.default_rng(seed)
    packs = [synthetic_pack(lengths, pack_len, rng) for _ in range(max_packs)]
    busiest = [split_micro_batch(p, sp, cp).imbalance() if cp > 1 else 1.0 for p in packs]
    sum_sq = [(p.astype(np.float64) ** 2).sum() * b for p, b in zip(packs, busiest)]
    return float(np.mean([p.sum() for p in packs])), float(np.mean(sum_sq))
