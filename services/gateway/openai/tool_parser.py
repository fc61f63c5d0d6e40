"""A chat choice's tool calls read as its text arrives, a character at a time, so that they stream
as the OpenAI API streams them: a call's start (its index, id and name) once its name is read,
then its arguments' raw text as it is generated; content before the calls streams as content.
The whole text read at once gives the same pieces joined, so a streamed call's arguments are the
returned call's arguments exactly.

Formats: `named` (the text is the arguments), `required` (a JSON list of {name, parameters}),
and under `auto` the model's own: `hermes` (`<tool_call>{"name", "arguments"}</tool_call>` after
optional content) and `llama3_json` (`{"name", "parameters"}` objects joined by ';', optionally
after <|python_tag|>). Text that turns out not to be a call is content from where it began."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass

HERMES_TAG = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"
_WHITESPACE = " \t\r\n"
_ARGUMENT_KEYS = ("arguments", "parameters")

# a reader is fed one character per send(), None once the text is over; it returns the
# character after what it read (None: the text is over)
Reader = Generator[None, str | None, str | None]


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int  # the call's place in the choice's tool_calls
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsPart:
    index: int
    text: str


Piece = str | CallStart | ArgumentsPart  # str: content


class ToolCallParser:
    def __init__(self, mode: str, parser: str = "", named: str | None = None) -> None:
        """mode: named, required or auto (auto without a parser: every piece is content)."""
        self.num_calls = 0
        self._text: list[str] = []
        self._pieces: list[Piece] = []
        self._is_over = False
        if mode == "named":
            main = self._named(named or "")
        elif mode == "required":
            main = self._required()
        elif parser == "hermes":
            main = self._hermes()
        elif parser == "llama3_json":
            main = self._llama3_json()
        else:
            main = self._content_from(0)
        self._run = main
        next(self._run)

    def feed(self, text: str) -> list[Piece]:
        for ch in text:
            self._text.append(ch)
            self._run.send(ch)
        return self._take()

    def finish(self) -> list[Piece]:
        """The pieces held back until the text is over."""
        if not self._is_over:
            self._is_over = True
            try:
                self._run.send(None)
            except StopIteration:
                pass
        return self._take()

    def _take(self) -> list[Piece]:
        merged: list[Piece] = []
        for piece in self._pieces:
            last = merged[-1] if merged else None
            if isinstance(piece, str) and isinstance(last, str):
                merged[-1] = last + piece
            elif (isinstance(piece, ArgumentsPart) and isinstance(last, ArgumentsPart)
                  and piece.index == last.index):
                merged[-1] = ArgumentsPart(piece.index, last.text + piece.text)
            else:
                merged.append(piece)
        self._pieces.clear()
        return merged

    def _content(self, text: str) -> None:
        if text:
            self._pieces.append(text)

    def _start_call(self, name: str) -> int:
        index = self.num_calls
        self.num_calls += 1
        self._pieces.append(CallStart(index, f"call_{uuid.uuid4().hex[:24]}", name))
        return index

    # the formats

    def _named(self, name: str) -> Reader:
        index = self._start_call(name)
        self._pieces.append(ArgumentsPart(index, ""))
        while (ch := (yield)) is not None:
            self._pieces.append(ArgumentsPart(index, ch))
        return None

    def _required(self) -> Reader:
        ch = yield from self._skip_whitespace((yield))
        if ch != "[":
            return (yield from self._content_from(0))
        ch = yield from self._skip_whitespace((yield))
        while True:
            ch = yield from self._call(ch, 0 if self.num_calls == 0 else len(self._text) - 1)
            if ch != ",":
                break
            ch = yield from self._skip_whitespace((yield))
        while ch is not None:  # the closing ']' and what the grammar lets follow it
            ch = yield
        return None

    def _hermes(self) -> Reader:
        ch = yield
        is_content = True  # what comes between and after calls is dropped
        while (yield from self._until(HERMES_TAG, ch, is_content)):
            is_content = False
            start = len(self._text) - len(HERMES_TAG)
            ch = yield from self._skip_whitespace((yield))
            ch = yield from self._call(ch, start)
        return None

    def _llama3_json(self) -> Reader:
        ch = yield from self._skip_whitespace((yield))
        if ch == "<":
            if not (yield from self._literal(ch, PYTHON_TAG)):
                return (yield from self._content_from(0))
            ch = yield from self._skip_whitespace((yield))
        start = 0
        while ch is not None:
            if ch != "{":
                return (yield from self._content_from(start))
            ch = yield from self._call(ch, start)
            while ch is not None and (ch in _WHITESPACE or ch == ";"):
                ch = yield
            start = len(self._text) - 1
        return None

    # the readers

    def _content_from(self, start: int) -> Reader:
        """Content from text[start] to the end."""
        self._content("".join(self._text[start:]))
        while (ch := (yield)) is not None:
            self._content(ch)
        return None

    def _until(self, tag: str, ch: str | None,
               is_content: bool) -> Generator[None, str | None, bool]:
        """Reads from ch until `tag` (False: the text ended first), as content if is_content:
        the whitespace before the tag and what may be its beginning are held back until they
        prove not to be."""
        held = ""
        while ch is not None:
            held += ch
            if held.endswith(tag):
                return True
            keep = _may_precede(held, tag)
            if is_content:
                self._content(held[:len(held) - keep])
            held = held[len(held) - keep:]
            ch = yield
        if is_content:
            self._content(held)
        return False

    def _literal(self, ch: str | None, literal: str) -> Generator[None, str | None, bool]:
        for i, expected in enumerate(literal):
            if i:
                ch = yield
            if ch != expected:
                return False
        return True

    def _skip_whitespace(self, ch: str | None) -> Reader:
        while ch is not None and ch in _WHITESPACE:
            ch = yield
        return ch

    def _call(self, ch: str | None, start: int) -> Reader:
        """A call object from its '{' (ch); returns the character after its '}'. Anything else
        before its name is read makes content of text[start:] and the rest."""
        if ch != "{":
            return (yield from self._content_from(start))
        index: int | None = None
        held: list[str] = []  # arguments read before the name
        has_arguments = False

        def on_argument(c: str) -> None:
            if index is None:
                held.append(c)
            else:
                self._pieces.append(ArgumentsPart(index, c))

        ch = yield from self._skip_whitespace((yield))
        while ch == '"':
            key: list[str] = []
            ch = yield from self._skip_whitespace((yield from self._value(ch, key.append)))
            if ch != ":":
                break
            ch = yield from self._skip_whitespace((yield))
            name = key == list('"name"')
            if name and index is None and ch == '"':
                raw: list[str] = []
                ch = yield from self._value(ch, raw.append)
                name_text = _string("".join(raw))
                if ch is None or name_text is None:
                    break
                index = self._start_call(name_text)
                self._pieces.append(ArgumentsPart(index, "".join(held)))
            elif "".join(key).strip('"') in _ARGUMENT_KEYS and not has_arguments:
                has_arguments = True
                ch = yield from self._value(ch, on_argument)
            elif name:
                break
            else:
                ch = yield from self._value(ch, lambda c: None)
            ch = yield from self._skip_whitespace(ch)
            if ch == ",":
                ch = yield from self._skip_whitespace((yield))
            elif ch == "}" and index is not None:
                if not has_arguments:
                    self._pieces.append(ArgumentsPart(index, "{}"))
                return (yield)
            else:
                break
        if index is None:
            return (yield from self._content_from(start))
        if ch is None:  # cut off inside the call: its arguments end where the text does
            return None
        return (yield from self._content_from(len(self._text) - 1))

    def _value(self, ch: str | None, on_char: Callable[[str], None]) -> Reader:
        """One JSON value from its first character (ch), each of its characters given to
        on_char; returns the character after it. Brackets and strings are followed, not
        checked: the grammar or the model's format makes them valid."""
        if ch is None:
            return None
        if ch not in '{["':
            while ch is not None and ch not in ",}]" + _WHITESPACE:
                on_char(ch)
                ch = yield
            return ch
        depth, in_string, is_escaped = 0, False, False
        while True:
            on_char(ch)
            if in_string:
                if is_escaped:
                    is_escaped = False
                elif ch == "\\":
                    is_escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
            if depth <= 0 and not in_string:
                return (yield)
            ch = yield
            if ch is None:
                return None


def _may_precede(held: str, tag: str) -> int:
    """How many of held's last characters may still turn out to precede `tag`: the beginning of
    the tag, and the whitespace before that."""
    num_tag = next((n for n in range(min(len(held), len(tag) - 1), 0, -1)
                    if held.endswith(tag[:n])), 0)
    before = held[:len(held) - num_tag]
    return num_tag + len(before) - len(before.rstrip(_WHITESPACE))


def _string(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
