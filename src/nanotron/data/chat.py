"""Conversations rendered with a chat template, tokenized, and the tokens the loss is trained on.

Rules:

- A conversation is a list of messages, each a mapping with a ``role`` (``system``, ``user`` or ``assistant``) and a
  ``content`` string; it has at least one assistant message.
- Rendering follows transformers' ``apply_chat_template``: the template is a Jinja2 template rendered in a sandbox
  with ``trim_blocks`` and ``lstrip_blocks``, given ``messages``, ``add_generation_prompt`` and the tokenizer's
  special tokens (``bos_token``, ``eos_token``, ... from ``tokenizer_config.json``); the text is tokenized whole,
  without adding special tokens (the template writes them).
- The template is the tokenizer's (``chat_template.jinja`` beside ``tokenizer.json``, else ``chat_template`` in
  ``tokenizer_config.json``) or a built-in one by name (``BUILT_IN_TEMPLATES``).
- The trained text of an assistant turn is what the template adds for it after the prompt that asks for it: the
  conversation rendered up to and with the turn, less the conversation before it rendered with the generation
  prompt (its content and the end-of-turn marker the template writes after it). ``train_on``: ``assistant``, every
  assistant turn's; ``last_assistant``, the last one's; ``all``, every token. A token is trained on when its first
  character is trained text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from nanotron.data.documents import DataError

ROLES = ("system", "user", "assistant")
TRAIN_ON = ("assistant", "last_assistant", "all")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
BUILT_IN_TEMPLATES = {"chatml": CHATML}
TEMPLATE_FILE_NAME = "chat_template.jinja"
TOKENIZER_CONFIG_FILE_NAME = "tokenizer_config.json"
INSTALL_HINT = 'pip install -e ".[sft]"'
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateError(DataError):
    """A chat template that cannot be found, compiled or rendered."""


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    source: str  # the template's text
    origin: str  # where it was read from, for messages
    special_tokens: Mapping[str, str]

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
        """The text of ``messages`` (``apply_chat_template(..., tokenize=False)``)."""
        try:
            return _compiled(self.source).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                                 **self.special_tokens)
        except TemplateError:
            raise
        except Exception as error:  # jinja2's errors, and a template's raise_exception
            raise TemplateError(f"the chat template ({self.origin}) does not render: {type(error).__name__}: "
                                f"{error}") from None


_TEMPLATES: dict[str, Any] = {}


def _compiled(source: str):
    """The template compiled as transformers compiles it (once per process)."""
    if source not in _TEMPLATES:
        try:
            from jinja2 import TemplateError as JinjaError
        except ImportError:
            raise TemplateError(f"rendering chat templates needs jinja2: {INSTALL_HINT}") from None
        try:
            _TEMPLATES[source] = _environment().from_string(source)
        except JinjaError as error:
            raise TemplateError(f"the chat template does not compile: {error}") from None
    return _TEMPLATES[source]


def _environment():
    """transformers' sandbox for chat templates: its options, globals, ``tojson`` and ``{% generation %}`` blocks
    (which mark what the assistant writes, rendered here as their body: the trained text is found as the module's
    rules say, the same text where a template has them)."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(Extension):
        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        def _body(self, caller) -> str:
            return caller()

    def raise_exception(message: str):
        raise TemplateError(f"the chat template refuses the conversation: {message}")

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlocks, loopcontrols])
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment


def load_chat_template(tokenizer: str | Path, name: str | None = None) -> ChatTemplate:
    """The built-in template ``name``, or (None) the one saved with ``tokenizer`` (a folder, or its tokenizer.json);
    with the special tokens of its ``tokenizer_config.json`` either way."""
    folder = Path(tokenizer)
    folder = folder if folder.is_dir() else folder.parent
    settings = _tokenizer_settings(folder)
    special = {key: _token_text(settings[key]) for key in _SPECIAL_TOKEN_KEYS if settings.get(key) is not None}
    if name is not None:
        if name not in BUILT_IN_TEMPLATES:
            raise TemplateError(f"there is no built-in chat template {name!r}; use one of "
                                f"{', '.join(BUILT_IN_TEMPLATES)}, or null for the tokenizer's")
        return ChatTemplate(BUILT_IN_TEMPLATES[name], f"built-in {name}", special)
    if (folder / TEMPLATE_FILE_NAME).is_file():
        return ChatTemplate((folder / TEMPLATE_FILE_NAME).read_text(encoding="utf-8"),
                            str(folder / TEMPLATE_FILE_NAME), special)
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((item.get("template") for item in template if item.get("name") == "default"), None)
    if not isinstance(template, str):
        raise TemplateError(f"the tokenizer {tokenizer} has no chat template ({TEMPLATE_FILE_NAME} or chat_template "
                            f"in {TOKENIZER_CONFIG_FILE_NAME}); name a built-in one with chat_template: "
                            f"{' or '.join(BUILT_IN_TEMPLATES)}")
    return ChatTemplate(template, str(folder / TOKENIZER_CONFIG_FILE_NAME), special)


