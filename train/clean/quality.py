"""Quality rules: per-document features and the per-language thresholds of ``rules.toml``.

The features follow Gopher (Rae et al. 2021, appendix A: word count and length, symbol ratio, ellipsis lines,
repeated lines / paragraphs / n-grams) and C4 / FineWeb (lines ending in a terminator, boilerplate markers), made
right for Bangla: sentences end in ``।`` (danda) and ``॥`` as well as ``.``; words are the normalised words of
:mod:`train.clean.text` (vowel signs, virama and nukta stay inside the word; lengths in code points); the
script mix counts letters of the Bengali block, of Latin and of every other script. The thresholds are data
(``rules.toml``) and every one was measured on the curated corpus before it was enabled.

:func:`load_rules` reads the file, applies ``data.clean_off`` / ``data.clean_set`` and checks them (a
:class:`~train.config.ConfigError` naming the key). :func:`failures` returns the bit mask of failed rules.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contract.text import letter_kinds, nfc
from train.clean.text import ChunkNgrams
from train.config import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

RULES_FILE = Path(__file__).with_name("rules.toml")
LANGUAGES = ("bn", "en")
_MOJIBAKE = re.compile("[\u00c2\u00c3\u00e0\u00e2][\u0080-\u00bf\u0152\u0153\u0160\u0161\u0178\u017d\u017e\u0192"
                       "\u02c6\u02dc\u2013\u2014\u2018\u2019\u201a\u201c\u201d\u201e\u2020\u2021\u2022\u2026"
                       "\u2030\u2039\u203a\u20ac\u2122]|\ufffd")
_MOJIBAKE_LEAD = ("\u00c2", "\u00c3", "\u00e0", "\u00e2", "\ufffd")
_BLANK = re.compile(r"\n[ \t\r\f\v]*\n")


@dataclass
class Rules:
    """The enabled rules in order (``names``, bit ``i`` of a failure mask is ``names[i]``... of ``ALL``),
    ``params[lang][rule][param]``, ``terminators`` (a tuple for ``str.endswith``) and ``markers[lang]``
    (NFC casefolded)."""

    enabled: tuple[str, ...]
    params: dict
    terminators: tuple[str, ...]
    markers: dict

    def __post_init__(self) -> None:
        self.marker_re = {lang: re.compile("|".join(map(re.escape, m))) if m else None
                          for lang, m in self.markers.items()}

    def as_dict(self) -> dict:
        """A JSON-able record (part of the fingerprint and of the report)."""
        return {"enabled": list(self.enabled), "params": self.params, "terminators": list(self.terminators),
                "markers": self.markers}


def _raw_rules() -> dict:
    return tomllib.loads(RULES_FILE.read_text(encoding="utf-8"))


def rule_names() -> tuple[str, ...]:
    """Every quality rule, in the order they are checked (and of the failure mask's bits)."""
    return tuple(k for k in _raw_rules() if k != "markers")


ALL = rule_names()


def load_rules(off: list[str] = (), overrides: dict[str, float] | None = None) -> Rules:
    """The rules of ``rules.toml`` without those in ``off``, with ``overrides`` (``"lang.rule.param" → value``).

    Raises ConfigError naming ``data.clean_off`` / ``data.clean_set`` and the bad name or value.
    """
    raw = _raw_rules()
    names = [k for k in raw if k != "markers"]
    for name in off:
        if name not in names:
            raise ConfigError(f"data.clean_off: unknown rule {name!r}; the rules are: {', '.join(names)}")
    params = {lang: {r: dict(raw[r][lang]) for r in names} for lang in LANGUAGES}
    for key, value in (overrides or {}).items():
        parts = key.split(".")
        if len(parts) != 3 or parts[0] not in LANGUAGES or parts[1] not in names or parts[2] not in raw[parts[1]]["range"]:
            raise ConfigError(f"data.clean_set: unknown threshold {key!r}; expected LANG.RULE.PARAM with LANG in "
                              f"{list(LANGUAGES)}, RULE one of {', '.join(names)} and PARAM one of that rule's "
                              f"(e.g. bn.min_words.min)")
        lo, hi = raw[parts[1]]["range"][parts[2]]
        if not lo <= value <= hi:
            raise ConfigError(f"data.clean_set: {key} = {value} is outside its range [{lo}, {hi}]")
        params[parts[0]][parts[1]][parts[2]] = value
    m = raw["markers"]
    return Rules(tuple(n for n in names if n not in off), params, tuple(nfc(t) for t in m["terminators"]),
                 {lang: [nfc(x).casefold() for x in m[lang]] for lang in LANGUAGES})


NGRAM_SHARES = ("top_2gram", "top_3gram", "top_4gram", "dup_5gram", "dup_6gram", "dup_7gram", "dup_8gram",
                "dup_9gram", "dup_10gram")


def features(text: str, wh: np.ndarray, wl: np.ndarray, rules: Rules, lang: str,
             shares: dict[str, int] | None = None) -> dict[str, float]:
    """The measured features of one NFC document: ``text``, its normalised words' hashes ``wh`` and lengths
    ``wl`` (:func:`train.clean.text.word_spans`); ``shares`` its n-gram characters (:func:`ngram_chars`'s, for
    this document) when the caller has them for many documents at once."""
    if shares is None:
        one = ngram_chars(ChunkNgrams(wh, np.array([0, len(wh)]), 10), wl)
        shares = {k: int(v[0]) for k, v in one.items()}
    f: dict[str, float] = {}
    n = len(wh)
    f["words"] = n
    total = int(wl.sum())
    f["mean_word_length"] = total / n if n else 0.0
    f["symbol_ratio"] = (text.count("#") + text.count("…") + text.count("...")) / max(n, 1)
    lines = [ln.strip() for ln in text.split("\n")]
    lines = [ln for ln in lines if ln]
    nl = max(len(lines), 1)
    f["lines"] = len(lines)
    f["terminal_lines"] = sum(ln.endswith(rules.terminators) for ln in lines) / nl
    f["ellipsis_lines"] = sum(ln.endswith(("…", "...")) for ln in lines) / nl
    f["dup_lines"], f["dup_lines_chars"] = _dup_share(lines)
    paras = [p.strip() for p in _BLANK.split(text) if p.strip()]
    f["dup_paragraphs"], f["dup_paragraphs_chars"] = _dup_share(paras)
    for name in NGRAM_SHARES:
        f[name] = shares[name] / max(total, 1)
    cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    kinds = letter_kinds()[cps]
    letters = int(np.count_nonzero(kinds))
    bengali = int(np.count_nonzero(kinds == 2))
    latin = int(np.count_nonzero((kinds == 1) & ((cps < 0x250) | ((cps >= 0x1E00) & (cps < 0x1F00)))))
    own = bengali if lang == "bn" else latin
    f["own_script"] = own / letters if letters else 1.0
    f["other_script"] = (letters - bengali - latin) / letters if letters else 0.0
    f["boilerplate"] = _marked_lines(text, rules.marker_re.get(lang), rules.markers.get(lang, ())) / nl
    moji = any(c in text for c in _MOJIBAKE_LEAD)  # every match holds one of these: most texts need no regex
    f["mojibake"] = len(_MOJIBAKE.findall(text)) / max(n, 1) if moji else 0.0
    return f


def _marked_lines(text: str, pattern: re.Pattern | None, markers=()) -> int:
    """Non-empty lines of ``text`` holding a marker (``pattern`` matches casefolded text; ``markers``, its
    alternatives, are looked for first with ``str.__contains__``, much faster than the alternation)."""
    if pattern is None:
        return 0
    low = text.casefold()
    if markers and not any(m in low for m in markers):
        return 0
    pos = [m.start() for m in pattern.finditer(low)]
    if not pos:
        return 0
    if len(low) != len(text):  # casefolding changed lengths (ß → ss): count line by line
        return sum(1 for ln in low.split("\n") if ln.strip() and pattern.search(ln))
    nl = np.flatnonzero(np.frombuffer(low.encode("utf-32-le", "surrogatepass"), dtype="<u4") == 10)
    return len(np.unique(np.searchsorted(nl, np.asarray(pos))))


def _dup_share(items: list[str]) -> tuple[float, float]:
    seen: set[str] = set()
    dup = dup_chars = chars = 0
    for x in items:
        chars += len(x)
        if x in seen:
            dup += 1
            dup_chars += len(x)
        else:
            seen.add(x)
    return dup / max(len(items), 1), dup_chars / max(chars, 1)


def ngram_chars(chunk: ChunkNgrams, wl: np.ndarray) -> dict[str, np.ndarray]:
    """Gopher's repetition counts for every document of ``chunk`` at once (``wl``: the word lengths, back to
    back), int64 per document, in characters of words (divided by the document's word characters they are the
    features):

    * ``top_{k}gram`` (k = 2, 3, 4): the most frequent k-gram's count × its characters (ties to the lowest key;
      0 when no k-gram repeats);
    * ``dup_{k}gram`` (k = 5 … 10): the characters of the words inside a k-gram that occurs more than once.

    The n-grams are grouped by (key, document) in one stable sort per n. A repeated k-gram starts where a repeated
    (k-1)-gram starts and the next one does too, so from k = 3 on only those places are sorted; likewise a
    repeated k-gram (k > 5) starts where a repeated 5-gram starts and a repeated 5-gram starts k − 5 words
    later."""
    counts = np.diff(chunk.offsets)
    ndocs, m = len(counts), chunk.all.m
    word_doc = np.repeat(np.arange(ndocs, dtype=np.int64), counts)
    csum = np.concatenate(([0], np.cumsum(wl))).astype(np.int64)
    out = {name: np.zeros(ndocs, dtype=np.int64) for name in NGRAM_SHARES}
    rep, dup5 = None, np.zeros(0, dtype=bool)  # per k-gram place: it repeats inside its document
    for k in range(2, 11):
        if m < k:
            break
        keys = chunk.all.keys(k)
        inside = word_doc[:m - k + 1] == word_doc[k - 1:]
        if k <= 5:
            cand = inside if rep is None else inside & rep[:m - k + 1] & rep[1:m - k + 2]
        else:
            cand = inside & dup5[:m - k + 1] & dup5[k - 5:m - 4]
        pos = np.flatnonzero(cand)
        ps = pos[np.argsort(keys[pos], kind="stable")]  # by key, then place: a key's places in one document adjoin
        ks, ds = keys[ps], word_doc[ps]
        eq = (ks[1:] == ks[:-1]) & (ds[1:] == ds[:-1])
        rep = np.zeros(m - k + 1, dtype=bool)
        rep[ps[1:][eq]] = True
        rep[ps[:-1][eq]] = True
        if k <= 4 and eq.any():
            cut = np.flatnonzero(np.concatenate(([True], ~eq, [True])))
            runs, rdoc, rpos = np.diff(cut), ds[cut[:-1]], ps[cut[:-1]]  # per (key, doc): count, first place
            most = np.zeros(ndocs, dtype=np.int64)
            np.maximum.at(most, rdoc, runs)
            top = np.flatnonzero((runs == most[rdoc]) & (runs > 1))
            _, first = np.unique(rdoc[top], return_index=True)  # in key order: the lowest key of each document
            top = top[first]
            out[f"top_{k}gram"][rdoc[top]] = runs[top] * (csum[rpos[top] + k] - csum[rpos[top]])
        if k == 5:
            dup5 = rep
        if k >= 5:
            starts = np.flatnonzero(rep)
            cover = np.cumsum(np.bincount(starts, minlength=m + 1) - np.bincount(starts + k, minlength=m + 1))[:m] > 0
            out[f"dup_{k}gram"] = np.bincount(word_doc[cover], weights=wl[cover], minlength=ndocs).astype(np.int64)
    return out


def verdicts(f: dict[str, float], p: dict) -> dict[str, bool]:
    """``{rule: failed}`` for every rule (enabled or not) from the features ``f`` and the language's ``p``."""
    dn = {k: p["dup_ngram"]["max5"] + (p["dup_ngram"]["max10"] - p["dup_ngram"]["max5"]) * (k - 5) / 5
          for k in range(5, 11)}
    return {
        "min_words": f["words"] < p["min_words"]["min"],
        "mean_word_length": f["words"] > 0 and not (p["mean_word_length"]["lo"] <= f["mean_word_length"]
                                                    <= p["mean_word_length"]["hi"]),
        "symbol_ratio": f["symbol_ratio"] > p["symbol_ratio"]["max"],
        "terminal_lines": f["lines"] >= p["terminal_lines"]["min_lines"] and f["terminal_lines"] < p["terminal_lines"]["min"],
        "ellipsis_lines": f["ellipsis_lines"] > p["ellipsis_lines"]["max"],
        "dup_lines": f["dup_lines"] > p["dup_lines"]["max_frac"] or f["dup_lines_chars"] > p["dup_lines"]["max_char_frac"],
        "dup_paragraphs": (f["dup_paragraphs"] > p["dup_paragraphs"]["max_frac"]
                           or f["dup_paragraphs_chars"] > p["dup_paragraphs"]["max_char_frac"]),
        "top_ngram": any(f[f"top_{k}gram"] > p["top_ngram"][f"max{k}"] for k in (2, 3, 4)),
        "dup_ngram": any(f[f"dup_{k}gram"] > dn[k] for k in range(5, 11)),
        "script_mix": f["own_script"] < p["script_mix"]["own_min"] or f["other_script"] > p["script_mix"]["other_max"],
        "boilerplate": f["lines"] > 0 and f["boilerplate"] >= p["boilerplate"]["max"],
        "mojibake": f["mojibake"] > p["mojibake"]["max"],
    }


def failure_mask(f: dict[str, float], rules: Rules, lang: str) -> int:
    """Bit ``i`` set when the document fails rule ``ALL[i]`` (every rule, enabled or not: the report measures
    what each would drop)."""
    v = verdicts(f, rules.params[lang])
    return sum(1 << i for i, name in enumerate(ALL) if v[name])


def enabled_mask(rules: Rules) -> int:
    """The bits of the enabled rules."""
    return sum(1 << i for i, name in enumerate(ALL) if name in rules.enabled)
