"""Shalik's script-aware byte-level BPE tokenizer: its definition, training, saving and loading.

The tokenizer (Hugging Face ``tokenizers``):

* normalizer NFC, inside ``tokenizer.json`` so the Python and Rust paths share it;
* pre-tokenizer :data:`PRETOKENIZER`, one of the splits llama.cpp implements by name
  (``train.tokenizer.pretokenizers``, the one table the GGUF exporter reads too), so llama.cpp, Ollama and LM
  Studio tokenize NFC text into the same ids as training. A word is a run of letters and marks (Bangla vowel
  signs, virama, nukta and candrabindu stay in their word; GPT-2's ``\\p{L}+`` cuts "বাংলা" into
  ব · াং · ল · া), with at most one leading non-letter; numbers go in pieces of up to three digits;
  punctuation runs take the newlines after them. Then ``ByteLevel(add_prefix_space=False, use_regex=False)``;
* model BPE over the 256 byte symbols, specials ``<|endoftext|>`` (id 0) and ``<|pad|>`` (id 1), and the chat
  turn tokens ``<|im_start|>`` / ``<|im_end|>`` (``contract.chat_format``) as the last two ids (since tokenizer
  format 4): the BPE is trained with ``vocab_size - 2`` entries, so every other id and merge is what a format-3
  tokenizer of the same data has (its last two merges are not learned), and :func:`add_chat_tokens` appends the
  two to an older tokenizer the same way (fine-tuning a run whose tokenizer lacks them). Training cuts
  pieces longer than ``pretokenizers.TRAIN_MAX_PIECE`` code points (the trainer's cost grows with the square of
  a piece); the saved tokenizer does not, as llama.cpp does not, and encodes in time linear in the input;
* decoder ByteLevel: ``decode(encode(x)) == NFC(x)`` exactly (no prefix space, no clean-up of spaces).

Tokenizers of format 2 (``pretokenizers.LEGACY``: ZWJ/ZWNJ inside words, pre-tokens of at most 128 code points)
still load, train and serve; only their GGUF is an approximation (``export.gguf --approximate-pretokenizer``).

Sampling the training text is ``train.tokenizer.sample``; fertility against other tokenizers is
``train.tokenizer.fertility``; the command lines (``python -m train.tokenizer train|fertility``) are
``train.tokenizer.cli`` (run as ``python -m train.tokenizer``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from contract.atomic import atomic_dir, sha256_file
from contract.byte_level import EOT, PAD, SPECIAL_TOKENS, bytes_to_unicode  # noqa: F401 - re-exported
from contract.chat_format import CHAT_TEMPLATE, CHAT_TOKENS, missing_chat_tokens
from train.tokenizer.pretokenizers import PRETOKENIZERS, Pretokenizer, training_pre_tokenizer

PRETOKENIZER: Pretokenizer = PRETOKENIZERS["deepseek-v3"]   # Shalik's split since tokenizer format 3


class TokenizerError(ValueError):
    """A tokenizer folder or file that cannot be used."""


def new_tokenizer(split: Pretokenizer = PRETOKENIZER) -> Tokenizer:
    """An untrained Shalik tokenizer: NFC, ``split`` (default :data:`PRETOKENIZER`), byte-level BPE, ByteLevel
    decoder."""
    tok = Tokenizer(models.BPE(ignore_merges=split.ignore_merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = split.pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = 32000, min_frequency: int = 2,
                    split: Pretokenizer = PRETOKENIZER, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` (strings); returns a ``tokenizers.Tokenizer`` that splits with ``split``.

    ``<|endoftext|>`` gets id 0 and ``<|pad|>`` id 1, ``<|im_start|>`` and ``<|im_end|>`` the last two ids
    (``vocab_size - 2`` and ``vocab_size - 1``; :func:`add_chat_tokens`); all 256 byte symbols are in the
    vocabulary, so any text encodes. The trainer sees ``split``'s pieces cut to ``TRAIN_MAX_PIECE`` code points (its cost is quadratic in
    a piece's length); the returned tokenizer splits exactly as ``split`` (and llama.cpp) does. Raises
    TokenizerError for a vocab_size below 256 + 4.
    """
    reserved = len(SPECIAL_TOKENS) + len(CHAT_TOKENS)
    if vocab_size < 256 + reserved:
        raise TokenizerError(f"vocab_size {vocab_size}: expected at least {256 + reserved}")
    tok = new_tokenizer(split)
    tok.pre_tokenizer = training_pre_tokenizer(split)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(CHAT_TOKENS),
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=length)
    tok.pre_tokenizer = split.pre_tokenizer()
    add_chat_tokens(tok)
    return tok


