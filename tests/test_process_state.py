"""The suite passes in any order: conftest's ProcessState (the autouse fixtures around every test and
module) puts back every process-wide setting a test changes, and ``LIT_HBP_TEST_ORDER=reverse`` runs
the suite last test first. Checked here against the values read before the changes, without it."""

import json
import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from conftest import ProcessState

ROOT = Path(__file__).resolve().parents[1]
# The pytest runs started here load no Hypothesis (a plugin of the environment none of their tests uses, whose
# import is most of a bare pytest's start): the orders and thread counts checked are the suite's conftest's.
NO_HYPOTHESIS = ("-p", "no:hypothesispytest")


def _ignore(signum, frame):
    pass


def test_every_process_wide_setting_a_test_changes_is_put_back(tmp_path):
    import torch._dynamo.config as dynamo_config
    from torch._logging import _internal as torch_logs
    from transformers.utils import logging as hf_logging

    b = torch.backends
    logger = logging.getLogger("lit_hbp.test_process_state")
    before = dict(
        dtype=torch.get_default_dtype(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        precision=torch.get_float32_matmul_precision(),
        tf32=b.cuda.matmul.allow_tf32,
        fp32=(b.cuda.matmul.fp32_precision, b.mkldnn.matmul.fp32_precision),
        benchmark=b.cudnn.benchmark,
        threads=torch.get_num_threads(),
        grad=torch.is_grad_enabled(),
        limit=dynamo_config.recompile_limit,
        artifacts=set(torch_logs.log_state.artifact_names),
        environ=dict(os.environ),
        cwd=os.getcwd(),
        usr1=signal.getsignal(signal.SIGUSR1),
        verbosity=hf_logging.get_verbosity(),
        bars=hf_logging.is_progress_bar_enabled(),
        level=logger.level,
        linear=torch.nn.functional.linear,
    )
    debug = logger.isEnabledFor(logging.DEBUG)  # (cached by the logger from here on)
    state = ProcessState()
    after_snapshot = (random.random(), np.random.rand(), torch.rand(1).item())

    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_float32_matmul_precision("medium")
    b.cuda.matmul.allow_tf32 = not b.cuda.matmul.allow_tf32
    b.cuda.matmul.fp32_precision = "ieee"  # torch's newer API after the older one: reading the older one fails
    b.cudnn.benchmark = not before["benchmark"]
    torch.set_num_threads(1 if before["threads"] != 1 else 2)
    torch.set_grad_enabled(not before["grad"])
    dynamo_config.recompile_limit = before["limit"] + 100  # what a compiled lit-hbp run does
    torch._logging.set_logs(recompiles=True)
    os.environ["OMP_NUM_THREADS"] = "7"
    os.environ["LIT_HBP_TEST_PROCESS_STATE"] = "set by the test"
    os.environ.pop("DS_ACCELERATOR", None)
    os.chdir(tmp_path)
    signal.signal(signal.SIGUSR1, _ignore)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logger.setLevel(logging.DEBUG)
    hf_logging.get_logger("transformers.test_process_state").warning_once("said once")
    assert hf_logging.warning_once.cache_info().currsize > 0
    random.random(), np.random.rand(), torch.rand(1)
    torch.nn.functional.linear = lambda x, w, b=None: x  # as DeepSpeed's zero.Init leaves it (its own linear)

    changed = state.restore()

    assert torch.get_default_dtype() == before["dtype"]
    assert torch.are_deterministic_algorithms_enabled() == before["deterministic"]
    assert torch.get_float32_matmul_precision() == before["precision"]
    assert b.cuda.matmul.allow_tf32 == before["tf32"] and b.cudnn.benchmark == before["benchmark"]
    assert (b.cuda.matmul.fp32_precision, b.mkldnn.matmul.fp32_precision) == before["fp32"]
    assert torch.get_num_threads() == before["threads"] and torch.is_grad_enabled() == before["grad"]
    assert dynamo_config.recompile_limit == before["limit"]
    assert torch_logs.log_state.artifact_names == before["artifacts"]
    assert dict(os.environ) == before["environ"] and os.getcwd() == before["cwd"]
    assert signal.getsignal(signal.SIGUSR1) == before["usr1"]
    assert hf_logging.get_verbosity() == before["verbosity"]
    assert hf_logging.is_progress_bar_enabled() == before["bars"]
    assert hf_logging.warning_once.cache_info().currsize == 0  # said again by the next test
    assert logger.level == before["level"] and logger.isEnabledFor(logging.DEBUG) == debug
    assert torch.nn.functional.linear is before["linear"]
    # The random generators are where they were at the snapshot: the same draws again.
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == after_snapshot
    for name in ("default dtype", "environment", "working directory", "torch._logging", "SIGUSR1 handler"):
        assert name in changed, changed
    assert "torch._dynamo.config.recompile_limit" in changed and "torch.nn.functional.linear" in changed


def test_the_reverse_order_runs_the_last_test_first(monkeypatch):
    """``LIT_HBP_TEST_ORDER=reverse``: pytest collects this file's tests last to first; another order is
    refused."""
    import pytest
    from conftest import pytest_collection_modifyitems

    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *NO_HYPOTHESIS, __file__],
        cwd=ROOT, env={**os.environ, "LIT_HBP_TEST_ORDER": "reverse"}, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    collected = [line.split("::")[1] for line in out.stdout.splitlines() if "::" in line]
    assert collected == [
        "test_a_pools_workers_start_in_the_environment_of_the_pool_not_of_the_first_pool",
        "test_two_workers_run_the_slow_tests_first_on_one_thread_each",
        "test_the_reverse_order_runs_the_last_test_first",
        "test_every_process_wide_setting_a_test_changes_is_put_back",
    ]
    monkeypatch.setenv("LIT_HBP_TEST_ORDER", "random")
    with pytest.raises(pytest.UsageError, match="LIT_HBP_TEST_ORDER='random': the only order is 'reverse'"):
        pytest_collection_modifyitems(None, [1, 2])


