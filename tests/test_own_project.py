"""A Lightning project of one's own adopting lit-hbp (``examples/own_project``): its LightningModule
calls ``prepare_model`` and ``packed_loss``, its trainer takes ``HBPDataModule`` and ``HBPStrategy``.
On one process its first update equals the one of each sample alone through the Hugging Face model
with eager attention; on two processes with an sp 2 level, the cross-entropy it logs (the whole pack's,
over the SP group, on both ranks) and every parameter's update equal that single-process reference;
the same module without ``prepare_model`` is refused under sp 2; the project's script runs as
docs/lightning.md says."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import save_pretrained_checkpoint
from distributed import Pool

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "examples" / "own_project"
LR = 1e4  # one large SGD step: the update (initial - final) / LR is the gradient to fp32 rounding


@pytest.fixture(scope="module")
def project(tmp_path_factory, toy_tokenizer):
    """A save_pretrained checkpoint folder and chats of 2-40 words, every tenth with a long prompt."""
    root = tmp_path_factory.mktemp("own_project")
    ckpt = save_pretrained_checkpoint(root / "ckpt", toy_tokenizer, "llama")
    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
    with open(root / "chats.jsonl", "w") as f:
        for i in range(60):
            n = int(rng.integers(100, 300)) if i % 10 == 0 else int(rng.integers(2, 40))
            chat = [{"role": "user", "content": " ".join(rng.choice(words, n))},
                    {"role": "assistant", "content": " ".join(rng.choice(words, rng.integers(2, 30)))}]  # fmt: skip
            f.write(json.dumps({"messages": chat}) + "\n")
    return str(ckpt), str(root / "chats.jsonl")


def one_update(ckpt: str, data: str, cache: str, devices: int, sp: int, prepare: bool = True) -> dict:
    """One optimizer step (SGD) of the project's ChatLM on the first micro-batch of a level at ``sp``:
    the parameters before and after (gathered), the pack's samples and the ``train/ce`` it logged."""
    import lightning as L

    sys.path.insert(0, str(PROJECT))
    from chat_lm import ChatLM
    from transformers import AutoModelForCausalLM

    from lit_hbp import HBPDataModule, HBPStrategy

    class Probe(ChatLM):
        def configure_model(self):
            if not prepare:  # the module as it was before adopting lit-hbp
                self.model = AutoModelForCausalLM.from_pretrained(self.hparams.checkpoint).train()
                return
            super().configure_model()

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=LR)

        def training_step(self, batch, batch_idx):
            self.seen = dict(samples=batch.sample_index.tolist())
            return super().training_step(batch, batch_idx)  # the project's own step, as it logs

        def log(self, name, value, *args, **kwargs):
            self.seen[name] = float(value)
            super().log(name, value, *args, **kwargs)

    def params(module):
        import deepspeed

        named = list(module.model.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {n: p.detach().clone() for n, p in named}

    class Grab(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            self.initial = params(pl_module)

    torch.manual_seed(0)
    dm = HBPDataModule(sources=[data], tokenizer=ckpt, levels=[{"pack_len": 2048, "sp": sp}], cache_dir=cache)
    module, grab = Probe(ckpt), Grab()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=HBPStrategy(stage=2) if sp > 1 else "auto", max_steps=1,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[grab],
    )  # fmt: skip
    trainer.fit(module, dm)
    return dict(initial=grab.initial, final=params(module), **module.seen)


def reference(ckpt: str, data: str, cache: str, samples: list[int], initial: dict):
    """Each sample alone through the model with eager attention: the token-mean cross-entropy and the
    gradient of it (what ave_token's update is on one step of one pack)."""
    from transformers import AutoModelForCausalLM

    from lit_hbp import HBPDataModule

    dm = HBPDataModule(sources=[data], tokenizer=ckpt, levels=["2048"], cache_dir=cache)
    dm.setup("fit")
    net = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager").train()
    net.load_state_dict(initial)
    ce, n = 0.0, 0
    for i in samples:
        ids, target = dm.store.tokens(i)
        ids = torch.as_tensor(ids.astype(np.int64))
        labels = torch.where(torch.as_tensor(target[1:]), ids[1:], -100)
        logits = net(input_ids=ids[None], use_cache=False).logits[0, :-1].float()
        ce = ce + F.cross_entropy(logits, labels, reduction="sum")
        n += int((labels != -100).sum())
    (ce / n).backward()
    return float(ce / n), {name: p.grad for name, p in net.named_parameters()}


def assert_update_is_the_reference(result: dict, ce: float, grads: dict) -> None:
    for name, grad in grads.items():
        initial = result["initial"][name]
        step = (initial - result["final"][name]) / LR
        rounding = 4 * torch.finfo(torch.float32).eps * max(initial.abs().max().item(), 1.0) / LR
        atol = rounding + 1e-5 * grad.abs().max().item()  # 1e-5 of the tensor's largest gradient
        torch.testing.assert_close(step, grad, rtol=1e-5, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def test_one_process_trains_each_sample_as_alone(project, tmp_path):
    ckpt, data = project
    result = one_update(ckpt, data, str(tmp_path / "cache"), devices=1, sp=1)
    assert len(result["samples"]) > 3  # a pack of several documents
    ce, grads = reference(ckpt, data, str(tmp_path / "cache"), result["samples"], result["initial"])
    assert result["train/ce"] == pytest.approx(ce, rel=1e-5)
    assert_update_is_the_reference(result, ce, grads)


@pytest.mark.slow
def test_two_processes_at_sp_2_train_like_one(project, tmp_path):
    ckpt, data = project
    pool = Pool(2)
    try:
        ranks = pool.run(one_update, ckpt, data, str(tmp_path / "cache"), 2, 2)
        with pytest.raises(RuntimeError) as refused:
            pool.run(one_update, ckpt, data, str(tmp_path / "cache"), 2, 2, False)
    finally:
        pool.close()
    assert ranks[0]["samples"] == ranks[1]["samples"]  # one SP group: both ranks hold shards of one pack
    ce, grads = reference(ckpt, data, str(tmp_path / "cache"), ranks[0]["samples"], ranks[0]["initial"])
    assert ranks[0]["train/ce"] == ranks[1]["train/ce"] == pytest.approx(ce, rel=1e-5)  # the pack's, on both
    for rank in ranks:
        assert_update_is_the_reference(rank, ce, grads)
    message = str(refused.value)
    assert "has sp 2, but self.model (LlamaForCausalLM) is not prepared for packs" in message
    assert "call lit_hbp.prepare_model(self.model) in your module's configure_model" in message


def validated(ckpt: str, data: str, cache: str) -> dict:
    """The project's ``val/ce`` from ``Trainer.validate`` on 2 processes (HBPStrategy, a level at sp 2), over a held
    out share of the chats, and the held-out samples."""
    import lightning as L

    sys.path.insert(0, str(PROJECT))
    from chat_lm import ChatLM

    from lit_hbp import HBPDataModule, HBPStrategy

    levels = [{"pack_len": 256, "sp": 1}, {"pack_len": 1024, "sp": 2}]
    dm = HBPDataModule(sources=[data], tokenizer=ckpt, levels=levels, val_fraction=0.15, seed=0, cache_dir=cache)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=HBPStrategy(stage=2), use_distributed_sampler=False, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.validate(ChatLM(ckpt), dm)
    return dict(ce=float(trainer.callback_metrics["val/ce"]), store=dm.val_store)


@pytest.mark.slow
def test_the_projects_validation_is_the_token_mean_of_each_held_out_sample_alone(project, tmp_path):
    """``validation_step`` as the example logs it (this rank's shard weighted by its supervised tokens) gives the
    validation set's token-mean cross-entropy on two processes, where the documented per-pack ``mean_ce`` was off
    (a rank's empty pack counted as 0, the packs' means averaged unweighted). Reference: each held-out sample alone
    through the model with eager attention, in one process."""
    ckpt, data = project
    pool = Pool(2)
    try:
        ranks = pool.run(validated, ckpt, data, str(tmp_path / "cache"))
    finally:
        pool.close()
    from transformers import AutoModelForCausalLM

    store = ranks[0]["store"]
    net = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager").eval()
    ce, n = 0.0, 0
    with torch.no_grad():
        for i in range(store.lengths.size):
            ids, target = store.tokens(i)
            ids = torch.as_tensor(ids.astype(np.int64))
            labels = torch.where(torch.as_tensor(target[1:]), ids[1:], -100)
            ce += float(F.cross_entropy(net(input_ids=ids[None]).logits[0, :-1].double(), labels, reduction="sum"))
            n += int((labels != -100).sum())
    assert store.lengths.size >= 5 and ranks[0]["ce"] == ranks[1]["ce"] == pytest.approx(ce / n, rel=1e-5)


def sharded_losses(docs: list, vocab: int) -> dict:
    """On each rank: the packed loss (sum) of ``docs`` through a tiny Llama sharded by FSDP2's ``fully_shard``, each
    decoder layer a unit and then the whole model ("whole"), or with the decoder and the head as units too."""
    from conftest import TINY_LLAMA
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_hbp import pack_samples, packed_loss, prepare_model

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for layout in ("whole", "units"):
        torch.manual_seed(0)
        net = prepare_model(AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA, vocab_size=vocab)))
        for layer in net.model.layers:
            fully_shard(layer, mesh=mesh)
        if layout == "units":
            fully_shard(net.model, mesh=mesh)
            fully_shard(net.lm_head, mesh=mesh)
        fully_shard(net, mesh=mesh)
        try:
            out[layout] = float(packed_loss(net, pack_samples(docs), "sum").loss)
        except ValueError as e:
            out[layout] = str(e)
    return out


