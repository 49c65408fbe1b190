"""One source of truth for a run's settings (issue 43): memory as devices report it, settings read from a
config as Lightning and DeepSpeed read them, set-up and the table of what it accepts agreeing with DeepSpeed,
and every lever a refusal names, applied, fitting or accepted: ZeRO 0/2/3, with and without Liger, on
H100s and H200s, in each tool's own flags."""

import pickle
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lit_hbp.autoselect.levers import NoLevelFits
from lit_hbp.autoselect.memory_fit import TILE_STEPS, greedy_profile_ckpt
from lit_hbp.autoselect.profiler import MemoryProfiler
from lit_hbp.autoselect.search import analytic_levels, covering_length
from lit_hbp.cost import hardware
from lit_hbp.cost.hardware import HARDWARE
from lit_hbp.cost.run_settings import (
    ANALYTIC,
    CONFIG,
    MEASURED,
    RULES,
    SIMULATE,
    Settings,
    check,
    config_settings,
    cost_model,
    problems,
    strategy_config,
    trainer_settings,
    with_zero,
)
from lit_hbp.model_spec import MODELS
from lit_hbp.packing.levels import Level
from lit_hbp.parallel.context_parallel import ContextParallel

MIB = 2**20
LLAMA_8B = MODELS["llama3.1-8b"]

# torch.cuda.get_device_properties(0).total_memory of each kind (nvidia-smi's memory.total, in MiB).
REPORTED = {"h100": 81559 * MIB, "h200": 143771 * MIB, "a100": 81251 * MIB}


def test_memory_is_counted_as_the_devices_report_it():
    """The H100 plans with the 79.6 GiB it reports, the H200 with 140.4 GiB, not the datasheets' decimal
    80 and 141 GB read as 10^9 bytes (74.5 and 131.3 GiB); no decimal GB is left as a memory unit."""
    assert {k: HARDWARE[k].memory_bytes for k in REPORTED} == REPORTED
    assert not hasattr(hardware, "GB") and hardware.GIB == 1024**3
    assert f"{HARDWARE['h100'].memory_bytes / 2**30:.1f}" == "79.6"
    assert f"{HARDWARE['h200'].memory_bytes / 2**30:.1f}" == "140.4"
    # 64K tokens at sp 8 on 8 H100s: the search checkpoints the fewest layers whose peak is within what the
    # device reports (a scan of every count, the reference): 1, where 10^9-byte gigabytes would ask for 5.
    cost = cost_model(LLAMA_8B, Settings(8, HARDWARE["h100"]))
    peaks = [cost.memory_bytes(65536, 8, c) for c in range(33)]
    fewest = next(c for c, peak in enumerate(peaks) if peak <= REPORTED["h100"])
    assert (fewest, next(c for c, peak in enumerate(peaks) if peak <= 80e9)) == (1, 5)
    assert greedy_profile_ckpt(MemoryProfiler(cost), 65536, 8, 0, 32)[0] == fewest


# -------------------------------------------------------------------------------- reading a run's settings


def deepspeed_reads(config: dict) -> tuple[int, bool, bool]:
    """What DeepSpeed itself makes of a config: its ZeRO stage, and whether an optimizer and a parameter
    offload are in it (``DeepSpeedConfig``, the reference)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, **config})
    zero = ds.zero_config
    return int(ds.zero_optimization_stage), zero.offload_optimizer is not None, zero.offload_param is not None


@pytest.mark.parametrize(
    "strategy",
    [
        "hbp",
        "hbp_stage_3",
        "deepspeed",
        "deepspeed_stage_1",
        "deepspeed_stage_2_offload",
        "deepspeed_stage_3_offload",
        {"class_path": "lit_hbp.lightning.strategy.HBPStrategy", "init_args": {"stage": 1, "offload_optimizer": True}},
        {
            "class_path": "lit_hbp.lightning.strategy.HBPStrategy",
            "init_args": {"config": {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}},
        },
        {"class_path": "lit_hbp.lightning.strategy.HBPStrategy", "init_args": {"config": {"zero_optimization": {}}}},
        {"class_path": "lit_hbp.lightning.strategy.HBPStrategy", "init_args": {"stage": None}},  # as a parser writes it
    ],
    ids=lambda s: s if isinstance(s, str) else str(s["init_args"]),
)
def test_a_configs_strategy_is_read_as_lightning_and_deepspeed_read_it(strategy):
    """The ZeRO stage and offloads a config's strategy trains with are what the strategy Lightning builds
    from it holds, as DeepSpeed reads that (a DeepSpeed config decides, a stage or offload argument beside it is
    refused unless it says the same: tests/test_deepspeed_config.py; a config without a stage is stage 0)."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lit_hbp.lightning.strategy as strategy_module

    if isinstance(strategy, str):
        built = StrategyRegistry.get(strategy)
    else:
        built = strategy_module.HBPStrategy(**strategy["init_args"])
    expected = deepspeed_reads(built.config)
    read = config_settings({"trainer": {"strategy": strategy}}, HARDWARE["h100"], 8)
    assert (read.zero_stage, read.optimizer_offload, read.param_offload) == expected


