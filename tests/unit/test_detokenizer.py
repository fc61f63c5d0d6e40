import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedserve.services.text.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

from tests.unit.tiny_tokenizers import byte_level_bpe, sentencepiece_bpe

TEXTS = [
    "hello world",
    "你好，世界！ the capital of france is paris.",
    "emoji 😀🎉 and a family 👨‍👩‍👧 stop.",
    "mixed: über café naïve — ∑ 1 2 3",
]


@pytest.fixture(scope="module")
def byte_level():
    return byte_level_bpe()


@pytest.fixture(scope="module")
def sentencepiece():
    return sentencepiece_bpe()


def stream(tokenizer, prompt_ids, output_ids, chunk=1, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detok.push(output_ids[i:i + chunk]) for i in range(0, len(output_ids), chunk)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_byte_level_stream_equals_full_decode(byte_level, text, chunk):
    prompt_ids = byte_level.encode("the quick brown fox", add_special_tokens=False)
    output_ids = byte_level.encode(text, add_special_tokens=False)
    deltas = stream(byte_level, prompt_ids, output_ids, chunk)
    assert "".join(deltas) == byte_level.decode(output_ids)
    # a token ending inside a character is held back, never shown as U+FFFD
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_keeps_leading_space_in_context(sentencepiece, text):
    prompt_ids = sentencepiece.encode("hello there", add_special_tokens=False)
    full_ids = sentencepiece.encode("hello there " + text, add_special_tokens=False)
    assert full_ids[:len(prompt_ids)] == prompt_ids
    output_ids = full_ids[len(prompt_ids):]
    deltas = stream(sentencepiece, prompt_ids, output_ids)
    full = sentencepiece.decode(prompt_ids + output_ids)
    prompt_text = sentencepiece.decode(prompt_ids)
    assert "".join(deltas) == full[len(prompt_text):]
    assert "".join(deltas).startswith(" ")
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_without_prompt_equals_full_decode(sentencepiece, text):
    output_ids = sentencepiece.encode(text, add_special_tokens=False)
    assert "".join(stream(sentencepiece, [], output_ids)) == sentencepiece.decode(output_ids)


def test_text_is_emitted_as_soon_as_a_character_completes(byte_level):
    output_ids = byte_level.encode("ab 你", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_level, [])
    deltas = [detok.push([t]) for t in output_ids]
    assert deltas[-1].endswith("你")  # the last byte piece releases the whole character
    assert "".join(deltas) == "ab 你"
    assert detok.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(byte_level, skip):
    eos = byte_level.eos_token_ids[0]
    output_ids = [*byte_level.encode("hello", add_special_tokens=False), eos,
                  *byte_level.encode(" world", add_special_tokens=False), eos]
    deltas = stream(byte_level, [], output_ids, skip_special_tokens=skip)
    assert "".join(deltas) == byte_level.decode(output_ids, skip_special_tokens=skip)
    assert ("</s>" in "".join(deltas)) is not skip


def test_invalid_bytes_are_released_not_held_forever(byte_level):
    lone_byte = byte_level.hf_tokenizer.convert_tokens_to_ids("Ã")  # 0xC3 alone: never completes
    ids = [lone_byte] * 8 + byte_level.encode(" ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_level, [])
    deltas = [detok.push([t]) for t in ids]
    assert "".join(deltas[:8])  # released before the stream ends
    assert "".join(deltas) + detok.flush() == byte_level.decode(ids)


def test_prompt_ending_inside_a_character(byte_level):
    ids = byte_level.encode("x 你好", add_special_tokens=False)
    prompt_ids, output_ids = ids[:-1], ids[-1:]  # the prompt's last character is incomplete
    assert "".join(stream(byte_level, prompt_ids, output_ids)) == byte_level.decode(output_ids)


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("ab xyz.你好😀é\n"), max_size=30),
       chunk=st.integers(1, 4))
def test_any_text_any_chunking_byte_level(text, chunk):
    tokenizer = byte_level_bpe()
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(tokenizer, tokenizer.encode("hello", add_special_tokens=False), output_ids, chunk)
    assert "".join(deltas) == tokenizer.decode(output_ids)


def test_cost_per_token_does_not_grow_with_length(byte_level):
    calls = []
    decode = byte_level.decode

    class CountingTokenizer(type(byte_level)):
        def decode(self, token_ids, skip_special_tokens=True):
            calls.append(len(token_ids))
            return decode(token_ids, skip_special_tokens)

    counting = CountingTokenizer(byte_level.hf_tokenizer)
    output_ids = byte_level.encode("the lazy dog 你好 " * 40, add_special_tokens=False)
    stream(counting, [], output_ids)
    assert max(calls) <= 12


def test_smollm2_chinese_and_emoji(smollm2_dir):
    from pagedserve.services.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(smollm2_dir)
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}])
    for text in TEXTS:
        output_ids = tokenizer.encode(text, add_special_tokens=False)
        deltas = stream(tokenizer, prompt_ids, output_ids)
        assert "".join(deltas) == tokenizer.decode(output_ids)
        assert all(REPLACEMENT_CHAR not in d for d in deltas)

