"""Which work a document belongs to: the unit the validation split is decided on.

A document is a part of a work: a chapter of a novel, a piece of a long Wikipedia article, a poem of a
collection. The key, in order of preference:

1. a ``work`` or ``group`` field of the input (JSON Lines field or ``hf:`` column), taken as it is;
2. else ``source`` + ``author`` + the title as the shared corpus formats it, with the part suffix removed
   (``… (অংশ 2)``, ``… (part 2)``) and, for a title ``book — section``, only the book (the bnarchive and the
   English novels: ``Oliver Twist — CHAPTER I`` → ``Oliver Twist``; ``গীতবিতান - পূজা — …`` → the collection);
3. else (no title) the document itself (its NFC text), so it is a work of its own.

The key is hashed (sha256) to order works for the split (:func:`train.clean.stage.choose_val_works`).
"""

from __future__ import annotations

import hashlib
import re

_PART = re.compile(r"\s*\((?:অংশ|part)\s*[0-9০-৯]+\)\s*$", re.IGNORECASE)
_BOOK = " — "


def work_title(title: str) -> str:
    """``title`` without a trailing part number, and only the book of ``book — section``."""
    t = _PART.sub("", title.strip())
    return t.split(_BOOK, 1)[0].strip() if _BOOK in t else t


def work_key(text: str, source: str, title: str | None, author: str | None, work: str | None) -> str:
    """The work key of one document (see the module doc)."""
    if work:
        return "work\x1f" + work
    if title and title.strip():
        return "\x1f".join(("title", source, author or "", work_title(title)))
    return "text\x1f" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def work_order(key: str) -> int:
    """The work's place in the split order: the first 8 bytes of sha256(key) as an integer."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
