"""The pre-tokenizers llama.cpp implements by name, written so that Hugging Face ``tokenizers`` splits text exactly
as llama.cpp does: the one table that the Python tokenizer (:func:`train.tokenizer.new_tokenizer`), the GGUF
exporter (``tokenizer.ggml.pre``, :func:`identify`) and the tests read.

llama.cpp knows a fixed list of pre-tokenizers by the name in ``tokenizer.ggml.pre`` (src/llama-vocab.cpp:
``llm_tokenizer_bpe``'s ``regex_exprs`` per ``LLAMA_VOCAB_PRE_TYPE_*`` and the name → type table in
``llama_vocab::impl::load``) and runs them with its own regex code (src/unicode.cpp, ``unicode_regex_split``).
Each entry here is one of those names with its regexes as llama.cpp *runs* them, rewritten for Oniguruma (the
engine of ``tokenizers``' ``Split``) where the two engines read the same text differently:

* The regexes of one name apply in order, each splitting every piece the previous one left; text between two
  matches is a piece of its own. That is a ``Sequence`` of ``Split(regex, behavior="isolated")``.
* A regex with ``\\p{..}`` runs on a copy of the text where each non-ASCII code point is replaced by one byte
  for its class (whitespace, letter, number, punctuation, mark, symbol, other) from llama.cpp's own Unicode
  tables; ASCII stays as is and ``\\p{..}`` covers, for ASCII: L ``A-Za-z``, N ``0-9``, P
  ``!"#%&'()*,-./:;?@[\\]_{}``, S ``$+<=>^`|~``, as Unicode does. (``~`` joined S in llama.cpp PR 26972, August
  2026; an older llama.cpp splits ``~`` next to a non-ASCII letter differently.) ``\\p{Lu}``, ``\\p{Ll}``,
  ``\\p{Lo}`` … all mean "any letter" there (one class byte for all letters), so they are written ``\\p{L}``.
* ``\\s`` is C's ``isspace`` on ASCII (tab, LF, VT, FF, CR, space) plus every non-ASCII code point llama.cpp's
  table calls whitespace: Oniguruma's ``\\s`` (Unicode White_Space) is the same set.
* Case-insensitive groups are spelled out (``'[sS]``), as llama.cpp does (``(?i:'s)`` would also match
  U+017F ſ in Oniguruma).
* llama.cpp has no length limit on a pre-token and applies no Unicode normalisation (Shalik's NFC is in
  ``tokenizer.json``; on NFC text the two agree).

``clean_spaces`` is what llama.cpp sets for the name: True means its ``llama_detokenize`` removes a space before
``? ! . ,`` and around apostrophes, which Shalik's decoder never does (text out would differ). ``ignore_merges``
is llama.cpp's flag of the same name (a piece that is itself a token is not merged), which ``tokenizers``' BPE
model has too. ``tests/test_llamacpp_tokenizer.py`` (slow) compares llama.cpp's ids with each entry's;
``benchmarks/pretokenizer_codepoints.py`` compares Shalik's split with llama.cpp's pieces for every code point.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

__all__ = ["Pretokenizer", "PRETOKENIZERS", "LEGACY", "BASELINE", "SCRIPT_EDGES", "pre_tokenizer_json", "identify",
           "training_pre_tokenizer", "TRAIN_MAX_PIECE"]


@dataclass(frozen=True)
class Pretokenizer:
    """A split of text into pre-tokens (the pieces BPE merges within).

    ``name``: llama.cpp's ``tokenizer.ggml.pre`` for it, "" when llama.cpp has no equal. ``splits``: Oniguruma
    regexes applied in order, each isolating its matches inside every piece of the one before. ``aliases``: other
    llama.cpp names that run the same regexes with the same flags.
    """

    name: str
    splits: tuple[str, ...]
    ignore_merges: bool = False
    clean_spaces: bool = False
    aliases: tuple[str, ...] = ()
    digits: str = ""   # how it groups digits, for tables: "1", "1-3 left", "1-3 right", "any"
    note: str = ""

    def pre_tokenizer(self):
        """The ``tokenizers`` pre-tokenizer: the Splits, then byte-level symbols (no prefix space, no regex)."""
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in self.splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


_C = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"   # English contractions, as llama.cpp spells them
_ASCII_PUNCT = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~]"
_DEEPSEEK_CJK = "[\\x{4E00}-\\x{9FA5}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}]+"
_DEEPSEEK_MAIN = (f"{_ASCII_PUNCT}[A-Za-z]+|[^\\r\\n\\p{{L}}\\p{{P}}\\p{{S}}]?[\\p{{L}}\\p{{M}}]+| ?[\\p{{P}}\\p{{S}}]+[\\r\\n]*"
                  "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_BLOOM = " ?[^(\\s|.,!?\\x{2026}\\x{3002}\\x{FF0C}\\x{3001}\\x{964}\\x{6D4}\\x{60C})]+"

PRETOKENIZERS: dict[str, Pretokenizer] = {p.name: p for p in [
    Pretokenizer(
        "deepseek-v3",
        ("\\p{N}{1,3}", _DEEPSEEK_CJK, _DEEPSEEK_MAIN),
        aliases=("hunyuan-dense", "joyai-llm", "hy_v4"), digits="1-3 left",
        note="numbers first (up to three digits a piece), then CJK runs, then words of letters and marks with "
             "at most one leading non-letter, punctuation runs with the newlines after them, whitespace"),
    Pretokenizer(
        "qwen35",
        (f"{_C}|[^\\r\\n\\p{{L}}\\p{{N}}]?[\\p{{L}}\\p{{M}}]+|\\p{{N}}| ?[^\\s\\p{{L}}\\p{{M}}\\p{{N}}]+[\\r\\n]*"
         "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
        digits="1", note="Qwen2's split with marks inside words; one digit a piece"),
    Pretokenizer(
        "spark2_5",
        ("\\p{N}{1,3}", _DEEPSEEK_CJK,
         f"{_ASCII_PUNCT}[A-Za-z]+|[^\\r\\n\\p{{L}}\\p{{P}}\\p{{S}}]?[\\p{{L}}\\p{{M}}]+| ?[\\p{{P}}\\p{{S}}]+|[\\r\\n]"
         "|\\s+(?!\\S)|\\s+", "\\p{N}"),
        digits="1", note="deepseek-v3's split, then every digit alone"),
    Pretokenizer(
        "afmoe",
        ("\\p{N}{1,3}(?=(?:\\p{N}{3})*(?!\\p{N}))",   # llama.cpp's custom code: groups of three from the right
         "[\\x{4E00}-\\x{9FFF}\\x{3400}-\\x{4DBF}\\x{8C48}-\\x{FAFF}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}"
         "\\x{FF65}-\\x{FF9F}\\x{2F00}-\\x{2FDF}\\x{E40}-\\x{E7F}\\x{E80}-\\x{EFF}\\x{1780}-\\x{17FF}"
         "\\x{1000}-\\x{109F}\\x{AA60}-\\x{AA7F}\\x{A9E0}-\\x{A9FF}\\x{AC00}-\\x{D7AF}\\x{1100}-\\x{11FF}]+",
         _DEEPSEEK_MAIN),
        digits="1-3 right", note="deepseek-v3's split with numbers grouped in threes from the right and Thai, Lao, "
                                 "Khmer, Myanmar, Hangul runs isolated too"),
    Pretokenizer(
        "granite-embed-multi-97m",
        (f"[^\\r\\n\\p{{L}}\\p{{N}}]?((?=[\\p{{L}}\\p{{M}}])([^a-z]))*((?=[\\p{{L}}\\p{{M}}])([^A-Z]))+{_C}?"
         f"|[^\\r\\n\\p{{L}}\\p{{N}}]?((?=[\\p{{L}}\\p{{M}}])([^a-z]))+((?=[\\p{{L}}\\p{{M}}])([^A-Z]))*{_C}?"
         "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
        ignore_merges=True, digits="1-3 left",
        note="GPT-4o's split with marks inside words (ASCII camelCase cut before a capital)"),
    Pretokenizer(
        "youtu",
        ("[\\x{AC00}-\\x{D7A3}\\x{3131}-\\x{318E}]+|[\\x{FF01}\\x{2026}\\x{201C}\\x{201D}\\x{2018}\\x{2019}"
         "\\x{2014}\\x{FF1A}\\x{FF1B}\\x{FF0C}\\x{3001}-\\x{303F}\\x{FE30}-\\x{FE4F}]+|[\\x{3105}-\\x{312F}]+"
         "|[\\x{4E00}-\\x{9FA5}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}]+",
         f"[^\\r\\n\\p{{L}}\\p{{N}}]?[\\p{{L}}\\p{{M}}]*[\\p{{L}}\\p{{M}}]+{_C}?"
         f"|[^\\r\\n\\p{{L}}\\p{{N}}]?[\\p{{L}}\\p{{M}}]+[\\p{{L}}\\p{{M}}]*{_C}?"
         "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
        ignore_merges=True, digits="1", note="curly quotes, ellipsis, em dash and CJK runs first; one digit a piece"),
    Pretokenizer(
        "exaone-moe",
        (f"{_C}|[^\\r\\n\\p{{L}}\\p{{N}}]?(?:\\p{{L}}\\p{{M}}*(?: \\p{{L}}\\p{{M}}*)*)+|\\p{{N}}"
         "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",),
        clean_spaces=True, digits="1", note="runs of words joined by single spaces are one piece"),
    Pretokenizer(
        "poro-chat", (_BLOOM,), digits="any",
        note="a piece is an optional space and a run of anything but whitespace and . , ! ? … 。 ， 、 । ۔ ، "
             "(bloom and gpt3-finnish split the same way but clean spaces when detokenizing)"),
    Pretokenizer(
        "viking", (_BLOOM, "\\p{N}"), digits="1", note="poro-chat's split, then every digit alone"),
]}

# Shalik's split until tokenizer format 3 (train/data.py FORMAT_VERSION): letters, marks and ZWJ/ZWNJ in a word,
# numbers up to three digits, pre-tokens at most 128 characters. llama.cpp has no equal; its nearest is qwen35.
_W = "\\p{L}\\p{M}\u200c\u200d"
LEGACY = Pretokenizer("", (
    f"[^\\r\\n{_W}\\p{{N}}]?[{_W}]{{1,127}}| ?\\p{{N}}{{1,3}}| ?[^\\s{_W}\\p{{N}}]{{1,63}}[\\r\\n]{{0,64}}"
    "|\\s{0,64}[\\r\\n]{1,64}|\\s{1,128}(?!\\S)|\\s{1,128}",), digits="1-3 left", note="Shalik format 2")
# The plain baseline: letters+marks words, single digits; benchmarks/fertility.py trains it.
BASELINE = Pretokenizer("", (" ?[\\p{L}\\p{M}]+| ?\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+|\\s+(?!\\S)|\\s+",), digits="1",
                        note="plain baseline")

# The tokenizer *trainer* cuts every piece into runs of at most this many code points after the split: its cost
# grows with the square of the longest piece (a 100,000-letter "word" took 235 s, a 30,000-letter one 13 s), and
# corpora hold such runs (base64, "=====", a 2 MB line without spaces). Only training sees the cut; the saved
# tokenizer splits as llama.cpp does, with no limit, and BPE encoding of a long piece stays linear in its length.
TRAIN_MAX_PIECE = 128


def training_pre_tokenizer(p: Pretokenizer):
    """``p``'s pre-tokenizer with every piece cut into runs of at most TRAIN_MAX_PIECE code points before the
    byte-level step (used only while training: see TRAIN_MAX_PIECE)."""
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in p.splits]
        + [pre_tokenizers.Split(Regex(f"[\\s\\S]{{1,{TRAIN_MAX_PIECE}}}"), behavior="isolated"),
           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def pre_tokenizer_json(p: Pretokenizer) -> dict:
    """``p``'s pre-tokenizer as it appears in a saved ``tokenizer.json`` (the ``"pre_tokenizer"`` object)."""
    return json.loads(p.pre_tokenizer().__getstate__())


