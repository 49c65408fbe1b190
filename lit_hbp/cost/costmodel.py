"""Analytic cost model of one HBP micro-step on a GPU cluster (numpy arithmetic).

It prices what a rank does for one micro-step of a level (pack length, sp, checkpointed layers):
dense matmul FLOPs, causal attention FLOPs (sum of squared document lengths), the SP kind's
communication bytes (``SPKind.comm_bytes_per_layer``; Ulysses: all-to-alls) over NVLink or
InfiniBand, the recomputation of checkpointed layers, a tiled MLP's second forward and the host
copies of offloaded layer inputs; and what it holds: ZeRO-partitioned parameters, gradients and Adam
states, the activations of the layers run whole, the checkpointed inputs (on the device or the host),
a layer's recompute and backward working set and the LM head's chunk (``memory_parts``). Every
constant is written here with where it comes from (the GPU kinds' in ``hardware``); the time and the memory of a
level price the same layout with the same constants, and the level search reads both. What a level's packs hold
is drawn in ``sample_packs``.

Time of a rank for a micro-step (seconds):
    dense        = tokens * 2 * (layer_params * (3 + c / L) + lm_head_params * 3) / (peak * eff_dense)
                 + a hybrid's mixers: (mixer_tokens - tokens) * 2 * mixer_params * M * (3 + c / L) / (peak * eff_dense)
    attention    = 2 * hidden * sum(len^2) / sp * (3.5 * A + c A / L) / (peak * eff_attn)
    ulysses_comm = all-to-all bytes per layer * (2 * A + c A / L) / link bandwidth (ulysses > 1)
                 + a hybrid's mixer gathers * (2 * (L - A) + c (L - A) / L) / link bandwidth
    cp_comm      = what the K/V all-gathers and dK/dV reduce-scatters add to attention (cp > 1)
    sp_comm      = ulysses_comm + cp_comm
    offload      = the host copies of the c checkpointed inputs (t b h bytes each, each way over
                   ``host_bw``) not hidden behind a layer's forward (going) or recompute and backward
                   (coming back), ``exposed`` in c pieces                       (offload levels)
with tokens = the rank's share of its SP group's packs, c = checkpointed layers, sp = ulysses x cp, A the
layers that attend (``ModelSpec.attending``: all but a hybrid's stateful mixers, whose work is dense; on a
Ulysses level they gather the pack's inputs and reduce-scatter their outputs, ``mixer_comm_bytes``), M the layers
holding one (``ModelSpec.mixing``), mixer_tokens what the busiest rank runs through each at full width
(``mixer_share.mixer_tokens``: its documents, 1/sp of every document's heads, or every document).
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

from lit_hbp.cost.hardware import Hardware
from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing.mixer_share import PAD_SLACK, splits
from lit_hbp.parallel.kind import resolve_sp_kind
from lit_hbp.parallel.topology import cp_slices

# Activation memory: the tensors lit-hbp's forward keeps for the backward, counted op by op for a
# Llama-style decoder layer (RMSNorm, q/k/v/o projections with RoPE, a gated MLP) in the model's
# dtype of ``b`` bytes, per token and layer (``CostModel.layer_saved_bytes``):
#   each RMSNorm: its input upcast to fp32 (4h), the normalized bf16 copy the weight multiplies and
#     the output the next matmuls save (2 x b h)                                    2 x (4h + 2bh)
#     (a layer's own norms where counted on the model: ``ModelSpec.norm_values`` values of 4 + 2b bytes, Gemma
#     3's four, Qwen 3's and OLMo 2's query and key norms)
#   attention: q and k after RoPE, v (the kernel's inputs), its output (o_proj's input is a view of
#     it; the CPU sdpa backend keeps each document's output and their concatenation: 2 copies) and
#     its fp32 log-sum-exp                                        b(q + 2kv) + b q copies + 4 heads
#   gated MLP: gate, act(gate), up, act * up                                                 4 b i
#   a mixture of experts instead: the router's input row, fp32 probabilities and top-k indices, and per routed
#     expert its copy of the row, gate, up, activation, product and output (2h + 4i_e each), shared experts
#     as a gated MLP (``moe_spec.Experts.saved``); multi-head latent attention at its own query-key and value
#     widths with its low-rank projections' normed rows; dropout's masks (a bool a value on CUDA, a value of
#     the dtype on CPU); attention dropout on the CPU's sdpa (each document's probabilities) is refused
# checked against measured bytes on CPU (tests/test_memory_model.py: within 10% at 4096-8192 tokens,
# sp 1 and Ulysses 2, 0-4 of 4 layers checkpointed, offload, 1-8 MLP tiles, fp32 and bf16). A
# checkpointed layer keeps its input (b h), on the host with offload; its recompute holds one layer's
# set again. The running layer's backward adds a working set (``working_bytes``): the gradients of
# the residual stream and of the layer input (2 b h) and the largest of its phases (MLP, upcast norm,
# attention with the SP kind's buffers). The LM head's phase (``head_bytes``) comes before the
# layers' backward and holds one chunk of fp32 logits and their gradient (8 bytes per vocab entry).
# The paper's framework (Tables 4 and 12) held 2.6x these activations (its temporaries and allocator
# fragmentation) and all the logits: ``PAPER_ACTIVATION_OVERHEAD`` with ``logits="full"`` reproduces
# its checkpoint counts at 32K on 32 H100s (sp 2/4/8/16: 28/21/7/0 layers; the paper: 28/23/8/0).
PAPER_ACTIVATION_OVERHEAD = 2.6
FULL_LOGITS_BYTES_PER_VOCAB = 8
MEMORY_RESERVE_BYTES = 2e9  # CUDA context, NCCL buffers, allocator reserve: an estimate of 2 GB (1.86 GiB)
FLASH_BACKWARD = 2.5  # flash-attention backward FLOPs / forward FLOPs
ATTENTION_OUTPUT_COPIES = {"flash": 1, "sdpa": 2}


@dataclass(frozen=True)
class CostModel:
    """Prices micro-steps of a model on a cluster. ``world`` ranks, ZeRO ``zero_stage`` over the
    whole world (HBP never gives DeepSpeed an SP mpu), bf16 compute, Adam's states as ``deepspeed`` says.

    logits: "chunked" (lit-hbp: the LM head runs in chunks of ``ce_chunk`` tokens) or "full"
    (the whole [tokens, vocab] logits in fp32, as the paper's framework held them).
    sp_kind: how levels with sp > 1 and no context parallelism split a pack
        (``lit_hbp.parallel.kind``), for its traffic; levels with cp > 1 run the ``cp`` kind.
    dtype_bytes: bytes of the model's parameters and activations (2: bf16; 4: fp32).
    attention: "flash" (a kernel keeping one output) or "sdpa" (lit-hbp's per-document fallback on CPU).
    activation_overhead: multiplies the activations, for a framework that keeps more than the tensors
        counted here (``PAPER_ACTIVATION_OVERHEAD``).
    liger: the model runs Liger's RMSNorm (keeps its bf16 input and an fp32 rstd per row, no fp32 copy)
        and SwiGLU (keeps gate and up, recomputes the activation), ``HBPLitModule(liger=True)``: from
        Liger-Kernel's ``LigerRMSNormFunction`` / ``LigerSiLUMulFunction`` ``save_for_backward``; GPU
        only, so not measured on CPU.
    optimizer_offload: DeepSpeed's ``offload_optimizer`` to the host: the Adam states leave the GPU (ZeRO 1-3).
    param_offload: DeepSpeed's ``offload_param`` to the host: ZeRO-3's parameter partitions leave the GPU.
    trainable: share of the parameters trained (gradients, Adam states, a tiled MLP's gradient sums, the
        backward's weight-gradient matmuls, the gradient sync): 1 for full fine-tuning; under LoRA its adapters'
        and ``modules_to_save``' parameters over the model's, counted on the model (``param_counts.lora_settings``).
    added_params: parameters the run holds beside the model's (LoRA's adapters and trained copies), in its dtype.
    prefetch: offload brings the next input back while a layer recomputes (a CUDA side stream: two
        inputs on the device then); False where the copy back is synchronous (CPU, other devices).
    vision_trained: a vision-language model's tower trains (its gradients, Adam states and activations);
        False under ``freeze_vision`` and LoRA (it runs forward only).
    vision_patches_per_token: the most image patches the tower encodes per token of a pack, from the data
        (``VisionLoad.patches_per_token``; 0: no images): a pack of L tokens holds up to L times it.
    lora_whole: the LoRA setting with which peft reads an adapted weight whole (``build.lora_reads_whole``: DoRA,
        trainable tokens, an init from the base weights), which ZeRO-3 partitions; "": none.
    compiled: the decoder layers run compiled (``HBPLitModule(compile=True)``): inductor's partitioner keeps
        fewer of a layer's tensors for its backward than eager does (``layer_saved_bytes``).
    autocast: the parameters stay in fp32 and the layers compute in ``dtype_bytes`` under autocast (Lightning's
        ``*-mixed`` precision without DeepSpeed, ``HBPDDPStrategy``): fp32 parameters and gradients, no master
        copy, and the low-precision copy of every layer's matmul weights, which autocast casts in the forward
        and the backward keeps (``static_parts``' ``casts``; the LM head's checkpointed loss chunks cast its weight
        again each time). DeepSpeed's bf16 holds the parameters in bf16 instead.
    deepspeed: DeepSpeed steps the optimizer (``HBPStrategy``, any ZeRO stage): below fp32 an fp32 master copy and fp32
        Adam states; False (DDP, one device: ZeRO stage 0 without DeepSpeed) torch's AdamW steps the parameters
        themselves, its m and v in their dtype (a ``*-true`` half precision: 4 bytes a parameter, no master)."""

    model: ModelSpec
    hardware: Hardware
    world: int
    zero_stage: int = 2
    logits: str = "chunked"
    ce_chunk: int = 1024
    grad_sync_overlap: float = 0.5
    sp_kind: str = "ulysses"
    dtype_bytes: int = 2
    attention: str = "flash"
    activation_overhead: float = 1.0
    liger: bool = False
    optimizer_offload: bool = False
    param_offload: bool = False
    trainable: float = 1.0
    added_params: float = 0.0
    prefetch: bool = True
    vision_trained: bool = True
    vision_patches_per_token: float = 0.0
    lora_whole: str = ""
    compiled: bool = False
    autocast: bool = False
    deepspeed: bool = True

    # ----------------------------------------------------------------------------- time

    def dense_seconds(self, tokens: float, ckpt: int, tiles: int = 1, mixer_tokens=None) -> float:
        """The matmuls of a rank holding ``tokens`` of its SP group's packs; a hybrid's stateful mixers run
        ``mixer_tokens`` at their full width instead (``mixer_share.mixer_tokens``: on a Ulysses level, the
        busiest rank's documents, or every document on every rank; None: ``tokens``)."""
        m = self.model
        # The checkpointed layers' second forward, up to the last tensor their backward reads (a compiled layer's, a
        # tiled MLP's and, under LoRA, whose adapter on the output projection runs after it, whole)
        skipped = m.recompute_skipped if tiles == 1 and not self.compiled and self.trainable == 1.0 else 0.0
        recompute = ckpt * 2.0 * (m.layer_params - skipped) * tokens
        if tiles > 1:  # a tiled MLP runs its forward once more in the backward, tile by tile
            recompute = recompute + m.layers * 2.0 * m.mlp_matrices * m.hidden * m.intermediate * tokens
        # Frozen weights (LoRA: ``trainable`` 0) run no weight gradient: a matmul's backward is one forward, not two.
        frozen = m.train_flops(tokens, 0.0, tokens, weight_grads=False)
        flops = frozen + self.trainable * (m.train_flops(tokens, 0.0, tokens) - frozen) + recompute
        if mixer_tokens is not None and m.mixing:  # beyond the rank's share, forward, backward and recompute
            passes = 2 + self.trainable + ckpt / m.layers
            flops = flops + (mixer_tokens - tokens) * 2.0 * m.mixer_matmul_params * m.mixing * passes
        return flops / (self.hardware.peak_flops * self.hardware.eff_dense)

    def attention_forward_seconds(self, sum_sq, sp: int):
        """One layer's attention forward on a rank holding 1/sp of the work of ``sum_sq``: its heads' query-key and
        value widths (``ModelSpec.train_flops``'s)."""
        m = self.model
        width = m.qk_width + m.v_width
        return m.heads * width * sum_sq / sp / (self.hardware.peak_flops * self.hardware.eff_attn)

    def attention_seconds(self, sum_sq: float, sp: int, ckpt: int) -> float:
        """The attention of the layers that attend (a hybrid's mixers are dense work), its checkpointed
        layers' recompute in their proportion."""
        m = self.model
        attending = m.attending
        return self.attention_forward_seconds(sum_sq, sp) * (
            (1 + FLASH_BACKWARD) * attending + ckpt * attending / m.layers
        )

    def vision_seconds(self, work, sp: int, ckpt: int):
        """The vision tower's part of a micro-step: its forward over the images of ``work`` (the planner's
        units, ``VisionLoad.work``) split over the SP group, with its backward (twice the forward: dense
        work) when it trains and, on a level that checkpoints, its forward again (its blocks recompute)."""
        passes = (3.0 + (1.0 if ckpt else 0.0)) if self.vision_trained else 1.0
        flops = work * self.model.pair_flops / sp * passes
        return flops / (self.hardware.peak_flops * self.hardware.eff_dense)

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
        own = self.dtype_bytes / 2  # the kinds count bf16 activations; they move in the run's own dtype
        if cp == 1:
            m, local = self.model, min(sp, hw.gpus_per_node)
            per_layer = own * kind.comm_bytes_per_layer(m, tokens, sp)
            ulysses = self._link_seconds(per_layer, sp, local)
            attending, mixing = m.attending, m.mixing
            comm = (2 * attending + ckpt * attending / layers) * (ulysses + 4 * hw.link_latency_s)
            if mixing:  # a hybrid's mixers: the pack's inputs gathered, the ranks' outputs reduce-scattered
                mixer = self._link_seconds(own * mixer_comm_bytes(m, tokens, sp), sp, local)
                comm = comm + (2 * mixing + ckpt * mixing / layers) * (mixer + 2 * hw.link_latency_s)
            return dict(ulysses_comm=comm, cp_comm=zero)
        parts = {name: own * nbytes for name, nbytes in kind.comm_breakdown(self.model, tokens, sp, cp).items()}
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

    def micro_step(
        self,
        tokens,
        sum_sq,
        sp: int,
        ckpt: int,
        cp: int = 1,
        offload: bool = False,
        tiles: int = 1,
        vision_work=0.0,
        mixer_tokens=None,
    ) -> dict:
        """Seconds of one rank for a micro-step: dense, attention, vision (the tower's images of
        ``vision_work``), sp_comm (with its parts ulysses_comm and cp_comm), offload (the host copies'
        exposed part) and the total. ``tokens``, ``sum_sq``, ``vision_work`` and ``mixer_tokens`` (a
        hybrid's: ``dense_seconds``) may be numpy arrays (one entry per rank or SP group); ``cp`` is the
        level's context-parallel degree."""
        comm = self.comm_parts(tokens, sp, ckpt, cp, sum_sq)
        parts = dict(
            dense=self.dense_seconds(tokens, ckpt, tiles, mixer_tokens),
            attention=self.attention_seconds(sum_sq, sp, ckpt),
            vision=self.vision_seconds(vision_work, sp, ckpt) + 0.0 * tokens,
            sp_comm=comm["ulysses_comm"] + comm["cp_comm"],
            offload=self.offload_seconds(tokens, ckpt, sum_sq, sp) if offload else 0.0 * tokens,
        )
        parts["total"] = sum(parts.values())
        return {**parts, **comm}

    def grad_sync_seconds(self, accumulate: int = 1) -> float:
        """Per optimizer step of ``accumulate`` micro-steps: reduce-scatter of the gradients and all-gather of the
        parameters (or DDP's all-reduce, the same bytes on a ring) over the world, on the slowest link, minus the part
        overlapped with backward; in the parameters' dtype (``dtype_bytes``; fp32 under ``autocast``), of the trained
        parameters only (LoRA's frozen weights have no gradient and no partition to gather; a trained vision
        tower's have). ZeRO-2 and 3 partition the gradients, so they reduce-scatter them at every micro-step's
        backward (DeepSpeed's ``partition_gradients``), and ZeRO-3 gathers the parameters at every micro-step's
        forward and backward; DDP and ZeRO 0-1 sync once, at the step's last micro-step."""
        if self.world == 1:
            return 0.0
        hw = self.hardware
        bw = hw.inter_node_bw if self.world > hw.gpus_per_node else hw.intra_node_bw
        bytes_per, m = (4 if self.autocast else self.dtype_bytes), self.model
        trained = m.params + (m.vision.params(m.hidden) if m.vision is not None and self.vision_trained else 0.0)
        per_collective = bytes_per * trained * self.trainable * (self.world - 1) / self.world
        partitioned = self.deepspeed or self.zero_stage >= 1
        reduces = accumulate if partitioned and self.zero_stage >= 2 else 1
        gathers = 2 * accumulate if partitioned and self.zero_stage >= 3 else 1
        return (reduces + gathers) * per_collective / (bw * hw.eff_link) * (1 - self.grad_sync_overlap)

    # --------------------------------------------------------------------------- memory

    def static_parts(self) -> dict:
        """Parameters and gradients (model dtype; fp32 under ``autocast``) and Adam states (DeepSpeed's: an fp32
        master below fp32, fp32 m and v; torch's without DeepSpeed: m and v in the parameters' dtype) per rank, as
        ZeRO partitions them over the world (none of what is offloaded to the host); under ``autocast`` the matmuls'
        low-precision weight copies (``casts``) too. The model's parameters each once (a shared layer's:
        ``ModelSpec.params``), with those the run adds (``added_params``: LoRA's)."""
        n, z, b, m = self.world, self.zero_stage, self.dtype_bytes, self.model
        vision = 0.0 if m.vision is None else m.vision.params(m.hidden)
        p = m.params + self.added_params + vision
        held = 4 if self.autocast else b  # autocast: fp32 parameters and gradients, and they are the master
        if self.deepspeed or z >= 1:  # a ZeRO stage is DeepSpeed's (a lever may raise one on a run without it)
            states = (4 if held < 4 else 0) + 8  # fp32 training keeps no master copy
        else:
            states = 2 * held  # torch.optim.AdamW: exp_avg and exp_avg_sq like the parameter
        trained = (m.params + (vision if self.vision_trained else 0.0)) * self.trainable
        per_layer = m.held_layer_params
        # the layers' matrices, LoRA's adapters; the LM head's copy is made again by each checkpointed loss chunk
        matmuls = m.layers * per_layer + vision + self.added_params
        return dict(
            params=0.0 if self.param_offload else held * p / (n if z >= 3 else 1),
            grads=held * trained / (n if z >= 2 else 1),
            optimizer=0.0 if self.optimizer_offload else states * trained / (n if z >= 1 else 1),
            casts=b * matmuls if self.autocast and b < 4 else 0.0,
        )

    def static_bytes(self) -> float:
        return sum(self.static_parts().values())

    def layer_saved_bytes(self, tiles: int = 1) -> float:
        """Bytes per token a decoder layer keeps for its backward (the table above). A compiled layer (without
        Liger's kernels or MLP tiles, which break its graph) keeps what inductor's min-cut partitioner saves,
        measured by saved-tensor hooks (``tests/test_memory_model.py``): four rows of the hidden width, the
        norms' fp32 rstd, q, k, v, one attention output, the LSE and three rows of the MLP's width; it recomputes
        the norms' fp32 copies and the MLP's activation that eager keeps."""
        m, b = self.model, self.dtype_bytes
        if m.attention_dropout and self.attention == "sdpa":
            raise ValueError(
                f"{m.name}: attention dropout on the CPU's sdpa keeps each document's attention probabilities (growing "
                "with its square), which the cost model does not price: set the config's attention dropout to 0"
            )
        masks = m.dropout_values * (b if self.attention == "sdpa" else 1)
        if self.compiled and tiles == 1 and not self.liger:
            q, kv = m.heads * m.dim, m.kv_heads * m.dim
            kept = b * (4 * m.hidden + 2 * q + 2 * kv + 3 * self._mlp_width()) + 4 * m.heads + 2 * 4
            return self.activation_overhead * (kept + m.mlp_bytes + masks)
        norms = 2 * (self._norm_input() + 2 * b * m.hidden)
        if m.norm_values is not None and not self.liger:  # Hugging Face's norms, of the layer's own widths
            norms = m.norm_values * (4 + 2 * b)
        if m.mlp_values is not None:  # a mixture of experts (Liger's SwiGLU replaces a dense gated MLP only)
            mlp = b * m.mlp_values + m.mlp_bytes if tiles == 1 else 0
        else:
            mlp = (2 if self.liger else 4) * b * m.intermediate if tiles == 1 else 0
        return self.activation_overhead * (norms + self._attention_saved() + mlp + masks)

    def _mlp_width(self) -> float:
        """The MLP width a token passes through: ``intermediate``, a mixture of experts' top-k and shared experts'."""
        m = self.model
        return m.intermediate if m.mlp_values is None else m.mlp_values / 4

    def _attention_saved(self) -> float:
        """Bytes per token attention keeps for its backward: q, k, v, the output's copies, the LSE; multi-head latent
        attention's at its query-key and value widths (v a view of the key-value projection's output, whose query-key
        part it keeps), and its low-rank projections' normed rows and rotary key."""
        m, b = self.model, self.dtype_bytes
        q, kv = m.heads * m.dim, m.kv_heads * m.dim
        if m.latent is None or m.value_dim is None or m.attention_width is None:
            return b * (q + 2 * kv) + b * q * ATTENTION_OUTPUT_COPIES[self.attention] + 4 * m.heads
        q_rank, kv_rank, rope = m.latent
        qk, v = m.attention_width - m.value_dim, m.value_dim
        kept = b * m.heads * (2 * qk + (qk - rope + v) + v * ATTENTION_OUTPUT_COPIES[self.attention]) + 4 * m.heads
        norm = 4 + 2 * b  # an RMSNorm's fp32 copy, its normed row, the next projection's input
        return kept + norm * (q_rank + kv_rank) + b * rope

    def mixer_saved_bytes(self, pack_len: int, sp: int, packs_per_rank: int = 1) -> float:
        """Bytes one stateful mixer layer of a hybrid keeps beyond a layer's saved set of the rank's tokens: on a
        Ulysses level the pack's gathered hidden states (its input projection's input) and, for a mixer that
        does not split by heads (``mixer_share.splits``), the saved set of the whole pack, the worst case (one
        document, run by every rank); at every sp the padding of the batches its documents run in as rows
        (``mixer_share.length_batches``: at most ``PAD_SLACK`` of a batch's tokens, so at most
        ``PAD_SLACK / (1 - PAD_SLACK)`` of the tokens run, the worst case: many short documents), each padded
        token holding the mixer's set and its copy of an input row (the batches are copies of the pack's rows,
        all of the gathered pack's on a Ulysses level). A mixer's own set per token priced as attention's."""
        m = self.model
        if not m.mixing:
            return 0.0
        tokens = pack_len * packs_per_rank / sp
        whole = tokens * sp
        run = tokens if splits(m.mixer_heads, sp) else whole
        gathered = (whole - tokens) * self.dtype_bytes * m.hidden
        per_token, pad = self._attention_saved(), PAD_SLACK / (1 - PAD_SLACK)
        padded = pad * (run * per_token + whole * self.dtype_bytes * m.hidden)  # rows of the whole pack's inputs
        return self.activation_overhead * (gathered + (run - tokens) * per_token + padded)

    def _norm_input(self) -> float:
        """Bytes per token an RMSNorm keeps beyond two model-dtype rows: Hugging Face's keeps an fp32
        copy of its input (the two rows: the normalized copy the weight multiplies, the output); Liger's
        keeps an fp32 rstd (the two rows: its input, the output)."""
        return 4 if self.liger else 4 * self.model.hidden

    def _upcast(self) -> float:
        """fp32 temporaries of an upcasting RMSNorm's backward (none in fp32 or with Liger)."""
        return 8 * self.model.hidden if self.dtype_bytes < 4 and not self.liger else 0

    def working_bytes(self, tokens: float, sp: int, cp: int = 1, tiles: int = 1) -> float:
        """Transient bytes of the running layer's backward on a rank of ``tokens`` tokens."""
        m, b = self.model, self.dtype_bytes
        q, kv = m.heads * m.qk_width, m.kv_heads * (m.qk_width + m.v_width) / 2  # (k and v: 2 kv)
        # Phases of the backward, at their largest: the MLP's (it frees its saved set as it makes
        # gradients, 1.5 b i beyond it; a tiled one recomputes a tile and keeps its input gradient
        # whole), an upcast RMSNorm's fp32 backward (8h) with attention's input gradients alive, and
        # attention's: dq, dk, dv, the all-to-all's other copy of them (Ulysses), the K/V gathered
        # from the CP group and their fp32 gradients (CP).
        mlp = 1.5 * b * self._mlp_width() if tiles == 1 else 2.5 * b * m.intermediate / tiles + b * m.hidden
        norm = self._upcast() + b * (q + 2 * kv) if self._upcast() else 0
        attention = b * (q + 2 * kv) * (2 if sp // cp > 1 else 1) + (2 * kv * (b + 4) * cp if cp > 1 else 0)
        per_token = 2 * b * m.hidden + max(mlp, norm, attention)
        # a tiled MLP sums its weights' gradients over the tiles in fp32
        sums = 4 * m.mlp_matrices * m.hidden * m.intermediate * self.trainable if tiles > 1 else 0.0
        return self.activation_overhead * per_token * tokens + sums

    def vision_bytes(self, tokens: float, ckpt: int) -> float:
        """What a trained vision tower keeps for its backward on a rank of ``tokens`` tokens (its share of the
        pack's patches, at most ``vision_patches_per_token`` a token): every block's saved set, or on a level
        that checkpoints (its blocks checkpoint too) their inputs. Held from its forward, before the language
        model's, to its backward, after it: on top of the language model's peak. None when frozen."""
        v = self.model.vision
        if v is None or not self.vision_trained or not self.vision_patches_per_token:
            return 0.0
        patches = tokens * self.vision_patches_per_token
        per_block = self.dtype_bytes * v.hidden if ckpt else v.saved_bytes_per_patch(self.dtype_bytes)
        per_patch = v.layers * per_block + v.outside_bytes_per_patch(self.dtype_bytes)
        return self.activation_overhead * per_patch * patches

    def head_bytes(self, tokens: float) -> float:
        """The LM head's phase: the final norm's saved set, the hidden rows the chunked loss keeps, the
        RoPE tables, one chunk's fp32 logits and gradient (all the logits with ``logits="full"``), and
        the final norm's backward (the hidden gradient, fp32 temporaries when upcast)."""
        m, b = self.model, self.dtype_bytes
        saved = tokens * (self._norm_input() + 3 * b * m.hidden + 2 * b * m.dim + 2 * b * m.hidden + self._upcast())
        rows = tokens if self.logits == "full" else min(tokens, self.ce_chunk)
        return saved + rows * m.vocab * FULL_LOGITS_BYTES_PER_VOCAB

    def memory_parts(
        self,
        pack_len: int,
        sp: int,
        ckpt: int,
        packs_per_rank: int = 1,
        offload: bool = False,
        tiles: int = 1,
        cp: int = 1,
    ) -> dict:
        """Peak bytes per rank of a level, by part: ``params``, ``grads``, ``optimizer`` (ZeRO),
        ``layers`` (what the layers run without checkpointing keep), ``mixers`` (what a hybrid's mixers keep
        beyond that: their batches' padding, on a Ulysses level the gathered pack, ``mixer_saved_bytes``),
        ``checkpointed`` (checkpointed layers' inputs on the device: all of them, or with ``offload`` the one
        being recomputed and the one prefetched behind it), ``recompute`` (a checkpointed layer's set, rebuilt
        in its backward),
        ``working`` (the running layer's transients), ``head``, ``vision`` (a trained vision tower's saved
        set, ``vision_bytes``) and ``reserve``; and ``host`` (the
        offloaded inputs, in host memory: not part of the device total). ``memory_bytes`` adds them up,
        the head's phase and the layers' backward phase (recompute + working) taken at their larger."""
        m, b = self.model, self.dtype_bytes
        tokens = pack_len * packs_per_rank / sp
        saved = tokens * self.layer_saved_bytes(tiles)
        plain = m.layers - ckpt
        on_device = min(ckpt, 2 if self.prefetch else 1) if offload else ckpt
        mixer = self.mixer_saved_bytes(pack_len, sp, packs_per_rank)  # the recomputed layer may be a mixer
        parts = dict(self.static_parts())
        parts.update(
            layers=plain * saved,
            mixers=mixer * (m.mixing * plain / m.layers + (1 if ckpt and plain == 0 else 0)),
            checkpointed=on_device * tokens * b * m.hidden,
            recompute=saved if ckpt and plain == 0 else 0.0,
            working=self.working_bytes(tokens, sp, cp, tiles),
            head=self.head_bytes(tokens),
            vision=self.vision_bytes(tokens, ckpt),
            reserve=MEMORY_RESERVE_BYTES,
        )
        parts["host"] = (ckpt if offload else 0) * tokens * b * m.hidden
        return parts

    def memory_bytes(
        self,
        pack_len: int,
        sp: int,
        ckpt: int,
        packs_per_rank: int = 1,
        offload: bool = False,
        tiles: int = 1,
        cp: int = 1,
    ) -> float:
        """Peak bytes per rank training packs of ``pack_len`` tokens at this sp, checkpointing, offload and tiles."""
        p = self.memory_parts(pack_len, sp, ckpt, packs_per_rank, offload, tiles, cp)
        phases = max(p["head"], p["recompute"] + p["working"])  # the LM head's backward runs before the layers'
        held = p["params"] + p["grads"] + p["optimizer"] + p["casts"] + p["layers"] + p["mixers"] + p["checkpointed"]
        held += p["vision"]
        return held + phases + p["reserve"]

    def host_fits(self, pack_len: int, sp: int, ckpt: int, packs_per_rank: int = 1) -> bool:
        """Whether the node's host memory holds its GPUs' offloaded inputs (all checkpointed)."""
        hw = self.hardware
        per_gpu = self.memory_parts(pack_len, sp, ckpt, packs_per_rank, offload=True)["host"]
        return not hw.host_memory_bytes or per_gpu * hw.gpus_per_node <= hw.host_memory_bytes

    def fits(
        self,
        pack_len: int,
        sp: int,
        ckpt: int,
        packs_per_rank: int = 1,
        offload: bool = False,
        tiles: int = 1,
        cp: int = 1,
    ) -> bool:
        device = self.memory_bytes(pack_len, sp, ckpt, packs_per_rank, offload, tiles, cp) <= self.hardware.memory_bytes
        return device and (not offload or self.host_fits(pack_len, sp, ckpt, packs_per_rank))

    def offload_seconds(self, tokens, ckpt: int, sum_sq=None, sp: int = 1) -> float:
        """Exposed seconds of a micro-step's offload copies: each checkpointed layer's input goes to
        the host during the forward and comes back during the backward on the side stream, behind the
        compute of one layer (its forward; the next layer's recompute and backward)."""
        if not ckpt or not self.hardware.host_bw:
            return 0.0 * tokens
        m = self.model
        copy = tokens * self.dtype_bytes * m.hidden / self.hardware.host_bw
        forward = self.dense_seconds(tokens, 0) / 3 / m.layers
        if sum_sq is not None:
            forward = forward + self.attention_forward_seconds(sum_sq, sp)
        return exposed(ckpt * copy, ckpt * forward, ckpt) + exposed(ckpt * copy, ckpt * 3 * forward, ckpt)


SPANNING_BYTES = 4  # a value a split mixer sums over the ranks, as float32 (a norm's squares; x_proj's bf16: less)


def mixer_comm_bytes(model: ModelSpec, tokens, sp: int):
    """Bytes a rank moves for one pass of a stateful mixer layer on a Ulysses level of ``sp`` holding
    ``tokens`` of the pack: the all-gather of the pack's hidden states (``SPKind.gather_tokens``) and the
    reduce-scatter of the ranks' outputs (``sum_own_tokens``), each of the whole pack's width in bf16,
    (sp - 1) / sp of it from or to the others; where the mixer splits by heads, the all-reduce (a reduce-scatter
    and an all-gather) of what spans the shares (``ModelSpec.mixer_spanning`` values a token of the whole pack);
    the backward moves the same, its duals."""
    spanning = model.mixer_spanning * SPANNING_BYTES if splits(model.mixer_heads, sp) else 0
    return 2 * tokens * sp * (model.hidden * 2 + spanning) * (sp - 1) / sp


def exposed(comm, compute, pieces: int):
    """Seconds a pass's collective adds to its compute when both run in ``pieces`` equal parts, part
    j + 1's transfer in flight while part j computes: the first part's transfer waits in full, each
    later one for what its part of the compute does not cover."""
    return comm / pieces + (pieces - 1) / pieces * np.maximum(comm - compute, 0.0)