LANES = """
import json, os
import pytest, torch

def record(request):
    with open(os.environ["LANES_LOG"], "a") as f:
        f.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER"), "threads": torch.get_num_threads(),
                            "omp": os.environ.get("OMP_NUM_THREADS"),
                            "order": [item.name for item in request.session.items]}) + "\\n")

def test_a(request): record(request)
@pytest.mark.slow
def test_b(request): record(request)
def test_c(request): record(request)
@pytest.mark.slow
def test_d(request): record(request)
"""

# The suite's conftest (its module-level settings and its collection hook), loaded under another name.
SUITE_HOOK = """
import importlib.util, sys
sys.path.insert(0, {tests!r})
spec = importlib.util.spec_from_file_location("suite_conftest", {tests!r} + "/conftest.py")
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_collection_modifyitems = suite.pytest_collection_modifyitems
"""


def test_two_workers_run_the_slow_tests_first_on_one_thread_each(tmp_path):
    """The README's ``-n 2 --dist worksteal``: each worker collects the slow tests first (in their order),
    and torch in it, and every process its tests start, take one thread; a plain run keeps the files'
    order and leaves the thread count to torch."""
    (tmp_path / "conftest.py").write_text(SUITE_HOOK.format(tests=str(ROOT / "tests")))
    (tmp_path / "test_lanes.py").write_text(LANES)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    log = tmp_path / "lanes.jsonl"
    # The suite's own settings stay out of the inner runs (a suite run in reverse order must not reverse them).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "OMP_NUM_THREADS", "LIT_HBP_TEST"))}
    for args in (["-n", "2", "--dist", "worksteal"], []):
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *NO_HYPOTHESIS, *args, "test_lanes.py"],
            cwd=tmp_path, env={**env, "LANES_LOG": str(log)}, capture_output=True, text=True,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    workers, plain = runs[:4], runs[4:]
    assert {r["worker"] for r in workers} == {"gw0", "gw1"}
    assert all(r["order"] == ["test_b", "test_d", "test_a", "test_c"] for r in workers), workers
    assert all(r["threads"] == 1 and r["omp"] == "1" for r in workers), workers
    assert all(r["order"] == ["test_a", "test_b", "test_c", "test_d"] and r["omp"] is None for r in plain), plain


def _environment_and_threads(name: str) -> tuple[str | None, int]:
    import torch

    return os.environ.get(name), torch.get_num_threads()


def test_a_pools_workers_start_in_the_environment_of_the_pool_not_of_the_first_pool(monkeypatch):
    """tests/distributed.py forks its workers from a server started at the first pool of the process: a later
    pool's workers still see the environment of the test that started them (as spawned workers would), on one
    thread each."""
    from distributed import Pool

    for value in ("first", "second"):
        monkeypatch.setenv("LIT_HBP_POOL_PROBE", value)
        pool = Pool(2)
        try:
            assert pool.run(_environment_and_threads, "LIT_HBP_POOL_PROBE") == [(value, 1), (value, 1)]
        finally:
            pool.close()
    monkeypatch.delenv("LIT_HBP_POOL_PROBE")
    pool = Pool(2)
    try:
        assert pool.run(_environment_and_threads, "LIT_HBP_POOL_PROBE") == [(None, 1), (None, 1)]
    finally:
        pool.close()
