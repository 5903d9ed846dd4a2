"""The script-aware tokenizer: cases T1–T5 of docs/cases.md, round trips, fertility, AutoTokenizer."""

from __future__ import annotations

import json
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, pre_tokenizers

from contract.byte_level import bytes_to_unicode
from tests.conftest import shared_path
from train.corpus import Document, iter_documents, list_input_files
from train.tokenizer import PRETOKENIZER, load_tokenizer, new_tokenizer, token_char_counts
from train.tokenizer.cli import main
from train.tokenizer.fertility import TokenizerAdapter, fertility, load_any_tokenizer
from train.tokenizer.pretokenizers import pre_tokenizer_json
from train.tokenizer.sample import sample_quotas

PROBES = {
    "বাংলা": ["বাংলা"],
    "আমি বাংলায় গান গাই": ["আমি", " বাংলায়", " গান", " গাই"],
    "কিন্তু": ["কিন্তু"],
    "সংস্কৃতি": ["সংস্কৃতি"],
    "ক্ষমা": ["ক্ষমা"],
}


def pre_tokens(tok, text: str) -> list[tuple[str, tuple[int, int]]]:
    """Pre-tokens with offsets into the NFC text, using the pre-tokenizer stored in tokenizer.json
    (the ByteLevel step maps bytes to printable characters, so read the words back through the offsets)."""
    norm = tok.normalizer.normalize_str(text)
    return [(norm[a:b], (a, b)) for _piece, (a, b) in tok.pre_tokenizer.pre_tokenize_str(norm)]


# ----------------------------------------------------------------------------------------------- T1

@pytest.mark.parametrize("word,expected", PROBES.items())
def test_t1_bangla_words_are_single_pre_tokens(fixture_tok, word, expected):
    tok = load_tokenizer(fixture_tok)
    pieces = pre_tokens(tok, word)
    assert [p for p, _ in pieces] == expected
    for p, _span in pieces:
        first = p.lstrip(" ")[:1]
        assert unicodedata.category(first) not in ("Mn", "Mc"), f"pre-token {p!r} starts with a mark"


