"""Activation offload: the inputs checkpointed layers keep, held in host memory until their recompute.

A checkpointed decoder layer keeps only its input for the backward (``torch.utils.checkpoint``
saves it through autograd's saved-tensor mechanism, ``_NoopSaveInputs``/``save_inputs``), yet
at 1M tokens over sp 8 the 32 inputs of an 8B model hold ~34 GB of every GPU. ``HostOffload``
is a pair of ``torch.autograd.graph.saved_tensors_hooks`` put around each checkpointed call: the
input is copied to pinned host memory on a side stream during the forward (the device copy is
freed once the next layer has it), and in the backward each input comes back on that stream one
layer ahead of its recompute, so the copy overlaps the previous layer's backward. Everything else
a layer saves lives inside the checkpoint's own hooks and is recomputed, as without offload.

Exact by construction: the tensor that returns is a bit copy of the one that left. On a CPU the
"host" copy is another CPU tensor (no pinning, no stream), the same path, which is what the tests
measure and compare bit for bit; other accelerators copy to the host synchronously. The CUDA stream
path is written to torch's stream semantics and has a ``-m gpu`` test, not yet run on a GPU. The
prefetch means a GPU holds two inputs during a recompute (the cost model counts them); PyTorch's
pinned-memory cache rounds host buffers up, so the host may hold more than ``host_bytes()``.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import checkpoint

OFFLOADER = "_hbp_offload"  # where prepare_model keeps the model's HostOffload (a plain attribute)


class _Stored:
    """One offloaded tensor: its host copy, and (on a GPU) the device copy prefetched for the backward."""

    __slots__ = ("host", "device", "ready", "used", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device):
        self.host = host
        self.device = device
        self.ready: tuple[torch.Tensor, torch.cuda.Event] | None = None
        self.used = False


class HostOffload:
    """Saved-tensor hooks that keep what they pack in host memory (one per prepared model).

    ``hooks()`` is the context to run a checkpointed call in; ``host_bytes()`` what it holds now.
    On a CUDA device the copies run on their own stream: device -> host after the producing work,
    host -> device one offloaded tensor ahead of the one the backward asks for."""

    def __init__(self) -> None:
        self._stored: list[weakref.ref[_Stored]] = []
        self._stream: torch.cuda.Stream | None = None

    def __deepcopy__(self, memo) -> HostOffload:
        """A copy of a prepared model (a reference, an EMA) offloads on its own: no shared stream or store."""
        return HostOffload()

    def __reduce__(self):
        """A pickled prepared model offloads on its own when loaded (streams and host copies stay here)."""
        return (HostOffload, ())

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def host_bytes(self) -> int:
        """Bytes of host copies alive (inputs of layers whose backward has not run yet)."""
        return sum(s.host.untyped_storage().nbytes() for s in self._live())

    def _live(self) -> list[_Stored]:
        live = [s for s in (r() for r in self._stored) if s is not None]
        if len(live) < len(self._stored):
            self._stored = [weakref.ref(s) for s in live]
        return live

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pack(self, t: torch.Tensor) -> _Stored | torch.Tensor:
        if t.numel() == 0:  # the checkpoint's empty marker: nothing to move
            return t
        if len(self._stored) > 4 * 1024:  # forwards whose backward never ran (their entries died)
            self._live()
        if t.device.type == "cpu":  # the same path, into another CPU tensor (what the CPU tests measure)
            stored = _Stored(t.detach().clone(memory_format=torch.preserve_format), t.device)
        elif t.device.type != "cuda":  # another accelerator: a synchronous copy to the host
            stored = _Stored(t.detach().to("cpu"), t.device)
        else:
            stream = self._side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(t.detach(), non_blocking=True)
            t.record_stream(stream)  # its memory is not reused before the copy has read it
            stored = _Stored(host, t.device)
        self._stored.append(weakref.ref(stored))
        return stored

    def _unpack(self, stored: _Stored | torch.Tensor) -> torch.Tensor:
        if isinstance(stored, torch.Tensor):
            return stored
        stored.used = True
        if stored.device.type == "cpu":
            out = stored.host
        elif stored.device.type != "cuda":
            out = stored.host.to(stored.device)
        else:
            if stored.ready is None:
                self._prefetch(stored)
            out, event = stored.ready
            stream = torch.cuda.current_stream(stored.device)
            stream.wait_event(event)
            out.record_stream(stream)
            stored.ready = None
        self._prefetch_before(stored)
        return out

    def _prefetch(self, stored: _Stored) -> None:
        stream = self._side_stream(stored.device)
        with torch.cuda.stream(stream):
            out = stored.host.to(stored.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        stored.ready = (out, event)

    def _prefetch_before(self, stored: _Stored) -> None:
        """Start bringing back the nearest input offloaded before ``stored`` that the backward has not
        used yet: it asks for it next (a layer of several offloaded inputs brings its next one)."""
        if stored.device.type != "cuda":
            return
        live = self._live()
        at = next((i for i, s in enumerate(live) if s is stored), 0)
        previous = next((s for s in reversed(live[:at]) if not s.used), None)
        if previous is not None and previous.ready is None:
            self._prefetch(previous)


def host_offload(model: torch.nn.Module) -> HostOffload:
    """The HostOffload ``prepare_model`` gave ``model`` (what a level with ``offload`` uses)."""
    net = model.get_base_model() if hasattr(model, "get_base_model") else model
    offload = net.__dict__.get(OFFLOADER)
    if offload is None:
        raise ValueError("this model has no HostOffload: call lit_hbp.prepare_model(model) first")
    return offload


def offloaded_checkpoint(offload: HostOffload, fn, *args):
    """``torch.utils.checkpoint`` (non-reentrant) whose saved inputs live in host memory."""
    with offload.hooks():
        return checkpoint(fn, *args, use_reentrant=False)
