"""Sync audit: a training micro-step that the logger does not write waits for nothing on a GPU,
accumulation micro-steps and optimizer steps alike.

``Trainer.fit`` on CPU with the trainer settings and callbacks of ``configs/llama_1b_1gpu.yaml``
(its strategy, ``HBPDDPStrategy``, precision and callback list, read from the file), and again with
``HBPStrategy`` at ZeRO-2 (DeepSpeed), plus the callbacks the CLI adds
(``with_default_callbacks``: FinalCheckpoint, InterruptCheckpoint, LevelSummary,
DiscardEmptyRunDir, HBPProgressBar), with ``accumulate_grad_batches=2`` and ``log_every_n_steps=3``:
accumulation micro-steps, optimizer steps that log and optimizer steps that do not.

What is counted, from a micro-step's ``on_train_batch_start`` to the end of the training loop's
work for it (``on_advance_end``: LR schedulers, loggers, Lightning's step-metric logging), in every
micro-step except the last micro-step of an optimizer step whose metrics the loggers write
(``lit_hbp.lightning.meter.logs_now``):

- every ``torch.cuda.synchronize()`` and DeepSpeed accelerator ``synchronize()`` (patched);
- every host read of a tensor that would live on the GPU: ``item``, ``tolist``, ``cpu``, ``numpy``,
  ``bool``/``int``/``float``/``index`` of a tensor, ``torch.equal``/``allclose`` and the
  data-dependent shapes (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing), seen by a
  torch-function mode. On a GPU each of these waits for the device;
- every host value copied to the device by a blocking copy: a ``torch.tensor``/``as_tensor`` made on
  the device (``torch.tensor(-1.0, device=...)``), a host tensor's ``.to(<device>)`` or ``.cuda()``
  without ``non_blocking=True``. torch's blocking host-to-device copy synchronizes its stream, so on a
  GPU each waits for the queued work too. (The batch's own copy is non-blocking from pinned memory on a
  GPU, ``PackedBatch.to``: made non-blocking here too, as it is there;)
- every ``LightningModule.log`` of a Python number (Lightning copies it to the device) or of a
  tensor that would live on the GPU.

Which tensors would live on the GPU: on CPU every tensor is a host tensor, so the mode tracks the
host ones and treats every other tensor as a device tensor (when in doubt, device: the audit errs
towards counting). Host tensors are those made by a factory (``torch.tensor``, ``zeros``,
``from_numpy``, ...) without a ``device`` argument, and the results of ops whose tensor inputs are
all host tensors; ``.to(<device>)`` (what ``batch_to_device`` does) makes a device tensor, ``.cpu()``
a host tensor. Parameters, gradients, the optimizer's states, the batch after ``batch_to_device``
and the model's outputs are device tensors. A factory given a device (``torch.tensor(x,
device=module.device)``) makes a device tensor: on a GPU that is a host-to-device copy.

DeepSpeed's accelerator is swapped for one that, like CUDA's, does not order its work itself, so
DeepSpeed takes the branches it takes on a GPU where it can, and AdamW is the fused one, as on a GPU.
Reads are attributed to the first frame outside torch. The bar: nothing at all in accumulation
micro-steps, nor, with ``HBPDDPStrategy``, at optimizer steps that do not log (fused AdamW, the
module's foreach clipping). Under DeepSpeed, at optimizer steps that do not log, only its clipping
check of the gradient norm (``is_invalid_grad_norm``, which DeepSpeed 0.19 runs whenever
gradient_clip_val > 0) and the device scalar it masks a non-finite norm with
(``mask_nan_or_inf_with_val_inplace``). HBPStrategy turns DeepSpeed's bf16 overflow check off, which
otherwise reads an overflow flag and the norm too.

Not seen on CPU: branches taken only on a CUDA device (``StepMeter``'s CUDA events,
``HBPThroughputMonitor``'s synchronize at logging steps), which the GPU test of
``tests/test_hot_path.py`` runs. The attention is one opaque call, as a GPU varlen kernel is: its
CPU stand-in, a loop over documents that reads their bounds on the host, runs unwatched. Layers run
eagerly (the config compiles them: ``tests/test_compile.py`` holds a compiled layer to one graph).
Epoch-level hooks (``LevelSummary``'s one all-gather per epoch) are outside micro-steps.

InterruptCheckpoint all-reduces a Ctrl-C flag at each optimizer step when the world has more than
one process: a CPU tensor over a gloo group, read with ``.item()`` on the host, no device sync. The
run fakes that group so the read happens in this single process, and the audit must not count it.
"""

from __future__ import annotations

