"""compile=True: each decoder layer compiles to one graph (attention is the opaque ``hbp::varlen_attention``
custom op, on every backend), packs of other lengths and document counts reuse it (dynamic shapes, no
guard on the pack), and the compiled module trains like the eager one."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from conftest import TINY_LLAMA

from lit_hbp import attention
from lit_hbp.attention import flex
from lit_hbp.data.collate import collate_packs
from lit_hbp.module import HBPLitModule, set_recompile_limit

MICRO_BATCHES = 13


def make_module(**kw) -> HBPLitModule:
    torch.manual_seed(0)
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=300, **kw)
    module.configure_model()
    return module


def packs(n: int) -> list:
    """``n`` micro-batches of 1 to 6 documents of 2 to 80 tokens (different lengths and counts each)."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(n):
        lengths = rng.integers(2, 80, rng.integers(1, 7))
        samples = {j: (rng.integers(0, 300, n), rng.random(n) < 0.7) for j, n in enumerate(lengths)}
        out.append(collate_packs([np.arange(len(lengths))], samples.__getitem__, loss_norm=40.0))
    return out


def grads(module: HBPLitModule, batch) -> list[torch.Tensor]:
    module.zero_grad()
    module(batch)[0].backward()
    attention.set_pack(None)
    return [p.grad.clone() for p in module.parameters()]


@pytest.mark.slow
def test_compiled_layers_are_one_graph_and_train_like_eager(monkeypatch):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    eager, compiled = make_module(), make_module(compile=True)
    for layer in compiled._layers:  # the module's own set-up, with a counting backend
        layer.compile(backend=backend, dynamic=True)
    graphs_after_first = None
    for i, batch in enumerate(packs(MICRO_BATCHES)):
        for a, b in zip(grads(eager, batch), grads(compiled, batch)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        if i == 0:
            graphs_after_first = backend.frame_count
            assert graphs_after_first >= 1
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert backend.frame_count - graphs_after_first <= 2, "recompiled for other packs"


def test_recompile_limit_falls_back_to_cache_size_limit_before_torch_2_7(monkeypatch):
    """torch 2.6's dynamo config has ``cache_size_limit`` and no ``recompile_limit``."""
    old = SimpleNamespace(cache_size_limit=8)
    monkeypatch.setattr(torch._dynamo, "config", old)
    set_recompile_limit(16)
    set_recompile_limit(4)  # never lowered
    assert vars(old) == {"cache_size_limit": 16}
    new = SimpleNamespace(recompile_limit=8, cache_size_limit=8)
    monkeypatch.setattr(torch._dynamo, "config", new)
    set_recompile_limit(16)
    assert vars(new) == {"recompile_limit": 16, "cache_size_limit": 8}


def test_flex_block_masks_are_held_by_the_pack_being_trained():
    """Built once per pack and window (every layer shares it), dropped with the pack."""
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    attention.set_pack(cu, 5, 9)
    try:
        mask = flex.document_block_mask(cu, 9, None)
        assert flex.document_block_mask(cu, 9, None) is mask
        assert flex.document_block_mask(cu, 9, 3) is not mask
        assert flex.document_block_mask(cu.clone(), 9, None) is not mask  # not the pack's documents
    finally:
        attention.set_pack(None)
    assert flex.document_block_mask(cu, 9, None) is not mask