def test_t1_gpt2_pattern_would_cut_bangla():
    """The control: GPT-2's letters-only pattern splits বাংলা at its vowel signs; our check must reject it."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw = [w for w, _ in gpt2.pre_tokenize_str("বাংলা")]
    assert len(raw) > 1
    ours = new_tokenizer().pre_tokenizer
    assert len(ours.pre_tokenize_str("বাংলা")) == 1


def test_t1_no_boundary_between_consonant_and_vowel_sign(fixture_tok):
    tok = load_tokenizer(fixture_tok)
    text = "আমি বাংলায় গান গাই। কিন্তু সংস্কৃতি, ক্ষমা! রবীন্দ্রনাথ ঠাকুর ১৮৬১ সালে জন্মগ্রহণ করেন।"
    norm = tok.normalizer.normalize_str(text)
    for _p, (a, _b) in pre_tokens(tok, text):
        if a > 0:
            assert unicodedata.category(norm[a]) not in ("Mn", "Mc"), f"boundary before a mark at {a}: {norm[a]!r}"


def test_t1_frequent_word_is_one_token(fixture_tok):
    """বাংলা, frequent in the fixture corpus, is one token where it occurs: after a space (GPT-2's Ġ
    convention: a word and its leading space are one pre-token). Word-initial without a space it is rarer
    and may take more tokens at vocab 1000."""
    tok = load_tokenizer(fixture_tok)
    assert len(tok.encode(" বাংলা", add_special_tokens=False).ids) == 1
    n_ami = len(tok.encode("আমি", add_special_tokens=False).ids)
    assert len(tok.encode("আমি বাংলা", add_special_tokens=False).ids) == n_ami + 1


# ----------------------------------------------------------------------------------------------- T2

@pytest.mark.parametrize("s,joiner,pieces", [("র\u200d্যাব", "\u200d", ["র", "\u200d্যাব"]),
                                             ("ক্\u200cষ", "\u200c", ["ক্", "\u200cষ"])])
def test_t2_zwj_zwnj_kept_and_never_alone(fixture_tok, s, joiner, pieces):
    """ZWJ/ZWNJ survive NFC, encoding and decoding byte for byte. Since tokenizer format 3 the split is llama.cpp's
    (issue 28): a joiner starts the next pre-token together with the virama or letter after it (BPE can learn
    "\u200d্য" as a unit); it is never dropped and never a pre-token alone."""
    tok = load_tokenizer(fixture_tok)
    assert joiner in tok.normalizer.normalize_str(s)
    ids = tok.encode(s, add_special_tokens=False).ids
    assert tok.decode(ids).encode("utf-8") == s.encode("utf-8")
    assert [p for p, _ in pre_tokens(tok, s)] == pieces


def test_t2_letters_marks_regex_alone_would_split_at_zwj():
    """The control: a split that treats the joiner as punctuation leaves it as a pre-token of its own."""
    split = pre_tokenizers.Split(Regex(r" ?[\p{L}\p{M}]+|\s+|[^\s\p{L}\p{M}]+"), behavior="isolated")
    assert [w for w, _ in split.pre_tokenize_str("র\u200d্যাব")] == ["র", "\u200d", "্যাব"]


# ----------------------------------------------------------------------------------------------- T3

@pytest.mark.parametrize("a,b", [
    ("\u09DC", "\u09A1\u09BC"), ("\u09DD", "\u09A2\u09BC"), ("\u09DF", "\u09AF\u09BC"),
    ("\u0995\u09C7\u09BE", "\u0995\u09CB"), ("আমি বাংলা\u09DF", "আমি বাংলা\u09AF\u09BC"),
])
def test_t3_canonically_equivalent_spellings_tokenize_alike(fixture_tok, a, b):
    tok = load_tokenizer(fixture_tok)
    assert tok.encode(a, add_special_tokens=False).ids == tok.encode(b, add_special_tokens=False).ids


def test_t3_nfc_decomposes_nukta_letters_and_composes_o_kar(fixture_tok):
    tok = load_tokenizer(fixture_tok)
    assert tok.normalizer.normalize_str("\u09DF") == "\u09AF\u09BC"
    assert tok.normalizer.normalize_str("\u0995\u09C7\u09BE") == "\u0995\u09CB"
    assert json.loads((fixture_tok / "tokenizer.json").read_text())["normalizer"]["type"] == "NFC"


# ----------------------------------------------------------------------------------------------- T4

T4 = ["hello", " hello", "x != y and a.b == c", " there is this someone 'you' who has the ability of 'sensing things",
      "আমি , তুমি ?", "a  b", "😀"]


@pytest.mark.parametrize("s", T4)
def test_t4_exact_round_trip(fixture_tok, s):
    tok = load_tokenizer(fixture_tok)
    ids = tok.encode(s, add_special_tokens=False).ids
    assert tok.decode(ids) == s
    pieces = b"".join(_token_bytes(tok, i) for i in ids)
    assert pieces.decode("utf-8") == tok.decode(ids)


def test_t4_prefix_space_matters(fixture_tok):
    tok = load_tokenizer(fixture_tok)
    assert tok.encode("hello", add_special_tokens=False).ids != tok.encode(" hello", add_special_tokens=False).ids


def test_t4_autotokenizer_loads_folder_without_cleanup(fixture_tok):
    transformers = pytest.importorskip("transformers")
    at = transformers.AutoTokenizer.from_pretrained(str(fixture_tok))
    for s in T4:
        ids = at.encode(s, add_special_tokens=False)
        assert ids == load_tokenizer(fixture_tok).encode(s, add_special_tokens=False).ids
        assert at.decode(ids) == s
    assert at.eos_token == "<|endoftext|>" and at.convert_tokens_to_ids("<|endoftext|>") == 0
    assert at.pad_token == "<|pad|>" and at.pad_token_id == 1


def _token_bytes(tok, i: int) -> bytes:

    inv = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(inv[c] for c in tok.id_to_token(i))


# ----------------------------------------------------------------------------------------------- round trips

MIXED = st.lists(st.sampled_from([
    "আমি", "বাংলা", "\u200d", "\u200c", "্", "র", "য", "\u09DF", "\u09AF\u09BC", "\u09DC", "ড\u09BC", "১২৩", "।",
    " ", "  ", "\n", "Hello", " world", "!", "😀", "🇧🇩", "ক্ষ", "ঁ", "ং", "ৎ", "\t", "'", "“", "é", "ﬁ",
]), max_size=30).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=MIXED)
def test_round_trip_generated(fixture_tok, text):
    tok = _cached(fixture_tok)
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == unicodedata.normalize("NFC", text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40))
def test_round_trip_any_unicode(fixture_tok, text):
    """Any text comes back (NFC) — a literal ``<|endoftext|>`` in it too, which Hypothesis draws from the project's
    own constants: it encodes to the special id (as in Hugging Face tokenizers) and decodes back when special tokens
    are kept."""
    tok = _cached(fixture_tok)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


_CACHE: dict = {}


def _cached(path):
    if path not in _CACHE:
        _CACHE[path] = load_tokenizer(path)
    return _CACHE[path]


def test_round_trip_on_corpus_documents(fixture_tok, mini_corpus):

    tok = load_tokenizer(fixture_tok)
    docs = list(iter_documents(list_input_files([str(mini_corpus)])))
    assert len(docs) > 50
    bad = [d.title for d in docs if tok.decode(tok.encode(d.text, add_special_tokens=False).ids) != d.text]
    assert bad == []


# ----------------------------------------------------------------------------------------------- fertility

def test_fertility_hand_counted():
    """A fake tokenizer with one token per whitespace-separated word: counts are checkable by hand."""

    words = lambda t: t.split()  # noqa: E731
    ad = TokenizerAdapter("words", "test", encode=lambda t: list(range(len(words(t)))),
                          decode=lambda ids: "x", vocab_size=10)
    text = unicodedata.normalize("NFC", "আমি বাংলায় গান গাই")
    docs = [Document(text, "bn", "s"), Document("hello big world", "en", "s")]
    res = fertility(ad, docs)
    # আমি (3) + space + ব া ং ল া য ় (7, NFC keeps য় decomposed) + space + গান (3) + space + গাই (3) = 19 code
    # points, 4 tokens, 4 words; UTF-8: 16 Bangla code points × 3 bytes + 3 spaces = 51 bytes
    assert res["bn"]["chars"] == 19 and res["bn"]["tokens"] == 4
    assert res["bn"]["chars_per_token"] == pytest.approx(19 / 4)
    assert res["bn"]["bytes_per_token"] == pytest.approx(51 / 4)
    assert res["bn"]["tokens_per_word"] == pytest.approx(1.0)
    assert res["bn"]["roundtrip_failures"] == 1
    assert res["en"]["chars_per_token"] == pytest.approx(15 / 3)


def test_fertility_of_real_tokenizer_counts_code_points(fixture_tok):

    tok = load_tokenizer(fixture_tok)
    ad = load_any_tokenizer(fixture_tok)
    text = "বাংলা বাংলা বাংলা"
    n = len(tok.encode(text, add_special_tokens=False).ids)
    res = fertility(ad, [Document(text, "bn", "s")])
    assert res["bn"]["tokens"] == n and res["bn"]["chars"] == 17
    assert res["bn"]["roundtrip_failures"] == 0


def test_token_char_counts_sum_to_code_points(fixture_tok):
    tok = load_tokenizer(fixture_tok)
    counts = token_char_counts(tok)
    text = "আমি বাংলায় গান গাই 😀 ক্ষমা, hello!"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert sum(counts[i] for i in ids) == len(text)
    assert counts[0] == 0 and counts[1] == 0


def test_sample_quotas_keep_ratio():
    assert sample_quotas({"bn": 7_000_000, "en": 9_000_000}, {"bn": 0.6, "en": 0.4}, 20_000_000) == \
        {"bn": 7_000_000, "en": 4_666_666}
    assert sample_quotas({"bn": 100, "en": 100}, {"bn": 0.5, "en": 0.5}, 50) == {"bn": 25, "en": 25}


def test_split_is_the_stored_one(fixture_tok):
    tj = json.loads((fixture_tok / "tokenizer.json").read_text())
    assert tj["pre_tokenizer"] == pre_tokenizer_json(PRETOKENIZER)
    assert [t["content"] for t in tj["added_tokens"]] == ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    assert [t["id"] for t in tj["added_tokens"]] == [0, 1, 998, 999]  # vocab 1000: the chat tokens are the last ids
    assert all(t["special"] and not t["normalized"] for t in tj["added_tokens"])


def test_chat_tokens_keep_every_other_id_and_merge():
    """A tokenizer reserves <|im_start|> / <|im_end|> as its last two ids: the BPE (ids, merges) is the one
    trained without them at two fewer entries, and add_chat_tokens gives such an older tokenizer the same two."""
    from tokenizers import Tokenizer, trainers

    from contract.chat_format import CHAT_TOKENS, render
    from train.tokenizer import add_chat_tokens, has_chat_tokens, train_tokenizer

    texts = ["আমি বাংলায় গান গাই। " * 30, "The river flows to the sea. " * 30]
    new = train_tokenizer(texts, vocab_size=290, min_frequency=1)
    old = new_tokenizer()  # what format 3 trained: only <|endoftext|> and <|pad|>, 288 entries
    old.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=288, min_frequency=1, show_progress=False,
                                                       special_tokens=["<|endoftext|>", "<|pad|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert not has_chat_tokens(old) and has_chat_tokens(new)
    assert new.get_vocab_size() == 290 and [new.token_to_id(t) for t in CHAT_TOKENS] == [288, 289]
    old_vocab = old.get_vocab(with_added_tokens=True)
    assert {k: v for k, v in new.get_vocab(with_added_tokens=True).items() if k not in CHAT_TOKENS} == old_vocab
    assert json.loads(new.to_str())["model"]["merges"] == json.loads(old.to_str())["model"]["merges"]
    assert add_chat_tokens(old) == [288, 289] and add_chat_tokens(old) == [288, 289]  # idempotent
    conversation = render([{"role": "user", "content": "গান গাই"}], add_generation_prompt=True)
    assert old.encode(conversation).ids == new.encode(conversation).ids
    ids = new.encode(conversation).ids
    assert ids[0] == 288 and ids.count(289) == 1 and new.decode(ids, skip_special_tokens=False) == conversation
    assert Tokenizer.from_str(new.to_str()).token_to_id("<|im_end|>") == 289


# ----------------------------------------------------------------------------------------------- anchors

@pytest.mark.parametrize("name,kind", [("gpt2", "vocab.json+merges.txt"), ("llama2", "sentencepiece"),
                                       ("mistral-v0.3", "sentencepiece"), ("gpt-neox-20b", "tokenizer.json"),
                                       ("bnlp-bangla-spm", "sentencepiece"), ("bangla-bert-base", "wordpiece")])
def test_anchor_formats_detected(name, kind):
    ad = load_any_tokenizer(shared_path("anchor_tokenizers", name))
    assert ad.kind == kind
    if name == "gpt2":
        assert ad.encode("Hello world") == [15496, 995]
    if name == "llama2":
        assert ad.encode("Hello world") == [15043, 3186]
    if name == "gpt-neox-20b":
        assert ad.encode("Hello world") == [12092, 1533]


def test_fertility_cli_json(fixture_tok, mini_corpus, capsys):

    assert main(["fertility", "--tokenizer", str(fixture_tok), "--data", str(mini_corpus), "--split", "all",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ours = next(v for k, v in out.items() if "(ours)" in k)
    assert ours["bn"]["chars_per_token"] > 1.5 and ours["en"]["roundtrip_failures"] == 0
    assert ours["bn"]["docs"] + ours["en"]["docs"] == 96


def test_fertility_cli_bad_tokenizer(tmp_path, mini_corpus, capsys):

    (tmp_path / "junk.txt").write_text("nothing")
    assert main(["fertility", "--tokenizer", str(tmp_path), "--data", str(mini_corpus), "--split", "all"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err


def test_train_cli_writes_a_loadable_tokenizer(tmp_path, mini_corpus, capsys):

    out = tmp_path / "tok"
    assert main(["train", "--data", str(mini_corpus), "--vocab-size", "400", "--out", str(out)]) == 0
    tok = load_tokenizer(out)
    assert tok.get_vocab_size() == 400 and tok.token_to_id("<|pad|>") == 1
    assert "sampling" in capsys.readouterr().out
    assert main(["train", "--data", str(mini_corpus), "--vocab-size", "400", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["train", "--data", str(mini_corpus), "--vocab-size", "300", "--out", str(out), "--force"]) == 0
    assert load_tokenizer(out).get_vocab_size() == 300


def test_train_cli_force_never_replaces_data_or_a_file(tmp_path, mini_corpus, capsys):
    """--force replaces a tokenizer folder only: the data folder it reads, a data file, "" (the working folder)
    are refused before any work, and nothing in them changes."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(mini_corpus, data)
    before = sorted((p.name, p.stat().st_size) for p in data.iterdir())
    one_file = next(p for p in data.iterdir() if p.is_file())
    for out, needle in ((data, "holds other files than a tokenizer's"), (one_file, "is a file, not a tokenizer folder"),
                        ("", "--out is empty")):
        assert main(["train", "--data", str(data), "--vocab-size", "400", "--out", str(out), "--force"]) == 2
        captured = capsys.readouterr()
        assert needle in captured.err and "sampling" not in captured.out, (out, captured)
    assert sorted((p.name, p.stat().st_size) for p in data.iterdir()) == before