def test_a_config_without_deepspeed_trains_without_zero_in_fp32():
    """No strategy, or DDP: no ZeRO; no precision: Lightning's 32-true; the model's Liger, LoRA (rank 8 on every
    linear layer of the Llama priced: 8 x (inputs + outputs) of its q, k, v, o, gate, up, down) and loss chunk."""
    from lightning.pytorch import Trainer

    assert Trainer(accelerator="cpu", logger=False).precision == "32-true"  # the default a config leaves
    for strategy in (None, "ddp", "auto"):
        read = config_settings({"trainer": {"strategy": strategy}}, HARDWARE["h100"], 8)
        assert (read.zero_stage, read.optimizer_offload, read.dtype_bytes) == (0, False, 4)
    model = {"liger": True, "lora": {"rank": 8}, "ce_chunk_size": 4096}
    read = config_settings({"trainer": {"precision": "bf16-mixed"}, "model": model}, HARDWARE["h200"], 16, LLAMA_8B)
    assert (read.liger, read.ce_chunk, read.dtype_bytes, read.world) == (True, 4096, 2, 16)
    adapters = 8 * 32 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    assert read.trainable * LLAMA_8B.params == pytest.approx(adapters) == read.added_params
    assert read.hardware is HARDWARE["h200"]


@pytest.mark.parametrize(
    "strategy, precision, autocast",
    [
        ({"class_path": "lit_hbp.lightning.strategy.HBPDDPStrategy"}, "bf16-mixed", True),
        ("ddp", "16-mixed", True),
        (None, "bf16-true", False),
        (None, "32-true", False),
        ({"class_path": "lit_hbp.lightning.strategy.HBPStrategy", "init_args": {"stage": 0}}, "bf16-mixed", False),
        ("deepspeed_stage_2", "bf16-mixed", False),
    ],
)
def test_a_mixed_precision_without_deepspeed_is_priced_with_fp32_parameters_and_autocasts_copies(
    strategy, precision, autocast
):
    """Lightning's ``*-mixed`` keeps the parameters in fp32 and autocasts the layers (the memory model's
    ``casts``); DeepSpeed's bf16 holds them in bf16, and ``*-true`` casts nothing. The config's reading and the
    trainer's agree."""

    import lit_hbp.lightning.strategy  # noqa: F401  (registers the hbp strategies)

    read = config_settings({"trainer": {"strategy": strategy, "precision": precision}}, HARDWARE["h100"], 1)
    assert read.autocast is autocast
    cost = cost_model(MODELS["llama3.1-8b"], read)
    assert (cost.static_parts()["casts"] > 0) is autocast
    assert trainer_settings(cpu_trainer(strategy, precision), HARDWARE["h100"]).autocast is autocast


