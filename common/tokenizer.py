"""Prompt text to token ids without transformers or torch: the model's `tokenizer.json` through
the `tokenizers` library (what transformers' fast tokenizers run), and its chat template through
jinja2 set up as transformers sets it up (sandboxed, trim_blocks, lstrip_blocks, the special
tokens as variables). tests/common/test_common.py checks both against transformers' tokenizer."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from common.errors import InvalidRequestError

Message = dict[str, Any]  # role, content (text, or None beside tool_calls), tool_calls, tool_call_id
# Ours, for ChatML models whose own template does not render tools.
CHATML_TOOLS_TEMPLATE = Path(__file__).parent / "chat_templates" / "chatml_tools.jinja"
_MENTIONS_TOOLS = re.compile(r"\btools\b")
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
# Appended to the message to continue: where it lands in the rendered chat is where the text is cut.
# Its space tells a template that trims messages (then the text before it is trimmed too) from one
# that does not, as transformers' apply_chat_template tells them.
_CONTINUE_MARKER = "<<continue final message>> "


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _template_environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment


def template_source(chat_template: str) -> str:
    """A `chat_template` setting (as vLLM's --chat-template): a file's path, or the template itself."""
    path = Path(chat_template)
    if "{" not in chat_template and len(chat_template) < 4096 and path.is_file():
        return path.read_text()
    if "{{" in chat_template or "{%" in chat_template:
        return chat_template
    raise InvalidRequestError("chat_template", f"{chat_template!r} is neither a file nor a Jinja template")


@dataclass(frozen=True)
class PromptTokenizer:
    tokenizer: Tokenizer
    chat_template: jinja2.Template | None
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as the template names them
    # tokenizer_config as vLLM's /tokenizer_info shows it: tokens as text, no file paths, and the
    # chat template in effect (what lm-eval's remote tokenizer reads)
    settings: dict[str, Any]
    # What renders tools and tool calls: the chat template when it mentions tools, else ours for a
    # ChatML model (CHATML_TOOLS_TEMPLATE), else None (requests with tools are refused).
    tools_template: jinja2.Template | None = None

    @classmethod
    def load(cls, hf_dir: Path, chat_template: str | None = None) -> PromptTokenizer:
        """From a Hugging Face directory: tokenizer.json, tokenizer_config.json and the chat
        template (`chat_template` if given, else chat_template.jinja, else tokenizer_config's)."""
        config_path = hf_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = hf_dir / "chat_template.jinja"
        source = template_path.read_text() if template_path.is_file() else config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if chat_template is not None:
            source = template_source(chat_template)
        special = {name: _as_text(config[name]) for name in _SPECIAL_TOKENS if config.get(name)}
        environment = _template_environment()
        template = environment.from_string(source) if source else None
        tools_template = template if source and _MENTIONS_TOOLS.search(source) else None
        if source and tools_template is None and "<|im_start|>" in source:
            tools_template = environment.from_string(CHATML_TOOLS_TEMPLATE.read_text())
        tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
        return cls(tokenizer, template, special, _settings(config, source), tools_template)

    @property
    def vocab_size(self) -> int:
        """Token ids this tokenizer can write out, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        # Special tokens kept, as transformers' decode keeps them by default.
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_strings(self, ids: list[int]) -> list[str]:
        """The vocabulary's spelling of each token (byte-level: "Ġ" for a leading space), as
        transformers' convert_ids_to_tokens gives it."""
        return [self.tokenizer.id_to_token(token_id) for token_id in ids]

    def render_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The conversation as the model's chat template writes it: ready for the assistant's turn
        (add_generation_prompt), or left open after the final message for the model to continue it
        (continue_final_message: a "prefill"). With `tools`, or tool calls in the conversation, the
        template that renders them. `template_kwargs`: more variables for the template (a request's
        `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`)."""
        taken = sorted(
            {"messages", "tools", "add_generation_prompt", *self.special_tokens} & set(template_kwargs or {})
        )
        if taken:
            raise InvalidRequestError(
                "chat_template_kwargs", f"{', '.join(taken)}: set by the server, not here"
            )
        template = self.chat_template
        if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            template = self.tools_template
            if template is None:
                raise InvalidRequestError(
                    "tools",
                    "this model's chat template does not render tools; serve it with a chat_template "
                    "that does",
                )
        assert template is not None
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidRequestError(
                    "continue_final_message",
                    "cannot be combined with add_generation_prompt (set it to false)",
                )
            last = messages[-1]
            messages = [*messages[:-1], {**last, "content": (last["content"] or "") + _CONTINUE_MARKER}]
        text = template.render(
            **(template_kwargs or {}),
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **self.special_tokens,
        )
        if not continue_final_message:
            return text
        cut = text.rfind(_CONTINUE_MARKER.rstrip())
        if cut < 0:
            raise InvalidRequestError(
                "continue_final_message", "this model's chat template does not write out the final message"
            )
        return text[:cut] if text.startswith(_CONTINUE_MARKER, cut) else text[:cut].rstrip()


def _settings(config: dict[str, Any], chat_template: str | None) -> dict[str, Any]:
    """What transformers' tokenizer was made with, as vLLM's /tokenizer_info answers it."""
    unlisted = {"vocab_file", "merges_file", "tokenizer_file", "chat_template", "added_tokens_decoder"}
    settings = {name: _as_text(value) for name, value in config.items() if name not in unlisted}
    settings.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    if chat_template is not None:
        settings["chat_template"] = chat_template
    return settings


def _as_text(value: Any) -> Any:
    """A config value with each AddedToken dict in it (in lists and dicts too) as its text:
    tokenizer_config writes a token as its text or as such a dict."""
    if isinstance(value, dict):
        return value["content"] if "content" in value else {k: _as_text(v) for k, v in value.items()}
    return [_as_text(item) for item in value] if isinstance(value, list) else value
