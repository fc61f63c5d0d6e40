"""The incremental tool-call parser read a token at a time: a call starts with its name, its
arguments arrive as they are generated, content before a call streams as content (a tag split
over tokens is held back, never sent as content), and the pieces add up to what the whole text
read at once gives."""

import pytest
from pagedserve.services.gateway.openai.tool_parser import ArgumentsPart, CallStart, ToolCallParser

from tests.unit.tiny_tokenizers import byte_level_bpe

TOKENIZER = byte_level_bpe()
HERMES = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", '
          '"note": "a \\"}\\" brace"}}\n</tool_call>\n<tool_call>{"arguments": {"tz": "CET"}, '
          '"name": "time"}</tool_call>')


def _tokens(text: str) -> list[str]:
    """The text as the detokenizer hands it on, one token at a time."""
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    pieces = [TOKENIZER.hf_tokenizer.decode(ids[:i + 1]) for i in range(len(ids))]
    return [b[len(a):] for a, b in zip(["", *pieces], pieces, strict=False)]


def _read(parser: ToolCallParser, chunks: list[str]) -> list[list]:
    return [parser.feed(c) for c in chunks] + [parser.finish()]


def _summary(pieces: list) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", []
    for piece in pieces:
        if isinstance(piece, str):
            content += piece
        elif isinstance(piece, CallStart):
            assert piece.index == len(calls) and piece.id.startswith("call_")
            calls.append((piece.name, ""))
        else:
            name, arguments = calls[piece.index]
            calls[piece.index] = (name, arguments + piece.text)
    return content, calls


@pytest.mark.parametrize(("mode", "parser", "text", "expected"), [
    ("auto", "hermes", HERMES, ("Let me check.", [
        ("weather", '{"city": "Oslo", "note": "a \\"}\\" brace"}'), ("time", '{"tz": "CET"}')])),
    ("auto", "hermes", "no call < here <tool_", ("no call < here <tool_", [])),
    ("auto", "hermes", "<tool_call>{not json</tool_call>", ("<tool_call>{not json</tool_call>",
                                                            [])),
    ("auto", "llama3_json", '<|python_tag|>{"name": "weather", "parameters": {"city": "Rome"}}; '
                            '{"name": "time"}', ("", [("weather", '{"city": "Rome"}'),
                                                      ("time", "{}")])),
    ("auto", "llama3_json", "  The weather is fine.", ("  The weather is fine.", [])),
    ("required", "", '[{"name": "weather", "parameters": {"city": "Paris"}}, '
                     '{"name": "time", "parameters": {"tz": "UTC"}}]',
     ("", [("weather", '{"city": "Paris"}'), ("time", '{"tz": "UTC"}')])),
    ("required", "", '[{"name": "weather", "parameters": {"city": "Par',
     ("", [("weather", '{"city": "Par')])),
    ("named", "", '{"city": "Oslo"}', ("", [("weather", '{"city": "Oslo"}')])),
    ("auto", "", '{"name": "weather", "parameters": {}}',
     ('{"name": "weather", "parameters": {}}', [])),
], ids=["hermes", "hermes_no_call", "hermes_not_json", "llama3_json", "llama3_content",
        "required", "required_cut_off", "named", "auto_without_parser"])
def test_token_by_token_gives_what_the_whole_text_gives(mode, parser, text, expected):
    whole = _read(ToolCallParser(mode, parser, "weather"), [text])
    by_token = _read(ToolCallParser(mode, parser, "weather"), _tokens(text))
    by_char = _read(ToolCallParser(mode, parser, "weather"), list(text))
    assert _summary([p for ps in whole for p in ps]) == expected
    assert _summary([p for ps in by_token for p in ps]) == expected
    assert _summary([p for ps in by_char for p in ps]) == expected


def test_a_call_streams_its_name_first_and_then_its_arguments_as_they_come():
    chunks = ["Sure", ". <to", "ol_c", "all>\n", '{"name": "weat', 'her", "argu', 'ments": {"ci',
              'ty": "Os', 'lo"}}', "</tool_call>"]
    got = _read(ToolCallParser("auto", "hermes"), chunks)
    assert got[0] == ["Sure"]
    assert got[1] == ["."]  # " <to" may begin the tag: held back, and dropped once it does
    assert got[2:5] == [[], [], []]
    (start, empty), = [got[5]]
    assert (start.index, start.name, empty) == (0, "weather", ArgumentsPart(0, ""))
    assert got[6:9] == [[ArgumentsPart(0, '{"ci')], [ArgumentsPart(0, 'ty": "Os')],
                        [ArgumentsPart(0, 'lo"}')]]
    assert got[9:] == [[], []]


def test_arguments_read_before_the_name_follow_the_call_start():
    got = _read(ToolCallParser("auto", "hermes"),
                ['<tool_call>{"arguments": {"a": ', '1}, "name": "f"}'])
    assert got[0] == [] and got[2:] == [[]]
    start, arguments = got[1]
    assert start.name == "f" and arguments == ArgumentsPart(0, '{"a": 1}')