import csv
import importlib
import traceback
import weakref
from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from conftest import TINY_LLAMA, chat_datamodule
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from torch.overrides import TorchFunctionMode

import lit_hbp.callbacks.interrupt as interrupt_module
import lit_hbp.lightning.module as module_module
from lit_hbp.callbacks import InterruptCheckpoint, with_default_callbacks
from lit_hbp.lightning.meter import logs_now
from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.model.attention import backends, kernel, loops

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "llama_1b_1gpu.yaml"
READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "equal", "allclose"}
READS |= {"nonzero", "masked_select", "unique", "argwhere"}
FACTORIES = {"tensor", "as_tensor", "scalar_tensor", "from_numpy", "zeros", "ones", "empty", "full", "arange"}
FACTORIES |= {"linspace", "rand", "randn", "randint", "eye"}
FAKE_GLOO = "fake-gloo-group"


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _moves_to_device(args, kwargs) -> bool:
    """``t.to(...)`` with a device (or a tensor whose device it takes), not only a dtype."""
    targets = [*args[1:], kwargs.get("device")]
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in targets)


def origin() -> str:
    """``package: file:line function`` of the first frame outside torch and this file: who asked."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        parts = Path(frame.filename).parts
        if frame.filename == __file__ or "torch" in parts:
            continue
        package = next((p for p in ("lit_hbp", "lightning", "deepspeed", "transformers") if p in parts), "other")
        return f"{package}: {parts[-1]}:{frame.lineno} {frame.name}"
    return "other: unknown"


def logged_metric_state() -> bool:
    """Whether Lightning's result collection is moving a logged metric's state to the logged value's
    device: the host for a host value (no copy on a GPU); a device value's logging is counted apart."""
    return any(f.filename.endswith(("logger_connector/result.py",)) for f in traceback.extract_stack())


class DeviceReads(TorchFunctionMode):
    """Records host reads of tensors that would be on the GPU, while ``watching``."""

    def __init__(self) -> None:
        super().__init__()
        self.host: dict[int, weakref.ref] = {}  # by id: a WeakSet would compare tensors with ==
        self.watching = False
        self.reads: list[str] = []  # "what (origin)" of device tensors
        self.host_reads: list[str] = []  # the same for host tensors (no sync on a GPU)

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self.host.get(id(t))
        return ref is not None and ref() is t

    def mark(self, t: torch.Tensor, host: bool) -> None:
        key = id(t)
        if not host:
            self.host.pop(key, None)
            return

        def forget(ref: weakref.ref) -> None:
            if self.host.get(key) is ref:
                del self.host[key]

        self.host[key] = weakref.ref(t, forget)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        inputs = _tensors(list(args)) + _tensors(kwargs)
        on_device = [t for t in inputs if not self.is_host(t)]
        if self.watching:
            read = name in READS or (name == "repeat_interleave" and torch.is_tensor(kwargs.get("repeats")))
            if name == "__getitem__" and len(args) > 1:
                index = args[1] if isinstance(args[1], tuple) else (args[1],)
                read = any(torch.is_tensor(i) and i.dtype == torch.bool for i in index)
            if read:
                (self.reads if on_device else self.host_reads).append(f"{name} ({origin()})")
            elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None and not on_device:
                self.reads.append(f"{name}(device=...) ({origin()})")
            elif name in ("to", "cuda") and inputs and not on_device and not kwargs.get("non_blocking"):
                if name == "cuda" or _moves_to_device(args, kwargs):
                    if not logged_metric_state():
                        self.reads.append(f"blocking copy {name} ({origin()})")
        out = func(*args, **kwargs)
        if name in FACTORIES:
            host = kwargs.get("device") is None
        elif name == "cpu":
            host = True
        elif name in ("to", "cuda"):
            host = not on_device and not (name == "cuda" or _moves_to_device(args, kwargs))
        else:
            host = bool(inputs) and not on_device
        for t in _tensors(out):
            self.mark(t, host)
        return out


def opaque_kernel(mode: DeviceReads) -> kernel.Backend:
    """An attention backend the recorder does not watch inside: a varlen kernel is one device call;
    its CPU stand-in (the eager loop) reads document bounds on the host."""

    def opaque(q, k, v, args):
        watching, mode.watching = mode.watching, False
        try:
            return loops.eager_run(q, k, v, args)
        finally:
            mode.watching = watching

    return kernel.Backend("opaque", loops._anywhere, lambda: frozenset(kernel.FEATURES), opaque)


