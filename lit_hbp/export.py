"""Export a training checkpoint to a Hugging Face ``save_pretrained`` folder ready to serve.

    python -m lit_hbp.export CKPT OUT_DIR [--dtype bfloat16] [--merge-lora] [--tokenizer PATH]

CKPT is what ``Trainer.save_checkpoint`` / ``ModelCheckpoint`` wrote: a Lightning checkpoint file, or
the checkpoint folder of a DeepSpeed run (HBPStrategy, ZeRO 0-3), whose partitioned parameters are
gathered into one fp32 state dict with Lightning's ``convert_zero_checkpoint_to_fp32_state_dict``
(DeepSpeed's zero_to_fp32). The checkpoint is all the export reads: the model is built from the
config the run saved in it (``hf_config``) and loaded with its weights, and the tokenizer is the one
the run trained with, chat template included (saved by ``HBPDataModule``); the folder the run started
from and the tokenizer folder may be gone. The folder holds config, safetensors weights in the dtype
asked for, by default the one the base model was saved in (its config.json's ``dtype``; float32 where it said
none), what the family keeps in fp32 in that dtype kept so, and the tokenizer, with the special ids a
server needs: BOS/EOS of the tokenizer in config.json (a vision-language model's text config too) and
generation_config.json, its padding in
generation_config.json (config.json keeps the model's), generation stopping at the tokenizer's EOS, at the chat
template's end-of-turn token and at every EOS of the base model, and the KV cache on. The base model's
own generation_config.json (a run started from a folder that has one; saved in the checkpoint as
``hf_generation_config``) is kept: its sampling defaults (do_sample, temperature, top_p, ...) stay as
they were, and none is added where it had none. It loads with ``AutoModelForCausalLM`` (and vLLM or
the Hub) and is a valid ``model:`` of a new lit-hbp run. A LoRA run writes its adapter
(``adapter_config.json`` + weights, for peft, with the tokenizer and generation config; its base model named by the
folder's absolute path or the run's Hub id, said when not found here), or with ``--merge-lora`` the merged full
model.

The checkpoint is opened with ``torch.load(weights_only=True)`` and lit-hbp's allow-list of what its runs
write (``lit_hbp.lightning.checkpoints``): a file whose pickle names anything else is refused, naming it, and
nothing in it runs. ``--trust-checkpoint`` opens any pickle: only for a file you made or trust.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

if not torch.cuda.is_available():  # transformers imports DeepSpeed where installed, which warns on a CPU
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from lit_hbp.errors import ConfigError, UserInputError  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def load_checkpoint(path: str | Path, trust: bool = False) -> dict:
    """The checkpoint as one dict with a full fp32 ``state_dict``, whatever wrote it. Read with the
    weights-only allow-list (``lit_hbp.lightning.checkpoints.check_checkpoint``) unless ``trust``."""
    from lit_hbp.lightning.checkpoints import (
        MODEL_STATES,
        TRUST_HINT,
        check_checkpoint,
        checkpoint_files,
        client_state_file,
        safe_load,
        trusted_load,
    )

    path = Path(path)
    if path.is_file() and MODEL_STATES.match(path.name):
        raise UserInputError(f"{path} is one file of the DeepSpeed checkpoint {path.parent.parent}: give that folder")
    opt_in = TRUST_HINT["export"]
    check_checkpoint(path, trust=trust, opt_in=opt_in)  # every file DeepSpeed's conversion reads, too
    load = trusted_load if trust else (lambda p: safe_load(p, opt_in=opt_in))
    if path.is_dir():  # DeepSpeed: one shard per rank (ZeRO) under <dir>/<tag>
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        if not any(f.name.endswith("optim_states.pt") for f in checkpoint_files(path)):
            return _unsharded(load(client_state_file(path)), path)

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "consolidated.ckpt"
            convert_zero_checkpoint_to_fp32_state_dict(str(path), str(out))
            return load(out)
    return load(path)


# What DeepSpeed keeps in a model-states file beside Lightning's client state (as Lightning's conversion drops them).
DEEPSPEED_STATES = ("module", "optimizer", "lr_scheduler", "csr_tensor_module_names", "skipped_steps", "global_steps",
                    "dp_world_size", "mp_world_size")  # fmt: skip


def _unsharded(states: dict, path: Path) -> dict:
    """A DeepSpeed folder without optimizer-states files: ZeRO stage 0 shards nothing and keeps the whole weights
    in its model states (fp32: lit-hbp refuses stage 0 in half precision), which DeepSpeed's zero_to_fp32 does not
    read; any other stage keeps its fp32 weights in the optimizer-states files, which are then missing."""
    stage = ((states.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0)
    module = states.get("module") or {}
    if stage != 0 or not module or any(v.is_floating_point() and v.dtype != torch.float32 for v in module.values()):
        raise UserInputError(
            f"not a checkpoint that can be exported: {path}: its tag folder has no optimizer-states files "
            f"(*_optim_states.pt), where DeepSpeed's ZeRO stage {stage} keeps the fp32 weights: copy the whole folder"
        )
    client = {k: v for k, v in states.items() if k not in DEEPSPEED_STATES}
    client["state_dict"] = {k.removeprefix("_forward_module."): v for k, v in module.items()}
    return client


def _hparams(ckpt: dict) -> dict:
    hparams = dict(ckpt.get("hyper_parameters") or {})
    if "model" not in hparams:
        raise UserInputError("the checkpoint has no HBPLitModule hyper-parameters (was it written by a lit-hbp run?)")
    return hparams


def hf_config_of(ckpt: dict):
    """The model's Hugging Face config: the one the run saved in the checkpoint (``hf_config``); for a
    checkpoint written before lit-hbp saved it, rebuilt from the module's hyper-parameters (a config
    mapping, or the config.json of the model folder the run started from)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if "hf_config" in ckpt:
        saved = dict(ckpt["hf_config"])
        return CONFIG_MAPPING[saved["model_type"]].from_dict(saved)
    hparams = _hparams(ckpt)
    model = hparams["model"]
    if isinstance(model, str):
        if not Path(model).exists():
            raise UserInputError(
                f"this checkpoint was written before lit-hbp saved the model config in it, so the config is read "
                f"from the model folder the run started from, {model}, which is gone: put that folder (its "
                "config.json is enough) back there"
            )
        return AutoConfig.from_pretrained(model, local_files_only=True)
    # The family's default special ids name tokens of another vocabulary: only those the mapping sets stay.
    cfg = {**dict.fromkeys(SPECIAL_IDS), **model}
    if hparams.get("vocab_size") is not None:
        cfg["vocab_size"] = hparams["vocab_size"]
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def generation_config_of(ckpt: dict):
    """The base model's own generation config (its generation_config.json, saved in the checkpoint by
    ``HBPLitModule.on_save_checkpoint`` as ``hf_generation_config``), or None: a model built from a
    config mapping or from a folder without one, and checkpoints written before lit-hbp saved it, whose
    export rebuilds the generation config from the model config and the tokenizer, as it always did."""
    from transformers import GenerationConfig

    saved = ckpt.get("hf_generation_config")
    return None if saved is None else GenerationConfig.from_dict(dict(saved))


