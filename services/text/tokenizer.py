"""A thin wrapper over a Hugging Face tokenizer. Decoding never cleans up tokenization spaces,
so incremental detokenization reproduces a full decode exactly. A fast tokenizer decodes through
its Rust tokenizer directly: the gateway decodes about twice per streamed token, and the Python
wrapper around that call cost several times the call."""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import transformers
from pagedserve.services.common.errors import ConfigError, InvalidRequest, Reason

logger = logging.getLogger(__name__)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# apply_chat_template's own parameters, which chat_template_kwargs must not override
_TEMPLATE_CALL_PARAMETERS = frozenset(
    set(inspect.signature(transformers.PreTrainedTokenizerBase.apply_chat_template).parameters)
    - {"self", "kwargs"})


class Tokenizer:
    def __init__(self, hf_tokenizer: transformers.PreTrainedTokenizerBase,
                 extra_eos_token_ids: Sequence[int] = ()) -> None:
        self.hf_tokenizer = hf_tokenizer
        eos = [hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos_token_ids]))
        # Exactly what decode(skip_special_tokens=True) drops.
        added_special = [i for i, tok in hf_tokenizer.added_tokens_decoder.items() if tok.special]
        self.special_token_ids: frozenset[int] = frozenset(
            [*hf_tokenizer.all_special_ids, *added_special])
        # At least the characters any one token decodes to (byte-level tokens: their bytes).
        self.max_token_chars: int = max(map(len, hf_tokenizer.get_vocab()), default=1)
        self._backend = _backend_decoding_alike(hf_tokenizer)
        # one token's text, by skip_special_tokens: incremental detokenization decodes each
        # streamed token alone as its next context
        self._token_texts: tuple[dict[int, str], dict[int, str]] = ({}, {})

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.is_dir():
            raise InvalidRequest(f"tokenizer folder {str(path)!r} does not exist")
        hf = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(hf, extra_eos_token_ids=_generation_eos_ids(path))

    @property
    def vocab_size(self) -> int:
        """Added tokens included; the model's may be larger."""
        return len(self.hf_tokenizer)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf_tokenizer.bos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf_tokenizer.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.hf_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)

    def decode_token(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """decode([token_id]), cached: the vocabulary bounds the cache."""
        texts = self._token_texts[skip_special_tokens]
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = self.decode([token_id], skip_special_tokens)
        return text

    def id_to_token(self, token_id: int) -> str:
        return self.hf_tokenizer.convert_ids_to_tokens(token_id)

    def use_chat_template(self, template: str) -> None:
        """Replaces the model's chat template (--chat-template): a file's path or the template."""
        path = Path(template)
        if "{" not in template and path.is_file():
            template = path.read_text()
        elif "{" not in template:
            raise ConfigError(f"chat_template {template!r} is neither a file nor a Jinja "
                              "template")
        try:
            jinja2.Environment().parse(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"chat_template does not parse: {exc}") from exc
        self.hf_tokenizer.chat_template = template

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """`template_kwargs` (chat_template_kwargs): variables the template reads, such as
        Qwen3's enable_thinking. `tools`: OpenAI's, as the template's `tools`."""
        if not self.has_chat_template:
            raise InvalidRequest("messages need a chat template, but the model has none; "
                                 "send a text prompt or token_ids instead",
                                 reason=Reason.NO_CHAT_TEMPLATE, field="messages")
        _check_messages(messages)
        if add_generation_prompt and continue_final_message:
            raise InvalidRequest("add_generation_prompt and continue_final_message cannot both "
                                 "be true", reason=Reason.INVALID_CHAT_MESSAGE,
                                 field="continue_final_message")
        kwargs = dict(template_kwargs or {})
        for name in kwargs:
            if name in _TEMPLATE_CALL_PARAMETERS:
                raise InvalidRequest(f"chat_template_kwargs must not set {name!r}, a parameter "
                                     "of the template call itself",
                                     reason=Reason.INVALID_CHAT_MESSAGE,
                                     field=f"chat_template_kwargs.{name}")
        try:
            return self.hf_tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False,
                tools=[dict(t) for t in tools] if tools else None, **kwargs)
        except jinja2.TemplateError as exc:  # e.g. a template's raise_exception("roles must alternate")
            raise InvalidRequest(f"messages rejected by the chat template: {exc}",
                                 reason=Reason.INVALID_CHAT_MESSAGE, field="messages") from exc
        except ValueError as exc:  # continue_final_message without a final message to continue
            raise InvalidRequest(f"messages rejected by the chat template: {exc}",
                                 reason=Reason.INVALID_CHAT_MESSAGE, field="messages") from exc

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True) -> list[int]:
        """The template writes its own BOS, so no special tokens are added a second time."""
        text = self.render_chat(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


def _backend_decoding_alike(hf_tokenizer: transformers.PreTrainedTokenizerBase) -> Any | None:
    """The fast tokenizer's Rust tokenizer, if it decodes a sample of the vocabulary (special
    tokens included) exactly as the Python tokenizer does; a tokenizer class that post-processes
    its decode keeps the Python path."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    vocab_size = len(hf_tokenizer)
    sample = [i for i in range(0, vocab_size, max(1, vocab_size // 256))]
    sample += list(hf_tokenizer.all_special_ids)
    for skip in (True, False):
        for ids in (sample, sample[::-1], sample[:3]):
            expected = hf_tokenizer.decode(ids, skip_special_tokens=skip,
                                           clean_up_tokenization_spaces=False)
            if backend.decode(ids, skip_special_tokens=skip) != expected:
                return None
    return backend


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if not messages:
        raise InvalidRequest("messages must not be empty", reason=Reason.PROMPT_EMPTY,
                             field="messages")
    for i, message in enumerate(messages):
        role = message.get("role", "")
        if role not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                reason=Reason.INVALID_CHAT_MESSAGE, field=f"messages[{i}].role")
        content = message.get("content", "")
        if role == "assistant" and message.get("tool_calls") and content == "":
            continue  # a turn of calls only
        if not isinstance(content, str) or not content:
            raise InvalidRequest(f"messages[{i}].content must be a non-empty string, got "
                                 f"{content!r}", reason=Reason.INVALID_CHAT_MESSAGE,
                                 field=f"messages[{i}].content")


def _generation_eos_ids(path: Path) -> list[int]:
    config_file = path / "generation_config.json"
    if not config_file.exists():
        return []
    eos = json.loads(config_file.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