class Audit(L.Callback):
    """Opens a watch window at each micro-step's start; the window closes after the loop's
    ``on_advance_end`` for it (patched in the test). Keeps, per micro-step, whether it logs, whether
    it steps the optimizer, and what was counted."""

    def __init__(self, mode: DeviceReads) -> None:
        self.mode = mode
        self.extra: list[str] = []  # synchronize and log calls of the open window
        self.windows: list[tuple[bool, bool, list[str]]] = []
        self.host_reads: list[str] = []
        self._logging = self._stepping = False

    def note(self, what: str) -> None:
        if self.mode.watching:
            self.extra.append(f"{what} ({origin()})")

    def on_train_start(self, trainer, pl_module):
        for cb in trainer.callbacks:
            if isinstance(cb, InterruptCheckpoint):
                cb._group = FAKE_GLOO  # as on a world of several processes: the flag is all-reduced and read

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.close()
        self.mode.reads, self.mode.host_reads, self.extra = [], [], []
        self.mode.watching = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._logging, self._stepping = logs_now(trainer), not trainer.fit_loop._should_accumulate()

    def close(self) -> None:
        if self.mode.watching:
            self.mode.watching = False
            self.host_reads += self.mode.host_reads
            self.windows.append((self._logging, self._stepping, self.mode.reads + self.extra))


def config_callbacks() -> list[L.Callback]:
    """The callbacks of configs/llama_1b_1gpu.yaml, built as LightningCLI builds them."""
    out = []
    for entry in yaml.safe_load(CONFIG.read_text())["trainer"]["callbacks"]:
        module, name = entry["class_path"].rsplit(".", 1)
        out.append(getattr(importlib.import_module(module), name)(**entry.get("init_args", {})))
    return out


def config_trainer_settings(strategy: str) -> dict:
    """The config's precision and its strategy (with its init_args), or ``HBPStrategy`` at ZeRO-2, on CPU."""
    from lit_hbp.lightning.strategy import HBPDDPStrategy, HBPStrategy

    trainer = yaml.safe_load(CONFIG.read_text())["trainer"]
    entry = trainer["strategy"]
    module, name = entry["class_path"].rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    assert cls is HBPDDPStrategy  # the config's fast path on one device
    built = cls(**entry.get("init_args", {})) if strategy == "config" else HBPStrategy(stage=2)
    return dict(strategy=built, precision=trainer["precision"])


def test_the_recorder_tells_device_reads_from_host_reads():
    """The mode's rules on their own: what it must count and what it must not."""
    layer = torch.nn.Linear(4, 2)
    with DeviceReads() as mode:
        mode.watching = True
        out = layer(torch.ones(1, 4))
        out.sum().item()  # a model output: device
        torch.tensor(3.0, device=torch.device("cpu")).tolist()  # made on the device
        torch.ones(3).to("cpu").cpu()  # moved to the device, then read back
        host = torch.tensor([1.0, 2.0])
        (host * 2).sum().item()  # host from its factory to its read
        float(torch.tensor(1.5).clone().detach().squeeze())  # how Lightning handles a logged host tensor
        torch.ones(2).to("cpu", non_blocking=True)  # pinned and without blocking, as a GPU batch is copied
        torch.zeros(2, device=torch.device("cpu"))  # made on the device by a kernel: no copy
    # a blocking copy of a host value to the device (a factory given one, or ``.to``) waits too
    want = ["item", "tensor(device=...)", "tolist", "blocking copy to", "cpu"]
    assert [r.split(" (")[0] for r in mode.reads] == want, mode.reads