@pytest.mark.parametrize("size,needle", [
    ("0", "tokenizer.vocab_size: expected 300 (256 bytes + specials) to 1,048,576, got 0"),
    ("10000000000", "got 10,000,000,000"),
])
def test_train_cli_checks_the_vocabulary_size_before_any_work(tmp_path, mini_corpus, capsys, size, needle):
    assert main(["train", "--data", str(mini_corpus), "--vocab-size", size, "--out", str(tmp_path / "t")]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and captured.out == ""


def test_train_cli_help_states_the_default_preset_s_vocabulary_size(capsys):
    from train.config import DEFAULT_PRESET, load_config

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    want = load_config(DEFAULT_PRESET).tokenizer.vocab_size
    assert f"{want:,} for {DEFAULT_PRESET}" in text and "32000" not in text and want != 32000


# ----------------------------------------------------------------------------------------------- for_nfc_text

@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=MIXED | st.text(max_size=40))
def test_for_nfc_text_gives_the_ids_of_the_tokenizer_as_saved(fixture_tok, text):
    """prepare's workers tokenize Python-NFC text with the tokenizer's NFC normalizer off: the same ids as the
    tokenizer as saved on the raw text."""
    from train.tokenizer import for_nfc_text

    if "off" not in _CACHE:
        _CACHE["off"] = load_tokenizer(fixture_tok)
        assert for_nfc_text(_CACHE["off"]) and _CACHE["off"].normalizer is None
    shipped = _cached(fixture_tok).encode(text, add_special_tokens=False).ids
    assert _CACHE["off"].encode(unicodedata.normalize("NFC", text), add_special_tokens=False).ids == shipped


def test_tokenizers_nfc_leaves_python_nfc_text_unchanged_over_the_code_space():
    """What for_nfc_text relies on, for every code point alone and after a Latin, a Bengali and a Hangul base:
    Python's NFC output is NFC for the tokenizers library too (their Unicode versions differ)."""
    from tokenizers import normalizers

    hf = normalizers.NFC()
    points = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    for base in ("", "a", "\u0995", "\u1100"):
        s = unicodedata.normalize("NFC", " ".join(base + p for p in points))
        assert hf.normalize_str(s) == s, base


def test_for_nfc_text_keeps_another_normalizer():
    from tokenizers import normalizers

    from train.tokenizer import for_nfc_text

    tok = new_tokenizer()
    tok.normalizer = normalizers.NFKC()
    assert for_nfc_text(tok) is False and isinstance(tok.normalizer, normalizers.NFKC)
