"""The cleaning stage of prepare (train/clean): normalisation and hashes, the quality rules on Bangla, the planted
corpus's known answers, the split of whole works, the same result whatever the number of workers, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.clean_planted import score
from benchmarks.planted_corpus import make_planted
from tests.conftest import fast_overrides
from train.clean import minhash, quality, stage
from train.clean.decide import CODE, VAL
from train.clean.split import scan_and_decide
from train.clean.text import ChunkNgrams, NgramHashes, ngram_hashes, text_hash, word_spans, word_spans_many, words
from train.clean.works import work_key, work_order, work_title
from train.config import ConfigError, load_config
from train.corpus import iter_documents, list_input_files

ROOT = Path(__file__).resolve().parent.parent


def test_words_normalise_case_punctuation_and_joiners():
    assert words("Hello, WORLD! আমার সোনার বাংলা। র\u200d্য") == ["hello", "world", "আমার", "সোনার", "বাংলা", "র্য"]
    assert text_hash("আমি  তোমায়, ভালোবাসি।") == text_hash("আমি তোমায় ভালোবাসি")
    assert text_hash("আমি তোমায় ভালোবাসি") != text_hash("আমি তোমায় ভালোবাসি না")
    # the hash is fixed across processes and runs (no hash()): a regression value
    assert text_hash("আমার সোনার বাংলা") == 0xF86A23CA3216651C


def test_ngram_hashes_incremental_equal_direct():
    wh, wl, _ = word_spans("এক দুই তিন চার পাঁচ ছয় সাত আট নয় দশ এগারো বারো তেরো চোদ্দ")
    assert wl.tolist()[:2] == [2, 3]
    ng = NgramHashes(wh, 13)
    for n in (1, 2, 5, 13, 20):
        assert np.array_equal(ng.get(n), ngram_hashes(wh, n))
    assert len(ng.get(13)) == 2 and len(ng.get(20)) == 1


def test_many_texts_at_once_equal_one_at_a_time():
    texts = ["এক দুই তিন চার পাঁচ ছয় সাত আট নয় দশ এগারো বারো তেরো চোদ্দ", "", "র\u200d্য আর\u200c কি", "।", "one",
             "Hello, WORLD! আমার সোনার বাংলা", "\u200c", "a b c d e f g h i j k l m n o p"]
    texts += [texts[0], "x y z w v " * 3]  # an n-gram of another document is no repeat
    wh, wl, off = word_spans_many(texts)
    assert off.tolist()[:3] == [0, 14, 14] and off[-1] == len(wh) == len(wl)
    chunk = ChunkNgrams(wh, off, 13, premix=(3,))
    g13, doc13 = chunk.windows(13)
    assert doc13.tolist() == [0, 0] + [7] * 4 + [8, 8] + [9] * 3
    for i, t in enumerate(texts):
        h, lengths, _ = word_spans(t)
        assert np.array_equal(wh[off[i]:off[i + 1]], h) and np.array_equal(wl[off[i]:off[i + 1]], lengths)
        one, view = NgramHashes(h, 13), chunk.doc(i)
        for n in (1, 2, 3, 5, 13, 20):
            assert np.array_equal(view.keys(n), one.keys(n)) and np.array_equal(view.get(n), one.get(n)), (i, n)
        assert np.array_equal(g13[doc13 == i], ngram_hashes(h, 13) if len(h) >= 13 else np.zeros(0, np.uint64))
    shares = quality.ngram_chars(ChunkNgrams(wh, off, 10), wl)
    for i in range(len(texts)):
        h, lengths, _ = word_spans(texts[i])
        alone = quality.ngram_chars(ChunkNgrams(h, np.array([0, len(h)]), 10), lengths)
        assert {k: int(v[i]) for k, v in shares.items()} == {k: int(v[0]) for k, v in alone.items()}, i
    assert shares["top_2gram"][0] == 0 and shares["dup_5gram"][-1] == 15 and shares["top_2gram"][-1] == 3 * 2


def test_batched_signatures_equal_one_document_at_a_time():
    rng = np.random.default_rng(3)
    a = minhash.permutations(112)
    docs = [rng.integers(0, 2**63, size=int(k), dtype=np.uint64) for k in (5, 0, 1, 13, 0, 40, 7, 2, 0)]
    want = np.stack([minhash.signature(d, a) for d in docs])
    assert want[1].tolist() == [0xFFFFFFFF] * 112 and len(set(want[3].tolist())) > 100
    for block in (1, 4, 7, 8192):  # documents cut across blocks, whole blocks of one document
        got = minhash.signatures(docs, a, block=block)
        assert got.dtype == np.uint32 and got.shape == (len(docs), 112) and np.array_equal(got, want)


def _plain_ngram_features(ws: list[str]) -> tuple[dict[str, float], dict[str, set]]:
    """Gopher's duplicate n-gram shares counted on word tuples (the reference for quality.features), and the
    top n-gram share's possible values (one per most frequent n-gram: a tie goes to the lowest hash)."""
    from collections import Counter  # noqa: PLC0415

    total = sum(map(len, ws))
    out, top = {}, {}
    for k in (2, 3, 4):
        grams = Counter(tuple(ws[i:i + k]) for i in range(len(ws) - k + 1))
        c = max(grams.values())
        top[f"top_{k}gram"] = {(c * sum(map(len, g)) if c > 1 else 0) / total for g, x in grams.items() if x == c}
    for k in range(5, 11):
        grams = Counter(tuple(ws[i:i + k]) for i in range(len(ws) - k + 1))
        cover = [False] * len(ws)
        for i in range(len(ws) - k + 1):
            if grams[tuple(ws[i:i + k])] > 1:
                cover[i:i + k] = [True] * k
        out[f"dup_{k}gram"] = sum(len(w) for w, c in zip(ws, cover) if c) / total
    return out, top