def model_from_checkpoint(ckpt: dict) -> torch.nn.Module:
    """The trained network (peft-wrapped under LoRA), fp32, built from the checkpoint alone: its config,
    the base model's generation config when it had one of its own (``generation_config_of``), its LoRA
    settings and its weights (never ``from_pretrained`` of the folder the run started from)."""
    from lit_hbp.model.build import _auto_class, apply_lora

    hparams = _hparams(ckpt)
    config = hf_config_of(ckpt)
    config.use_cache = True  # training turned the KV cache off; generation wants it
    auto, _ = _auto_class(config.model_type)  # a vision-language model: AutoModelForImageTextToText
    net = auto.from_config(config, dtype=torch.float32)
    generation = generation_config_of(ckpt)
    if generation is not None:
        net.generation_config = generation
    if hparams.get("lora"):
        net = apply_lora(net, dict(hparams["lora"]))
    # HBPLitModule holds the network as ``model``: its state dict keys are ``model.<name>``.
    if "state_dict" not in ckpt:
        raise UserInputError("the checkpoint holds no state_dict: it is not one a Lightning run saved")
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    try:
        missing, unexpected = net.load_state_dict(state, strict=False)
    except RuntimeError as e:  # weights of other shapes: another model's checkpoint, or its config changed
        said = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e).splitlines()[0])
        raise UserInputError(
            f"the checkpoint's weights do not fit its model config ({config.model_type}): {said}"
        ) from None
    if missing or unexpected:
        raise UserInputError(
            f"the checkpoint's weights do not fit its model config ({config.model_type}): missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    return net


BASE_CHANGING_INITS = ("pissa", "olora", "corda")  # peft's inits that subtract the adapter's start from the base


def check_adapter_servable(hparams: dict, merge_lora: bool) -> None:
    """A LoRA adapter names the base model it was trained on; a run whose base was built from a config mapping
    (random weights, held only in the checkpoint) has none a server can load: refused, the merged model is the
    export."""
    if hparams.get("lora") and not merge_lora and isinstance(hparams.get("model"), Mapping):
        raise ConfigError(
            "the run's LoRA adapters were trained on a model built from a config mapping, whose base weights live "
            "only in this checkpoint: an adapter alone could not be loaded; export with --merge-lora (HBPExport: "
            "merge_lora: true)"
        )
    init = str((hparams.get("lora") or {}).get("init_lora_weights", ""))
    if hparams.get("lora") and not merge_lora and init.startswith(BASE_CHANGING_INITS):
        raise ConfigError(
            f"the run's LoRA adapters were initialised with init_lora_weights {init!r}, which moved part of each "
            "base weight into them: the adapter alone on the original base model would not be the trained model; "
            "export with --merge-lora (HBPExport: merge_lora: true)"
        )


def held_tokenizer(ckpt: dict) -> dict | None:
    """The files of the tokenizer the run trained with, as the checkpoint holds them (``HBPDataModule.state_dict``),
    or None for a checkpoint written before lit-hbp kept them."""
    return next((v["tokenizer_files"] for v in ckpt.values() if isinstance(v, dict) and "tokenizer_files" in v), None)


def check_export_folder(out: Path, name: str) -> None:
    """An export goes into a new or empty folder: files of an earlier one left beside it (a LoRA adapter's
    ``adapter_config.json`` beside a full model's weights) are what a Hugging Face loader would read. A path the
    system cannot even look up (a name too long) is said as such."""
    try:
        _check_export_folder(out, name)
    except OSError as e:
        raise ConfigError(f"{name} {out}: {e.strerror or e}: give another folder") from None


def _check_export_folder(out: Path, name: str) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{name} {out} is a file: give a folder to write the model into")
    above = None if out.exists() else next((p for p in out.absolute().parents if p.exists()), None)  # made in it
    if above is not None and not above.is_dir():
        raise ConfigError(f"{name} {out}: {above} is a file, so no folder can be made under it: give another folder")
    if above is not None and not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"{name} {out}: {above} is not writable: give a folder you can write")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise ConfigError(
            f"{name} {out} already holds {shown}: a loader would read them beside the export; give a new or empty "
            "folder (or remove it)"
        )


