"""Tiny tokenizers built in the test with the `tokenizers` library (no download).

- byte-level BPE (GPT-2 / SmolLM2 style): every character is bytes, 'Ġ' marks a space;
- SentencePiece-style BPE (Llama 2 style): '▁' marks a space, dropped at the start of a decode,
  and characters outside the vocabulary fall back to <0xNN> byte tokens.
Built once per process (cached); treat them as read-only.
Both know ASCII words only, so Chinese and emoji split into byte pieces across several tokens.
"""

from __future__ import annotations

import functools
import json

import transformers
from pagedserve.services.text.tokenizer import Tokenizer
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there. the capital of france is paris.",
    "stop here and there; a stop is a stop.",
    "1 2 3 4 5 6 7 8 9 0 + - * / = ! ? ( ) [ ] \" ' : ;",
] * 20
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _wrap(raw: RawTokenizer, chat_template: str | None) -> Tokenizer:
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    hf.chat_template = chat_template
    return Tokenizer(hf)


@functools.cache
def byte_level_bpe(chat_template: str | None = CHATML) -> Tokenizer:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(CORPUS, trainer)
    return _wrap(raw, chat_template)


@functools.cache
def sentencepiece_bpe(chat_template: str | None = None) -> Tokenizer:
    trained = RawTokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS, limit_alphabet=60)
    trained.train_from_iterator(CORPUS, trainer)
    vocab = trained.get_vocab()
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in _merges(trained)]
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    raw.add_special_tokens(SPECIAL_TOKENS)
    return _wrap(raw, chat_template)


def _merges(raw: RawTokenizer) -> list:
    return json.loads(raw.to_str())["model"]["merges"]