def identify(tokenizer_json: dict) -> Pretokenizer | None:
    """The table entry (or LEGACY) whose split a ``tokenizer.json`` (parsed) uses, else None.

    Compares the ``pre_tokenizer`` object and the BPE model's ``ignore_merges`` with what :class:`Pretokenizer`
    writes; nothing else (the normalizer and the model are the exporter's to check).
    """
    pre = tokenizer_json.get("pre_tokenizer")
    ignore = bool((tokenizer_json.get("model") or {}).get("ignore_merges", False))
    for p in [*PRETOKENIZERS.values(), LEGACY]:
        if pre == pre_tokenizer_json(p) and ignore == p.ignore_merges:
            return p
    return None


# Text where splits differ: the benchmark measures fertility on these and the llama.cpp tests
# compare ids on them. Escapes keep the spellings visible: U+09DC/09DD/09DF are the precomposed nukta letters
# (NFC decomposes them), U+200D ZWJ, U+200C ZWNJ.
SCRIPT_EDGES: dict[str, str] = {
    "nukta precomposed": "সে প\u09dcাশোনা করে, আষা\u09dd মাসে বৃষ্টি হ\u09dfে যা\u09dfে।",
    "nukta decomposed": "সে প\u09a1\u09bcাশোনা করে, আষা\u09a2\u09bc মাসে বৃষ্টি হ\u09af\u09bcে যা\u09af\u09bcে।",
    "khanda-ta": "উৎসব, ভবিষ্যৎ আর হঠাৎ; সৎ মানুষ।",
    "ZWJ (র‍্য)": "র\u200d্যাব আর র\u200d্যাঙ্কিং, র্যাব না।",
    "ZWNJ": "ক্\u200cষ আর ক্ষ, কি\u200cন্তু আর কিন্তু।",
    "chandrabindu": "চাঁদ উঠেছে, হাঁস কাঁদে না, বাঁশি বাজে।",
    "Bangla digits": "১৯৭১ সালের ২৬শে মার্চ; ১২৩৪৫৬৭৮৯০ টাকা, ০৭ নম্বর।",
    "ASCII digits": "In 1971, pi was 3.14159 and 1234567890 + 007 = 1234567897.",
    "danda": "আমি যাব। তুমি যাবে? হ্যাঁ।। শেষ॥",
    "mixed Bangla-English": "আমি Python-এ code লিখি, version 3.11-এ; it's নতুন!",
    "emoji": "ভালো 🙂👍🏽 লাগল ❤️ 🇧🇩 ok👌",
    "spaces and newlines": "এক  দুই   তিন\n\n\nচার \t পাঁচ\r\n\r\n   \n   ছয়    ",
    "<|endoftext|> in text": "প্রথম<|endoftext|>দ্বিতীয় <|endoftext|> third<|pad|>end",
    "punctuation": "“উদ্ধৃতি” — ‘single’ … (বন্ধনী) [x] {y} ~ ^_^ ~~ a~b ~কথা $১০",
}