def run_tokenizer(ckpt: dict, folder: str | Path, fallback: str | None = None):
    """The tokenizer the run trained with, written into ``folder``: the files the checkpoint holds
    (``HBPDataModule.state_dict``); for older checkpoints ``fallback`` (``--tokenizer``), else the path
    in the data module's hyper-parameters. None when there is none."""
    from lit_hbp.lightning.renderers import load_tokenizer, tokenizer_from_files

    files = held_tokenizer(ckpt)
    if files is not None:
        return tokenizer_from_files(files, folder)
    path = fallback or (ckpt.get("datamodule_hyper_parameters") or {}).get("tokenizer")
    if not path:
        return None
    tokenizer = load_tokenizer(path)
    tokenizer.save_pretrained(folder)
    return tokenizer


def run_processor(ckpt: dict, folder: str | Path) -> None:
    """A vision-language run's processor (image processor settings, chat template), written into
    ``folder`` beside the tokenizer: ``AutoProcessor`` loads the export as it loaded the checkpoint."""
    from lit_hbp.lightning.renderers import write_files

    files = next((v["processor_files"] for v in ckpt.values() if isinstance(v, dict) and "processor_files" in v), None)
    write_files(files or {}, folder, keep=True)  # the tokenizer's own files are written from the tokenizer


