"""bench/step_profile.py, the profile a GPU session takes first (issue 54): its window holds exactly the
optimizer steps it says, and its device-busy share is the union of the device's intervals (brute force)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
from conftest import QUIET, TINY_LLAMA
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from step_profile import HookRanges, ProfileWindow, busy_share, summary  # noqa: E402

from lit_hbp.autoselect.measured import ProbeData  # noqa: E402
from lit_hbp.lightning.module import HBPLitModule  # noqa: E402
from lit_hbp.packing.levels import Level  # noqa: E402


def event(device: DeviceType, start: float, end: float, annotation: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        device_type=device, time_range=SimpleNamespace(start=start, end=end), is_user_annotation=annotation
    )


@settings(max_examples=200, deadline=None)
@given(
    spans=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 30), st.booleans()), max_size=12),
    window=st.tuples(st.integers(0, 40), st.integers(1, 60)),
)
def test_the_busy_share_is_the_union_of_the_devices_intervals_in_the_window(spans, window):
    start, end = window[0], window[0] + window[1]
    events = [event(DeviceType.CUDA if on_device else DeviceType.CPU, a, a + n) for a, n, on_device in spans]
    # a record_function range the profiler mirrors on the device's timeline: no work of the device's
    events.append(event(DeviceType.CUDA, 0, 200, annotation=True))
    busy = np.zeros(200, dtype=bool)  # unit cells [t, t + 1) of the timeline
    for a, n, on_device in spans:
        if on_device:
            busy[a : a + n] = True
    expected = busy[start:end].sum() / (end - start)
    assert abs(busy_share(events, start, end) - expected) < 1e-9


def test_the_window_records_the_steps_after_the_warm_up_and_only_those(tmp_path):
    """Four optimizer steps of two micro-batches each; the window is steps 3 and 4: the trace holds two
    optimizer steps and four forwards, and the summary says two steps."""
    module = HBPLitModule(model={**TINY_LLAMA, "vocab_size": 300}, self_check=False)
    window, hooks = ProfileWindow(warmup=2, steps=2), HookRanges()
    trainer = L.Trainer(
        **{**QUIET, "max_steps": 4, "accumulate_grad_batches": 2, "callbacks": [window], "profiler": hooks}
    )
    trainer.fit(module, datamodule=ProbeData(Level(256), np.full(50, 40), 8, 0))
    assert trainer.global_step == 4 and window.done == 4 and window.seconds > 0
    names = [e.name for e in window.prof.events()]
    assert sum(n.startswith("Optimizer.step#") and n.endswith(".step") for n in names) == 2
    assert sum(n == "aten::embedding" for n in names) == 4  # one forward a micro-batch
    assert not any(hooks._open.values())  # every action Lightning started was closed
    text = summary(window.prof, window.seconds, 2, cuda=False, hook_names=frozenset(hooks._open))
    assert text.startswith("window: 2 optimizer steps, ") and "device busy: n/a (CPU)" in text
    each = text.split("host ms of each micro-batch (Lightning's run_training_batch): ")[1].split("\n")[0]
    assert len(each.split(", ")) == 4  # the window's four micro-batches
    assert "compilations in the window: 0" in text  # nothing compiled in this run
    table = text.split("host time by Lightning action, per step")[1].split("by self host time")[0]
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[3:] if line.strip()}
    assert rows["[LightningModule]HBPLitModule.optimizer_step"][0] == "1"  # one optimizer step a step
    assert rows["[Strategy]SingleDeviceStrategy.training_step"][0] == "2"  # two micro-batches a step
