"""PackedBatch: the one micro-batch type that collate builds and the strategy, module, loss,
callbacks and benches read.

A micro-batch is one row of concatenated samples (varlen: no padding between samples, one padding
segment at the end). Its token tensors are [1, T / sp]: under sequence parallelism each rank holds
a shard (contiguous under Ulysses; the planner's balanced ranges under context parallelism, with
``pack_index`` and ``cp_shard`` saying where they are), while ``cu_seqlens``/``max_seqlen`` always
describe the whole pack. Everything
else is counted on the host by collate, so the training step never reads a value back from the
device. The plan's fields (``level``, ``ckpt_layers``, ``loss_norm``, ``epoch``, ``micro_index``)
say where the micro-batch comes from and how the strategy and the loss must treat it.

No field but a vision-language pack's pixels is a floating tensor: Lightning's precision plugins
(``convert_input``) cast every floating tensor of a batch to the training dtype, so counts travel as
integer tensors or Python numbers (the pixels are meant to be cast: the model computes in that dtype).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from lit_hbp.model_spec import ModelSpec


@dataclass
class CPShard:
    """The attention geometry of one CP rank's queries (``lit_hbp.packing.context_split``): its
    query ranges ``cu_q`` against key prefixes ``cu_k`` (int32), and where those keys are in the
    CP group's all-gathered K/V (``key_index``, int64, into the rank-ordered concatenation).
    ``key_rounds``: when ranges of one document overlap in keys, (positions into ``key_index``,
    their ``key_index``) per round of distinct keys (``ContextSplit.key_rounds``); empty when every
    key is distinct."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    key_index: torch.Tensor
    max_q: int
    max_k: int
    key_rounds: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    def apply(self, fn) -> CPShard:
        tensors = {k: fn(getattr(self, k)) for k in ("cu_q", "cu_k", "key_index")}
        rounds = tuple((fn(pos), fn(keys)) for pos, keys in self.key_rounds)
        return dataclasses.replace(self, **tensors, key_rounds=rounds)


PACK_MARK = "_hbp_pack_segments"  # on a PackedBatch's input_ids: how many segments the pack holds
DOCS_MARK = "_hbp_pack_documents"  # ... and how many of them are documents (the padding segment not counted)
SP_MARK = "_hbp_pack_sp"  # ... and the level's SP degree: above 1, the ids are one rank's shard of the pack
LEVEL_MARK = "_hbp_pack_level"  # ... and the level's (ckpt_layers, offload, mlp_tiles), for a call of its own
SHIFTED_MARK = "_hbp_labels_shifted"  # on a PackedBatch's labels: pre-shifted (labels[t] the target of position t)
VERSION_MARK = "_hbp_packed_version"  # on the fields the collation derives together: their version when packed


def _own_version(t: torch.Tensor) -> int | None:
    """The version ``t`` had when packed, where the mark is its own (a deep copy's tensor carries its original's
    ``__dict__``, and its own version counter)."""
    mark = t.__dict__.get(VERSION_MARK)
    return mark[1] if mark is not None and mark[0] == id(t) else None