def end_of_turn_id(tokenizer) -> int | None:
    """The token the chat template closes an assistant turn with (``<|im_end|>``, ``<|eot_id|>``, the
    EOS...), found by rendering a conversation: generation must stop there, or the served model talks
    on past its turn. None without a template, or when what follows the answer is not one added or
    special token."""
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        return None
    answer = "lit-hbp probe answer"
    messages = [{"role": "user", "content": "lit-hbp probe question"}, {"role": "assistant", "content": answer}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except TemplateError:  # a template that refuses this conversation (e.g. it wants a system turn)
        return None
    if answer not in text:
        return None
    ids = tokenizer(text[text.rindex(answer) + len(answer) :], add_special_tokens=False)["input_ids"]
    if not ids or tokenizer.convert_ids_to_tokens(ids[0]) not in tokenizer.get_added_vocab():
        return None
    return int(ids[0])


def _ids(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def id_configs(config) -> list:
    """The configs that say the model's special ids: ``config``, and for a composite one (a vision-language
    model's) its decoder's ``text_config`` too, which transformers 5 keeps them in (Qwen2-VL's and LLaVA's top
    level has none)."""
    text = config.get_text_config(decoder=True)
    return [config] if text is config else [config, text]


def base_ids(config, name: str) -> list:
    """The ids ``name`` (``eos_token_id``...) the config says, at its top level then in its text config, each once."""
    return list(dict.fromkeys(i for c in id_configs(config) for i in _ids(getattr(c, name, None))))


def serving_token_ids(tokenizer, config, generation=None) -> tuple[dict[str, int | None], list[int]]:
    """(BOS/EOS/padding ids for generation_config.json, the ids generation stops at).
    The ids are the tokenizer's (padding: its pad, else EOS), the config's where the tokenizer has
    none; generation stops at the tokenizer's EOS, the chat template's end-of-turn token and any EOS
    the config (a composite one's text config too) or the base model's ``generation`` config already named
    (e.g. Llama-3 instruct's three), in that order, each once."""
    base_eos = base_ids(config, "eos_token_id")

    def first(*ids):
        return next((int(i) for i in ids if i is not None), None)

    eos = first(tokenizer.eos_token_id, *base_eos)
    ids = dict(
        bos_token_id=first(tokenizer.bos_token_id, *base_ids(config, "bos_token_id")),
        eos_token_id=eos,
        pad_token_id=first(tokenizer.pad_token_id, eos),
    )
    stop = [tokenizer.eos_token_id, end_of_turn_id(tokenizer), *base_eos]
    stop += _ids(getattr(generation, "eos_token_id", None))
    return ids, list(dict.fromkeys(int(i) for i in stop if i is not None))


def prepare_for_serving(net: torch.nn.Module, tokenizer) -> None:
    """Set the special ids (``serving_token_ids``) and the KV cache on the model's config and
    generation config; the rest of the generation config (the base model's sampling defaults, when
    ``model_from_checkpoint`` restored its own) is left as it is. config.json keeps the padding id the
    model trained with: a family's embedding never trains that row (``padding_idx``), so an EOS written
    there would freeze the EOS embedding of every run fine-tuned from the export. A base config that lists
    several EOS ids keeps them all (a server reading config.json stops where the base model stopped)."""
    config, generation = net.config, net.generation_config
    published = not _strictly_valid(generation)  # the base's own flags: Llama 2's temperature without do_sample
    config.use_cache = generation.use_cache = True
    generation._from_model_config = False  # set on purpose: no library may rebuild it from config.json
    if tokenizer is not None:
        _set_serving_ids(config, generation, tokenizer)
    if published:  # saved with its flags, as transformers saves a published config it loaded (with a warning)
        generation._original_object_hash = hash(generation)


def _strictly_valid(generation) -> bool:
    """Whether ``generation`` passes the strict check transformers' save runs on a config it takes as modified."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            generation.validate(strict=True)
    except ValueError:
        return False
    return True


def _set_serving_ids(config, generation, tokenizer) -> None:
    """The serving ids on the generation config, and BOS/EOS on the config: on a composite one's top level and its
    text config alike (a folder that says two EOS ids stops where a reader of either looks)."""
    base_eos = base_ids(config, "eos_token_id")
    ids, stop = serving_token_ids(tokenizer, config, generation)
    eos = ids["eos_token_id"]
    if len(base_eos) > 1:  # the base's several EOS ids (Llama 3.1's three) stay in config.json, in the base's order
        eos = base_eos if eos in base_eos else [eos, *base_eos]
    for each in id_configs(config):
        each.bos_token_id, each.eos_token_id = ids["bos_token_id"], eos
    for name in SPECIAL_IDS:
        setattr(generation, name, ids[name])
    generation.eos_token_id = stop


def kept_in_fp32(net: torch.nn.Module, dtype: torch.dtype) -> set[str]:
    """The parameters and buffers ``from_pretrained(dtype=dtype)`` keeps in fp32 (a MoE router's gate and
    score bias under bf16: ``_keep_in_fp32_modules_strict``), by transformers' own rule for the dtype."""
    import re

    plan = net._get_dtype_plan(dtype) if hasattr(net, "_get_dtype_plan") else {}
    if not plan:
        return set()
    pattern = re.compile("|".join(f"(?:{name.replace('*', '.*')})" for name in plan))
    names = [n for n, _ in net.named_parameters()] + [n for n, _ in net.named_buffers()]
    return {n for n in names if pattern.search(n)}


def cast_for_saving(net: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``net`` in ``dtype``, but for what the family keeps in fp32 (``kept_in_fp32``), from the fp32 values:
    as the family's own model saves in that dtype, not rounded through it."""
    base = net.get_base_model() if hasattr(net, "peft_config") else net
    keep = kept_in_fp32(base, dtype)
    kept = {name: t.detach().clone() for name, t in base.state_dict(keep_vars=True).items() if name in keep}
    net = net.to(dtype)
    for name, value in kept.items():
        owner, _, leaf = name.rpartition(".")
        target = getattr(base.get_submodule(owner), leaf)
        target.data = value.to(torch.float32)
    return net


def untie_adapted_embeddings(net: torch.nn.Module) -> None:
    """Before LoRA is merged into a model whose output head shares the input embedding's weight: give the head
    its own copy when an adapter sits on either side. The run trained ``E + dE`` for the input and the shared
    ``E`` (or ``E + dH``) for the output; merged into one shared tensor, the adapter of one would reach both.
    The export then stores both matrices and says they are no longer tied (``say_untied``)."""
    base = net.get_base_model()
    inputs, outputs = base.get_input_embeddings(), base.get_output_embeddings()
    if inputs is None or outputs is None:
        return
    shared_in = getattr(inputs, "base_layer", inputs).weight
    head = getattr(outputs, "base_layer", outputs)
    adapted = hasattr(inputs, "base_layer") or hasattr(outputs, "base_layer")
    if head.weight is not shared_in or not adapted:
        return
    head.weight = torch.nn.Parameter(shared_in.detach().clone(), requires_grad=head.weight.requires_grad)


def say_untied(net: torch.nn.Module) -> None:
    """A model whose output head no longer shares the input embedding's tensor (an untied adapter merged, a
    trained ``modules_to_save`` copy of the head) says so in every config that carries ``tie_word_embeddings``:
    peft unties only the top level's, and a loader reading ``text_config`` (a vision-language model's text model,
    a server) would tie the trained head back to the embedding."""
    inputs, outputs = net.get_input_embeddings(), net.get_output_embeddings()
    if inputs is None or outputs is None or outputs.weight is inputs.weight:
        return
    for config in {id(c): c for c in (net.config, net.config.get_text_config())}.values():
        if getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = False


def warn_unservable_base(name: str, out: Path) -> None:
    """An adapter export names its base model (``base_model_name_or_path``): the run's folder by its absolute path,
    or a Hub id (``org/name``). Said when neither holds here (the folder is gone, or an older run named it
    relative to its own working directory), since a server would then load another folder of that name, or none."""
    path = Path(name).expanduser()
    hub_id = not path.is_absolute() and len(Path(name).parts) == 2 and not name.startswith(".")
    if (path.is_absolute() and path.is_dir()) or (hub_id and not path.exists()):
        return
    warnings.warn(
        f"the adapter names its base model {name!r} (base_model_name_or_path in {out / 'adapter_config.json'}), which "
        "is not a folder here: a server would look for it in its own working directory or on the Hub; set it to the "
        "base model's folder or Hub id",
        stacklevel=3,
    )


def warn_half_frozen(ckpt: dict, dtype: str) -> None:
    """DeepSpeed keeps the weights a run did not train (a LoRA run's base, a frozen vision tower) only as its
    module's copies, in the run's half precision (``frozen_param_fragments``): an export wider than that writes
    them rounded, not the base folder's values. What the run computed with, but said, since an adapter export over
    the base folder then serves other logits than the merged one."""
    frozen = ckpt.get("frozen_param_fragments") or {}
    width = torch.finfo(DTYPES[dtype]).bits
    half = sorted({str(t.dtype).removeprefix("torch.") for t in frozen.values() if torch.is_tensor(t)
                   and t.is_floating_point() and torch.finfo(t.dtype).bits < width})  # fmt: skip
    if half:
        warnings.warn(
            f"the checkpoint holds the {len(frozen)} weights the run did not train in {', '.join(half)}, as DeepSpeed "
            f"kept them: this {dtype} export writes them rounded so, not the base model's values (a LoRA run's "
            "adapters exported alone, without --merge-lora, leave them to the base folder)",
            stacklevel=3,
        )


def export_dtype(ckpt: dict) -> str:
    """The dtype an export writes when none is asked for: the one the run's base model was saved in (its
    config.json's ``dtype``, kept in the checkpoint as ``hf_saved_dtype``), float32 where it said none (a model
    built from a config mapping without one) or the checkpoint was written before lit-hbp kept it."""
    saved = ckpt.get("hf_saved_dtype")
    if saved is not None and saved not in DTYPES:
        said = f"the base model was saved in {saved}, not a dtype the export writes: float32 (--dtype to choose)"
        warnings.warn(said, stacklevel=3)
    return saved if saved in DTYPES else "float32"


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    dtype: str | None = None,
    merge_lora: bool = False,
    tokenizer: str | None = None,
    trust: bool = False,
    option: str = "OUT_DIR",
) -> Path:
    """Write ``out_dir`` (see the module docstring); returns it. ``dtype``: the weights' (None: ``export_dtype``,
    the base model's saved one; LoRA adapters alone: float32, their trained dtype). ``tokenizer``: only for
    checkpoints that do not hold the run's tokenizer (written before lit-hbp saved it in them). ``trust``: open a
    checkpoint whose pickle names more than lit-hbp's runs write (``--trust-checkpoint``). ``option``: what names
    ``out_dir`` in a refusal."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    check_export_folder(out, option)
    ckpt = load_checkpoint(checkpoint, trust=trust)
    check_adapter_servable(_hparams(ckpt), merge_lora)
    net = model_from_checkpoint(ckpt)
    adapters_only = hasattr(net, "peft_config") and not merge_lora  # trained in float32, as peft loads them
    dtype = dtype or ("float32" if adapters_only else export_dtype(ckpt))
    if merge_lora and not hasattr(net, "peft_config"):
        raise ConfigError("--merge-lora: the checkpoint's run trained no LoRA adapters (its model is whole): drop it")
    if tokenizer and held_tokenizer(ckpt) is not None:
        raise ConfigError(
            f"--tokenizer {tokenizer}: the checkpoint holds the tokenizer the run trained with, which the export "
            "writes; --tokenizer is for checkpoints written before lit-hbp kept it: drop it"
        )
    if not adapters_only:
        warn_half_frozen(ckpt, dtype)
    if hasattr(net, "peft_config") and merge_lora:
        from lit_hbp.model.build import unmergeable_lora_bias

        unmergeable = unmergeable_lora_bias(net)
        if unmergeable:
            raise ConfigError(
                f"--merge-lora: the run trained a LoRA bias (model.lora.lora_bias) beside {len(unmergeable)} layer(s) "
                f"without a bias of their own ({unmergeable[0]}, ...), which a merged model cannot hold: export the "
                "adapter (without --merge-lora)"
            )
        untie_adapted_embeddings(net)
        net = net.merge_and_unload()
        say_untied(net)
    net = cast_for_saving(net, DTYPES[dtype])
    base = net.get_base_model() if hasattr(net, "peft_config") else net
    for key in base.config.sub_configs:  # save_pretrained writes the top level's; sub-configs say the same (as
        if (sub := getattr(base.config, key, None)) is not None:  # from_pretrained sets them)
            sub.dtype = DTYPES[dtype]
    # Written beside OUT_DIR (an empty folder, or a link to one, is kept: the files move into it), then moved there:
    # a failure leaves nothing a second export would refuse.
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a folder the checks could not foresee refusing it (/proc, a read-only mount)
        raise ConfigError(f"{option} {out}: cannot make it ({e.strerror or e}): give another folder") from None
    staging = Path(tempfile.mkdtemp(dir=out.resolve().parent, prefix=f".{out.resolve().name}."))
    try:
        tok = run_tokenizer(ckpt, staging, tokenizer)
        run_processor(ckpt, staging)
        if tok is None:
            warnings.warn(
                "no tokenizer written: the checkpoint holds none and none was given (--tokenizer); the special "
                "ids of the config are left as they were",
                stacklevel=2,
            )
        prepare_for_serving(base, tok)
        net.save_pretrained(staging, safe_serialization=True)
        if base is not net:  # an adapter: the server reads the base model's config, but our stop ids from here
            base.generation_config.save_pretrained(staging)
            warn_unservable_base(base.name_or_path, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if made:
            out.rmdir()
        raise
    for entry in staging.iterdir():
        os.replace(entry, out / entry.name)
    staging.rmdir()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lit_hbp.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("checkpoint", help="a Lightning checkpoint file or a DeepSpeed checkpoint folder")
    p.add_argument("out_dir")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="the weights' dtype (default: the one the run's base model was saved in, its config.json's dtype; "
        "float32 where it said none)",
    )
    p.add_argument("--merge-lora", action="store_true", help="LoRA runs: write merged full weights, not the adapter")
    p.add_argument(
        "--tokenizer",
        help="tokenizer to save alongside, for checkpoints that do not hold the run's own (written by older lit-hbp)",
    )
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="open a checkpoint whose pickle names more than lit-hbp's runs write (it may run code: only for a "
        "file you made or trust)",
    )
    args = p.parse_args(argv)
    try:
        out = export_checkpoint(
            args.checkpoint, args.out_dir, args.dtype, args.merge_lora, args.tokenizer, args.trust_checkpoint
        )
    except UserInputError as e:  # a wrong path or checkpoint: one line and status 2, as the training CLI
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}: " + ", ".join(sorted(x.name for x in out.iterdir())))
    return 0


if __name__ == "__main__":
    atexit.register(gc.freeze)  # as lit-hbp's entry point: a process of its own exits without walking its heap
    sys.exit(main())
