"""train.compression (the compressor floor) and the per-source evaluation it is compared with
(train.components.evaluation.evaluate_sources, strided_spans), on the mini corpus."""

from __future__ import annotations

import lzma
from pathlib import Path

import numpy as np
import pytest
import torch

from contract.text import distinct_word_share
from tests.conftest import MINI, fast_config
from train import compression as C
from train.components.evaluation import evaluate_sources, strided_spans
from train.model import LlamaForCausalLM, ModelConfig


@pytest.mark.parametrize("length,seq_len,stride", [(2, 8, 4), (9, 8, 4), (10, 8, 4), (37, 8, 4), (100, 16, 16),
                                                   (100, 16, 5), (1, 8, 4), (0, 8, 4)])
def test_strided_spans_score_every_target_once_with_context(length, seq_len, stride):
    scored, context = [], []
    for begin, n, skip in strided_spans(length, seq_len, stride):
        assert 2 <= n <= seq_len + 1 and begin + n <= length
        targets = list(range(begin + 1 + skip, begin + n))
        scored += targets
        context += [t - begin for t in targets]
    assert scored == list(range(1, length))  # each target once, in order
    if length > seq_len + 1:  # past the first window, every target sees at least seq_len - stride tokens
        assert min(c for t, c in zip(scored, context) if t > seq_len) >= seq_len - stride


def test_distinct_word_share():
    assert distinct_word_share("the the the the") == 0.25
    assert distinct_word_share("আমি বাংলায় গান গাই, আমি") == 0.8  # combining marks stay inside words
    assert distinct_word_share("The river, the sea.") == 0.75  # case-folded, punctuation dropped
    assert distinct_word_share(" ... ") is None


@pytest.fixture(scope="module")
def floor(tmp_path_factory):
    cfg = fast_config(tmp_path_factory.mktemp("floor"), tmp_path_factory.mktemp("cache"))
    return cfg, C.measure(cfg, log=lambda m: None)


def test_floor_per_source_matches_a_direct_measurement(floor):
    cfg, res = floor
    train, sources = C.split_by_source(cfg, [str(p) for p in sorted(MINI.glob("*.jsonl.gz"))])
    assert set(res["sources"]) == set(sources) and {"bn-literature", "en-literature"} <= set(sources)
    name = "bn-literature"
    held = C.SEPARATOR.join(d.encode() for d in sources[name].docs)
    prime = C.SEPARATOR.join(t.encode() for t in train["bn"])
    opts = {"preset": C.XZ_PRESET}
    xz_bits = (len(lzma.compress(prime + C.SEPARATOR + held, **opts)) - len(lzma.compress(prime, **opts))) * 8
    enc = C._ppmd_encoder()
    enc.encode(prime)
    ppmd_bits = (len(enc.encode(C.SEPARATOR + held)) + len(enc.flush())) * 8
    got = res["sources"][name]
    assert got["chars"] == sum(len(d) for d in sources[name].docs) > 0
    assert got["xz_bits"] == xz_bits and got["ppmd16_bits"] == ppmd_bits  # the forked children measure the same
    assert 0.5 < got["ppmd16"] < got["xz"] < 8  # PPMd beats xz on text; both well under 8 bits/char
    lang = res["languages"]["bn"]
    bn = [v for v in res["sources"].values() if v["lang"] == "bn"]
    assert lang["chars"] == sum(v["chars"] for v in bn)
    assert lang["ppmd16"] == pytest.approx(sum(v["ppmd16_bits"] for v in bn) / lang["chars"])


def test_floor_is_cached_by_fingerprint(floor, monkeypatch, tmp_path):
    cfg, res = floor
    monkeypatch.setattr(C, "_added_bytes", lambda *a: pytest.fail("measured again despite the cache"))
    assert C.measure(cfg, log=lambda m: None) == res
    files = [str(f) for f in sorted(MINI.glob("*.jsonl.gz"))]
    other = fast_config(tmp_path, Path(cfg.data.cache_dir), **{"data.val_fraction": 0.2})
    assert C.cache_paths(other, files)[0] != C.cache_paths(cfg, files)[0]