def add_chat_tokens(tok: Tokenizer) -> list[int]:
    """Give ``tok`` the chat turn tokens (``contract.chat_format.CHAT_TOKENS``) it lacks, as special added tokens
    after its last id (in place: no merge or other id changes; each is always one token, never split or
    normalised). Returns the ids of ``<|im_start|>`` and ``<|im_end|>``."""
    missing = missing_chat_tokens(tok.get_vocab(with_added_tokens=True))
    if missing:
        tok.add_special_tokens(missing)
    return [tok.token_to_id(t) for t in CHAT_TOKENS]


def has_chat_tokens(tok: Tokenizer) -> bool:
    """Whether ``tok`` can encode the chat format (both turn tokens in its vocabulary)."""
    return not missing_chat_tokens(tok.get_vocab(with_added_tokens=True))


def tokenizer_config(model_max_length: int | None = 2048, chat: bool = False) -> dict:
    """``tokenizer_config.json`` for ``transformers.AutoTokenizer`` (PreTrainedTokenizerFast over tokenizer.json).

    ``chat``: the tokenizer has the chat turn tokens, so ``chat_template`` is ``contract.chat_format.CHAT_TEMPLATE``
    (``apply_chat_template``; gguf-py's ``SpecialVocab`` copies it into a GGUF); without them no template is
    written (a base model's tokenizer cannot encode the format).

    ``clean_up_tokenization_spaces`` is false and no prefix space is added: decode(encode(x)) must return x.
    ``model_max_length`` is the model's context (``max_position_embeddings``); None leaves it out (a cached
    tokenizer serves any context length: checkpoints and bundles write their own).
    """
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": None,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
    }
    if model_max_length is None:
        del cfg["model_max_length"]
    if chat:
        cfg["chat_template"] = CHAT_TEMPLATE
    return cfg


def write_tokenizer_files(tok: Tokenizer, out_dir: Path, model_max_length: int | None = 2048) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into an existing (temporary) folder."""
    out_dir = Path(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = tokenizer_config(model_max_length, chat=has_chat_tokens(tok))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int | None = 2048, overwrite: bool = False) -> Path:
    """Save atomically into ``out_dir`` (built in a temporary folder, then renamed). Returns the folder."""
    with atomic_dir(Path(out_dir), overwrite=overwrite) as tmp:
        write_tokenizer_files(tok, tmp, model_max_length)
    return Path(out_dir)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` from a folder (or the file itself). Raises TokenizerError naming the path."""
    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise TokenizerError(f"tokenizer {str(path)!r}: no tokenizer.json there")
    try:
        tok = Tokenizer.from_file(str(f))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on parse errors
        raise TokenizerError(f"tokenizer {str(f)!r}: cannot be read ({e})") from None
    if tok.token_to_id(EOT) != 0:
        raise TokenizerError(f"tokenizer {str(f)!r}: expected {EOT} at id 0, found it at {tok.token_to_id(EOT)}")
    return tok


def for_nfc_text(tok: Tokenizer) -> bool:
    """Switch ``tok``'s normalizer off when it is exactly NFC, for input that is NFC already (in place).

    NFC is idempotent, so the ids are the same, and the text is not normalised twice (on already-NFC text the
    saving is small: within noise in an interleaved in-process test). Returns True when it was switched off; another normalizer (a ``tokenizer.path`` with NFKC, lower-casing
    …) is left in place (False). The caller must only feed text that is NFC (``contract.text.nfc``).
    """
    if isinstance(tok.normalizer, normalizers.NFC):
        tok.normalizer = None
        return True
    return False


def tokenizer_sha256(path: str | Path) -> str:
    """sha256 of the folder's ``tokenizer.json`` bytes."""
    p = Path(path)
    return sha256_file(p / "tokenizer.json" if p.is_dir() else p)


def token_char_counts(tok: Tokenizer) -> list[int]:
    """For every id, the number of UTF-8 lead bytes in its byte string: summed over a token sequence this is
    its NFC code point count, even where a token boundary cuts a character (used for bits per character).
    Special tokens count 0."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    vocab = tok.get_vocab(with_added_tokens=True)
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    counts = [0] * tok.get_vocab_size(with_added_tokens=True)
    for token, idx in vocab.items():
        if token in specials:
            continue
        bs = bytes(byte_of[c] for c in token if c in byte_of)
        counts[idx] = sum(1 for b in bs if (b & 0xC0) != 0x80)
    return counts