@pytest.mark.parametrize("text", [
    "আমি তোমায় ভালোবাসি আমি তোমায় ভালোবাসি আমি তোমায় খুব ভালোবাসি নদী বয়ে যায় সাগরে",
    "এক দুই তিন চার পাঁচ ছয় সাত আট নয় দশ এগারো বারো এক দুই তিন চার পাঁচ ছয় সাত আট নয় দশ তেরো চোদ্দ পনেরো",
    "cheap phones best price buy now cheap phones best price buy now deal free shipping cheap phones best buy",
])
def test_top_and_repeated_ngram_shares_equal_a_plain_count(text):
    wh, wl, _ = word_spans(text)
    f = quality.features(text, wh, wl, quality.load_rules(), "bn")
    want, top = _plain_ngram_features(words(text))
    assert {k: f[k] for k in want} == pytest.approx(want)
    assert max(want.values()) > 0.3  # the texts do repeat
    for k, values in top.items():
        assert any(f[k] == pytest.approx(v) for v in values) and max(values) > 0.1, k


def test_work_key_groups_parts_and_books():
    assert work_title("বাংলা ভাষা (অংশ 2)") == "বাংলা ভাষা"
    assert work_title("Oliver Twist — CHAPTER I") == "Oliver Twist"
    assert work_title("Great Expectations — Chapter XIX (part 1)") == "Great Expectations"
    assert work_key("x", "s", "A — b", "au", None) == work_key("y", "s", "A — c (অংশ 3)", "au", None)
    assert work_key("x", "s", "A", "au", None) != work_key("x", "s", "A", "other", None)
    assert work_key("x", "s", "A", None, "w1") == work_key("y", "t", "B", None, "w1")


def test_terminators_include_danda_and_short_poem_lines_pass():
    rules = quality.load_rules()
    poem = "আকাশে চাঁদ\nমাঠে ধান\nনদীর জল\nবাতাস বয়\nপাখি গায়\nসন্ধ্যা নামে।"
    wh, wl, _ = word_spans(poem)
    f = quality.features(poem, wh, wl, rules, "bn")
    assert f["terminal_lines"] == pytest.approx(1 / 6)
    assert quality.failure_mask(f, rules, "bn") == 0
    prose = "সে বলল। তারপর চলে গেল॥ কেন?"
    wh, wl, _ = word_spans(prose)
    assert quality.features(prose, wh, wl, rules, "bn")["terminal_lines"] == 1.0


@pytest.mark.parametrize("off, sets, match", [
    (["no_such_rule"], {}, "data.clean_off: unknown rule 'no_such_rule'"),
    ([], {"bn.min_words.min": 1e9}, r"data.clean_set: bn.min_words.min = 1000000000.0 is outside its range"),
    ([], {"xx.min_words.min": 1}, "data.clean_set: unknown threshold 'xx.min_words.min'"),
])
def test_bad_rule_names_and_thresholds_name_the_key(off, sets, match):
    with pytest.raises(ConfigError, match=match):
        quality.load_rules(off, sets)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("planted") / "corpus"
    truth = make_planted(folder, seed=1, base_docs=250, counts={"near": 20, "exact": 8, "boilerplate": 10,
                                                                 "spam": 10, "mojibake": 10, "mixed_script": 6,
                                                                 "eval": 10})
    cache = folder.parent / "cache"
    cfg = load_config("tiny", [f"data.paths={json.dumps([str(folder)])}", f"data.cache_dir={json.dumps(str(cache))}"])
    return folder, truth, cfg


