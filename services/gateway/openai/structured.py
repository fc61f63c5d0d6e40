"""The OpenAI and vLLM ways of asking for structured output → one StructuredOutputsParams:
OpenAI's `response_format` (json_object; json_schema, strict or not: always enforced), vLLM's
`structured_outputs` object and its older `guided_*` fields. At most one of them per request."""

from __future__ import annotations

from typing import Any

from pagedserve.services.common.errors import InvalidRequest, Reason
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.services.gateway.openai.protocol import GenerationRequest

# vLLM's names for the engine; any of them means llguidance here
BACKENDS = ("auto", "guidance", "llguidance")
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
# vLLM's StructuredOutputsParams field → ours
_VLLM_FIELDS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                "grammar": "grammar", "json_object": "json_object"}


def _invalid(field: str, message: str, reason: Reason = Reason.INVALID_SAMPLING_PARAMS
             ) -> InvalidRequest:
    return InvalidRequest(f"{field} {message}", reason=reason, field=field)


def _params(field: str, kind: str, value: Any) -> StructuredOutputsParams:
    if kind == "choice" and not (isinstance(value, list) and all(isinstance(c, str)
                                                                 for c in value)):
        raise _invalid(field, f"must be a list of strings, got {value!r:.80}")
    if kind in ("regex", "grammar") and not isinstance(value, str):
        raise _invalid(field, f"must be a string, got {value!r:.80}")
    if kind == "json_schema" and not isinstance(value, (str, dict)):
        raise _invalid(field, f"must be a JSON schema (an object or its text), got {value!r:.80}")
    try:
        return StructuredOutputsParams(**{kind: value})
    except InvalidRequest as exc:
        raise _invalid(field, exc.args[0]) from None


def _from_response_format(value: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise _invalid("response_format.json_schema",
                           f"must be an object with a `schema` object, got {spec!r:.80}")
        return _params("response_format.json_schema.schema", "json_schema",
                       spec.get("schema", {}))
    raise _invalid("response_format.type", f"must be text, json_object or json_schema, got "
                   f"{kind!r}", Reason.UNSUPPORTED_PARAMETER)


def _from_vllm(value: dict[str, Any]) -> StructuredOutputsParams:
    unknown = sorted(k for k, v in value.items()
                     if k not in _VLLM_FIELDS and v not in (None, False))
    if unknown:
        raise _invalid(f"structured_outputs.{unknown[0]}",
                       f"is not supported (supported: {', '.join(_VLLM_FIELDS)})",
                       Reason.UNSUPPORTED_PARAMETER)
    kinds = [k for k in _VLLM_FIELDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise _invalid("structured_outputs", f"must set exactly one of "
                       f"{', '.join(_VLLM_FIELDS)}, got {kinds or 'none'}")
    field = f"structured_outputs.{kinds[0]}"
    return _params(field, _VLLM_FIELDS[kinds[0]], value[kinds[0]])


def structured_outputs(request: GenerationRequest) -> StructuredOutputsParams | None:
    """None: free text. Compiling is left to the Frontend (its executor)."""
    backend = request.guided_decoding_backend
    if backend is not None and backend not in BACKENDS:
        raise _invalid("guided_decoding_backend", f"must be one of {', '.join(BACKENDS)} "
                       f"(llguidance serves every constraint), got {backend!r}",
                       Reason.UNSUPPORTED_PARAMETER)
    found: list[tuple[str, StructuredOutputsParams]] = []
    if request.response_format is not None:
        params = _from_response_format(request.response_format)
        if params is not None:
            found.append(("response_format", params))
    if request.structured_outputs is not None:
        found.append(("structured_outputs", _from_vllm(request.structured_outputs)))
    for name, kind in _GUIDED.items():
        value = getattr(request, name)
        if value is not None:
            found.append((name, _params(name, kind, value)))
    if len(found) > 1:
        names = [name for name, _ in found]
        raise _invalid(names[1], f"cannot be combined with {names[0]}: a request follows one "
                       f"constraint, got {', '.join(names)}")
    return found[0][1] if found else None
