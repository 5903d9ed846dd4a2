"""Issue 28: Shalik's tokenizer splits text as a llama.cpp pre-tokenizer does, the GGUF names it, and llama.cpp
itself tokenizes and generates as the bundle does.

The fast tests need no llama.cpp: the one table (``train.tokenizer.pretokenizers``) against tokenizer.json and the
GGUF keys, the training cut, the exporter's refusals, the Modelfile, NFC where Shalik owns the path. The ``slow``
tests run llama.cpp (llama-cpp-python, the ``bench`` extra: ``pip install -e ".[bench]" && pytest -m slow
tests/test_llamacpp_tokenizer.py``).
"""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path

import pytest
from gguf import GGUFReader

from export import gguf as G
from export.errors import ExportError
from export.modelfile import HEADER, MODELFILE, sampling_defaults
from train.corpus import iter_documents, list_input_files
from train.tokenizer import PRETOKENIZER, load_tokenizer, new_tokenizer, save_tokenizer, train_tokenizer
from train.tokenizer.pretokenizers import (
    LEGACY,
    PRETOKENIZERS,
    SCRIPT_EDGES,
    TRAIN_MAX_PIECE,
    identify,
    pre_tokenizer_json,
    training_pre_tokenizer,
)


def _copy_bundle(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.is_file() and not p.name.startswith("model.onnx") and p.name != "model.q8_0.onnx":
            shutil.copyfile(p, dst / p.name)
    return dst


def _with_split(bundle: Path, dst: Path, pre_tokenizer: dict) -> Path:
    """A copy of ``bundle`` whose tokenizer.json has another ``pre_tokenizer`` object."""
    b = _copy_bundle(bundle, dst)
    t = json.loads((b / "tokenizer.json").read_text())
    t["pre_tokenizer"] = pre_tokenizer
    (b / "tokenizer.json").write_text(json.dumps(t, ensure_ascii=False))
    return b


def _kv(path: Path) -> dict:
    return {k: f.contents() for k, f in GGUFReader(str(path)).fields.items() if not k.startswith("tokenizer.ggml.t")
            and k != "tokenizer.ggml.merges"}


# ---------------------------------------------------------------- the one table

def test_every_split_in_the_table_is_recognised_from_its_tokenizer_json():
    """tokenizer.json → table entry is a bijection: the exporter's name comes from the same table that built the
    tokenizer (and ignore_merges is part of the identity)."""
    for name, p in PRETOKENIZERS.items():
        tj = json.loads(new_tokenizer(p).to_str())
        assert identify(tj) is p, name
        assert tj["model"]["ignore_merges"] is p.ignore_merges
        tj["model"]["ignore_merges"] = not p.ignore_merges
        assert identify(tj) is not p
    assert identify(json.loads(new_tokenizer(LEGACY).to_str())) is LEGACY
    changed = pre_tokenizer_json(PRETOKENIZER)
    changed["pretokenizers"][0]["pattern"]["Regex"] += "|x"
    assert identify({"pre_tokenizer": changed, "model": {}}) is None


def test_shalik_tokenizer_is_an_exact_llama_cpp_split(fixture_tok):
    tj = json.loads((fixture_tok / "tokenizer.json").read_text())
    assert identify(tj) is PRETOKENIZER and PRETOKENIZER.name == "deepseek-v3"
    assert not PRETOKENIZER.clean_spaces  # llama.cpp detokenizes this name without touching spaces
    assert tj["normalizer"]["type"] == "NFC"


def test_training_cuts_long_pieces_the_saved_tokenizer_does_not(fixture_tok):
    """Issue 18's 2 MB word made BPE training quadratic: the trainer sees pieces of at most TRAIN_MAX_PIECE code
    points. llama.cpp has no such limit, so the saved tokenizer keeps the run whole (and round-trips it)."""
    tok = load_tokenizer(fixture_tok)
    for text in ["ক" * 5000, "a" * 5000, "=" * 5000, " " * 5000 + "x", "\n" * 5000]:
        cut = [b - a for _, (a, b) in training_pre_tokenizer(PRETOKENIZER).pre_tokenize_str(text)]
        assert max(cut) <= TRAIN_MAX_PIECE and len(cut) >= 5000 // TRAIN_MAX_PIECE
        whole = tok.pre_tokenizer.pre_tokenize_str(text)
        assert max(b - a for _, (a, b) in whole) >= 4999
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_train_tokenizer_saves_the_exact_split():
    tok = train_tokenizer(["আমি বাংলায় গান গাই ১২৩৪ " * 20, "The river 2024 " * 20], vocab_size=300)
    assert identify(json.loads(tok.to_str())) is PRETOKENIZER


def test_digits_and_joiners_split_as_llama_cpp_names_it(fixture_tok):
    """deepseek-v3: numbers in pieces of at most three digits (no leading space), ZWJ/ZWNJ start the next piece
    (kept with the virama after them, never dropped), a word keeps its marks, punctuation and symbols take one
    leading space."""
    tok = load_tokenizer(fixture_tok)

    def pieces(t):
        n = tok.normalizer.normalize_str(t)
        return [n[a:b] for _, (a, b) in tok.pre_tokenizer.pre_tokenize_str(n)]

    assert pieces("সাল ২০২৪৫ 12345") == ["সাল", " ", "২০২", "৪৫", " ", "123", "45"]
    assert pieces("র\u200d্যাব") == ["র", "\u200d্যাব"]
    assert pieces("ক্\u200cষ") == ["ক্", "\u200cষ"]
    assert pieces("বাংলায় গান") == ["বাংলায়", " গান"]
    # '~' is a symbol, as in llama.cpp since PR 26972 (Aug 2026; measured with llama.cpp's own split)
    assert pieces("a~~b ~কথা $১০") == ["a", "~~", "b", " ~", "কথা", " $", "১০"]


# ---------------------------------------------------------------- the GGUF: name, BOS, refusals, Modelfile

def test_gguf_names_the_split_without_flags_and_writes_a_modelfile(bundle, tmp_path, capsys):
    b = _copy_bundle(bundle, tmp_path / "b")
    assert G.main([str(b), "--type", "f32"]) == 0
    out = b / "model-f32.gguf"
    kv = _kv(out)
    assert kv["tokenizer.ggml.pre"] == "deepseek-v3" and kv[G.PRETOKENIZER_KEY] == "exact:deepseek-v3"
    assert kv["tokenizer.ggml.bos_token_id"] == 0 and kv["tokenizer.ggml.add_bos_token"] is True
    assert kv["tokenizer.ggml.add_eos_token"] is False and kv["tokenizer.ggml.eos_token_id"] == 0
    assert "NFC" in kv["general.description"]
    text = (b / MODELFILE).read_text()
    lines = text.splitlines()
    assert lines[0] == HEADER and "FROM ./model-f32.gguf" in lines
    assert 'PARAMETER stop "<|endoftext|>"' in lines  # the chat template and stop: tests/test_chat_clients.py
    d = sampling_defaults(b)   # the bundle's generation_config.json
    gc = json.loads((b / "generation_config.json").read_text())
    assert d["max_new_tokens"] == gc["max_new_tokens"]
    assert (d["temperature"], d["top_p"]) == ((gc["temperature"], gc["top_p"]) if gc.get("do_sample") else (0.0, 1.0))
    ctx = json.loads((b / "config.json").read_text())["max_position_embeddings"]
    assert f"PARAMETER num_ctx {ctx}" in lines and f"PARAMETER num_predict {d['max_new_tokens']}" in lines
    assert f"PARAMETER temperature {d['temperature']:g}" in lines and f"PARAMETER top_k {d['top_k']}" in lines
    assert f"PARAMETER repeat_penalty {d['repetition_penalty']:g}" in lines
    assert "ollama create" in capsys.readouterr().out
    # a Modelfile Shalik did not write is never overwritten
    (b / MODELFILE).write_text("FROM llama3\n")
    assert G.main([str(b), "--type", "q8_0"]) == 0
    assert (b / MODELFILE).read_text() == "FROM llama3\n"


def test_split_without_a_llama_cpp_name_is_refused(bundle, tmp_path, capsys):
    custom = pre_tokenizer_json(PRETOKENIZER)
    custom["pretokenizers"][0]["pattern"]["Regex"] = "\\p{N}"
    b = _with_split(bundle, tmp_path / "b", custom)
    assert G.main([str(b)]) == 2
    assert G.main([str(b), "--approximate-pretokenizer"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: ") and "has no llama.cpp equivalent" in err[0] and "deepseek-v3" in err[0]
    assert len(err) == 2 and "Traceback" not in "".join(err)
    assert [p.name for p in b.iterdir() if "gguf" in p.name or p.name == MODELFILE or p.name.startswith(".")] == []


def test_other_normalizer_is_refused(bundle, tmp_path):
    b = _copy_bundle(bundle, tmp_path / "b")
    t = json.loads((b / "tokenizer.json").read_text())
    t["normalizer"] = {"type": "Lowercase"}
    (b / "tokenizer.json").write_text(json.dumps(t))
    with pytest.raises(G.PretokenizerError, match="normalizer 'Lowercase' has no llama.cpp equivalent"):
        G.export_gguf(b, log=lambda m: None)


def test_format_2_tokenizer_needs_the_approximation_flag(bundle, tmp_path, capsys):
    b = _with_split(bundle, tmp_path / "b", pre_tokenizer_json(LEGACY))
    with pytest.raises(G.PretokenizerError, match="format 2.*--approximate-pretokenizer"):
        G.export_gguf(b, log=lambda m: None)
    assert G.main([str(b)]) == 2 and "Traceback" not in capsys.readouterr().err
    assert [p.name for p in b.iterdir() if "gguf" in p.name] == []
    out = G.export_gguf(b, log=lambda m: None, approximate_pretokenizer=True)
    kv = _kv(out)
    assert kv["tokenizer.ggml.pre"] == "qwen35" and kv[G.PRETOKENIZER_KEY] == "approximate:qwen35"
    assert "token ids" in kv["general.description"]
    assert not (b / MODELFILE).exists()  # text in through Ollama would not tokenize as trained


def test_unknown_type_and_existing_output(bundle, tmp_path):
    b = _copy_bundle(bundle, tmp_path / "b")
    with pytest.raises(ExportError, match="--type 'q3'"):
        G.export_gguf(b, type="q3", log=lambda m: None)
    out = G.export_gguf(b, type="f16", log=lambda m: None)
    said: list[str] = []   # the same command again: nothing to do (the manifest records this file)
    assert G.export_gguf(b, type="f16", log=said.append) == out and "nothing to do" in said[0]
    with pytest.raises(ExportError, match="already exists and is not a GGUF recorded"):
        G.export_gguf(b, out=out, type="f32", log=lambda m: None)   # another type at that path
    assert out.is_file()


def test_vocab_only_gguf_has_the_tokenizer_and_no_tensors(fixture_tok, tmp_path):
    out = G.write_vocab_gguf(fixture_tok, tmp_path / "v.gguf")
    r = GGUFReader(str(out))
    assert len(r.tensors) == 0 and r.fields["tokenizer.ggml.pre"].contents() == "deepseek-v3"
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == load_tokenizer(fixture_tok).get_vocab_size()


# ---------------------------------------------------------------- NFC where Shalik owns the path

def test_serve_normalises_prompts_and_stop_strings(bundle):
    from serve import load
    from serve.lm import normalize_stop

    assert normalize_stop(["\u09df", "ক\u09c7\u09be"]) == ["\u09af\u09bc", "\u0995\u09cb"]
    lm = load(bundle)
    try:
        raw, nfc = SCRIPT_EDGES["nukta precomposed"], SCRIPT_EDGES["nukta decomposed"]
        assert raw != nfc and unicodedata.normalize("NFC", raw) == nfc
        assert lm.tokenize(raw) == lm.tokenize(nfc)
        a = lm.complete(raw, max_new_tokens=8, temperature=0)
        b = lm.complete(nfc, max_new_tokens=8, temperature=0)
        assert a.token_ids == b.token_ids
    finally:
        lm.close()


# ---------------------------------------------------------------- through llama.cpp itself (slow)

def _llama_cpp():
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        pytest.skip(f"llama-cpp-python is not installed ({e}); it is the bench extra (pip install -e \".[bench]\")")


def _mini_texts(mini_corpus) -> list[str]:
    return [d.text for d in iter_documents(list_input_files([str(mini_corpus)]))]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PRETOKENIZERS))
def test_llama_cpp_splits_as_the_table_says(name, mini_corpus, tmp_path):
    """Every entry of the table: a tokenizer trained with it, llama.cpp on its vocabulary-only GGUF with that
    name, the same ids on every mini-corpus document and script-edge string (NFC)."""
    _llama_cpp()
    from export.llamacpp_check import token_agreement

    texts = _mini_texts(mini_corpus)
    tok = train_tokenizer(texts, vocab_size=1500, split=PRETOKENIZERS[name])
    save_tokenizer(tok, tmp_path / "tok")
    path = G.write_vocab_gguf(tmp_path / "tok", tmp_path / "v.gguf")
    got = token_agreement(path, tmp_path / "tok" / "tokenizer.json", texts + list(SCRIPT_EDGES.values()))
    assert got.equal == got.total == len(texts) + len(SCRIPT_EDGES), got.differences


@pytest.mark.slow
def test_llama_cpp_ids_equal_tokenizer_json_on_nfc_text(bundle, mini_corpus, tmp_path):
    """The bundle's GGUF: llama.cpp's ids equal tokenizer.json's on every document (mini corpus, and the shared
    corpus's validation split when it is beside the checkout) and every script-edge string, 100 % for NFC input.
    Raw (non-NFC) input differs exactly where NFC would change it: the precomposed nukta letters."""
    _llama_cpp()
    from export.llamacpp_check import token_agreement
    from tests.conftest import SHARED
    from train.tokenizer.fertility import split_docs

    path = G.export_gguf(bundle, tmp_path / "m.gguf", log=lambda m: None)
    texts = _mini_texts(mini_corpus) + list(SCRIPT_EDGES.values())
    if (SHARED / "corpus").is_dir():
        texts += [d.text for d in split_docs(list_input_files([str(SHARED / "corpus")]), "val", 0.01)]
    got = token_agreement(path, bundle / "tokenizer.json", texts)
    assert got.equal == got.total == len(texts), got.differences
    raw = token_agreement(path, bundle / "tokenizer.json", [SCRIPT_EDGES["nukta precomposed"]], nfc=False)
    assert raw.equal == 0  # llama.cpp applies no NFC: U+09DC/09DD/09DF stay precomposed and tokenize apart
    same = token_agreement(path, bundle / "tokenizer.json",
                           [v for k, v in SCRIPT_EDGES.items() if k != "nukta precomposed"], nfc=False)
    assert same.equal == same.total  # the other edge strings are NFC already


@pytest.mark.slow
def test_llama_cpp_greedy_text_in_text_out_equals_serve(bundle, tmp_path):
    """Text in, text out: llama.cpp's completion on the f32 GGUF (its own tokenizer, BOS and detokenizer) equals
    ``serve.load(bundle)``'s greedy text for 10 prompts per language (a difference only at a near-tie)."""
    _llama_cpp()
    from export.llamacpp_check import GREEDY_PROMPTS, greedy_text_agreement

    path = G.export_gguf(bundle, tmp_path / "m.gguf", log=lambda m: None)
    results = greedy_text_agreement(path, bundle, GREEDY_PROMPTS, max_new_tokens=24)
    assert sum(r.lang == "bn" for r in results) == 10 and sum(r.lang == "en" for r in results) == 10
    bad = [(r.prompt, r.ours, r.theirs) for r in results if not r.ok]
    assert bad == []
    assert sum(r.equal for r in results) >= 18


@pytest.mark.slow
def test_format_2_tokenizer_differs_in_llama_cpp_as_the_refusal_says(mini_corpus, tmp_path):
    """The reason for the refusal: a format-2 tokenizer under its nearest llama.cpp name (qwen35) agrees on plain
    words and differs on digit runs and joiners."""
    _llama_cpp()
    from export.llamacpp_check import token_agreement

    tok = train_tokenizer(_mini_texts(mini_corpus), vocab_size=1500, split=LEGACY)
    save_tokenizer(tok, tmp_path / "tok")
    path = G.write_vocab_gguf(tmp_path / "tok", tmp_path / "v.gguf", approximate_pretokenizer=True)
    tj = tmp_path / "tok" / "tokenizer.json"
    assert token_agreement(path, tj, ["আমি বাংলায় গান গাই", "The history of the river"]).equal == 2
    hard = token_agreement(path, tj, ["সাল ২০২৪ এবং 12345 টাকা", "র\u200d্যাব ক্\u200cষ", "১৯৭১ সালে ২৬শে"])
    assert hard.equal < hard.total
