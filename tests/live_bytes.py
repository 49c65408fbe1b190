"""Measured memory on a CPU: the bytes of every tensor storage alive, op by op.

``LiveBytes`` is a TorchDispatchMode: after each aten op it registers the storages of the op's
outputs (weakly: a storage leaves when its last tensor dies) and records the sum of what is alive,
minus ``host_bytes()`` (what an offloader holds in "host" memory, which on a CPU is the same
memory), keeping the peak. Tensors that exist before the mode starts (parameters) are registered
with ``track``. It measures tensors as torch's allocator sees them, not the allocator's own caching
or fragmentation: what a memory model of tensors must predict.

A bf16 matmul or attention on a CPU without bf16 instructions runs torch's reference kernel, 20 times
slower than fp32 (40 s a micro-step of the memory tests' wide model): the mode computes it in fp32 and
rounds the result, outputs of the op's own dtypes, shapes and bytes (the fp32 copies live and die inside the
handler, below what it counts), so the bytes measured are the same in a fraction of the time. Where torch runs bf16
through oneDNN (``_is_mkldnn_bf16_supported``: AVX-512 or AMX) the kernels run as they are:
there the round trip through fp32 costs twice the op (a micro-step of the wide model 3 s against 1 s).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
# The ops computed in fp32 when given bf16 on a CPU: each with the outputs that are bf16 then (the attention's
# log-sum-exp is fp32 either way).
IN_FP32 = {
    aten.mm.default: None, aten.bmm.default: None, aten.addmm.default: None, aten.baddbmm.default: None,
    aten._scaled_dot_product_flash_attention_for_cpu.default: (0,),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (0, 1, 2),
}  # fmt: skip


# torch's own bf16 kernels are oneDNN's where it reports them supported: fast, nothing to compute in fp32.
NATIVE_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _bf16_on_cpu(args) -> bool:
    if NATIVE_BF16:
        return False
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return any(t.dtype == torch.bfloat16 for t in tensors) and all(t.device.type == "cpu" for t in tensors)


def in_fp32(func, args, kwargs):
    """``func`` of bf16 arguments computed in fp32, its bf16 outputs rounded back: the same dtypes, shapes and
    bytes as ``func`` itself returns."""
    up = [a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in args]
    out = func(*up, **kwargs)
    bf16 = IN_FP32[func]
    if bf16 is None:
        return out.to(torch.bfloat16)
    return tuple(o.to(torch.bfloat16) if i in bf16 else o for i, o in enumerate(out))


class LiveBytes(TorchDispatchMode):
    def __init__(self, host_bytes: Callable[[], int] = lambda: 0):
        super().__init__()
        self.live = WeakIdKeyDictionary()
        self.host_bytes = host_bytes
        self.peak = 0
        self.trace: list[int] = []

    def track(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.live[st] = st.nbytes()

    def now(self) -> int:
        # The mapping's own dict: a storage's entry leaves it the moment the storage dies (the weak reference's
        # callback, nothing iterates the mapping to defer it), so its values are the live bytes without
        # dereferencing every key at every op (a fifth of a micro-step's time).
        return sum(self.live.data.values()) - self.host_bytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in IN_FP32 and _bf16_on_cpu(args):
            out = in_fp32(func, args, kwargs or {})
        else:
            out = func(*args, **(kwargs or {}))
        self.track(t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.device.type != "meta")
        now = self.now()
        self.trace.append(now)
        self.peak = max(self.peak, now)
        return out