def test_a_model_sharded_by_fully_shard_as_a_whole_is_refused_and_by_units_trains_like_alone():
    """Your own project under Lightning's ModelParallelStrategy (FSDP2): ``fully_shard`` on the whole causal LM
    leaves its embedding and head to the whole model's forward, which packed_loss does not call: it stopped inside
    the embedding ("got mixed torch.Tensor and DTensor"); refused by name now, with the layout that trains.
    Reference: each document alone through the unsharded, unprepared model with eager attention."""
    from conftest import TINY_LLAMA, separate_loss
    from transformers import AutoConfig, AutoModelForCausalLM

    rng = np.random.default_rng(0)
    docs = [(rng.integers(3, 128, n), np.ones(n, bool)) for n in (9, 14, 5)]
    pool = Pool(2)
    try:
        ranks = pool.run(sharded_losses, docs, 128)
    finally:
        pool.close()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA, vocab_size=128))
    ref.set_attn_implementation("eager")
    want = float(separate_loss(ref.eval(), dict(enumerate(docs))))
    for rank in ranks:
        assert rank["whole"].startswith("LlamaForCausalLM is sharded by fully_shard as a whole"), rank["whole"]
        assert "model.embed_tokens.weight" in rank["whole"] and "fully_shard(model.lm_head)" in rank["whole"]
        assert rank["units"] == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_the_projects_script_runs_on_two_processes(project, tmp_path):
    """``python train.py --checkpoint ... --data ... --devices 2`` from the project's own folder."""
    ckpt, data = project
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, str(PROJECT / "train.py"), "--checkpoint", ckpt, "--data", data, "--devices", "2",
         "--max-steps", "3", "--out", str(tmp_path / "runs")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "HBPStrategy levels: 1024 tokens sp 1 ckpt 0, 4096 tokens sp 2 ckpt 2" in out.stderr + out.stdout
    assert (
        tmp_path / "runs" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    ).exists()  # DeepSpeed's folder
