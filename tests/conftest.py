import logging
import os
import sys
from pathlib import Path

# Brute-force references live next to the tests.
sys.path.insert(0, str(Path(__file__).parent))
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run ("lit-hbp", the default): a clean machine's CI is green
# when it was green here, and a failure repeats. ``--hypothesis-profile explore`` draws new ones (random
# seeds, a few times the examples where a test sets none): run it to look for what the fixed draws miss.
settings.register_profile("lit-hbp", deadline=None, max_examples=60, derandomize=True, database=None)
settings.register_profile("explore", deadline=None, max_examples=300)
settings.load_profile("lit-hbp")

# Without a GPU DeepSpeed must not look for CUDA (with one, the GPU tests' DeepSpeed runs on it), and its
# JIT op is compiled once into the repo's cache.
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))
# Under pytest-xdist (the README's ``-n 2``) two workers share the cores: one thread each, for torch here
# and every process a test starts (torch's default, a thread per core, would have each worker's threads
# spin while the other's run).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """``LIT_HBP_TEST_ORDER=reverse`` runs the collected tests last to first: a test that passes only
    after (or before) another shows up (no plugin needed). Under pytest-xdist the slow tests go first."""
    order = os.environ.get("LIT_HBP_TEST_ORDER", "")
    if order == "reverse":
        items.reverse()
    elif order:
        raise pytest.UsageError(f"LIT_HBP_TEST_ORDER={order!r}: the only order is 'reverse'")
    if hasattr(config, "workerinput"):  # a worker of pytest-xdist (not a pytest a test starts inside one)
        # The slow tests first (in their order), then the rest: the two workers of ``-n 2 --dist worksteal``
        # start with the long runs and steal the short tests from each other at the end, not a long one
        # that leaves the other worker idle. A module's tests stay together (what one computes for the next).
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# How long a test waits for a process, a line or a file before it calls it a hang: a bound on hangs,
# never on speed (an hour: no machine is too busy for it, whatever runs beside the suite).
HANG_S = 3600


def console_script(name: str) -> str:
    """The path of the console script ``name`` (``lit-hbp``, ``torchrun``) of the Python running the tests.
    pip puts it beside the interpreter in a virtual environment, and in the install scheme's scripts
    folder otherwise (Debian's /usr/local/bin for /usr/bin/python3, ~/.local/bin for ``--user``); PATH last."""
    import shutil
    import sysconfig

    folders = [os.path.dirname(sys.executable), sysconfig.get_path("scripts")]
    if f"{os.name}_user" in sysconfig.get_scheme_names():
        folders.append(sysconfig.get_path("scripts", f"{os.name}_user"))
    found = shutil.which(name, path=os.pathsep.join([*folders, os.environ.get("PATH", "")]))
    assert found, f"console script {name!r} is in none of {folders} and not on PATH (pip install -e . puts it there)"
    return found


HANDLED_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")


def _settings() -> list[tuple[str, object, object]]:
    """(name, getter, setter) of each process-wide setting of torch a test may change."""
    import torch

    b = torch.backends
    out = [
        ("default dtype", torch.get_default_dtype, torch.set_default_dtype),
        (
            "deterministic algorithms",
            lambda: (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
        ),
        ("threads", torch.get_num_threads, torch.set_num_threads),
        ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
        ("anomaly detection", torch.is_anomaly_enabled, torch.autograd.set_detect_anomaly),
        ("flash sdp", b.cuda.flash_sdp_enabled, b.cuda.enable_flash_sdp),
        ("mem-efficient sdp", b.cuda.mem_efficient_sdp_enabled, b.cuda.enable_mem_efficient_sdp),
        ("math sdp", b.cuda.math_sdp_enabled, b.cuda.enable_math_sdp),
        ("cudnn sdp", b.cuda.cudnn_sdp_enabled, b.cuda.enable_cudnn_sdp),
    ]
    out.append(("tf32 and fp32 precision", _precision, _set_precision))
    for name in ("enabled", "benchmark", "deterministic"):
        get = lambda n=name: getattr(b.cudnn, n)  # noqa: E731
        put = lambda v, n=name: setattr(b.cudnn, n, v)  # noqa: E731
        out.append((f"torch.backends.cudnn.{name}", get, put))
    out.append(("torch.backends.mkldnn.enabled", lambda: b.mkldnn.enabled, lambda v: setattr(b.mkldnn, "enabled", v)))
    # what DeepSpeed's zero.Init replaces for the process (its linear "will persist unless manually reset"): under
    # autocast every later model would keep fp32 weights for its backward (tests/test_memory_model.py measured none)
    for owner, name in ((torch.nn.functional, "linear"), (torch.nn.Module, "apply")):
        get = lambda o=owner, n=name: getattr(o, n)  # noqa: E731
        put = lambda v, o=owner, n=name: setattr(o, n, v)  # noqa: E731
        out.append((f"{owner.__name__}.{name}", get, put))
    return out


def _precision_owners() -> dict:
    """The objects whose ``fp32_precision`` (torch's newer TF32 settings) torch has, by name."""
    import torch

    b = torch.backends
    owners = {"": b, "cuda.matmul": b.cuda.matmul, "cudnn": b.cudnn, "mkldnn": b.mkldnn}
    for parent in ("cudnn", "mkldnn"):
        for child in ("matmul", "conv", "rnn"):
            owners[f"{parent}.{child}"] = getattr(getattr(b, parent), child, None)
    return {name: o for name, o in owners.items() if o is not None and hasattr(o, "fp32_precision")}


def _precision():
    """The TF32 settings through both of torch's APIs: the older one (the matmul precision and the
    ``allow_tf32`` flags; "unreadable" where torch refuses to read it after a mix of the two APIs) and
    the newer ``fp32_precision`` of each backend."""
    import torch

    b = torch.backends
    old = []
    for get in (torch.get_float32_matmul_precision, lambda: b.cuda.matmul.allow_tf32, lambda: b.cudnn.allow_tf32):
        try:
            old.append(get())
        except RuntimeError:
            old.append("unreadable")
    return tuple(old), tuple((name, o.fp32_precision) for name, o in _precision_owners().items())


def _set_precision(value) -> None:
    """Back to ``value`` (``_precision``): the older API first, then every ``fp32_precision`` (what makes
    the two agree again after a test used both)."""
    import torch

    b = torch.backends
    (precision, matmul, cudnn), new = value
    if precision != "unreadable":
        torch.set_float32_matmul_precision(precision)
    if matmul != "unreadable":
        b.cuda.matmul.allow_tf32 = matmul
    if cudnn != "unreadable":
        b.cudnn.allow_tf32 = cudnn
    owners = _precision_owners()
    for name, setting in new:
        owners[name].fp32_precision = setting


class ProcessState:
    """A snapshot of every process-wide setting a test may change, and its restore: torch's default
    dtype, deterministic and backend flags, thread count and grad mode; the torch functions DeepSpeed
    replaces; the configs of dynamo and inductor (their recompile limit); torch._logging's settings;
    the environment; the working directory; signal handlers; the random generators of random, numpy
    and torch; transformers' verbosity, progress bars and ``warning_once`` records; the levels of every
    named logger; and lit-hbp's memo of the installed attention kernels."""

    def __init__(self) -> None:
        import importlib
        import random
        import signal

        import torch

        self.settings = [(name, get, put, get()) for name, get, put in _settings()]
        self.configs = []
        for module in ("torch._dynamo.config", "torch._inductor.config"):
            if module in sys.modules or module == "torch._dynamo.config":
                config = importlib.import_module(module)
                self.configs.append((config, config.get_config_copy()))
        from torch._logging import _internal as torch_logs

        self.torch_logs = (dict(torch_logs.log_state.log_qname_to_level), set(torch_logs.log_state.artifact_names))
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.signals = {s: signal.getsignal(getattr(signal, s)) for s in HANDLED_SIGNALS if hasattr(signal, s)}
        self.rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        self.loggers = {
            name: (lg.level, lg.disabled, lg.propagate)
            for name, lg in logging.root.manager.loggerDict.items()
            if isinstance(lg, logging.Logger)
        }
        self.transformers = None
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            self.transformers = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled())

    @staticmethod
    def forget_warnings_said_once() -> None:
        """transformers' ``warning_once``/``info_once`` remember what they said (an lru_cache): forgotten."""
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            for said in (getattr(hf_logging, "warning_once", None), getattr(hf_logging, "info_once", None)):
                if hasattr(said, "cache_clear"):
                    said.cache_clear()

    def restore(self) -> list[str]:
        """Put every setting back; returns the names of those the test had changed."""
        import random
        import signal

        import torch

        changed = []
        for name, get, put, before in self.settings:
            if get() != before:
                changed.append(name)
                put(before)
        for config, before in self.configs:
            now = config.get_config_copy()
            for key, value in before.items():
                if key in now and now[key] != value:
                    changed.append(f"{config.__name__}.{key}")
                    setattr(config, key, value)
        self._restore_torch_logs(changed)
        if dict(os.environ) != self.environ:
            changed.append("environment")
            for key in set(os.environ) - set(self.environ):
                del os.environ[key]
            os.environ.update(self.environ)
        try:
            here = os.getcwd()
        except FileNotFoundError:  # the test's folder was removed while it was the working directory
            here = None
        if here != self.cwd:
            changed.append("working directory")
            os.chdir(self.cwd)
        for name, handler in self.signals.items():
            if signal.getsignal(getattr(signal, name)) is not handler and handler is not None:
                changed.append(f"{name} handler")
                signal.signal(getattr(signal, name), handler)
        random.setstate(self.rng[0])
        np.random.set_state(self.rng[1])
        torch.set_rng_state(self.rng[2])
        for name, lg in list(logging.root.manager.loggerDict.items()):
            if isinstance(lg, logging.Logger) and name in self.loggers:
                level, lg.disabled, lg.propagate = self.loggers[name]
                if lg.level != level:
                    lg.setLevel(level)  # (clears the loggers' cached isEnabledFor answers)
        if self.transformers is not None:
            from transformers.utils import logging as hf_logging

            verbosity, bars = self.transformers
            if hf_logging.get_verbosity() != verbosity:
                changed.append("transformers verbosity")
                hf_logging.set_verbosity(verbosity)
            if hf_logging.is_progress_bar_enabled() != bars:
                changed.append("transformers progress bars")
                (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
        self.forget_warnings_said_once()
        if "lit_hbp.model.attention.backends" in sys.modules:  # a test may fake a kernel's install or a GPU
            sys.modules["lit_hbp.model.attention.backends"].reset_probes()
        return changed

    def _restore_torch_logs(self, changed: list[str]) -> None:
        """torch._logging.set_logs(...) as before: its loggers' levels and handlers set up again from the
        snapshot (torch's own set-up, reading the snapshot instead of TORCH_LOGS)."""
        from torch._logging import _internal as torch_logs

        levels, artifacts = self.torch_logs
        state = torch_logs.log_state
        if state.log_qname_to_level == levels and state.artifact_names == artifacts:
            return
        changed.append("torch._logging")

        def from_snapshot():
            state.log_qname_to_level, state.artifact_names = dict(levels), set(artifacts)

        from_env = torch_logs._update_log_state_from_env
        torch_logs._update_log_state_from_env = from_snapshot
        try:
            torch_logs._init_logs()
        finally:
            torch_logs._update_log_state_from_env = from_env


@pytest.fixture(autouse=True, scope="module")
def _module_leaves_the_process_as_it_found_it():
    """What a module's own fixtures change (set up before the first test's snapshot) ends with the module."""
    state = ProcessState()
    yield
    state.restore()


@pytest.fixture(autouse=True)
def _test_leaves_the_process_as_it_found_it():
    """Each test starts from the settings the one before it found and ends leaving them so: Lightning's
    launchers set OMP_NUM_THREADS and torch's thread count in the process that runs ``fit`` (every
    process a later test starts would inherit them), a compiled run raises dynamo's recompile limit and
    turns on torch's recompile logs, a warning said once per process would not be said in a later test
    that checks it (tests/test_input_errors.py), a test may chdir, seed, or install a signal handler.
    Once-per-process warnings are forgotten before each test too."""
    ProcessState.forget_warnings_said_once()
    state = ProcessState()
    yield
    state.restore()


def flat_tokens(t):
    """(ids, supervised mask) of every sample of a TokenizedSource, back to back, as int64 and bool."""
    parts = [t.sample(i) for i in range(len(t))]
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    return np.concatenate([p[0] for p in parts]).astype(np.int64), np.concatenate([p[1] for p in parts])


# Command-line overrides of configs/tiny_cpu.yaml for runs whose checks do not depend on them. Its model at half its
# width: the run's every part at less than two thirds of its time (the README's walk trains the config as it is).
NARROW = ("--model.model.hidden_size", "64", "--model.model.intermediate_size", "192")
# Its three levels with a 5K long level in place of its 16K one: the 1K and 4K levels stay the curriculum's short
# levels and the long level is still deferred past the warm-up, but the demo's long samples of 5K-16K (a training
# or validation 16K pack is seconds of attention on CPU) are dropped as over-length.
SHORTER = ("--data.levels", "[{pack_len: 1024}, {pack_len: 4096, ckpt_layers: 2}, {pack_len: 5120, ckpt_layers: 4}]")

# A two-layer Llama-style model small enough to train in seconds on CPU.
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_toy_tokenizer(path: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A small byte-level BPE tokenizer saved as a Hugging Face fast tokenizer (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, what is packing?", "def f(x): return x"]
    tok.train_from_iterator(corpus * 50, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return path


# The shapes of the pretrained folders the tests fine-tune (save_pretrained, as users' checkpoints are).
PRETRAINED_SHAPES = {
    "llama": {**TINY_LLAMA, "num_hidden_layers": 4, "max_position_embeddings": 4096},
    "qwen2": {**TINY_LLAMA, "model_type": "qwen2", "num_hidden_layers": 4, "max_position_embeddings": 4096},
}


def save_pretrained_checkpoint(
    path: Path, tokenizer: str | Path, family: str = "llama", seed: int = 0, **shape
) -> Path:
    """A randomly initialized causal LM written the way a user's checkpoint folder looks: config.json,
    generation_config.json, safetensors weights and the tokenizer files side by side, its special
    token ids and vocabulary those of ``tokenizer``. ``shape`` overrides PRETRAINED_SHAPES[family]."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    cfg = {**PRETRAINED_SHAPES[family], **shape}
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **cfg,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)


LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")


@pytest.fixture(autouse=True)
def no_leftover_process_group(monkeypatch):
    """Each test starts and ends without a process group (DeepSpeed's cached ones included) or a launcher's
    environment in this process:
    an in-process DeepSpeed fit initializes one (Lightning sets MASTER_PORT to the port its store
    listens on), and a later test's subprocess would inherit the variable and fail on the busy port."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # As at a run's exit: DeepSpeed's cached groups too (an in-process DeepSpeed fit caches a clone of
        # the world group, which a later test's engine would otherwise try to use after it was destroyed).
        from lit_hbp.lightning.strategy import release_process_groups

        release_process_groups()


@pytest.fixture(scope="session")
def _shared_pools():
    from distributed import SharedPool

    shared = SharedPool(2)
    yield shared
    shared.close()


@pytest.fixture
def shared_pool2(_shared_pools):
    """Two gloo worker processes (tests/distributed.py) shared by the 2-process tests of several modules:
    a pool's start imports torch, Lightning, transformers and DeepSpeed in each worker (seconds). Each call
    leaves the workers' process-wide settings as it found them; a pool a failed call stopped is replaced."""
    return _shared_pools.get()


@pytest.fixture(scope="session")
def toy_tokenizer(tmp_path_factory) -> str:
    return str(build_toy_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="session")
def pretrained_llama(tmp_path_factory, toy_tokenizer) -> str:
    """A 4-layer Llama checkpoint folder with the toy tokenizer (``save_pretrained``)."""
    return str(save_pretrained_checkpoint(tmp_path_factory.mktemp("llama_ckpt"), toy_tokenizer, "llama"))


@pytest.fixture(scope="session")
def pretrained_qwen2(tmp_path_factory, toy_tokenizer) -> str:
    """A 4-layer Qwen2 checkpoint folder with the toy tokenizer (``save_pretrained``)."""
    return str(save_pretrained_checkpoint(tmp_path_factory.mktemp("qwen2_ckpt"), toy_tokenizer, "qwen2"))


@pytest.fixture(scope="session")
def small_demo(tmp_path_factory) -> Path:
    """The embedded demo data set, built small (a few hundred chats, a few long samples)."""
    from lit_hbp.demo.text import build_demo

    out = tmp_path_factory.mktemp("demo")
    build_demo(out, n_short=400, n_long=8, vocab_size=2048)
    return out


@pytest.fixture(scope="session")
def vlm_demo(tmp_path_factory) -> Path:
    """configs/tiny_vlm_cpu.yaml's image demo (``lit_hbp.demo.vision``, its default size) built once, for
    the runs of the config that do not test its build on first use (a symlink ``demo_vlm`` to it)."""
    from lit_hbp.demo.vision import ensure_vlm_demo

    out = tmp_path_factory.mktemp("demo_vlm")
    ensure_vlm_demo(out)
    return out


@pytest.fixture(scope="session")
def demo_pretrained(tmp_path_factory, small_demo) -> str:
    """A 4-layer Llama checkpoint folder with the small demo's tokenizer, covering the tiny configs'
    16K level: what ``--model.model <folder>`` of configs/tiny_cpu.yaml fine-tunes."""
    out = tmp_path_factory.mktemp("demo_llama")
    shape = dict(hidden_size=64, intermediate_size=128, max_position_embeddings=16384)
    return str(save_pretrained_checkpoint(out, small_demo / "tokenizer", "llama", **shape))


@pytest.fixture(scope="session")
def paper_shaped_mix():
    """../shared/workloads' paper_mix recipe at a quarter of its size (log-normal chats,
    log-uniform long samples): the tests make their own, CI has no shared folder."""
    import numpy as np

    rng = np.random.default_rng(20250310)
    short = np.clip(np.rint(rng.lognormal(np.log(700), 1.1, 100_000)), 32, 32768)
    long_ = np.rint(np.exp(rng.uniform(np.log(8192), np.log(131072), 500)))
    return rng.permutation(np.r_[short, long_]).astype(np.int64)


def separate_loss(model, samples, device="cpu"):
    """The independent reference of every packed loss: each sample run alone through the model's own
    forward (the caller picks its attention), cross-entropy of its supervised next tokens, summed
    over the samples. ``samples``: {i: (token ids, supervised mask)}."""
    import torch
    import torch.nn.functional as F

    total = 0.0
    for ids, target in samples.values():
        ids = torch.as_tensor(ids, device=device).long()
        labels = torch.where(torch.as_tensor(target[1:], device=device), ids[1:], -100)
        logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].float()
        total = total + F.cross_entropy(logits, labels, reduction="sum")
    return total


def chat_datamodule(demo, tokenizer, cache, **kw):
    """The demo chats in 256- and 1024-token levels: the data of the short training runs."""
    from lit_hbp.lightning.datamodule import HBPDataModule

    kw = {"levels": ["256:1", "1024:1"], "over_length": "drop", "sources": [{"path": str(demo / "short.jsonl")}], **kw}
    return HBPDataModule(tokenizer=tokenizer, cache_dir=str(cache), **kw)


QUIET = dict(
    accelerator="cpu",
    use_distributed_sampler=False,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)


def quiet_trainer(**kw):
    """A Trainer for a test run: CPU, HBPDataModule's own sampling, nothing logged, saved or printed
    (``kw`` overrides any of those)."""
    import lightning as L

    return L.Trainer(**{**QUIET, **kw})


@pytest.fixture(scope="session")
def sp_data(tmp_path_factory):
    """Chats of 2-25 words, every eighth with a prompt of 60-150: packs of every level of the SP tests."""
    import json

    import numpy as np

    rng = np.random.default_rng(7)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
    path = tmp_path_factory.mktemp("spdata") / "d.jsonl"
    with path.open("w") as f:
        for i in range(160):
            n = int(rng.integers(60, 150)) if i % 8 == 0 else int(rng.integers(2, 25))
            f.write(
                json.dumps(
                    {
                        "prompt": " ".join(rng.choice(words, n)),
                        "response": " ".join(rng.choice(words, rng.integers(2, 20))),
                    }
                )
                + "\n"
            )
    return path
