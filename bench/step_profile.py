"""Where one level's optimizer step goes: a ``torch.profiler`` trace of a few steps of that level as
``Trainer.fit`` trains the config, named before anything is optimised (issue 54: the 4K level's ~300 ms
step on an H100, of which its forward and backward took ~82).

    python bench/step_profile.py --config configs/llama_1b_1gpu.yaml --level 4096 --steps 3 --warmup 4 --out DIR
    python bench/step_profile.py --config configs/tiny_cpu.yaml --level 1024 --steps 2 --warmup 1 --out DIR  # CPU
    Other arguments are LightningCLI overrides of the config, as in bench/gpu_throughput.py.

The run is gpu_throughput's ``hbp_alone`` mode (the config's model, strategy, precision, compile, logger
and callbacks; the plan's steps of that level only, in their order; no checkpoint, no validation; the
logger writes into a temporary folder). After
``--warmup`` optimizer steps the device is synchronized and ``--steps`` steps are recorded; the device is
synchronized again at the window's end, nowhere between, so the host runs ahead as in training.

Printed, per optimizer step of the window: its wall time; the device's busy share (the union of its
kernels', copies' and memsets' intervals over the window; none on a CPU); kernels launched; reads of a
tensor's value on the host (``aten::_local_scalar_dense``: ``.item()``, ``bool()``, ``.tolist()``, of a tensor
on any device) and the host's waits for the device (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
``cudaEventSynchronize``, device-to-host copies): on a GPU, a step that does not log should wait nowhere.
Then the operations by self device time and by self host time. Written to ``--out``: ``profile.txt`` (what
is printed) and ``trace.json.gz`` (Perfetto or chrome://tracing)."""

from __future__ import annotations

import argparse
import gzip
import shutil
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.profilers import Profiler
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_throughput import build, only_level, sync  # noqa: E402

from lit_hbp.report import format_table  # noqa: E402

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
READ = "aten::_local_scalar_dense"
COMPILE = "_compile.compile_inner"  # dynamo's range around one frame's compilation


class HookRanges(Profiler):
    """Lightning's actions (its hooks, ``run_training_batch``, ``optimizer_step``, ...) as ranges in the
    torch trace, so the host time between operations is named by the hook it ran in."""

    def __init__(self) -> None:
        super().__init__()
        self._open: dict[str, list[record_function]] = {}

    def start(self, action_name: str) -> None:
        scope = record_function(action_name)
        scope.__enter__()
        self._open.setdefault(action_name, []).append(scope)

    def stop(self, action_name: str) -> None:
        opened = self._open.get(action_name)
        if opened:
            opened.pop().__exit__(None, None, None)


class ProfileWindow(L.Callback):
    """``torch.profiler`` over optimizer steps ``warmup + 1`` to ``warmup + steps``, the device synchronized
    just before the window and at its end; ``seconds``: the window's wall time."""

    def __init__(self, warmup: int, steps: int):
        self.warmup, self.steps, self.done = warmup, steps, 0
        self.prof: profile | None = None
        self.seconds: float | None = None

    def _start(self, device: torch.device) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        sync(device)
        self.prof = profile(activities=activities)
        self.prof.__enter__()
        self._t0 = time.perf_counter()

    def on_train_start(self, trainer, pl_module):
        if self.warmup == 0:
            self._start(pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        self.done += 1
        if self.done == self.warmup:
            self._start(pl_module.device)
        elif self.done == self.warmup + self.steps and self.prof is not None:
            sync(pl_module.device)
            self.seconds = time.perf_counter() - self._t0
            self.prof.__exit__(None, None, None)


def on_device(e) -> bool:
    """A kernel, copy or memset the device ran; not a ``record_function`` range the profiler mirrors on the
    device's timeline (a user annotation spans its whole range, busy or not: the H200's first profile read
    99.9% busy from Lightning's training_step range)."""
    return e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)


def busy_share(events, start: float, end: float) -> float:
    """The share of [start, end] (us) in which the device ran anything: the union of its events' intervals."""
    spans = sorted(
        (max(e.time_range.start, start), min(e.time_range.end, end))
        for e in events
        if on_device(e) and e.time_range.end > start and e.time_range.start < end
    )
    busy, reach = 0.0, start
    for a, b in spans:
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    return busy / max(end - start, 1e-9)


