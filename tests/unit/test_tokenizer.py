import pytest
from pagedserve.services.common.errors import ConfigError, InvalidRequest
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.text.sampling_text import bad_words_token_ids, truncated_prompt
from pagedserve.services.text.tokenizer import Tokenizer

from tests.unit.tiny_tokenizers import byte_level_bpe, sentencepiece_bpe


def test_encode_decode_round_trip():
    tokenizer = byte_level_bpe()
    ids = tokenizer.encode("hello 你好 😀", add_special_tokens=False)
    assert tokenizer.decode(ids) == "hello 你好 😀"


def test_special_tokens_and_eos():
    tokenizer = byte_level_bpe()
    eos = tokenizer.eos_token_ids[0]
    assert tokenizer.id_to_token(eos) == "</s>"
    assert eos in tokenizer.special_token_ids
    im_end = tokenizer.hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tokenizer.special_token_ids
    ids = tokenizer.encode("hi", add_special_tokens=False) + [eos]
    assert tokenizer.decode(ids, skip_special_tokens=False) == "hi</s>"
    assert tokenizer.decode(ids) == "hi"


def test_chat_template_tiny():
    tokenizer = byte_level_bpe()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    start = tokenizer.hf_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == start  # the marker is one special token, not spelled out in pieces


def test_no_chat_template_is_invalid_request():
    tokenizer = sentencepiece_bpe(chat_template=None)
    with pytest.raises(InvalidRequest, match="chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])


@pytest.mark.parametrize("messages, match", [
    ([], "messages must not be empty"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role .* got 'robot'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}],
     r"messages\[1\]\.content must be a non-empty string, got ''"),
    ([{"content": "no role"}], r"messages\[0\]\.role"),
])
def test_bad_messages(messages, match):
    with pytest.raises(InvalidRequest, match=match):
        byte_level_bpe().apply_chat_template(messages)


def test_template_exception_is_invalid_request():
    template = "{{ raise_exception('roles must alternate') }}"
    tokenizer = byte_level_bpe(chat_template=template)
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_folder(tmp_path):
    with pytest.raises(InvalidRequest, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")


def test_smollm2_chat_template(smollm2_dir):
    tokenizer = Tokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.has_chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.render_chat(messages)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
                    "<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages)
    assert ids[0] == tokenizer.bos_token_id == 1  # <|im_start|>, once
    assert ids.count(1) == 3
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.vocab_size == 49152
    no_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[:len(no_prompt)] == no_prompt and len(ids) > len(no_prompt)


@pytest.mark.parametrize("make", [byte_level_bpe, sentencepiece_bpe])
def test_decode_through_the_backend_equals_the_python_decode(make):
    tokenizer = make()
    hf = tokenizer.hf_tokenizer
    ids = tokenizer.encode("hello 你好 😀 <|im_end|> world", add_special_tokens=False)
    ids += sorted(tokenizer.special_token_ids)
    for skip in (True, False):
        for window in (ids, ids[3:], ids[:1], [ids[2], ids[2]]):
            assert tokenizer.decode(window, skip_special_tokens=skip) == hf.decode(
                window, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_a_chat_template_replaces_the_models_from_a_file_or_inline(tmp_path):
    tokenizer = byte_level_bpe()
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template.replace("<", "("))
    tokenizer.use_chat_template(str(path))
    assert tokenizer.render_chat([{"role": "developer", "content": "x"}]) == "(developer>x"
    tokenizer.use_chat_template(template)
    assert tokenizer.render_chat([{"role": "tool", "content": "y"}]) == "<tool>y"
    for bad in (str(tmp_path / "missing.jinja"), "{% for %}"):
        with pytest.raises(ConfigError, match="chat_template"):
            tokenizer.use_chat_template(bad)


def test_bad_words_become_ids_as_written_and_mid_text():
    tokenizer = byte_level_bpe()
    ids = bad_words_token_ids(("fox", " quick"), tokenizer)
    encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    assert set(ids) == {encode("fox"), encode(" fox"), encode(" quick")}  # as written, spaced
    sampling = SamplingParams(truncate_prompt_tokens=2)
    assert truncated_prompt([1, 2, 3, 4], sampling) == [3, 4]
    assert truncated_prompt([1], sampling) == [1]