@pytest.mark.parametrize(
    "precision, dtype",
    [
        ("bf16-true", torch.bfloat16),
        ("16-true", torch.float16),
        ("bf16-mixed", torch.float32),
        ("32-true", torch.float32),
        ("64-true", torch.float64),
    ],
)
def test_without_deepspeed_the_adam_states_are_torchs_in_the_parameters_dtype(precision, dtype):
    """Without DeepSpeed the module's torch AdamW steps the parameters themselves: m and v in their dtype, no fp32
    master (bf16-true: 4 bytes a parameter, not DeepSpeed's 12), as measured on its states; DeepSpeed's below fp32
    keeps an fp32 master and fp32 m and v (12 bytes), 8 in fp32."""
    import lit_hbp.lightning.strategy  # noqa: F401  (registers the hbp strategies)

    layer = torch.nn.Linear(64, 64, bias=False).to(dtype)
    adam = torch.optim.AdamW(layer.parameters(), foreach=True)
    layer(torch.ones(2, 64, dtype=dtype)).sum().backward()
    adam.step()
    states = [t for state in adam.state.values() for t in state.values() if t.dim() > 0]  # not the step count
    measured = sum(t.numel() * t.element_size() for t in states) / layer.weight.numel()
    for strategy in (None, "ddp", {"class_path": "lit_hbp.lightning.strategy.HBPDDPStrategy"}):
        read = config_settings({"trainer": {"strategy": strategy, "precision": precision}}, HARDWARE["h100"], 1)
        for run in (read, trainer_settings(cpu_trainer(strategy, precision), HARDWARE["h100"])):
            assert cost_model(LLAMA_8B, run).static_parts()["optimizer"] == pytest.approx(measured * LLAMA_8B.params)
    if dtype != torch.float64:  # DeepSpeed refuses fp64
        read = config_settings({"trainer": {"strategy": "hbp", "precision": precision}}, HARDWARE["h100"], 1)
        deepspeed = 8 if dtype == torch.float32 and precision.endswith("-true") else 12
        assert cost_model(LLAMA_8B, read).static_parts()["optimizer"] == pytest.approx(deepspeed * LLAMA_8B.params)


def cpu_trainer(strategy, precision: str):
    """A CPU trainer with ``strategy`` (a registered name, or a config's class_path entry) at ``precision``."""
    from lightning.pytorch import Trainer

    from lit_hbp.lightning import strategy as strategies

    built = strategy or "auto"
    if isinstance(strategy, dict):
        built = getattr(strategies, strategy["class_path"].rsplit(".", 1)[1])(**strategy.get("init_args", {}))
    return Trainer(accelerator="cpu", devices=1, strategy=built, precision=precision, logger=False)


def test_levers_written_into_a_strategys_arguments_reach_the_strategy():
    """``--zero-stage`` and ``--offload-optimizer`` of the measured selector reach the probes' HBPStrategy,
    also when it has a DeepSpeed config of its own (where Lightning reads no stage argument)."""
    from lit_hbp.lightning.strategy import HBPStrategy

    for args in ({"stage": 0}, {"config": {"zero_optimization": {"stage": 0}}}):
        changed = with_zero(args, 2, True)
        assert deepspeed_reads(HBPStrategy(**changed).config) == (2, True, False)
        assert deepspeed_reads(strategy_config(changed)) == (2, True, False)