def summary(prof: profile, seconds: float, steps: int, cuda: bool, hook_names: frozenset[str] = frozenset()) -> str:
    """The window's figures per optimizer step, the host time of Lightning's actions (``hook_names``), then the
    top operations by self device and host time."""
    events = prof.events()
    host = [e for e in events if e.device_type == DeviceType.CPU]
    start = min(e.time_range.start for e in host)
    end = max(e.time_range.end for e in events)
    kernels = [e for e in events if on_device(e)]
    reads = sum(e.name == READ for e in host)
    waits = sum(e.name in WAITS for e in host)
    to_host = sum("DtoH" in e.name for e in kernels)
    compiles = [e for e in host if e.name.startswith(COMPILE)]
    batches = sorted((e for e in host if e.name == "run_training_batch"), key=lambda e: e.time_range.start)
    lines = [
        f"window: {steps} optimizer steps, {seconds * 1e3 / steps:.1f} ms a step (wall, device synchronized at "
        "the window's ends only)",
        "host ms of each micro-batch (Lightning's run_training_batch): "
        + (", ".join(f"{e.cpu_time_total / 1e3:.1f}" for e in batches) or "n/a (no hook ranges)"),
        f"compilations in the window: {len(compiles)}"
        + (
            f" ({sum(e.cpu_time_total for e in compiles) / 1e6:.2f} s of host time, in the step times above)"
            if compiles
            else ""
        ),
        f"device busy: {busy_share(events, start, end):.1%} of the window" if cuda else "device busy: n/a (CPU)",
        f"per step: {len(kernels) / steps:.0f} device kernels and copies, {waits / steps:.1f} waits for the device "
        f"({', '.join(WAITS)}), {to_host / steps:.1f} device-to-host copies, {reads / steps:.1f} reads of a "
        f"tensor's value on the host ({READ}: on any device; a CPU tensor's wait for nothing)",
    ]
    averages = prof.key_averages()
    hooks = [a for a in averages if a.key in hook_names]
    if hooks:
        rows = [
            dict(name=a.key, calls=f"{a.count / steps:g}", host_ms=f"{a.cpu_time_total / 1e3 / steps:.2f}")
            for a in sorted(hooks, key=lambda a: -a.cpu_time_total)[:25]
        ]
        lines += ["", "host time by Lightning action, per step (nested actions counted in each):"]
        lines.append(format_table(rows, [("calls", "s"), ("host_ms", "s")], name="action"))
    if cuda:
        lines += ["", "by self device time:", averages.table(sort_by="self_device_time_total", row_limit=25)]
    lines += ["", "by self host time:", averages.table(sort_by="self_cpu_time_total", row_limit=25)]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/llama_1b_1gpu.yaml")
    p.add_argument("--level", type=int, required=True, help="the pack_len of the config's level to profile")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps recorded")
    p.add_argument("--warmup", type=int, default=4, help="optimizer steps before the window (compilation)")
    p.add_argument("--out", required=True, help="folder for profile.txt and trace.json.gz")
    args, overrides = p.parse_known_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    total = args.warmup + args.steps
    logs = tempfile.TemporaryDirectory(prefix="step_profile_")  # the config's logger writes there, not in runs/
    fit = build(args.config, [f"--trainer.logger.init_args.save_dir={logs.name}", *overrides], total)
    dm = fit.datamodule
    dm.trainer = fit.trainer  # the plan counts the run's world and accumulation, as Trainer.fit's would
    dm.setup("fit")
    lengths = [lv.pack_len for lv in dm.levels]
    if args.level not in lengths:
        p.error(f"--level {args.level}: the config's levels are {lengths}")
    level = lengths.index(args.level)
    plans, whole = {}, dm.plan_for_epoch
    dm.plan_for_epoch = lambda epoch: plans.setdefault(epoch, only_level(whole(epoch), level))
    have = int((whole(0).step_level == level).sum())
    if have < total:
        p.error(f"level {args.level} has {have} optimizer steps in an epoch: fewer than --warmup + --steps {total}")
    window = ProfileWindow(args.warmup, args.steps)
    fit.trainer.callbacks.append(window)
    hooks = fit.trainer.profiler = HookRanges()
    fit.trainer.fit(fit.model, dm)
    if window.seconds is None:
        print(f"the run stopped before the window's end ({window.done} optimizer steps)", file=sys.stderr)
        return 1
    device = fit.trainer.strategy.root_device
    text = f"{args.config}, level {args.level}, {device}\n" + summary(
        window.prof, window.seconds, args.steps, device.type == "cuda", frozenset(hooks._open)
    )
    print(text)
    (out / "profile.txt").write_text(text + "\n")
    trace = out / "trace.json"
    window.prof.export_chrome_trace(str(trace))
    with trace.open("rb") as f, gzip.open(out / "trace.json.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    trace.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
