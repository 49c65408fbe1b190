# ruff: noqa: E501  (the upstream signatures are kept as they are written)
"""flash-attention installs as pip lays them out, for tests on a faked CUDA GPU: each module at its
upstream path, with the upstream function signatures (copied from the tags of Dao-AILab/flash-attention
named in ``SIGNATURES``) and a ``*.dist-info`` (METADATA, RECORD with sha256 hashes, top_level.txt).
The kernels return zeros; what a release's backward cannot do raises as that release's
``interface.py`` does (its asserts and NotImplementedError, quoted), or, where upstream returns no
gradient (learnable_sink before flash-attn-4 4.0.0b26), returns none. A backend choice that would
train on such a backward then fails a test instead of a run.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

SIGNATURES = {
    "fa4-v4.0.0.beta4": (
        (
            "def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, "
            "cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None, "
            "max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, "
            "seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None, "
            "page_table: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None, "
            "causal: bool = False, window_size: Tuple[Optional[int], Optional[int]] = (None, None), "
            "learnable_sink: Optional[torch.Tensor] = None, softcap: float = 0.0, num_splits: int = 1, "
            "pack_gqa: Optional[bool] = None, deterministic: bool = False, score_mod: Optional[Callable] = None, "
            "aux_tensors: Optional[list] = None, return_lse: bool = False):"
        ),
        (
            "def _flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, "
            "cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None, "
            "seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None, "
            "max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, "
            "page_table: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None, "
            "causal: bool = False, softcap: Optional[float] = None, window_size_left: Optional[int] = None, "
            "window_size_right: Optional[int] = None, learnable_sink: Optional[torch.Tensor] = None, "
            "m_block_size: int = 128, n_block_size: int = 128, num_threads: int = 384, num_splits: int = 1, "
            "pack_gqa: Optional[bool] = None, _arch: Optional[int] = None, score_mod: Optional[Callable] = None, "
            "mask_mod: Optional[Callable] = None, block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None, "
            "return_lse: bool = False, out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None, "
            "aux_tensors: Optional[list[torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:"
        ),
        (
            "def _flash_attn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, "
            "dout: torch.Tensor, lse: torch.Tensor, softmax_scale: Optional[float] = None, causal: bool = False, "
            "softcap: float = 0.0, window_size_left: Optional[int] = None, "
            "window_size_right: Optional[int] = None, m_block_size: int = 64, n_block_size: int = 128, "
            "num_threads: int = 256, pack_gqa: bool = False, num_stages_Q: int = 2, num_stages_dO: int = 2, "
            "SdP_swapAB: bool = False, dKV_swapAB: bool = False, dQ_swapAB: bool = False, AtomLayoutMSdP: int = 2, "
            "AtomLayoutNdKV: int = 2, AtomLayoutMdQ: int = 2, V_in_regs: bool = False, "
            "cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None, "
            "seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None, "
            "max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, deterministic: bool = False, "
            "dq: Optional[torch.Tensor] = None, dk: Optional[torch.Tensor] = None, "
            "dv: Optional[torch.Tensor] = None, score_mod: Optional[Callable] = None, "
            "score_mod_bwd: Optional[Callable] = None, mask_mod: Optional[Callable] = None, "
            "aux_tensors: Optional[list[torch.Tensor]] = None, "
            "block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None) -> Tuple[torch.Tensor, torch.Tensor, "
            "torch.Tensor]:"
        ),
    ),
    "fa4-v4.0.0.beta20": (
        (
            "def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, "
            "qv: Optional[torch.Tensor] = None, cu_seqlens_q: Optional[torch.Tensor] = None, "
            "cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None, "
            "max_seqlen_k: Optional[int] = None, min_seqlen_k: Optional[int] = None, "
            "seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None, "
            "gather_kv_indices: Optional[torch.Tensor] = None, page_table: Optional[torch.Tensor] = None, "
            "softmax_scale: Optional[float] = None, causal: bool = False, window_size: Tuple[Optional[int], "
            "Optional[int]] = (None, None), learnable_sink: Optional[torch.Tensor] = None, softcap: float = 0.0, "
            "num_splits: int = 1, pack_gqa: Optional[bool] = None, deterministic: bool = False, "
            "score_mod: Optional[Callable] = None, score_mod_bwd: Optional[Callable] = None, "
            "mask_mod: Optional[Callable] = None, block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None, "
            "aux_tensors: Optional[list] = None, aux_scalars: Optional[tuple] = None, return_lse: bool = False):"
        ),
        (
            "def _flash_attn_fwd(q: Optional[torch.Tensor], k: Optional[torch.Tensor], v: torch.Tensor, "
            "qv: Optional[torch.Tensor] = None, cu_seqlens_q: Optional[torch.Tensor] = None, "
            "cu_seqlens_k: Optional[torch.Tensor] = None, seqused_q: Optional[torch.Tensor] = None, "
            "seqused_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None, "
            "max_seqlen_k: Optional[int] = None, min_seqlen_k: Optional[int] = None, "
            "page_table: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None, "
            "causal: bool = False, softcap: Optional[float] = None, window_size_left: Optional[int] = None, "
            "window_size_right: Optional[int] = None, learnable_sink: Optional[torch.Tensor] = None, "
            "tile_mn: Optional[Tuple[int, int]] = None, mma_pv_is_rs: Optional[bool] = None, "
            "intra_wg_overlap: Optional[bool] = None, num_threads: int = 384, num_splits: int = 1, "
            "pack_gqa: Optional[bool] = None, _arch: Optional[int] = None, score_mod: Optional[Callable] = None, "
            "mask_mod: Optional[Callable] = None, block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None, "
            "return_lse: bool = False, out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None, "
            "aux_tensors: Optional[list[torch.Tensor]] = None, aux_scalars: Optional[tuple] = None, "
            "q_descale: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None, "
            "v_descale: Optional[torch.Tensor] = None, "
            "gather_kv_indices: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, "
            "Optional[torch.Tensor], Optional[torch.Tensor]]:"
        ),
        (
            "def _flash_attn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, "
            "dout: torch.Tensor, lse: torch.Tensor, softmax_scale: Optional[float] = None, causal: bool = False, "
            "softcap: float = 0.0, window_size_left: Optional[int] = None, "
            "window_size_right: Optional[int] = None, m_block_size: int = 64, n_block_size: int = 128, "
            "num_threads: int = 256, pack_gqa: bool = False, num_stages_Q: int = 2, num_stages_dO: int = 2, "
            "SdP_swapAB: bool = False, dKV_swapAB: bool = False, dQ_swapAB: bool = False, AtomLayoutMSdP: int = 2, "
            "AtomLayoutNdKV: int = 2, AtomLayoutMdQ: int = 2, V_in_regs: bool = False, "
            "cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None, "
            "seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None, "
            "max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, deterministic: bool = False, "
            "dq: Optional[torch.Tensor] = None, dk: Optional[torch.Tensor] = None, "
            "dv: Optional[torch.Tensor] = None, score_mod: Optional[Callable] = None, "
            "score_mod_bwd: Optional[Callable] = None, mask_mod: Optional[Callable] = None, "
            "aux_tensors: Optional[list[torch.Tensor]] = None, aux_scalars: Optional[tuple] = None, "
            "block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None, "
            "dlse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:"
        ),
    ),
    "fa4-v4.0.0.beta25": (
        (
            "def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, "
            "qv: Optional[torch.Tensor] = None, cu_seqlens_q: Optional[torch.Tensor] = None, "
            "cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None, "
            "max_seqlen_k: Optional[int] = None, min_seqlen_k: Optional[int] = None, "
            "seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None, "
            "gather_kv_indices: Optional[torch.Tensor] = None, page_table: Optional[torch.Tensor] = None, "
            "softmax_scale: Optional[float] = None, causal: bool = False, window_size: Tuple[Optional[int], "
            "Optional[int]] = (None, None), learnable_sink: Optional[torch.Tensor] = None, softcap: float = 0.0, "
            "num_splits: int = 1, pack_gqa: Optional[bool] = None, deterministic: bool = False, "
            "score_mod: Optional[Callable] = None, score_mod_bwd: Optional[Callable] = None, "
            "mask_mod: Optional[Callable] = None, block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None, "
            "aux_tensors: Optional[list] = None, aux_scalars: Optional[tuple] = None, return_lse: bool = False, "
            "scheduler_metadata: Optional[SchedulerMetadataTensorsTorch] = None, "
            "seqlen_k_per_split: Optional[int] = None, disable_scheduler_metadata: bool = False):"
        ),
        (
            "def _flash_attn_fwd(q: Optional[torch.Tensor], k: Optional[torch.Tensor], v: torch.Tensor, "
            "qv: Optional[torch.Tensor] = None, cu_seqlens_q: Optional[torch.Tensor] = None, "
            "cu_seqlens_k: Optional[torch.Tensor] = None, seqused_q: Optional[torch.Tensor] = None, "
            "seqused_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None, "
            "max_seqlen_k: Optional[int] = None, min_seqlen_k: Optional[int] = None, "
            "page_table: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None, "
            "causal: bool = False, softcap: Optional[float] = None, window_size_left: Optional[int] = None, "
            "window_size_right: Optional[int] = None, learnable_sink: Optional[torch.Tensor] = None, "
            "tile_mn: Optional[Tuple[int, int]] = None, mma_pv_is_rs: Optional[bool] = None, "
            "intra_wg_overlap: Optional[bool] = None, num_threads: int = 384, num_splits: int = 1, "
            "pack_gqa: Optional[bool] = None, _arch: Optional[int] = None, score_mod: Optional[Callable] = None, "
            "mask_mod: Optional[Callable] = None, block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None, "
            "return_lse: bool = False, out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None, "
            "aux_tensors: Optional[list[torch.Tensor]] = None, aux_scalars: Optional[tuple] = None, "
            "q_descale: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None, "
            "v_descale: Optional[torch.Tensor] = None, gather_kv_indices: Optional[torch.Tensor] = None, "
            "scheduler_metadata: Optional[SchedulerMetadataTensorsTorch] = None, "
            "seqlen_k_per_split: Optional[int] = None, "
            "disable_scheduler_metadata: bool = False) -> Tuple[torch.Tensor, torch.Tensor, "
            "Optional[torch.Tensor], Optional[torch.Tensor]]:"
        ),
        (
            "def _flash_attn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, "
            "dout: torch.Tensor, lse: torch.Tensor, softmax_scale: Optional[float] = None, causal: bool = False, "
            "softcap: float = 0.0, window_size_left: Optional[int] = None, "
            "window_size_right: Optional[int] = None, m_block_size: int = 64, n_block_size: int = 128, "
            "num_threads: int = 256, pack_gqa: bool = False, num_stages_Q: int = 2, num_stages_dO: int = 2, "
            "SdP_swapAB: bool = False, dKV_swapAB: bool = False, dQ_swapAB: bool = False, AtomLayoutMSdP: int = 2, "
            "AtomLayoutNdKV: int = 2, AtomLayoutMdQ: int = 2, V_in_regs: bool = False, "
            "cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None, "
            "seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None, "
            "max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, deterministic: bool = False, "
            "dq: Optional[torch.Tensor] = None, dk: Optional[torch.Tensor] = None, "
            "dv: Optional[torch.Tensor] = None, score_mod: Optional[Callable] = None, "
            "score_mod_bwd: Optional[Callable] = None, mask_mod: Optional[Callable] = None, "
            "aux_tensors: Optional[list[torch.Tensor]] = None, aux_scalars: Optional[tuple] = None, "
            "block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None, "
            "dlse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:"
        ),
    ),
    "fa4-v4.0.0.beta27": (
        (
            "def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, "
            "qv: Optional[torch.Tensor] = None, cu_seqlens_q: Optional[torch.Tensor] = None, "
            "cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None, "
            "max_seqlen_k: Optional[int] = None, min_seqlen_k: Optional[int] = None, "
            "seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None, "
            "gather_kv_indices: Optional[torch.Tensor] = None, page_table: Optional[torch.Tensor] = None, "
            "softmax_scale: Optional[float] = None, causal: bool = False, window_size: Tuple[Optional[int], "
            "Optional[int]] = (None, None), learnable_sink: Optional[torch.Tensor] = None, softcap: float = 0.0, "
            "num_splits: int = 1, pack_gqa: Optional[bool] = None, deterministic: bool = False, "
            "score_mod: Optional[Callable] = None, score_mod_bwd: Optional[Callable] = None, "
            "mask_mod: Optional[Callable] = None, block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None, "
            "aux_tensors: Optional[list] = None, aux_scalars: Optional[tuple] = None, return_lse: bool = False, "
            "scheduler_metadata: Optional[SchedulerMetadataTensorsTorch] = None, "
            "seqlen_k_per_split: Optional[int] = None, disable_scheduler_metadata: bool = False):"
        ),
        (
            "def _flash_attn_fwd(q: Optional[torch.Tensor], k: Optional[torch.Tensor], v: torch.Tensor, "
            "qv: Optional[torch.Tensor] = None, cu_seqlens_q: Optional[torch.Tensor] = None, "
            "cu_seqlens_k: Optional[torch.Tensor] = None, seqused_q: Optional[torch.Tensor] = None, "
            "seqused_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None, "
            "max_seqlen_k: Optional[int] = None, min_seqlen_k: Optional[int] = None, "
            "page_table: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None, "
            "causal: bool = False, softcap: Optional[float] = None, window_size_left: Optional[int] = None, "
            "window_size_right: Optional[int] = None, learnable_sink: Optional[torch.Tensor] = None, "
            "tile_mn: Optional[Tuple[int, int]] = None, mma_pv_is_rs: Optional[bool] = None, "
            "intra_wg_overlap: Optional[bool] = None, num_threads: int = 384, num_splits: int = 1, "
            "pack_gqa: Optional[bool] = None, _arch: Optional[int] = None, score_mod: Optional[Callable] = None, "
            "mask_mod: Optional[Callable] = None, block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None, "
            "return_lse: bool = False, out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None, "
            "aux_tensors: Optional[list[torch.Tensor]] = None, aux_scalars: Optional[tuple] = None, "
            "q_descale: Optional[torch.Tensor] = None, k_descale: Optional[torch.Tensor] = None, "
            "v_descale: Optional[torch.Tensor] = None, gather_kv_indices: Optional[torch.Tensor] = None, "
            "scheduler_metadata: Optional[SchedulerMetadataTensorsTorch] = None, "
            "seqlen_k_per_split: Optional[int] = None, "
            "disable_scheduler_metadata: bool = False) -> Tuple[torch.Tensor, torch.Tensor, "
            "Optional[torch.Tensor], Optional[torch.Tensor]]:"
        ),
        (
            "def _flash_attn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, "
            "dout: torch.Tensor, lse: torch.Tensor, softmax_scale: Optional[float] = None, causal: bool = False, "
            "softcap: float = 0.0, window_size_left: Optional[int] = None, "
            "window_size_right: Optional[int] = None, m_block_size: int = 64, n_block_size: int = 128, "
            "num_threads: int = 256, pack_gqa: bool = False, num_stages_Q: int = 2, num_stages_dO: int = 2, "
            "SdP_swapAB: bool = False, dKV_swapAB: bool = False, dQ_swapAB: bool = False, AtomLayoutMSdP: int = 2, "
            "AtomLayoutNdKV: int = 2, AtomLayoutMdQ: int = 2, V_in_regs: bool = False, "
            "cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None, "
            "seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None, "
            "max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, deterministic: bool = False, "
            "dq: Optional[torch.Tensor] = None, dk: Optional[torch.Tensor] = None, "
            "dv: Optional[torch.Tensor] = None, score_mod: Optional[Callable] = None, "
            "score_mod_bwd: Optional[Callable] = None, mask_mod: Optional[Callable] = None, "
            "aux_tensors: Optional[list[torch.Tensor]] = None, aux_scalars: Optional[tuple] = None, "
            "block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None, dlse: Optional[torch.Tensor] = None, "
            "learnable_sink: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, ...]:"
        ),
    ),
    # flash-attn-4 4.0.0b40 as its wheel installs it (flash_attn/cute/interface.py), read 2026-12-04
    "fa4-4.0.0b40-wheel": (
        (
            "def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qv: "
            "Optional[torch.Tensor]=None, cu_seqlens_q: Optional[torch.Tensor]=None, cu_seqlens_k: "
            "Optional[torch.Tensor]=None, max_seqlen_q: Optional[int]=None, max_seqlen_k: Optional[int]=None, "
            "min_seqlen_k: Optional[int]=None, seqused_q: Optional[torch.Tensor]=None, seqused_k: "
            "Optional[torch.Tensor]=None, gather_kv_indices: Optional[torch.Tensor]=None, page_table: "
            "Optional[torch.Tensor]=None, softmax_scale: Optional[float]=None, causal: bool=False, window_size: "
            "Tuple[Optional[int], Optional[int]]=(None, None), learnable_sink: Optional[torch.Tensor]=None, "
            "softcap: float=0.0, num_splits: int=1, pack_gqa: Optional[bool]=None, deterministic: bool=False, "
            "score_mod: Optional[Callable]=None, score_mod_bwd: Optional[Callable]=None, mask_mod: "
            "Optional[Callable]=None, block_sparse_tensors: Optional[BlockSparseTensorsTorch]=None, aux_tensors: "
            "Optional[list]=None, aux_scalars: Optional[tuple]=None, return_lse: bool=False, scheduler_metadata: "
            "Optional[SchedulerMetadataTensorsTorch]=None, seqlen_k_per_split: Optional[int]=None, "
            "disable_scheduler_metadata: bool=False, gather_bwd_recompute_p: bool=False, gather_bwd_token_chunk: "
            "Optional[int]=None, config: FwdConfig | MlaFwdConfig | None=None, scales: TensorwiseScales | "
            "None=None):"
        ),
        (
            "def _flash_attn_fwd(q: Optional[torch.Tensor], k: Optional[torch.Tensor], v: torch.Tensor, qv: "
            "Optional[torch.Tensor]=None, cu_seqlens_q: Optional[torch.Tensor]=None, cu_seqlens_k: "
            "Optional[torch.Tensor]=None, seqused_q: Optional[torch.Tensor]=None, seqused_k: "
            "Optional[torch.Tensor]=None, max_seqlen_q: Optional[int]=None, max_seqlen_k: Optional[int]=None, "
            "min_seqlen_k: Optional[int]=None, page_table: Optional[torch.Tensor]=None, softmax_scale: "
            "Optional[float]=None, causal: bool=False, softcap: Optional[float]=None, window_size_left: "
            "Optional[int]=None, window_size_right: Optional[int]=None, learnable_sink: "
            "Optional[torch.Tensor]=None, tile_mn: Optional[Tuple[int, int]]=None, mma_pv_is_rs: "
            "Optional[bool]=None, intra_wg_overlap: Optional[bool]=None, num_splits: int=1, pack_gqa: "
            "Optional[bool]=None, _arch: Optional[int]=None, score_mod: Optional[Callable]=None, mask_mod: "
            "Optional[Callable]=None, block_sparse_tensors: Optional[BlockSparseTensorsTorch]=None, return_lse: "
            "bool=False, out: Optional[torch.Tensor]=None, lse: Optional[torch.Tensor]=None, aux_tensors: "
            "Optional[list[torch.Tensor]]=None, aux_scalars: Optional[tuple]=None, scales: TensorwiseScales | "
            "BlockScales | None=None, gather_kv_indices: Optional[torch.Tensor]=None, scheduler_metadata: "
            "Optional[SchedulerMetadataTensorsTorch]=None, seqlen_k_per_split: Optional[int]=None, "
            "disable_scheduler_metadata: bool=False, gather_bwd_recompute_p: bool=False, *, config: FwdConfig | "
            "MlaFwdConfig | None=None) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], "
            "Optional[torch.Tensor], Optional[torch.Tensor]]:"
        ),
        (
            "def _flash_attn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: "
            "torch.Tensor, lse: torch.Tensor, softmax_scale: Optional[float]=None, causal: bool=False, softcap: "
            "float=0.0, window_size_left: Optional[int]=None, window_size_right: Optional[int]=None, "
            "m_block_size: int=64, n_block_size: int=128, num_threads: int=256, pack_gqa: bool=False, "
            "num_stages_Q: int=2, num_stages_dO: int=2, SdP_swapAB: bool=False, dKV_swapAB: bool=False, "
            "dQ_swapAB: bool=False, AtomLayoutMSdP: int=2, AtomLayoutNdKV: int=2, AtomLayoutMdQ: int=2, "
            "V_in_regs: bool=False, cu_seqlens_q: Optional[torch.Tensor]=None, cu_seqlens_k: "
            "Optional[torch.Tensor]=None, seqused_q: Optional[torch.Tensor]=None, seqused_k: "
            "Optional[torch.Tensor]=None, max_seqlen_q: Optional[int]=None, max_seqlen_k: Optional[int]=None, "
            "deterministic: bool=False, dq: Optional[torch.Tensor]=None, dk: Optional[torch.Tensor]=None, dv: "
            "Optional[torch.Tensor]=None, score_mod: Optional[Callable]=None, score_mod_bwd: "
            "Optional[Callable]=None, mask_mod: Optional[Callable]=None, aux_tensors: "
            "Optional[list[torch.Tensor]]=None, aux_scalars: Optional[tuple]=None, block_sparse_tensors: "
            "Optional[BlockSparseTensorsTorch]=None, dlse: Optional[torch.Tensor]=None, learnable_sink: "
            "Optional[torch.Tensor]=None, *, config: BwdConfig | None=None) -> Tuple[torch.Tensor, ...]:"
        ),
    ),
    "v2.8.3-cute": (
        (
            "def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, "
            "cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None, "
            "seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None, "
            "page_table: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None, "
            "causal: bool = False, window_size: Tuple[Optional[int], Optional[int]] = (None, None), "
            "learnable_sink: Optional[torch.Tensor] = None, softcap: float = 0.0, "
            "pack_gqa: Optional[bool] = None):"
        ),
        (
            "def _flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, "
            "cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None, "
            "seqused_q: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None, "
            "page_table: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None, "
            "causal: bool = False, softcap: Optional[float] = None, window_size_left: Optional[int] = None, "
            "window_size_right: Optional[int] = None, learnable_sink: Optional[torch.Tensor] = None, "
            "m_block_size: int = 128, n_block_size: int = 128, num_threads: int = 384, "
            "pack_gqa: Optional[bool] = None, _compute_capability: Optional[int] = None) -> Tuple[torch.Tensor, "
            "torch.Tensor]:"
        ),
        (
            "def _flash_attn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, "
            "dout: torch.Tensor, lse: torch.Tensor, softmax_scale: Optional[float] = None, causal: bool = False, "
            "softcap: float = 0.0, m_block_size: int = 64, n_block_size: int = 128, num_threads: int = 256, "
            "num_stages_Q: int = 2, num_stages_dO: int = 2, SdP_swapAB: bool = False, dKV_swapAB: bool = False, "
            "dQ_swapAB: bool = False, AtomLayoutMSdP: int = 2, AtomLayoutNdKV: int = 2, AtomLayoutMdQ: int = 2, "
            "V_in_regs: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:"
        ),
    ),
    "v2.8.3": (
        (
            "def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "
            "dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
            "alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):"
        ),
        (
            "def _flash_attn_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, "
            "cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, "
            "dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int = -1, "
            "window_size_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, "
            "return_softmax: bool = False, block_table: Optional[torch.Tensor] = None, "
            "leftpad_k: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None, "
            "zero_tensors: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:"
        ),
        (
            "def _flash_attn_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, "
            "v: torch.Tensor, out: torch.Tensor, softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], "
            "dk: Optional[torch.Tensor], dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, "
            "cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, "
            "softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int, softcap: float, "
            "alibi_slopes: Optional[torch.Tensor], deterministic: bool, rng_state: Optional[torch.Tensor] = None, "
            "zero_tensors: bool = False) -> torch.Tensor:"
        ),
    ),
    "fa3-c7697bbf": (
        (
            "def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "
            "seqused_q=None, seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, "
            "k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, "
            "pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):"
        ),
        (
            "def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, "
            "k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor], qv: Optional[torch.Tensor], "
            "out: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor], "
            "cu_seqlens_k: Optional[torch.Tensor], cu_seqlens_k_new: Optional[torch.Tensor], "
            "seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], max_seqlen_q: Optional[int], "
            "max_seqlen_k: Optional[int], page_table: Optional[torch.Tensor], "
            "kv_batch_idx: Optional[torch.Tensor], leftpad_k: Optional[torch.Tensor], "
            "rotary_cos: Optional[torch.Tensor], rotary_sin: Optional[torch.Tensor], "
            "seqlens_rotary: Optional[torch.Tensor], q_descale: Optional[torch.Tensor], "
            "k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor], softmax_scale: Optional[float], "
            "causal: bool, window_size_left: int = -1, window_size_right: int = -1, attention_chunk: int = 0, "
            "softcap: float = 0.0, rotary_interleaved: bool = True, "
            "scheduler_metadata: Optional[torch.Tensor] = None, num_splits: int = 1, "
            "pack_gqa: Optional[bool] = None, sm_margin: int = 0) -> Tuple[torch.Tensor, torch.Tensor, "
            "torch.Tensor, torch.Tensor]:"
        ),
        (
            "def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, "
            "out: torch.Tensor, softmax_lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor], "
            "cu_seqlens_k: Optional[torch.Tensor], sequed_q: Optional[torch.Tensor], "
            "sequed_k: Optional[torch.Tensor], max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], "
            "dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], dv: Optional[torch.Tensor], "
            "softmax_scale: Optional[float], is_causal: bool, window_size_left: int = -1, "
            "window_size_right: int = -1, softcap: float = 0.0, deterministic: bool = False, "
            "sm_margin: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:"
        ),
    ),
    "fa3-fa445ff6": (
        (
            "def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, "
            "max_seqlen_k, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, "
            "v_descale=None, window_size=(-1, -1), sink_token_length=0, softcap=0.0, num_splits=1, pack_gqa=None, "
            "deterministic=False, sm_margin=0):"
        ),
        (
            "def _flash_attn_forward(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, "
            "seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, "
            "rotary_sin, q_descale, k_descale, v_descale, softmax_scale, causal, window_size=(-1, -1), "
            "sink_token_length=0, softcap=0.0, rotary_interleaved=True, num_splits=1, pack_gqa=None, "
            "sm_margin=0):"
        ),
        (
            "def _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, "
            "sequed_k, max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1), "
            "sink_token_length=0, softcap=0.0, deterministic=False, sm_margin=0):"
        ),
    ),
}


FA4_PRELUDE = """import torch
from typing import Callable, Optional, Tuple