def test_floor_val_documents_are_the_trainers_val_split(floor):
    """The floor's validation text is the data preparation's val split: same documents per language."""
    from train.data import prepare
    from train.shards import open_shard
    from train.tokenizer import load_tokenizer

    cfg, _ = floor
    prepared = prepare(cfg, log=lambda m: None)
    tok = load_tokenizer(prepared.tokenizer_dir)
    sources = C.validation_sources(cfg, log=lambda m: None)
    for lang, fname in prepared.index["splits"]["val"]["files"].items():
        ids = np.asarray(open_shard(prepared.shard_dir / fname)).tolist()
        docs = [d for d in tok.decode(ids, skip_special_tokens=False).split("<|endoftext|>") if d]
        mine = [d for s in sources.values() if s.lang == lang for d in s.docs]
        assert sorted(docs) == sorted(mine), lang


def test_compression_cli_refuses_a_missing_path_with_exit_2(capsys, tmp_path):
    assert C.main(["--data", str(tmp_path / "nope"), "--set", f'data.cache_dir="{tmp_path}"']) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "compression").exists()


def test_evaluate_sources_counts_every_character_and_matches_a_full_forward(floor):
    from train.data import prepare
    from train.tokenizer import EOT, load_tokenizer, token_char_counts

    cfg, _ = floor
    tok = load_tokenizer(prepare(cfg, log=lambda m: None).tokenizer_dir)
    eot = tok.token_to_id(EOT)
    counts = np.asarray(token_char_counts(tok), dtype=np.int64)
    sources = C.validation_sources(cfg, log=lambda m: None)
    torch.manual_seed(0)
    m = LlamaForCausalLM(ModelConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                     max_position_embeddings=4096))
    res = evaluate_sources(m, sources, tok, eot, counts, seq_len=32, device=torch.device("cpu"))
    for name, s in sources.items():
        assert res[name]["chars"] == s.chars  # every NFC character scored exactly once
    assert res["all"]["chars"] == sum(s.chars for s in sources.values())
    # with a window as long as the whole stream, the strided score is the plain full-context NLL
    name = "bn-literature"
    one = {name: sources[name]}
    ids = [i for d in one[name].docs for i in [eot, *tok.encode(d, add_special_tokens=False).ids]]
    x = torch.tensor([ids])
    with torch.no_grad():
        logits, _ = m(x[:, :-1])
    nll = float(torch.nn.functional.cross_entropy(logits[0].double(), x[0, 1:], reduction="mean"))
    full = evaluate_sources(m, one, tok, eot, counts, seq_len=len(ids), device=torch.device("cpu"))
    assert full[name]["nll"] == pytest.approx(nll, rel=1e-5)
    assert full[name]["tokens"] == len(ids) - 1


def test_a_finished_run_reports_its_bits_per_char_beside_the_floor(trained_run):
    """summary.json and train.log of a finished run carry the whole-val-split figures per source beside PPMd-16
    and xz, and the user's samples (sampled with the bundle's defaults, and greedy) with distinct-word shares."""
    import json as _json

    s = _json.loads((trained_run / "summary.json").read_text())
    floor, val = s["compression_floor"], s["val_sources"]
    assert {"bn-literature", "en-literature", "bn", "en"} <= set(floor) <= set(val) | {"all"}
    for k in floor:
        assert 0 < floor[k]["ppmd16"] < floor[k]["xz"] and val[k]["bpc"] > 0
    assert val["all"]["chars"] == sum(v["chars"] for k, v in val.items() if k in ("bn", "en"))
    assert len(s["samples"]) == 5 and all(set(x) >= {"sampled", "greedy", "distinct_sampled"} for x in s["samples"])
    log = (trained_run / "train.log").read_text()
    assert "PPMd-16" in log and "bn-literature" in log and "distinct words" in log


def test_the_model_card_puts_the_model_beside_the_floor(bundle, trained_run):
    import json as _json

    card = (bundle / "README.md").read_text()
    s = _json.loads((trained_run / "summary.json").read_text())
    assert "Against a compressor" in card and "| PPMd-16 |" in card
    row = next(line for line in card.splitlines() if line.startswith("| bn-literature |"))
    assert f"{s['val_sources']['bn-literature']['bpc']:.3f}" in row
    assert f"{s['compression_floor']['bn-literature']['ppmd16']:.3f}" in row
