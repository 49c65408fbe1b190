"""The chat templates ``data.chat_template`` names: the built-in ones and how an option becomes a template."""

from __future__ import annotations

from pathlib import Path

from lit_hbp.errors import ConfigError

# Built-in chat templates (``data.chat_template: NAME``). Each closes an assistant turn with the
# tokenizer's EOS, one token of every vocabulary, so the model learns to stop and generation stops
# there without new tokens; each is prefix-stable (the first k turns render to a prefix of them all).
CHAT_TEMPLATES = {
    "tags": (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    "plain": (
        "{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}assistant:\n{% endif %}"
    ),
}
CHAT_TEMPLATE_FIX = (
    f"set data.chat_template to a Jinja template string, a template file, or a built-in ({', '.join(CHAT_TEMPLATES)})"
)


def resolve_chat_template(option: str, tokenizer) -> str:
    """The template ``data.chat_template`` names: a built-in name, a template file or a Jinja string
    (told apart by its ``{{`` / ``{%``); a short error naming the option for anything else."""
    if option in CHAT_TEMPLATES:
        if tokenizer.eos_token is None:
            raise ConfigError(
                f"data.chat_template {option!r} ends assistant turns with the tokenizer's EOS token, and this "
                "tokenizer has none: give a template of your own"
            )
        return CHAT_TEMPLATES[option]
    if "{{" in option or "{%" in option:
        return option
    if Path(option).expanduser().is_file():
        return Path(option).expanduser().read_text()
    raise ConfigError(
        f"data.chat_template {option!r} is no built-in template ({', '.join(CHAT_TEMPLATES)}), no existing file "
        "and no Jinja template string"
    )
