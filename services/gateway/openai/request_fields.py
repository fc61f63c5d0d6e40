"""Request fields the models do not declare. A field vLLM's OpenAI server serves and this one
does not is refused (400 naming it) unless it holds vLLM's default, which changes nothing; any
other field is ignored, as vLLM ignores it, and logged once per name so that an operator sees
what clients send in vain."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pagedserve.services.common.errors import InvalidRequest, Reason
from pydantic import BaseModel

logger = logging.getLogger(__name__)

# vLLM's fields → the values that ask for nothing (its default, or an explicit null)
_SHARED: dict[str, tuple[Any, ...]] = {
    "spaces_between_special_tokens": (None, True),
    "logits_processors": (None,),
    "return_token_ids": (None, False),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "guided_whitespace_pattern": (None,),
    "structural_tag": (None,),
}
REFUSED_COMPLETION_FIELDS: Mapping[str, tuple[Any, ...]] = {
    **_SHARED,
    "prompt_embeds": (None,),
}
REFUSED_CHAT_FIELDS: Mapping[str, tuple[Any, ...]] = {
    **_SHARED,
    "documents": (None,),
    "chat_template": (None,),
    "mm_processor_kwargs": (None,),
    "media_io_kwargs": (None,),
    "reasoning_effort": (None,),
    "include_reasoning": (None, True),
}

REFUSED_EMBEDDING_FIELDS: Mapping[str, tuple[Any, ...]] = {
    "embed_dtype": (None, "float32"),
    "endianness": (None, "native", "little"),
    "use_activation": (None,),
    "mm_processor_kwargs": (None,),
    "cache_salt": (None,),
}

_MAX_LOGGED_NAMES = 256  # bounds the memory and the log that random names could fill
_logged_names: set[str] = set()


def check_undeclared_fields(request: BaseModel, refused: Mapping[str, tuple[Any, ...]]) -> None:
    for name, value in (request.model_extra or {}).items():
        if name in refused:
            if not any(value is v or (value == v and type(value) is type(v))
                       for v in refused[name]):
                raise InvalidRequest(f"{name} is not supported by this server, got "
                                     f"{_brief(value)}", reason=Reason.UNSUPPORTED_PARAMETER,
                                     field=name)
        elif name not in _logged_names and len(_logged_names) < _MAX_LOGGED_NAMES:
            _logged_names.add(name)
            logger.warning("request field %r is not known and was ignored (logged once per "
                           "field name)", name[:64])


def _brief(value: Any, max_chars: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= max_chars else text[:max_chars] + "..."