# ------------------------------------------------------------------------ set-up and the table agree


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "setting, argument", [("optimizer_offload", "offload_optimizer"), ("param_offload", "offload_parameters")]
)
def test_setup_refuses_an_offload_exactly_where_deepspeed_would_ignore_it(stage, setting, argument):
    """DeepSpeed reads offload_optimizer only in ZeRO's optimizers (stages 1-3) and offload_param only in
    ZeRO-3's: HBPStrategy refuses an offload exactly there, naming the option, its value and the fix, and
    the table agrees."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from lit_hbp.lightning.strategy import HBPStrategy

    ds = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}})
    read = ds.zero_enabled if setting == "optimizer_offload" else ds.zero_optimization_stage == 3
    table = not problems(Settings(zero_stage=stage, **{setting: True}))
    assert table == read
    if read:
        HBPStrategy(stage=stage, **{argument: True})
        return
    with pytest.raises(ValueError) as refused:
        HBPStrategy(stage=stage, **{argument: True})
    message = str(refused.value)
    assert message.startswith(f"HBPStrategy {argument}: true needs ZeRO stage ") and f", not {stage} (" in message
    (rule,) = [r for r in RULES if r.setting == setting]
    fixed = replace(Settings(zero_stage=stage, **{setting: True}), **dict(rule.fixes[:1]))
    assert f"HBPStrategy stage: {fixed.zero_stage}" in message and not problems(fixed)
    HBPStrategy(stage=fixed.zero_stage, **{argument: True})


@pytest.mark.parametrize(
    "world, stage, offload, said",
    [(1, 2, False, "one process"), (1, 3, False, "one process"), (4, 0, False, "stage 0"), (4, 2, False, None),
     (1, 2, True, None), (4, 0, True, None)],
)  # fmt: skip
def test_hbp_strategy_says_where_it_shards_nothing(world, stage, offload, said):
    """HBPStrategy over one process, or at ZeRO stage 0, shards nothing and costs the step more than
    HBPDDPStrategy: its set-up line says so and names the lighter strategy; not where DeepSpeed shards, nor
    where it offloads (which only DeepSpeed does)."""
    from lit_hbp.lightning.deepspeed_config import sharding_note

    text = sharding_note(world, Settings(zero_stage=stage, optimizer_offload=offload))
    if said is None:
        assert text == ""
    else:
        assert f"({said}: nothing sharded; --trainer.strategy hbp_ddp " in text


@pytest.mark.parametrize(
    "strategy",
    [dict(stage=2, offload_optimizer=True), dict(config={"zero_optimization": {"stage": 2, "cpu_offload": True}})],
    ids=["argument", "older_config_key"],
)
def test_an_offloaded_optimizer_is_accepted_by_setup_and_trains(strategy):
    """The lever a refusal names most (the Adam states on the host) trains an HBPLitModule: DeepSpeed refuses
    a torch optimizer beside ZeRO-Offload unless told, and HBPStrategy tells it (also for DeepSpeed's older
    ``cpu_offload`` key, which it read as no offload)."""
    import lightning as L
    from conftest import QUIET, TINY_LLAMA

    from lit_hbp.autoselect.measured import ProbeData
    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.lightning.strategy import HBPStrategy

    module = HBPLitModule(model={**TINY_LLAMA, "vocab_size": 300}, self_check=False)
    trainer = L.Trainer(**{**QUIET, "max_steps": 2, "strategy": HBPStrategy(**strategy)})
    trainer.fit(module, datamodule=ProbeData(Level(256), np.full(50, 40), 2, 0))
    engine = trainer.strategy.model
    assert trainer.global_step == 2 and engine.zero_cpu_offload() and engine.zero_optimization_stage() == 2


def fake_trainer(stage: int, levels) -> SimpleNamespace:
    """What HBPLitModule.on_fit_start reads of a trainer: its data module's levels, a DeepSpeed strategy, the
    accumulation."""
    from lit_hbp.lightning.meter import MicroStepEnd

    strategy = SimpleNamespace(sp_groups=None, config={"zero_optimization": {"stage": stage}})
    return SimpleNamespace(
        datamodule=SimpleNamespace(levels=levels),
        strategy=strategy,
        world_size=1,
        precision="32-true",
        accumulate_grad_batches=1,
        callbacks=[MicroStepEnd()],  # as configure_callbacks gives a fit
    )


TINY_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=64)


@pytest.mark.parametrize("stage", [2, 3])
def test_liger_and_mlp_tiles_under_zero3_are_refused_by_setup_as_the_table_says(stage):
    """HBPLitModule refuses Liger and MLP tiles under ZeRO-3 and HBPStrategy MLP tiles, in a training config's
    words, where the table does; below ZeRO-3, Liger on a CPU is refused for the CUDA it needs, as
    ``apply_liger`` itself refuses it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.lightning.strategy import HBPStrategy
    from lit_hbp.model.build import apply_liger

    module = HBPLitModule(model={"model_type": "llama", **TINY_SHAPE}, liger=True, self_check=False)
    module._trainer = fake_trainer(stage, [Level(64)])
    with pytest.raises(ValueError) as refused:
        module.on_fit_start()
    if stage == 3:
        assert str(refused.value).startswith("model.liger: true needs ZeRO stage 0-2, not 3 (")
        assert str(refused.value).endswith(": use HBPStrategy stage: 2 or model.liger: false")
    else:
        assert str(refused.value).startswith("model.liger: true needs a CUDA GPU, not cpu (")
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            apply_liger(AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY_SHAPE)))
    on_cpu = Settings(zero_stage=stage, liger=True, hardware=replace(HARDWARE["h100"], accelerator="cpu"))
    assert problems(on_cpu)[0] == str(refused.value)

    tiled = [Level(64, mlp_tiles=2)]
    net = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY_SHAPE))
    trainer = SimpleNamespace(datamodule=SimpleNamespace(levels=tiled), lightning_module=net, num_devices=1)
    assert bool(problems(Settings(zero_stage=stage), tiles=2)) == (stage == 3)
    if stage == 3:
        module = HBPLitModule(model={"model_type": "llama", **TINY_SHAPE}, self_check=False)
        module._trainer = fake_trainer(stage, tiled)
        with pytest.raises(ValueError, match=r"^mlp_tiles: 2 needs ZeRO stage 0-2, not 3 .*HBPStrategy stage: 2"):
            module.on_fit_start()
        with pytest.raises(ValueError, match=r"^level 0 \(pack_len 64\): mlp_tiles: 2 needs ZeRO stage 0-2, not 3"):
            HBPStrategy(stage=stage).setup(trainer)