import cutlass  # the CuTe DSL (nvidia-cutlass-dsl), imported at the top of interface.py upstream


class BlockSparseTensorsTorch:
    pass


class SchedulerMetadataTensorsTorch:
    pass


class FwdConfig:
    pass


class BwdConfig:
    pass


class TensorwiseScales:
    pass


class BlockScales:
    pass


class MlaFwdConfig:
    pass
"""

# What each flash-attn-4 release's backward does, read in its flash_attn/cute/interface.py:
# (varlen backward on SM90, soft-capping in the varlen backward, a learnable_sink gradient, outputs of
# _flash_attn_fwd, learnable_sink must be bf16).
FA4_RELEASES = {
    # 4.0.0b3 has no tag: it was published from 3e643ef9 as the "fa4" distribution, between beta2 and beta4,
    # whose interface.py it shares.
    "4.0.0b3": ("fa4-v4.0.0.beta4", (False, False, False, 2, True)),
    "4.0.0b4": ("fa4-v4.0.0.beta4", (False, False, False, 2, True)),
    "4.0.0b20": ("fa4-v4.0.0.beta20", (True, False, False, 4, True)),
    "4.0.0b25": ("fa4-v4.0.0.beta25", (True, True, False, 4, True)),
    "4.0.0b27": ("fa4-v4.0.0.beta27", (True, True, True, 4, False)),
    "4.0.0b40": ("fa4-4.0.0b40-wheel", (True, True, True, 5, False)),  # what bench/fa4_wheels.sh fetches
}


def fa4_interface(version: str) -> str:
    tag, flags = FA4_RELEASES[version]
    varlen, fwd, bwd = SIGNATURES[tag]
    return f"""{FA4_PRELUDE}