@dataclass
class PackedBatch:
    input_ids: torch.Tensor
    """[1, T / sp] token ids of this rank's shard of the pack."""
    labels: torch.Tensor
    """[1, T / sp] pre-shifted targets: labels[t] = input_ids[t + 1] of the same sample when that
    token is supervised, else -100 (a shard needs no neighbour token)."""
    position_ids: torch.Tensor
    """[1, T / sp] positions restarting at 0 at every sample."""
    sample_targets: torch.Tensor
    """[1, T / sp] int32: supervised tokens of each position's sample (per-sample normalizers). An
    integer tensor, so precision plugins that cast a batch's floating tensors (DeepSpeed's bf16
    casts 265 to 264) leave it exact; the loss turns it into fp32 weights."""
    cu_seqlens: torch.Tensor
    """int32 [segments + 1]: cumulative sample lengths of the whole pack (the padding is a segment)."""
    max_seqlen: int
    """Longest segment of the whole pack."""
    target_index: torch.Tensor
    """Positions in this shard of the supervised labels: the rows the LM head runs on."""
    sample_index: torch.Tensor
    """Store indices of the pack's samples, in pack order."""
    n_tokens: int
    """Real (non-padding) tokens of the whole pack."""
    n_targets: int
    """Supervised tokens of the whole pack."""
    n_loss_samples: int
    """Samples of the pack with at least one supervised token."""
    doc_sq: float
    """Sum of squared sample lengths of the whole pack (the attention FLOPs)."""
    loss_norm: float | None = None
    """The plan's Ave-Token normalizer: supervised tokens of the global batch over data-parallel
    ranks (see docs/design.md, the loss). None when the batch was not planned (ave_token refuses it)."""
    level: int = 0
    """Index of the plan level the pack belongs to."""
    sp: int = 1
    """Sequence-parallel degree of the level: the number of shards of the pack."""
    sp_rank: int = 0
    """Which shard this is."""
    sp_kind: str = "ulysses"
    """How the level splits the pack over its SP group (``lit_hbp.parallel.kind``)."""
    cp: int = 1
    """Context-parallel degree of the level's layout (sp = ulysses x cp)."""
    pack_index: torch.Tensor | None = None
    """Positions in the pack of this shard's tokens, when they are not the contiguous slice
    ``sp_rank * T / sp`` onward (context parallelism)."""
    cp_shard: CPShard | None = None
    """Attention geometry of this rank's CP group shard (cp > 1)."""
    cp_imbalance: float = 1.0
    """Largest causal attention area of the pack's CP ranks over their mean (the ABR inside the SP
    group; 1.0 without CP)."""
    ckpt_layers: int = 0
    """Decoder layers to run with activation checkpointing at this level."""
    offload: bool = False
    """Keep the checkpointed layers' inputs in host memory until their recompute (``lit_hbp.model.offload``)."""
    mlp_tiles: int = 1
    """Tiles each decoder layer's MLP runs this shard's tokens in (``lit_hbp.model.tiling``; 1: untiled)."""
    mm: dict[str, torch.Tensor] | None = None
    """A vision-language pack's images and videos (``lit_hbp.model.vision``): the family's processor fields,
    records concatenated in pack order (``pixel_values``, ``image_grid_thw``, ``image_sizes``, video fields;
    per-token ``mm_token_type_ids`` / ``token_type_ids`` as [1, T]) and, for multimodal RoPE,
    ``position_ids`` [3, 1, T] (each record's rows computed alone). None for text."""
    media_items: dict[str, tuple[int, ...]] | None = None
    """Per kind of media (``image``, ``video``), the items each record of a vision-language pack holds, in pack order,
    where the processor fields tell them apart (``media_batch.media_items``), with the pack's token ids on the host
    (``media_ids``): ``packed_loss`` checks each record's placeholders against its own items' encodings, where a
    pack-wide count would let one record's image fill another's placeholders. None for text."""
    media_ids: Any = None
    """The whole pack's token ids as a host numpy array, beside ``media_items`` (typed loosely: never moved)."""
    sp_group: Any = None
    """The level's SP group on this rank and its kind, a ``lit_hbp.parallel.context.SPCall`` (typed
    loosely: the batch type sits below the parallel package): set by ``HBPStrategy`` when it hands
    the micro-batch over (sp > 1); its packed calls carry it."""
    epoch: int = 0
    micro_index: int = 0
    """Micro-step of the epoch's plan (for resume and debugging)."""
    bounds: tuple[int, ...] | None = None
    """The whole pack's document boundaries on the host (``cu_seqlens`` as ints, the padding segment's
    included): a stateful token mixer's per-document run reads them here, not back from the device."""

    TOKEN_FIELDS: ClassVar[tuple[str, ...]] = ("input_ids", "labels", "position_ids", "sample_targets")
    DERIVED_FIELDS: ClassVar[tuple[str, ...]] = ("labels", "target_index", "sample_targets")
    """Fields the collation derives from the supervised masks together (with the counts n_targets and
    n_loss_samples): one changed in place alone would be trained in part, so it is refused."""

    def __post_init__(self) -> None:
        # The pack's segment count on its token ids (a host int): a prepared model called on them
        # without the document boundaries refuses instead of running the pack as one document.
        segments = int(self.cu_seqlens.shape[0]) - 1
        self.input_ids.__dict__[PACK_MARK] = segments
        # The whole pack's length on the host: its boundaries' end where they travel (an SP kind's shard or the
        # collated pack alike), else a shard's length times sp.
        whole = self.bounds[-1] if self.bounds else int(self.input_ids.shape[1]) * int(self.sp)
        padded = self.n_tokens < whole
        self.input_ids.__dict__[DOCS_MARK] = segments - int(padded)
        self.input_ids.__dict__[SP_MARK] = int(self.sp)
        self.input_ids.__dict__[LEVEL_MARK] = (self.ckpt_layers, bool(self.offload), self.mlp_tiles)
        self.labels.__dict__[SHIFTED_MARK] = True  # the model's own loss would shift them again: refused
        self.check_untouched()
        for name in self.DERIVED_FIELDS:
            t = getattr(self, name)
            if _own_version(t) is None and not t.is_inference():  # (an inference tensor keeps no version)
                t.__dict__[VERSION_MARK] = (id(t), t._version)
        if self.bounds is not None:  # the host copy of the boundaries stays the boundaries (on the host: read)
            same = len(self.bounds) == self.cu_seqlens.shape[0] and (
                self.cu_seqlens.device.type != "cpu" or list(self.bounds) == self.cu_seqlens.tolist()
            )
            if not same:
                raise ValueError(
                    "PackedBatch: bounds (the host copy of cu_seqlens) no longer match cu_seqlens: replace both, or "
                    "set bounds=None (a stateful mixer then reads them from cu_seqlens)"
                )

    def __setstate__(self, state: dict) -> None:
        # A DataLoader worker's batch arrives pickled, its tensors without the marks above: set them again.
        self.__dict__.update(state)
        self.__post_init__()

    def check_untouched(self) -> None:
        """Refuse labels (or their positions and counts) changed in place since they were packed: the loss runs
        the LM head on ``target_index`` and normalizes by the collation's counts, so a label set to -100 would
        still be counted and one set from -100 never trained. Read from the tensors' version counters (host)."""
        for name in self.DERIVED_FIELDS:
            t = getattr(self, name)
            mark = _own_version(t)
            if mark is not None and not t.is_inference() and t._version != mark:
                raise ValueError(
                    f"PackedBatch.{name} was changed in place after packing: the loss takes the supervised positions "
                    "and their counts from the collation, so the change would train in part. Pack the samples with "
                    "their new supervised masks (lit_hbp.pack_samples), or weigh tokens with packed_loss's weights="
                )

    @property
    def shard_len(self) -> int:
        """Positions in this rank's shard (T / sp)."""
        return self.input_ids.shape[1]

    @property
    def pack_len(self) -> int:
        """Positions of the whole pack, padding included (T)."""
        return self.input_ids.shape[1] * self.sp

    def attention_sq(self, spec: ModelSpec) -> float:
        """``doc_sq`` as the attending layers of ``spec`` (a ``ModelSpec``) see the pack's documents: a sliding
        window or a chunk bounds a longer one's (``ModelSpec.attention_sq``), read from the host copy of the
        boundaries (``bounds``, the padding segment left out); ``doc_sq`` without that copy."""
        if self.bounds is None or not spec.attention_windows:
            return self.doc_sq
        lengths = [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])]
        return spec.attention_sq(lengths[:-1] if self.n_tokens < self.bounds[-1] else lengths)

    def replace(self, **changes) -> PackedBatch:
        """The batch with ``changes``. New ``labels`` come with their ``target_index`` (an SP kind's shard gives
        both): the loss runs the LM head on the positions ``target_index`` names and counts the pack's targets
        from the collation, so labels alone would train the old targets and count the old number."""
        if "labels" in changes and "target_index" not in changes:
            raise ValueError(
                "PackedBatch.replace(labels=...) without target_index (and the counts n_targets, sample_targets, "
                "n_loss_samples the collation derived from the labels): pack the samples with lit_hbp.pack_samples "
                "and their new supervised masks, or weigh tokens with packed_loss's weights="
            )
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str) -> PackedBatch:
        """The batch with its tensors on ``device`` (Lightning moves it through ``batch_to_device``,
        which calls ``to(device)`` on anything that is not a tensor). Copies to an accelerator are
        non-blocking, as Lightning makes them for tensors: from pinned memory the host does not wait."""
        device = torch.device(device)
        non_blocking = device.type not in ("cpu", "mps")
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PackedBatch:
        """Called by the DataLoader's pin-memory thread (``pin_memory=True``)."""
        return self._map(torch.Tensor.pin_memory)

    def positions_in_pack(self) -> torch.Tensor:
        """[T / sp] positions in the pack of this shard's tokens."""
        if self.pack_index is not None:
            return self.pack_index
        size = self.input_ids.shape[1]
        return torch.arange(size, device=self.input_ids.device) + self.sp_rank * size

    def _map(self, fn) -> PackedBatch:
        self.check_untouched()  # a copy elsewhere would carry the change with a fresh version
        fields = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        changes = {name: fn(value) for name, value in fields if isinstance(value, torch.Tensor)}
        if self.cp_shard is not None:
            changes["cp_shard"] = self.cp_shard.apply(fn)
        if self.mm is not None:
            changes["mm"] = {k: fn(v) for k, v in self.mm.items()}
        return dataclasses.replace(self, **changes)  # the same values elsewhere: nothing derived goes stale