# ------------------------------------------------------------ every lever a refusal names, applied


def fits_somewhere(cost, pack_len: int) -> bool:
    """The reference for 'fits': a scan of every (sp, cp) layout the world offers with every layer
    checkpointed and offloaded and, below ZeRO-3, every MLP tile count, against what the device reports
    and what the node's host holds."""
    tiles = (1, *TILE_STEPS) if cost.zero_stage < 3 else (1,)
    for sp, cp in ContextParallel().layouts(cost.world, cost.model.heads, cost.model.kv_heads):
        if pack_len % sp:
            continue
        for t in tiles:
            if t <= pack_len // sp and cost.fits(pack_len, sp, cost.model.layers, 1, True, t, cp):
                return True
    return False


def setup_accepts(run) -> bool:
    """The reference for 'accepted': HBPStrategy builds with the run's ZeRO stage and optimizer offload and
    DeepSpeed reads them back; Liger only below ZeRO-3 (its fused loss reads the LM head's weight whole)."""
    from lit_hbp.lightning.strategy import HBPStrategy

    try:
        strategy = HBPStrategy(stage=run.zero_stage, offload_optimizer=run.optimizer_offload)
    except ValueError:
        return False
    read = deepspeed_reads(strategy.config)
    return read == (run.zero_stage, run.optimizer_offload, False) and not (run.liger and run.zero_stage == 3)


def chats_and(longest: int) -> np.ndarray:
    rng = np.random.default_rng(3)
    return np.r_[np.clip(rng.lognormal(np.log(1500), 1.0, 300).astype(np.int64), 256, 32768), longest]


