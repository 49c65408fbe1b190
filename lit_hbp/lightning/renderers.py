"""The checkpoint's renderers of chat records: its tokenizer and, for a vision-language checkpoint, its processor,
loaded from ``data.tokenizer`` (a local folder or the Hugging Face cache: no downloads in a training job) and
carried in a run's checkpoint as their files, so a checkpoint is all an export needs."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path, PurePosixPath

from lit_hbp.data.tokenize import resolve_chat_template
from lit_hbp.errors import ConfigError, did_you_mean
from lit_hbp.model.checks import local_checkpoint

# The files a tokenizer folder holds (its own, a slow tokenizer's vocabulary): a folder with none holds no tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(path: str):
    """A local Hugging Face tokenizer (hub downloads are off in training jobs: give a path). A path that holds no
    tokenizer (a file, a folder without one) is a ConfigError naming it, not transformers' traceback."""
    from transformers import AutoTokenizer

    if not Path(path).exists():
        try:
            return AutoTokenizer.from_pretrained(local_checkpoint(path), local_files_only=True)
        except OSError:
            parent = Path(path).parent
            folders = [p.name for p in parent.iterdir() if p.is_dir()] if parent.is_dir() else []
            near = did_you_mean(Path(path).name, folders)
            raise ConfigError(
                f"data.tokenizer: {path!r} is neither a local folder{near} nor a tokenizer in the Hugging Face cache"
            ) from None
    if Path(path).is_file():
        raise ConfigError(f"data.tokenizer: {path} is a file: give the folder that holds the tokenizer's files")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):  # transformers' words say not that
            raise ConfigError(
                f"data.tokenizer: {path} is a folder without a tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                "give the checkpoint's folder, or one a tokenizer's save_pretrained wrote"
            ) from None
        raise ConfigError(
            f"data.tokenizer: the tokenizer in {path} does not load: {' '.join(str(e).split())}"
        ) from None


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def load_renderers(path: str, chat_template: str | None = None, processor_kwargs: dict | None = None) -> tuple:
    """(tokenizer, processor, model config) of ``data.tokenizer``: a vision-language checkpoint's processor
    shares the tokenizer and the processor's chat template, which its ``apply_chat_template`` renders (a folder
    may carry another one for the tokenizer alone), (None, None) for a text checkpoint; ``chat_template``
    replaces the template of both; ``processor_kwargs`` overrides the image and video processor's settings."""
    tokenizer = load_tokenizer(path)
    processor, config = load_processor(path, processor_kwargs)
    if processor is not None:  # one tokenizer and chat template for text and images
        # as AutoProcessor.from_pretrained(folder, **kwargs) gives its own tokenizer the settings (Gemma 3's
        # processor reads pan-and-scan from there at each call; its saved config carries them into the export)
        tokenizer.init_kwargs.update(processor_kwargs or {})
        processor.tokenizer = tokenizer
        if getattr(processor, "chat_template", None):
            tokenizer.chat_template = processor.chat_template
    if chat_template is not None:
        tokenizer.chat_template = resolve_chat_template(chat_template, tokenizer)
        if processor is not None:
            processor.chat_template = tokenizer.chat_template
    return tokenizer, processor, config


def load_processor(path: str, processor_kwargs: dict | None = None):
    """(processor, config) of a vision-language checkpoint folder (one with an image processor's
    files), else (None, None): its processor expands and encodes the images of chat records.
    ``processor_kwargs`` (``data.processor_kwargs``: ``max_pixels``, ``size``, ``image_grid_pinpoints``...) is
    passed to ``AutoProcessor.from_pretrained``, which drops a setting no part of the processor has: each is
    checked to be held by its image or video processor."""
    if processor_kwargs is not None and not isinstance(processor_kwargs, dict):
        raise ConfigError(f"data.processor_kwargs must be a mapping of processor settings, got {processor_kwargs!r}")
    folder = Path(path) if Path(path).exists() else None
    if folder is None or not any((folder / name).exists() for name in PROCESSOR_FILES):
        if processor_kwargs:
            raise ConfigError(
                f"data.processor_kwargs: {path} has no image processor (a text checkpoint): remove processor_kwargs"
            )
        return None, None
    from transformers import AutoConfig, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(folder, **(processor_kwargs or {}))
    except (ImportError, OSError, ValueError, TypeError) as e:
        raise ConfigError(f"data.tokenizer: the processor of {path} does not load: {e}") from None
    if not hasattr(processor, "image_processor"):
        if processor_kwargs:
            raise ConfigError(f"data.processor_kwargs: {path}'s processor has no image processor to set them on")
        return None, None
    _check_settings(processor, processor_kwargs or {}, folder)
    config = AutoConfig.from_pretrained(folder) if (folder / "config.json").exists() else None
    for key, value in (processor_kwargs or {}).items():  # one the model reads too (LLaVA-NeXT's pinpoints)
        held = [getattr(c, key) for c in (config, *_sub_configs(config)) if c is not None and hasattr(c, key)]
        if any(_json(h) != _json(value) for h in held):
            raise ConfigError(
                f"data.processor_kwargs.{key}: the model's config.json in {folder} holds {held[0]!r}, which its "
                f"forward reads: the processor's must be the same (remove it, or change both)"
            )
    return processor, config


