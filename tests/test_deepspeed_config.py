"""A DeepSpeed config as HBPStrategy runs it: what DeepSpeed or Lightning would drop or apply other than asked is
refused before a step, naming it. Each refused case trained otherwise than its config said (weights against a
plain AdamW loop: stage 0's hidden AdamW step under bf16 0.032 off after 4 steps, a config's clipping 6.7e-3, its
optimizer 2.7e-2 off, a stage beside a config trained at the config's)."""

import copy
import os

import lightning as L
import pytest
import torch
from conftest import TINY_LLAMA, chat_datamodule, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import DeepSpeedPrecision

from lit_hbp.errors import ConfigError
from lit_hbp.lightning.deepspeed_config import check_precision_sections
from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.lightning.strategy import HBPStrategy


def fit(tmp_path, small_demo, strategy, **trainer_kw) -> HBPLitModule:
    L.seed_everything(0)
    dm = chat_datamodule(small_demo, str(small_demo / "tokenizer"), tmp_path / "cache")
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, lr=1e-3, self_check=False)
    trainer = quiet_trainer(strategy=strategy, max_steps=1, default_root_dir=tmp_path, **trainer_kw)
    trainer.fit(module, dm)
    return module


@pytest.mark.parametrize(
    "kwargs, refused",
    [
        (dict(stage=3, config={"gradient_clipping": 0.05}), "stage=3 beside a DeepSpeed config whose zero_.* says 0"),
        (dict(stage=3, config={"zero_optimization": {"stage": 1}}), "stage=3 beside a DeepSpeed config .* says 1"),
        (dict(offload_optimizer=True, config={"zero_optimization": {"stage": 2}}), "offload_optimizer=True beside"),
        (dict(overlap_comm=True, config={"zero_optimization": {"stage": 2}}), "overlap_comm=True beside"),
        (dict(allgather_bucket_size=1000, config={"zero_optimization": {"stage": 2}}), "allgather_bucket_size=1000"),
        (dict(stage=2, partition_activations=True), "partition_activations configure DeepSpeed's activation"),
        (dict(config={"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}),
         "activation_checkpointing.partition_activations, activation_checkpointing.cpu_checkpointing configure"),
        (dict(config={"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}),
         r"gradient_accumulation_steps \(4\) is the trainer's to set: .* trainer.accumulate_grad_batches"),
        # DeepSpeed overlaps at stage 3 unless told: False here was dropped
        (dict(overlap_comm=False, config={"zero_optimization": {"stage": 3}}),
         "overlap_comm=False beside a DeepSpeed config whose zero_optimization says True"),
        (dict(config={"zero_optimization": True}), "zero_optimization: true is DeepSpeed's deprecated form"),
        # zero_optimization=False builds no ZeRO section: stage 3 and the offload trained at stage 0
        (dict(zero_optimization=False, stage=3), "stage=3 beside zero_optimization=False, which builds no ZeRO"),
        (dict(zero_optimization=False, offload_optimizer=True, reduce_bucket_size=1000),
         "offload_optimizer=True, reduce_bucket_size=1000 beside zero_optimization=False"),
        # a config's fp16 section is DeepSpeed's: the arguments' loss scaling was dropped (dynamic from 2**16)
        (dict(config={"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}, loss_scale=128.0,
              initial_scale_power=8), r"loss_scale=128.0, initial_scale_power=8 beside a DeepSpeed config with an"),
    ],
)  # fmt: skip
def test_an_argument_the_strategy_would_not_use_is_refused(kwargs, refused):
    """Beside a DeepSpeed config Lightning builds nothing from ``stage``, the offloads, ``overlap_comm`` or the
    bucket sizes (stage=3 trained at the config's stage 0); DeepSpeed's activation checkpointing is never called."""
    with pytest.raises(ConfigError, match=refused):
        HBPStrategy(**kwargs)


@pytest.mark.parametrize(
    "section, precision",
    [({"bf16": {"enabled": True}}, "32-true"), ({"bf16": {"enabled": False}}, "bf16-mixed"),
     ({"fp16": {"enabled": True}}, "bf16-mixed")],
)  # fmt: skip
def test_a_configs_precision_section_must_say_the_trainers_precision(tmp_path, small_demo, section, precision):
    """Lightning writes ``trainer.precision``'s section only where the DeepSpeed config has none, so the config's
    decided: ``bf16: {enabled: true}`` under ``32-true`` trained in bf16 (the parameters bfloat16), ``enabled: false``
    under ``bf16-mixed`` in fp32. Refused before a step; sections that agree (or none) are kept."""
    says = f"config's {next(iter(section))} section says enabled: .* trainer.precision is '{precision}'"
    config = {"zero_optimization": {"stage": 2}, **section}
    with pytest.raises(ConfigError, match=says):
        fit(tmp_path, small_demo, HBPStrategy(config=config), precision=precision)
    with pytest.raises(ConfigError, match=says):  # a plugin given to the strategy itself
        HBPStrategy(config=config, precision_plugin=DeepSpeedPrecision(precision))
    with pytest.raises(ConfigError, match=r"config's bf16.enabled must be true or false, got 'false'"):
        check_precision_sections({"bf16": {"enabled": "false"}}, "bf16-mixed")  # Python's bool("false") is True
    for config, agrees in (({"bf16": {"enabled": True}}, "bf16-mixed"), ({"fp16": {"enabled": False}}, "32-true"),
                           ({"fp16": {"enabled": True}}, "16-mixed"), ({}, "bf16-true")):  # fmt: skip
        check_precision_sections(config, agrees)


@pytest.mark.parametrize("overlap", [None, True, False])
@pytest.mark.parametrize("zero", [None, False, True, {}, {"stage": 1}, {"stage": 2}, {"stage": 3}])
def test_a_configs_zero_settings_are_read_as_deepspeed_reads_them(zero, overlap):
    """The stage and ``overlap_comm`` lit-hbp reads from a config (its checks, the cost model) are DeepSpeed's own
    reading (``get_zero_config``): ``overlap_comm`` defaults on at stage 3, and the old ``zero_optimization: true``
    is stage 1 (it was read as stage 0)."""
    from deepspeed.runtime.zero.config import get_zero_config

    from lit_hbp.cost.run_settings import deepspeed_zero
    from lit_hbp.lightning.deepspeed_config import ARGUMENTS

    config = {} if zero is None else {"zero_optimization": zero}
    if overlap is not None and isinstance(zero, dict):
        config["zero_optimization"] = {**zero, "overlap_comm": overlap}
    deepspeed = get_zero_config(copy.deepcopy(config))
    assert deepspeed_zero(config)["zero_stage"] == deepspeed.stage
    if not isinstance(zero, bool):  # the deprecated form is refused (above)
        assert ARGUMENTS["overlap_comm"](config) == deepspeed.overlap_comm
        assert ARGUMENTS["stage"](config) == deepspeed.stage


def test_loss_scaling_arguments_are_refused_where_no_fp16_section_takes_them():
    """Lightning writes ``loss_scale`` and the other scaling arguments into the fp16 section it adds under 16-mixed
    or 16-true; under another precision they changed nothing. Under 16-mixed they reach the section DeepSpeed trains
    (the reference: Lightning's own DeepSpeedStrategy, as written into its config)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    args = dict(loss_scale=128.0, initial_scale_power=8, loss_scale_window=50, hysteresis=4, min_loss_scale=16)
    for precision in ("bf16-mixed", "32-true"):
        with pytest.raises(
            ConfigError, match=rf"loss_scale=128.0, .* scale fp16's loss, and trainer.precision is '{precision}'"
        ):
            HBPStrategy(precision_plugin=DeepSpeedPrecision(precision), **args)
    strategy = HBPStrategy(precision_plugin=DeepSpeedPrecision("16-mixed"), **args)
    plain = DeepSpeedStrategy(precision_plugin=DeepSpeedPrecision("16-mixed"), **args)
    for s in (strategy, plain):
        s._format_config()  # no module yet: the precision section alone
    assert strategy.config["fp16"] == plain.config["fp16"] and strategy.config["fp16"]["loss_scale"] == 128.0
    HBPStrategy(precision_plugin=DeepSpeedPrecision("bf16-mixed"), loss_scale=0, initial_scale_power=16)  # defaults


def test_zero_optimization_false_is_priced_as_the_stage_0_it_trains():
    """The cost tools priced ``zero_optimization=False`` at HBPStrategy's default stage 2 (``strategy_config``)."""
    from lit_hbp.cost.run_settings import deepspeed_zero, strategy_config

    strategy = HBPStrategy(zero_optimization=False)
    assert "zero_optimization" not in strategy.config
    assert deepspeed_zero(strategy_config({"zero_optimization": False})) == deepspeed_zero(strategy.config)
    assert deepspeed_zero(strategy.config)["zero_stage"] == 0


def test_the_callers_config_is_left_as_it_was():
    """HBPStrategy wrote its run settings (micro-batch size, timers) into the dict the caller gave it."""
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    before = copy.deepcopy(config)
    strategy = HBPStrategy(config=config)
    assert config == before and strategy.config["train_micro_batch_size_per_gpu"] == 1


def test_arguments_that_say_what_the_config_says_or_are_defaults_are_kept():
    """What a parser passes (every default) and what agrees with the config is not refused: the config trains."""
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    strategy = HBPStrategy(stage=2, offload_optimizer=True, allgather_bucket_size=200_000_000, config=config)
    assert strategy.config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert HBPStrategy().config["zero_optimization"]["stage"] == 2  # no config: stage 2, as before


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_zero_stage_0_under_half_precision_is_refused_before_a_step(tmp_path, small_demo, precision):
    """DeepSpeed's fp16/bf16 optimizer wrapper (stage 0) steps AdamW once on zero gradients as it is built."""
    with pytest.raises(ConfigError, match="ZeRO stage 0 with (bf16|fp16) precision"):
        fit(tmp_path, small_demo, HBPStrategy(stage=0), precision=precision)


@pytest.mark.parametrize(
    "section, refused",
    [
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "'optimizer' section would replace"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}, "'scheduler' section would be"),
    ],
)  # fmt: skip
def test_a_configs_optimizer_or_scheduler_beside_the_modules_is_refused(tmp_path, small_demo, section, refused):
    config = {"zero_optimization": {"stage": 2}, **section}
    with pytest.raises(ConfigError, match=refused):
        fit(tmp_path, small_demo, HBPStrategy(config=config))


def test_a_configs_clipping_must_be_the_trainers(tmp_path, small_demo):
    """DeepSpeed clips at the config's ``gradient_clipping`` whatever ``gradient_clip_val`` says."""

    def config():  # a fresh one each time: Lightning writes into the dict it is given
        return {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}

    with pytest.raises(ConfigError, match="gradient_clipping 1.0 and trainer.gradient_clip_val 0.05 differ"):
        fit(tmp_path, small_demo, HBPStrategy(config=config()), gradient_clip_val=0.05)
    module = fit(tmp_path / "same", small_demo, HBPStrategy(config=config()), gradient_clip_val=1.0)
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_lightnings_will_not_clip_warning_is_left_out_for_the_module_whose_clipping_deepspeed_runs(
    tmp_path, small_demo, recwarn
):
    """Lightning warned on every HBPStrategy run that clips that HBPLitModule's configure_gradient_clipping "will not
    actually clip gradients": DeepSpeed clips in its step at gradient_clip_val (here 1e-4 moves the weights otherwise
    than no clipping), so the warning is left out for it. A user's module that overrides the hook itself still gets
    it (DeepSpeed clips its run alike, whatever its hook does)."""
    from lit_hbp.lightning.deepspeed_config import CLIPPING_WARNING

    def weights(module):
        return torch.cat([p.detach().flatten() for p in module.model.parameters()])

    clipped = fit(tmp_path / "clip", small_demo, HBPStrategy(stage=2), gradient_clip_val=1e-4)
    assert not [w for w in recwarn if CLIPPING_WARNING in str(w.message)]
    free = fit(tmp_path / "free", small_demo, HBPStrategy(stage=2))
    assert not torch.allclose(weights(clipped), weights(free))

    class OwnClipping(HBPLitModule):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    L.seed_everything(0)
    dm = chat_datamodule(small_demo, str(small_demo / "tokenizer"), tmp_path / "cache")
    module = OwnClipping(model=TINY_LLAMA, vocab_size=dm.vocab_size, lr=1e-3, self_check=False)
    recwarn.clear()
    trainer = quiet_trainer(strategy=HBPStrategy(stage=2), max_steps=1, default_root_dir=tmp_path / "own",
                            gradient_clip_val=1e-4)  # fmt: skip
    trainer.fit(module, dm)
    assert [w for w in recwarn if CLIPPING_WARNING in str(w.message)]
    assert torch.allclose(weights(module), weights(clipped))


def test_the_strategys_levels_must_lay_out_as_the_data_modules():
    """A strategy's CP level beside the data module's plain one: the batches trained Ulysses (cp 1) while the
    set-up line and the self-check said CP (the layout was not compared)."""
    from lit_hbp.lightning.strategy import _plan_fields
    from lit_hbp.packing.levels import as_level
    from lit_hbp.parallel.topology import layout_levels

    class Config:
        num_attention_heads, num_key_value_heads = 4, 4

        def get_text_config(self):
            return self

    strategy = [as_level("64:1"), as_level({"pack_len": 256, "sp": 2, "cp": 2})]
    data = [as_level("64:1"), as_level("256:2")]
    assert _plan_fields(layout_levels(strategy, Config(), 2)) != _plan_fields(layout_levels(data, Config(), 2))
    assert _plan_fields(layout_levels(data, Config(), 2)) == _plan_fields(layout_levels(list(data), Config(), 2))


OFFLOADS = [None, {"device": "none"}, {"device": "cpu"}, {"device": "nvme", "nvme_path": "/tmp"}]


@pytest.mark.parametrize("older", [None, False, True])
@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("stage", [None, 1, 3])
def test_offloads_are_read_as_deepspeeds_own_config_reads_them(stage, offload, older):
    """``deepspeed_zero`` against DeepSpeed's ``DeepSpeedZeroConfig``, the older keys (``cpu_offload``,
    ``cpu_offload_param``) included: an optimizer offloaded by one was trained with the module's AdamW on the
    device (``optimizer_device``) and priced on the GPU."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from lit_hbp.cost.run_settings import deepspeed_zero

    for new, old in (("offload_optimizer", "cpu_offload"), ("offload_param", "cpu_offload_param")):
        zero = {k: v for k, v in (("stage", stage), (new, offload), (old, older)) if v is not None}
        if offload is not None and older is not None:
            with pytest.raises(AssertionError):  # DeepSpeed refuses both: lit-hbp need not read them
                DeepSpeedZeroConfig(**zero)
            continue
        parsed = getattr(DeepSpeedZeroConfig(**zero), new)
        want = parsed is not None and parsed.device != "none"
        ours = deepspeed_zero({"zero_optimization": zero})
        assert ours["optimizer_offload" if new == "offload_optimizer" else "param_offload"] == want, zero
        assert ours["zero_stage"] == int(DeepSpeedZeroConfig(**zero).stage)


def test_lightnings_deepspeed_strategy_with_accumulation_is_refused(tmp_path, small_demo):
    """Lightning's loop divides an accumulated loss by A and DeepSpeed's ``engine.backward`` (``scale_wrt_gas``) again:
    under Lightning's own DeepSpeedStrategy every update was 1/A of the loss's (an audit's SGD run: 0.495x at A=2),
    clipping A times as strong. HBPStrategy's backward divides once; a strategy with Lightning's is refused at fit."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lit_hbp.lightning.optimizer import check_deepspeed_accumulation

    class LightningsBackward(HBPStrategy):  # HBPStrategy runs on CPU: here with DeepSpeedStrategy's backward
        backward = DeepSpeedStrategy.backward

    with pytest.raises(ConfigError, match="LightningsBackward with accumulate_grad_batches 2: Lightning and Deep"):
        fit(tmp_path, small_demo, LightningsBackward(stage=2), accumulate_grad_batches=2)
    with pytest.raises(ConfigError, match="DeepSpeedStrategy with accumulate_grad_batches 4: .* trainer.strategy hbp"):
        check_deepspeed_accumulation(DeepSpeedStrategy(), 4)
    check_deepspeed_accumulation(DeepSpeedStrategy(), 1)
    check_deepspeed_accumulation(HBPStrategy(), 4)
    fit(tmp_path / "ours", small_demo, HBPStrategy(stage=2), accumulate_grad_batches=2)


def test_a_stage_0_runs_checkpoint_resumes(tmp_path, small_demo):
    """A DeepSpeed config without a ``zero_optimization`` section (stage 0, or ``zero_optimization=False``) trained
    and saved, and its checkpoint never loaded: ``KeyError: 'zero_optimization'``. It resumes as a run of the
    section's stage does: the step after the saved one."""
    for i, strategy in enumerate((lambda: HBPStrategy(config={"train_micro_batch_size_per_gpu": 1}),
                                  lambda: HBPStrategy(zero_optimization=False))):  # fmt: skip
        L.seed_everything(0)
        dm = chat_datamodule(small_demo, str(small_demo / "tokenizer"), tmp_path / "cache")
        module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, lr=1e-3, self_check=False)
        saves = ModelCheckpoint(tmp_path / str(i), "{step}", every_n_train_steps=1, save_top_k=-1)
        first = quiet_trainer(
            strategy=strategy(), max_steps=2, default_root_dir=tmp_path, callbacks=[saves], enable_checkpointing=True
        )
        first.fit(module, dm)
        again = quiet_trainer(strategy=strategy(), max_steps=2, default_root_dir=tmp_path)
        again.fit(HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, lr=1e-3, self_check=False), dm,
                  ckpt_path=tmp_path / str(i) / "step=1.ckpt")  # fmt: skip
        assert again.global_step == 2


def test_a_weights_only_deepspeed_folder_holds_no_training_state(tmp_path, small_demo):
    """``--ckpt_path auto`` and ``fit`` pass over a ``save_weights_only`` save (``holds_training_state``): under
    DeepSpeed the client state Lightning keeps in the folder tells, as Lightning's own resume from it fails."""
    from lit_hbp.lightning.checkpoints import find_resumable, holds_training_state

    L.seed_everything(0)
    dm = chat_datamodule(small_demo, str(small_demo / "tokenizer"), tmp_path / "cache")
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, lr=1e-3, self_check=False)
    full = ModelCheckpoint(tmp_path / "ckpt", "full-{step}", every_n_train_steps=2, save_top_k=-1)
    light = ModelCheckpoint(tmp_path / "ckpt", "weights-{step}", every_n_train_steps=1, save_top_k=-1,
                            save_weights_only=True)  # fmt: skip
    quiet_trainer(strategy=HBPStrategy(stage=2), max_steps=2, default_root_dir=tmp_path, callbacks=[full, light],
                  enable_checkpointing=True).fit(module, dm)  # fmt: skip
    full, weights = tmp_path / "ckpt" / "full-step=2.ckpt", tmp_path / "ckpt" / "weights-step=2.ckpt"
    os.utime(weights / "latest", (os.path.getmtime(full / "latest") + 1,) * 2)  # the newer, whatever the clock says
    assert holds_training_state(full) is True and holds_training_state(weights) is False
    assert find_resumable([tmp_path / "ckpt"])[0] == str(full)
    again = quiet_trainer(strategy=HBPStrategy(stage=2), max_steps=3, default_root_dir=tmp_path)
    with pytest.raises(KeyError):
        again.fit(HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, lr=1e-3, self_check=False), dm,
                  ckpt_path=weights)  # fmt: skip