def test_planted_defects_are_found(planted):
    folder, truth, cfg = planted
    files = list_input_files(cfg.data.paths)
    codes, report, cleaner = scan_and_decide(cfg, files, workers=1)
    texts = [d.text for d in iter_documents(files) if d.lang in cfg.data.languages]
    res = score(codes, report, cleaner, truth, texts)
    r = res["recall"]
    assert r["near ≤ 10 %"]["recall"] >= 0.95
    assert r["exact"]["recall"] == 1.0
    for kind in ("boilerplate", "spam", "mojibake"):
        assert r[kind]["recall"] >= 0.9, kind
    assert r["eval"]["recall"] == 1.0
    assert res["precision"]["near_dup"]["precision"] >= 0.99
    assert report["val_works_with_train_parts"] == 0
    assert report["split"]["val"]["docs"] > 0
    # the same decisions with two workers
    codes2, report2, _ = scan_and_decide(cfg, files, workers=2)
    assert np.array_equal(codes, codes2) and report2["removed"] == report["removed"]


def test_a_near_copy_of_a_validation_document_drops_the_copy(tmp_path):
    def text(tag: str, n: int = 120) -> str:
        ws = [f"{tag}কথা{k}" for k in range(n)]
        return "\n".join(" ".join(ws[i:i + 10]) + "।" for i in range(0, n, 10))

    others = [{"text": text(f"অ{i}"), "title": f"t{i}", "source": "s", "author": "a"} for i in range(40)]
    keys = [work_order(work_key(r["text"], "s", r["title"], "a", None)) for r in others]
    val_work = next(f"v{i}" for i in range(10_000) if work_order("work\x1f" + f"v{i}") < min(keys))
    base = text("মূল")
    copy = base.replace("মূলকথা5 ", "নতুন ", 1).replace("মূলকথা50 ", "আরেক ", 1)
    rows = [{"text": base, "work": val_work, "source": "s"}, *others, {"text": copy, "title": "copy", "source": "s"}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows), encoding="utf-8")
    cfg = load_config("tiny", [f"data.paths={json.dumps([str(tmp_path)])}", "data.languages=[\"bn\"]",
                               "data.mix={bn=1.0}", "tokenizer.sample_weights={bn=1.0}", "data.val_fraction=0.05",
                               f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}"])
    codes, report, _ = scan_and_decide(cfg, list_input_files(cfg.data.paths), workers=1)
    assert codes[0] == VAL and codes[len(rows) - 1] == CODE["near_dup"]
    assert report["removed"]["near_dup"]["docs"] == 1


def test_clean_off_removes_nothing_and_keeps_the_split(planted):
    _folder, _truth, cfg = planted
    cfg.data.clean = False
    try:
        codes, report, _ = scan_and_decide(cfg, list_input_files(cfg.data.paths), workers=1)
    finally:
        cfg.data.clean = True
    assert set(np.unique(codes).tolist()) == {0, 1} and report["removed"] == {}
    assert report["val_works_with_train_parts"] == 0


def _prepare_cli(tmp_path, *sets):
    cache = tmp_path / "cache"
    over = fast_overrides(tmp_path, cache)
    args = [sys.executable, "-m", "train.data", "prepare", "--config", "tiny", "--workers", "1"]
    for o in [*over, *sets]:
        args += ["--set", o]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600), cache


@pytest.mark.parametrize("sets, match", [
    (['data.clean_off=["nope"]'], "data.clean_off: unknown rule 'nope'"),
    (['data.clean_set={"en.mojibake.max"=1000}'], "data.clean_set: en.mojibake.max = 1000.0 is outside"),
    (['data.clean_set={"en.min_words.min"=100000}'], "cleaning removed every en (English) document"),
])
def test_bad_cleaning_input_exits_2_with_one_line_and_no_shards(tmp_path, sets, match):
    p, cache = _prepare_cli(tmp_path, *sets)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and match in last
    assert "Traceback" not in p.stderr
    shards = cache / "shards"
    assert not shards.exists() or not any(x.name[0] != "." and (x / "index.json").exists() for x in shards.iterdir())


def test_report_lists_rules_and_works(tmp_path):
    cache = tmp_path / "cache"
    args = [sys.executable, "-m", "train.data", "report", "--config", "tiny", "--workers", "1"]
    for o in fast_overrides(tmp_path, cache):
        args += ["--set", o]
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "# Cleaning report" in p.stdout and "Validation works with a part in training: 0." in p.stdout
    shard_dir = Path(p.stdout.strip().splitlines()[-1].split("shards: ", 1)[1])
    index = json.loads((shard_dir / "index.json").read_text())
    works = index["splits"]["works"]
    assert works["val"]["works"] >= 1 and works["train"]["works"] > works["val"]["works"]
    assert index["cleaning"]["in"]["docs"] >= index["cleaning"]["kept"]["docs"]
    assert (shard_dir / "cleaning.md").is_file()
    assert "cleaning: split of whole works" in p.stderr


def test_settings_fingerprint_follows_the_keys():
    cfg = load_config("tiny")
    a = stage.fingerprint(stage.settings_from(cfg))
    cfg.data.clean_off = ["dup_lines"]
    assert stage.fingerprint(stage.settings_from(cfg)) != a
    cfg.data.clean = False
    assert stage.fingerprint(stage.settings_from(cfg)) == {"format": stage.FORMAT_VERSION, "enabled": False}