SM90_VARLEN_BWD, SOFTCAP_VARLEN_BWD, SINK_GRAD, FWD_OUTPUTS, SINK_BF16_ONLY = {flags!r}


{fwd}
    if learnable_sink is not None and SINK_BF16_ONLY:
        assert learnable_sink.dtype == torch.bfloat16, "learnable_sink must be bfloat16"
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
    return (out, lse, *(None,) * (FWD_OUTPUTS - 2))


{bwd}
    major, _ = torch.cuda.get_device_capability()
    is_varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if major == 9 and not SM90_VARLEN_BWD:
        assert window_size_left is None and window_size_right is None, "local not supported yet on 9.x"
        assert not is_varlen, "varlen backward is not yet supported on sm90"
    if softcap and is_varlen and not SOFTCAP_VARLEN_BWD:
        raise AssertionError("varlen + score_mod not supported in bwd yet")
    grads = tuple(torch.zeros_like(x) for x in (q, k, v))
    sink = locals().get("learnable_sink")
    return grads if sink is None else (*grads, torch.zeros_like(sink))


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, kw):
        out, lse = _flash_attn_fwd(q, k, v, learnable_sink=learnable_sink, **kw)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kw, ctx.sink = kw, learnable_sink
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        sink = dict(learnable_sink=ctx.sink) if SINK_GRAD and ctx.sink is not None else dict()
        res = _flash_attn_bwd(q, k, v, out, dout, lse, **ctx.kw, **sink)
        return res[0], res[1], res[2], res[3] if len(res) == 4 else None, None


