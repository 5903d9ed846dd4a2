"""Small text helpers shared by the data and tokenizer steps: NFC, language by script, the val split.

* NFC (``unicodedata.normalize``) keeps ZWJ U+200D and ZWNJ U+200C, which change how Bangla conjuncts render
  (র‍্য). The Bengali nukta letters U+09DC, U+09DD, U+09DF are composition exclusions: NFC *decomposes* them to
  base + U+09BC, while e.g. U+0995 U+09C7 U+09BE composes to U+0995 U+09CB.
* Language by script (docs/design.md): ``bn`` when most of a text's letters lie in the Bengali block
  U+0980–U+09FF, else ``en``.
* Split (docs/design.md): a document is in ``val`` when the first 8 hex digits of ``sha256(NFC text)`` read as an
  integer, divided by 2**32, fall below ``val_fraction``.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

import numpy as np

# Letters (Unicode category L*) of the Bengali block; vowel signs, virama and nukta are marks (M*), not letters.
_BENGALI_LETTER = re.compile("[\u0985-\u098c\u098f\u0990\u0993-\u09a8\u09aa-\u09b0\u09b2\u09b6-\u09b9\u09bd"
                             "\u09ce\u09dc\u09dd\u09df-\u09e1\u09f0\u09f1\u09fc]")
_BENGALI_LETTERS = frozenset(chr(c) for c in range(0x0980, 0x0A00) if _BENGALI_LETTER.fullmatch(chr(c)))
_LETTER_KINDS: np.ndarray | None = None


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> int | None:
    """The index (code points) of the first lone surrogate in ``text`` (U+D800-U+DFFF: what a JSON ``\\ud800``
    escape without its pair decodes to; such a string has no UTF-8 form), or None where there is none."""
    m = _SURROGATE.search(text)
    return None if m is None else m.start()


def nfc(text: str) -> str:
    """NFC-normalise ``text`` (ZWJ/ZWNJ are kept; nukta letters decompose, see the module doc)."""
    return unicodedata.normalize("NFC", text)


def letter_kinds() -> np.ndarray:
    """uint8 per code point (all 0x110000): 0 not a letter, 1 a letter (str.isalpha), 2 a Bengali-block letter.
    Built once per process on first use (~0.1 s); a forked worker inherits it."""
    global _LETTER_KINDS
    if _LETTER_KINDS is None:
        kinds = np.fromiter(map(str.isalpha, map(chr, range(0x110000))), dtype=np.uint8, count=0x110000)
        kinds[[ord(ch) for ch in _BENGALI_LETTERS]] = 2
        _LETTER_KINDS = kinds
    return _LETTER_KINDS


def bengali_letter_share(text: str) -> float:
    """Share of ``text``'s letters (str.isalpha: Unicode L*) that are Bengali-block letters (0.0 without letters).

    One table look-up per code point in numpy (the text as UTF-32; a lone surrogate counts as a non-letter):
    exact counts, about ten times faster than counting the characters with collections.Counter.
    """
    cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    counts = np.bincount(letter_kinds()[cps], minlength=3)
    letters = int(counts[1]) + int(counts[2])
    return int(counts[2]) / letters if letters else 0.0


def language_of_share(share: float) -> str:
    """``"bn"`` when more than half of the letters are Bengali-block letters (``share > 0.5``), else ``"en"``."""
    return "bn" if share > 0.5 else "en"


def detect_language(text: str) -> str:
    """``"bn"`` when more than half of the letters are Bengali-block letters, else ``"en"``."""
    return language_of_share(bengali_letter_share(text))


def split_value(text_nfc: str) -> float:
    """The document's split hash in [0, 1): first 8 hex digits of sha256(UTF-8 of the NFC text) / 2**32."""
    return int(hashlib.sha256(text_nfc.encode("utf-8")).hexdigest()[:8], 16) / 2**32


def is_val(text_nfc: str, val_fraction: float) -> bool:
    """True when the document belongs to the validation split (docs/design.md)."""
    return split_value(text_nfc) < val_fraction


_WORD = re.compile(r"[\w\u0980-\u09ff]+")


def distinct_word_share(text: str) -> float | None:
    """Distinct words over words in ``text`` (distinct-1 over words; Li et al., "A Diversity-Promoting Objective
    Function for Neural Conversation Models", 2016): 1.0 when no word repeats, near 0 when a sample loops on one
    word. Words are runs of letters, marks and digits (Bangla's combining marks included), compared case-folded.
    None for a text without words."""
    words = [w.casefold() for w in _WORD.findall(text)]
    return len(set(words)) / len(words) if words else None