def _tokenizer_settings(folder: Path) -> dict:
    path = folder / TOKENIZER_CONFIG_FILE_NAME
    if not path.is_file():
        return {}
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TemplateError(f"{path} is not valid JSON ({error})") from None
    return settings if isinstance(settings, dict) else {}


def _token_text(token: str | dict) -> str:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken's mapping."""
    return token["content"] if isinstance(token, dict) else str(token)


def checked_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """``messages`` as a conversation, or a DataError naming ``where`` (the file and row) and what is wrong."""
    if not isinstance(messages, list):
        raise DataError(f"{where}: the messages are a {type(messages).__name__}, not a list of {{role, content}} "
                        "mappings")
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role is None:
            raise DataError(f"{where}: message {index} has no role; give every message a role "
                            f"({', '.join(ROLES)}) and a content")
        if role not in ROLES:
            raise DataError(f"{where}: message {index} has the unknown role {role!r}; the roles are "
                            f"{', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise DataError(f"{where}: message {index} ({role}) has no text content")
    if not any(message["role"] == "assistant" for message in messages):
        raise DataError(f"{where}: the conversation has no assistant message, so nothing in it is trained on; "
                        "remove it or add the assistant's answer")
    return [{"role": message["role"], "content": message["content"]} for message in messages]


def trained_spans(template: ChatTemplate, messages: list[dict[str, str]], train_on: str) -> tuple[str, list]:
    """The rendered text of a conversation and the character spans ``[start, end)`` of its trained text."""
    text = template.render(messages)
    if train_on == "all":
        return text, [(0, len(text))]
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = template.render(messages[:index], add_generation_prompt=True) if index else ""
        turn = template.render(messages[:index + 1])
        if not (text.startswith(turn) and turn.startswith(prompt)):
            raise TemplateError(f"the chat template ({template.origin}) renders the start of a conversation "
                                f"differently once later turns follow, so assistant turns cannot be told apart; "
                                f"set train_on: all, or use another template")
        spans.append((len(prompt), len(turn)))
    return text, spans[-1:] if train_on == "last_assistant" else spans


def tokenized_conversation(tokenizer, template: ChatTemplate, messages: list[dict[str, str]],
                           train_on: str) -> tuple[np.ndarray, np.ndarray]:
    """The token ids of a conversation rendered with ``template`` and whether each is trained on."""
    text, spans = trained_spans(template, messages, train_on)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    starts = np.array([start for start, _ in encoding.offsets], dtype=np.int64)
    trained = np.zeros(len(starts), dtype=bool)
    for start, end in spans:
        trained |= (starts >= start) & (starts < end)
    return np.asarray(encoding.ids, dtype=np.int64), trained


def checkpoint_tokenizer_config(config) -> dict | None:
    """What a checkpoint of a run that trains on conversations stores as ``tokenizer/tokenizer_config.json``: the
    tokenizer's settings with the chat template its last stage of conversations renders with (``chat_template``), so
    that the model exported to Hugging Face formats its prompts as it was trained; None for a run without
    conversations."""
    from nanotron.config import SFTDatasetArgs

    stages = [stage.data.dataset for stage in config.data_stages if isinstance(stage.data.dataset, SFTDatasetArgs)]
    tokenizer = config.tokenizer.tokenizer_name_or_path
    if not stages or tokenizer is None or not Path(tokenizer).exists():
        return None
    folder = Path(tokenizer) if Path(tokenizer).is_dir() else Path(tokenizer).parent
    template = load_chat_template(tokenizer, stages[-1].chat_template)
    return _tokenizer_settings(folder) | {"chat_template": template.source}