@pytest.mark.parametrize("strategy", ["config", "hbp_zero2"])
def test_no_sync_outside_logging_steps(strategy, tmp_path, toy_tokenizer, small_demo, monkeypatch):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    settings = config_trainer_settings(strategy)
    from lit_hbp.data.batch import PackedBatch

    # On a GPU the batch is pinned by the loader and copied without blocking (``PackedBatch.to``).
    monkeypatch.setattr(PackedBatch, "to", lambda self, device: self._map(lambda t: t.to(device, non_blocking=True)))
    mode = DeviceReads()
    audit = Audit(mode)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: audit.note("torch.cuda.synchronize"))
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed synchronizes through its accelerator (torch.cuda.synchronize on a GPU, a no-op on CPU),
    # and skips some of those syncs on an accelerator that orders its work itself, as CPU's does and
    # CUDA's does not. (ZeRO's overlap_comm path, which needs a CUDA stream, then fails here.)
    monkeypatch.setattr(get_accelerator(), "synchronize", lambda *a, **k: audit.note("accelerator.synchronize"))
    monkeypatch.setattr(get_accelerator(), "resolves_data_dependency", lambda: False)

    real_all_reduce = interrupt_module.dist.all_reduce

    def all_reduce(tensor, *args, group=None, **kwargs):
        return None if group == FAKE_GLOO else real_all_reduce(tensor, *args, group=group, **kwargs)

    monkeypatch.setattr(interrupt_module.dist, "all_reduce", all_reduce)
    real_log = L.LightningModule.log

    def log(self, name, value, *args, **kwargs):
        if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and not mode.is_host(value)):
            audit.note(f"log({name!r}, {type(value).__name__})")
        return real_log(self, name, value, *args, **kwargs)

    monkeypatch.setattr(L.LightningModule, "log", log)
    real_advance_end = _TrainingEpochLoop.on_advance_end

    def on_advance_end(self, *args, **kwargs):
        try:
            return real_advance_end(self, *args, **kwargs)
        finally:
            audit.close()

    monkeypatch.setattr(_TrainingEpochLoop, "on_advance_end", on_advance_end)

    monkeypatch.setitem(backends.REGISTRY, "opaque", opaque_kernel(mode))
    # On a GPU every trainable parameter is a CUDA float, so AdamW is fused (``adamw_kind``): it keeps
    # its step counts on the device and never reads them (off CUDA AdamW keeps them on the host).
    monkeypatch.setattr(module_module, "adamw_kind", lambda params, device=None: "fused")
    dm = chat_datamodule(small_demo, toy_tokenizer, tmp_path / "cache")
    torch.manual_seed(0)
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, attn_backend="opaque", self_check=False)
    callbacks = with_default_callbacks([audit, *config_callbacks()], enable_progress_bar=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        accumulate_grad_batches=2,
        log_every_n_steps=3,
        gradient_clip_val=1.0,
        use_distributed_sampler=False,
        logger=CSVLogger(tmp_path / "logs"),
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
        **settings,
    )
    with mode:
        trainer.fit(module, dm)

    names = {type(c).__name__ for c in trainer.callbacks}
    assert {"PackingMetrics", "HBPThroughputMonitor", "InterruptCheckpoint"} <= names
    assert {"FinalCheckpoint", "LevelSummary", "DiscardEmptyRunDir", "HBPProgressBar"} <= names
    assert trainer.global_step == 6 and len(audit.windows) == 12
    quiet_step, logging_step = [(False, False), (False, True)], [(False, False), (True, True)]
    shape = [(logging, stepping) for logging, stepping, _ in audit.windows]
    assert shape == (quiet_step * 2 + logging_step) * 2  # log_every_n_steps=3: optimizer steps 3 and 6 log
    accumulating = [c for _, stepping, counted in audit.windows if not stepping for c in counted]
    assert not accumulating, "\n".join(f"{n} x {c}" for c, n in Counter(accumulating).most_common())
    quiet = [c for logging, _, counted in audit.windows if not logging for c in counted]
    if strategy == "config":  # fused AdamW and the module's foreach clipping: nothing at all
        assert trainer.optimizers[0].defaults["fused"]
        assert not quiet, "\n".join(f"{n} x {c}" for c, n in Counter(quiet).most_common())
    else:
        assert trainer.strategy.deepspeed_engine.zero_overlap_comm() is False  # one process: nothing to overlap
        assert trainer.strategy.config["bf16"] == {"enabled": True, "check_grad_overflow": False}
        # DeepSpeed's clipping (``unscale_and_clip_grads``) checks the norm's finiteness on the host when
        # gradient_clip_val > 0, whatever the config, and masks a non-finite norm with a scalar it makes on
        # the device: its reads left, at optimizer steps alone.
        known = ("__bool__ (deepspeed: utils.py", "tensor(device=...) (deepspeed: utils.py")
        others = Counter(
            c for c in quiet if not c.startswith(known) or not any(f in c for f in ("is_invalid_grad_norm", "mask_nan"))
        )
        assert not others, "\n".join(f"{n} x {c}" for c, n in others.most_common())
        # Each twice an optimizer step (DeepSpeed 0.19 checks and masks the norm in its step and again in
        # its clipping): 4 waits for the device at every step that does not log, the DDP path's none.
        assert len(quiet) <= 4 * 4, Counter(quiet)
    # The recorder does see device reads: the logging steps read the loss...
    assert any(c.startswith("tolist (lit_hbp: meter.py") for logging, _, w in audit.windows if logging for c in w)
    # ...while InterruptCheckpoint's Ctrl-C flag, read on the host at each optimizer step, is not counted.
    assert sum("interrupt.py" in c for c in audit.host_reads) == 6, audit.host_reads
    # The gradient norm (DeepSpeed's, kept on the device) is written at the two logging steps alone.
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        norms = [float(row["train/grad_norm"]) for row in csv.DictReader(f) if row.get("train/grad_norm")]
    assert len(norms) == 2 and all(0 < n < float("inf") for n in norms), norms