def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
    return flash_attn_varlen_func(q, k, v, softmax_scale=softmax_scale, causal=causal)


{varlen}
    kw = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
              max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, softcap=softcap,
              window_size_left=window_size[0], window_size_right=window_size[1])
    return FlashAttnVarlenFunc.apply(q, k, v, learnable_sink, kw)
"""


FA4_INIT = """\"\"\"Flash Attention CUTE (CUDA Template Engine) implementation.\"\"\"

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fa4")
except PackageNotFoundError:
    __version__ = "0.0.0"

from .interface import (
    flash_attn_func,
    flash_attn_varlen_func,
)
"""

# flash-attn 2.8.3's flash_attn/cute/__init__.py, as shipped.
FA28_CUTE_INIT = """\"\"\"Flash Attention CUTE (CUDA Template Engine) implementation.\"\"\"

from .interface import (
    flash_attn_func,
    flash_attn_varlen_func,
)

__version__ = "0.1.0"
"""


def fa28_cute_interface() -> str:
    varlen, fwd, bwd = SIGNATURES["v2.8.3-cute"]
    return f"""{FA4_PRELUDE}

{fwd}
    return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])


{bwd}
    return tuple(torch.zeros_like(x) for x in (q, k, v))


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return _flash_attn_fwd(q, k, v)

    @staticmethod
    def backward(ctx, dout, dlse):
        raise NotImplementedError(
            "Backward pass for FlashAttention with variable length sequences is not implemented yet."
        )