@pytest.mark.parametrize("gpu, longest", [("h100", 4 << 20), ("h200", 8 << 20)])
@pytest.mark.parametrize("zero", [0, 2, 3])
@pytest.mark.parametrize("liger", [False, True], ids=["hf", "liger"])
def test_each_lever_a_refusal_names_fits_when_applied(gpu, longest, zero, liger):
    """LLaMA3.1-8B on 8 GPUs with a sample no layout fits: the refusal names only levers set-up accepts, in
    the simulator's flags, and each, applied to the run and searched again, plans a largest level holding
    the sample (or the cap it names), which the reference scan confirms fits. A run set-up refuses (Liger
    under ZeRO-3) is refused first, and each fix it names is accepted."""
    run = Settings(8, HARDWARE[gpu], zero, liger=liger)
    if liger and zero == 3:
        with pytest.raises(ValueError) as refused:
            check(run, SIMULATE)
        assert str(refused.value).startswith("--liger needs ZeRO stage 0-2, not 3 (")
        (rule,) = [r for r in RULES if r.setting == "liger" and not r.allowed(run)]
        for setting, value in rule.fixes:
            assert f"{SIMULATE.spell(setting, value)}" in str(refused.value)
            assert setup_accepts(replace(run, **{setting: value}))
        return
    cost = cost_model(LLAMA_8B, run)
    lengths = chats_and(longest)
    assert not fits_somewhere(cost, longest)
    with pytest.raises(NoLevelFits) as refused:
        analytic_levels(cost, lengths, candidates=[longest], tool=SIMULATE)
    found = refused.value.levers
    assert found and str(refused.value).endswith(str(found[-1]))
    for lever in found:
        applied = replace(cost, **lever.changes)
        assert setup_accepts(applied), lever
        for setting in ("liger", "optimizer_offload", "zero_stage"):
            if setting in lever.changes:
                assert SIMULATE.spell(setting, lever.changes[setting]) in lever.text
        if "world" in lever.changes:
            assert f"(--gpus {applied.world}: " in lever.text
        top = longest if lever.max_len is None else lever.max_len
        assert lever.max_len is None or f"--max-len {lever.max_len}" in lever.text
        selection = analytic_levels(applied, lengths, candidates=[top], max_len=lever.max_len)
        assert selection.levels[-1].pack_len == covering_length(lengths, lever.max_len) == top
        assert fits_somewhere(applied, top), lever
    if zero == 0:
        assert not any(lever.changes.get("optimizer_offload") and "zero_stage" not in lever.changes for lever in found)


def test_what_zero_stage_3_cannot_train_is_neither_searched_nor_advised():
    """The strategy refuses a model with stateful token mixers under ZeRO-3 (``refuse_mixers_under_zero3``, the
    reference here on a tiny Qwen3-Next), yet the search chose a hybrid's levels at stage 3 and its "no level fits"
    refusal advised stage 3 as the only lever (Qwen3-Next on 8 H100s, one 32K sample): a run set so stopped at set-up.
    Refused up front now, naming stage 2, and never advised; so too data with images, which HBPLitModule refuses under
    ZeRO-3 (the search advised it for Qwen2.5-VL-72B), and DoRA, which peft builds from whole weights (advised for
    Llama-3.1-70B on 2 GPUs); a text model without mixers keeps stage 3 among its levers."""
    from test_mixers import tiny

    from lit_hbp import prepare_model
    from lit_hbp.errors import ConfigError
    from lit_hbp.lightning.trained_model import refuse_mixers_under_zero3

    with pytest.raises(ConfigError, match="stage 3: qwen3_next holds a stateful token mixer under DeepSpeed ZeRO-3"):
        refuse_mixers_under_zero3(prepare_model(tiny("qwen3_next")), 3)
    dense = MODELS["qwen2.5-32b"]
    hybrid = replace(dense, attention_layers=dense.layers // 4)  # three of four layers a stateful mixer
    says = r"^--zero-stage 3 needs a model without stateful token mixers, not a hybrid's .*: use --zero-stage 2"
    with pytest.raises(ValueError, match=says):
        check(cost_model(hybrid, Settings(8, HARDWARE["h100"], 3)), SIMULATE)
    imaged = replace(cost_model(dense, Settings(8, HARDWARE["h100"], 3)), vision_patches_per_token=0.3)
    with pytest.raises(ValueError, match=r"^--zero-stage 3 needs text-only data, not samples with images or videos"):
        check(imaged, SIMULATE)  # HBPLitModule refuses ZeRO-3 with images (on_fit_start)
    from lit_hbp.cost.run_settings import settings_of

    big, dora_lora = MODELS["llama3.1-70b"], {"lora": {"r": 16, "use_dora": True}}
    dora = cost_model(big, settings_of(HARDWARE["h100"], 2, {"stage": 2}, dora_lora, spec=big))
    with pytest.raises(ValueError, match=r"^--zero-stage 3 needs LoRA settings .* not model\.lora\.use_dora"):
        check(replace(dora, zero_stage=3), SIMULATE)  # HBPLitModule refuses it (build.check_lora_strategy)
    levers = {}
    runs = {
        "dense": cost_model(dense, Settings(8, HARDWARE["h100"], 2)),
        "hybrid": cost_model(hybrid, Settings(8, HARDWARE["h100"], 2)),
        "images": replace(imaged, zero_stage=2),
        "dora": dora,
    }
    for name, cost in runs.items():
        with pytest.raises(NoLevelFits) as refused:
            analytic_levels(cost, chats_and(32768), candidates=[32768])
        levers[name] = [lever.changes for lever in refused.value.levers]
    assert {"zero_stage": 3} in levers["dense"]
    for name in ("hybrid", "images", "dora"):  # the rest of the levers, or none left
        assert not any("zero_stage" in changes for changes in levers[name]), name
    assert levers["hybrid"] and levers["images"]


def test_a_measured_refusal_is_priced_on_the_devices_gpu_in_its_own_flags(monkeypatch):
    """The measured selector prices its refusal with the GPU it runs on, as it reports itself (an H200
    here), and names more GPUs as its --devices; its probes sure to run out of memory are not run."""
    import torch

    from lit_hbp.autoselect import MeasuredSelector, RunSetting

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=143771 * MIB))
    run = RunSetting(LLAMA_8B, 8, trainer_args={"accelerator": "cuda"}, in_world=True, node_size=8, tool=MEASURED)
    lengths = np.r_[np.full(50, 4000), 64 << 20]
    with pytest.raises(NoLevelFits) as refused:
        MeasuredSelector(candidates=[64 << 20]).select(lengths, run)
    message = str(refused.value)
    assert "fits no sp of 8 x NVIDIA H200 at ZeRO-2 (" in message
    assert "138.4 GiB to use (140.4 less the margin of 2.0 GiB kept free, margin_gib)" in message
    assert "--devices " in message and "--gpus" not in message
    devices = [lever for lever in refused.value.levers if "world" in lever.changes]
    assert devices and devices[0].text.startswith(f"{devices[0].changes['world']} GPUs (--devices ")
    assert pickle.loads(pickle.dumps(refused.value)).levers == refused.value.levers  # it crosses processes