def _sub_configs(config) -> list:
    return [getattr(config, name) for name in getattr(config, "sub_configs", {}) if getattr(config, name, None)]


def _settings(processor) -> list[dict]:
    """The image and video processor's settings (``to_dict``) and what each takes at construction (its
    ``valid_kwargs``: Qwen2-VL's ``max_pixels`` becomes ``size["longest_edge"]``)."""
    parts = [part for part in (processor.image_processor, getattr(processor, "video_processor", None)) if part]
    return [
        {"held": part.to_dict(), "takes": getattr(type(part), "valid_kwargs", dict).__annotations__} for part in parts
    ]


def _check_settings(processor, kwargs: dict, folder: Path) -> None:
    """Each of ``kwargs`` held as given by the image or video processor, or taken by one and changing its settings
    (transformers drops what none has: LLaVA-NeXT's ``max_pixels`` changed nothing, unsaid); a processor's own
    settings (its patch size, feature strategy) must match the model's config and are not set here."""
    from transformers import AutoProcessor

    parts = _settings(processor)
    plain: list[dict] | None = None
    for key, value in kwargs.items():
        held = [part["held"][key] for part in parts if key in part["held"]]
        if held and any(_json(h) != _json(value) for h in held):
            raise ConfigError(
                f"data.processor_kwargs.{key}: {folder}'s processor holds {held[0]!r} after loading with {value!r}: "
                "give the value in the form its own config writes it (processor_config.json)"
            )
        if held:
            continue
        if key in getattr(processor, "__dict__", {}):  # the processor's own: how many tokens it expands an image to
            raise ConfigError(
                f"data.processor_kwargs.{key}: a setting of {folder}'s processor itself ({type(processor).__name__}), "
                "which expands images to as many tokens as the model's config says: not set here; remove it"
            )
        if plain is None:
            plain = [part["held"] for part in _settings(AutoProcessor.from_pretrained(folder))]
        if not any(key in part["takes"] for part in parts) or [part["held"] for part in parts] == plain:
            names = sorted({k for part in parts for k in (*part["held"], *part["takes"]) if not k.startswith("_")})
            raise ConfigError(
                f"data.processor_kwargs.{key}: {folder}'s image processor does not hold it (loading with it changed "
                f"none of its settings); it has {', '.join(names)}"
            )


def _json(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The files ``save_pretrained`` writes for ``tokenizer`` (or a processor; a few MB at most), by their paths in
    its folder: subfolders too (named chat templates go to ``additional_chat_templates/``)."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return {p.relative_to(tmp).as_posix(): p.read_bytes() for p in sorted(Path(tmp).rglob("*")) if p.is_file()}


def write_files(files: dict[str, bytes | str], folder: str | Path, keep: bool = False) -> None:
    """Write ``files`` (``tokenizer_files``) under ``folder`` at their paths, none outside it (a checkpoint's names are
    data); with ``keep`` a file already there stays."""
    folder = Path(folder)
    for name, data in files.items():
        parts = PurePosixPath(name).parts
        if not parts or PurePosixPath(name).is_absolute() or ".." in parts:
            raise ValueError(f"a tokenizer file named {name!r} would be written outside {folder}")
        target = folder.joinpath(*parts)
        if keep and target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data if isinstance(data, bytes) else data.encode())


def tokenizer_from_files(files: dict[str, bytes | str], folder: str | Path):
    """Write ``files`` (``tokenizer_files``) into ``folder`` and load the tokenizer from there."""
    from transformers import AutoTokenizer

    Path(folder).mkdir(parents=True, exist_ok=True)
    write_files(files, folder)
    return AutoTokenizer.from_pretrained(folder)