def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
    return FlashAttnVarlenFunc.apply(q, k, v)


{varlen}
    return FlashAttnVarlenFunc.apply(q, k, v)
"""


ZERO_GRADS = """

class _Zeros(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.shapes = q, k, v
        return torch.zeros_like(q)

    @staticmethod
    def backward(ctx, dout):
        return tuple(torch.zeros_like(x) for x in ctx.shapes)
"""


def fa2_interface() -> str:
    """flash-attn 2.8.3's flash_attn/flash_attn_interface.py (its private functions are torch custom
    ops upstream; plain functions here, as with torch < 2.4, which the adapters read alike)."""
    varlen, fwd, bwd = SIGNATURES["v2.8.3"]
    return f"""import torch
from typing import Optional, Tuple
{ZERO_GRADS}

{fwd}
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
    return torch.zeros_like(q), lse, None, torch.zeros(2, dtype=torch.int64)


{bwd}
    for g, x in ((dq, q), (dk, k), (dv, v)):
        g.zero_()
    return torch.zeros(q.shape[1], q.shape[0])


{varlen}
    return _Zeros.apply(q, k, v)
"""


def fa3_interface(key: str) -> str:
    """hopper/flash_attn_interface.py at commit ``key`` (its public and private functions)."""
    varlen, fwd, bwd = SIGNATURES[key]
    return f"""import torch