def test_each_tool_spells_what_its_own_command_line_takes():
    """Every flag a tool's refusal may print is an option of that tool's parser; the rest is a training
    config's (the measured selector's GPUs are its --devices)."""
    import contextlib
    import io

    from lit_hbp.autoselect.__main__ import main as autoselect_main
    from lit_hbp.simulate.__main__ import main as simulate_main

    def options(main) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            main(["--help"])
        return out.getvalue()

    for tool, main in ((SIMULATE, simulate_main), (ANALYTIC, autoselect_main), (MEASURED, autoselect_main)):
        text = options(main)
        for template in tool.flags.values():
            assert template.split()[0] in text, template
    assert MEASURED.spell("world", 16) == "--devices 16" and ANALYTIC.spell("world", 16) == "--gpus 16"
    assert CONFIG.spell("liger") == "model.liger: true" and SIMULATE.spell("liger", False) == "without --liger"
    assert SIMULATE.spell_all({"liger": True, "zero_stage": 2}) == "--liger --zero-stage 2"


def test_deepspeed_on_another_device_than_the_trainers_is_refused_naming_ds_accelerator(monkeypatch):
    """DeepSpeed picks its device once (``DS_ACCELERATOR``, set to cpu here): a trainer on CUDA with it would
    keep the model on the host, where the NCCL group cannot reach it ("No backend type associated with
    device type cpu", the GPU test suite's own mistake on an H100). Refused at set-up, naming the variable."""
    from deepspeed.accelerator import get_accelerator

    from lit_hbp.errors import ConfigError
    from lit_hbp.lightning.strategy import _check_deepspeed_device

    assert get_accelerator().device_name() == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    refused = r"DeepSpeed runs on 'cpu' \(DS_ACCELERATOR='cpu'\) but the trainer on cuda:0"
    with pytest.raises(ConfigError, match=refused):
        _check_deepspeed_device(torch.device("cuda", 0))
    _check_deepspeed_device(torch.device("cpu"))
