"""StructuredOutputsParams: one constraint on a request's output (vLLM's names), and the
llguidance grammar it compiles to. The gateway checks it with `verify()`; the worker compiles it
(worker_svc/grammar_cache.py). Grammars are compiled with llguidance: one dependency-free wheel
that reads JSON schema, regex and Lark grammars, compiles lazily and masks a 49k vocabulary in
tens of microseconds (docs/openai.md, "Structured outputs", has the measurement)."""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Any

from pagedserve.services.common.errors import InvalidRequest, Reason

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# compact JSON: a small model that may indent freely can spend its max_tokens on whitespace
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_JSON_OBJECT = '{"type": "object"}'
MAX_CONSTRAINT_CHARS = 65536  # a schema, regex, grammar or all choices together
MAX_VERIFIED_CONSTRAINTS = 1024  # constraints whose verdict is kept, the most recent


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one field set. json_schema is JSON text (a dict is serialised as it is: the order
    of `properties` is the order of the output's keys)."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect; EBNF rules `a: b | c`)

    def __post_init__(self) -> None:
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = self.kinds()
        if len(kinds) != 1:
            raise InvalidRequest(
                f"structured_outputs must set exactly one of {', '.join(KINDS)}, got "
                f"{kinds or 'none'}", reason=Reason.INVALID_SAMPLING_PARAMS,
                field="structured_outputs")

    def kinds(self) -> list[str]:
        return [k for k in KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    def to_grammar(self) -> str:
        """llguidance's grammar text; raises InvalidRequest for JSON that is not a schema."""
        from llguidance import LLMatcher

        if self.json_object:
            return LLMatcher.grammar_from_json_schema(_ANY_JSON_OBJECT, overrides=_JSON_OPTIONS)
        if self.json_schema is not None:
            schema = self._parsed_schema()
            return LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)

    def verify(self) -> None:
        """Compiles without a vocabulary: an unparsable schema, an unsupported keyword, a regex
        or grammar that does not compile fail here, naming the field. Once per content: a
        constraint every request of a client repeats is compiled for the first."""
        problem = _problem(self)
        if problem is not None:
            raise copy.copy(problem)

    def _verify(self) -> None:
        from llguidance import LLMatcher

        field = f"structured_outputs.{self.kind}"
        value = getattr(self, self.kind)
        num_chars = sum(map(len, value)) if self.choice is not None else len(str(value))
        if num_chars > MAX_CONSTRAINT_CHARS:
            raise InvalidRequest(f"{field} must be at most {MAX_CONSTRAINT_CHARS} characters, "
                                 f"got {num_chars}", reason=Reason.LIMIT_EXCEEDED, field=field)
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise InvalidRequest(f"{field} must list non-empty strings, got {list(self.choice)}",
                                 reason=Reason.INVALID_SAMPLING_PARAMS, field=field)
        try:
            grammar = self.to_grammar()
        except InvalidRequest:
            raise
        except ValueError as e:
            raise self._invalid(field, str(e)) from e
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise self._invalid(field, messages[0])

    def _parsed_schema(self) -> dict[str, Any]:
        try:
            schema = json.loads(self.json_schema)
        except json.JSONDecodeError as e:
            raise self._invalid("structured_outputs.json_schema", f"not JSON: {e}") from e
        if not isinstance(schema, dict):
            raise self._invalid("structured_outputs.json_schema",
                                f"a schema is a JSON object, got {type(schema).__name__}")
        return schema

    def _invalid(self, field: str, problem: str) -> InvalidRequest:
        value = getattr(self, field.rsplit(".", 1)[1])
        shown = value if isinstance(value, str) else repr(value)
        if len(shown) > 120:
            shown = shown[:120] + "..."
        return InvalidRequest(f"{field} does not compile: {problem.strip()} (got {shown})",
                              reason=Reason.INVALID_SAMPLING_PARAMS, field=field)


@functools.lru_cache(maxsize=MAX_VERIFIED_CONSTRAINTS)
def _problem(params: StructuredOutputsParams) -> InvalidRequest | None:
    """What is wrong with the constraint, or None; remembered by content."""
    try:
        params._verify()
    except InvalidRequest as problem:
        return problem
    return None