from typing import Optional, Tuple
{ZERO_GRADS}

{fwd}
    return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32), None, None


{bwd}
    for g in (dq, dk, dv):
        g.zero_()
    return torch.zeros(q.shape[1], q.shape[0])


{varlen}
    return _Zeros.apply(q, k, v)
"""


FA2_INIT = '__version__ = "2.8.3"\n\nfrom flash_attn.flash_attn_interface import flash_attn_varlen_func\n'
CUTLASS = {"cutlass/__init__.py": "", "cutlass/cute.py": ""}

# (distribution name, version, {path: source}) as each wheel installs them.
INSTALLS = {
    "flash-attn 2.8.3": (
        "flash_attn",
        "2.8.3",
        {
            "flash_attn/__init__.py": FA2_INIT,
            "flash_attn/flash_attn_interface.py": fa2_interface(),
            "flash_attn/cute/__init__.py": FA28_CUTE_INIT,
            "flash_attn/cute/interface.py": fa28_cute_interface(),
        },
    ),
    **{
        f"flash-attn-4 {v}": (
            "fa4" if v == "4.0.0b3" else "flash-attn-4",
            v,
            {"flash_attn/cute/__init__.py": FA4_INIT, "flash_attn/cute/interface.py": fa4_interface(v)},
        )
        for v in FA4_RELEASES
    },
    "nvidia-cutlass-dsl": ("nvidia-cutlass-dsl", "4.2.1", CUTLASS),
    "flash-attn 3 (2025-07)": ("flash_attn_3", "3.0.0b1", {"flash_attn_interface.py": fa3_interface("fa3-c7697bbf")}),
    "flash-attn 3 (2025-02)": ("flash_attn_3", "3.0.0b1", {"flash_attn_interface.py": fa3_interface("fa3-fa445ff6")}),
}


def _record_line(site: Path, path: str) -> str:
    data = (site / path).read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}\n"


def install(site: Path, *names: str, installs: dict | None = None) -> None:
    """pip install, in order, into ``site``: the files (a later wheel overwrites a file an earlier one
    wrote, both RECORDs keep listing it) and a dist-info per distribution."""
    for key in names:
        dist, version, files = (installs or INSTALLS)[key]
        for path, text in files.items():
            (site / path).parent.mkdir(parents=True, exist_ok=True)
            (site / path).write_text(text)
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "RECORD").write_text("".join(_record_line(site, path) for path in files))
        (info / "top_level.txt").write_text("\n".join(sorted({p.split("/")[0].removesuffix(".py") for p in files})))
