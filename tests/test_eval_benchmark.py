"""Shalik's next-sentence benchmark: the committed task files rebuild byte for byte from the corpus and hold only
validation text, choices are split as lm-evaluation-harness splits them, the Wilson interval, and the model card
showing a checkpoint's figures only when they are its own."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.client_helpers import ROOT, load_script

TASK_DIR = ROOT / "benchmarks" / "eval_tasks"
TASKS = ("bn_next_sentence", "en_next_sentence")


@pytest.fixture(scope="module")
def build():
    return load_script("benchmarks/eval_tasks/build.py")


@pytest.fixture(scope="module")
def bench():
    import benchmarks.eval

    return benchmarks.eval


def test_task_files_rebuild_identically_from_the_val_split(build, tmp_path):
    meta = json.loads((TASK_DIR / "build.json").read_text(encoding="utf-8"))
    docs = build.val_documents([str(ROOT / "data" / "sample")], meta["val_fraction"])
    build.write_tasks(docs, tmp_path, meta["items_asked"], meta["seed"],
                      {k: meta[k] for k in ("val_fraction", "inputs")})
    for name in (*(f"{t}.jsonl" for t in TASKS), "build.json"):
        assert (tmp_path / name).read_bytes() == (TASK_DIR / name).read_bytes(), name
    for task, lang in zip(TASKS, ("bn", "en")):
        flat = {d["sha256"][:12]: " ".join(d["text"].split()) for d in docs[lang]}
        items = [json.loads(line) for line in (TASK_DIR / f"{task}.jsonl").open(encoding="utf-8")]
        assert len(items) == meta["tasks"][task]["items"] and len({it["id"] for it in items}) == len(items)
        for it in items:
            gold = it["choices"][it["gold"]]
            assert it["context"] + " " + gold in flat[it["doc"]], it["id"]  # the true next sentence, in a val doc
            for c in it["choices"]:
                homes = [k for k, text in flat.items() if c in text]
                assert homes, (it["id"], c)  # every choice is validation text
                if c != gold:
                    assert it["doc"] not in homes, (it["id"], c)  # distractors come from other documents
            assert len(set(it["choices"])) == 4


def test_encode_pair_mirrors_lm_eval(bench, fixture_tok):
    model = pytest.importorskip("lm_eval.api.model")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(fixture_tok / "tokenizer.json"))

    class Ours:
        def tokenize(self, text):
            return tok.encode(text, add_special_tokens=False).ids

    class Theirs(model.TemplateLM):  # lm-eval's own split, on the same tokenizer
        tok_encode = staticmethod(Ours().tokenize)
        eot_token_id = 0
        loglikelihood_rolling = generate_until = _loglikelihood_tokens = None

    for context, continuation in [("আমি বাংলায় গান গাই।", " সে ঘরে ফিরল।"), ("He came in.", " She left."),
                                  ("trailing space। ", "x"), ("নদী।\n", "\nপাখি")]:
        assert bench.encode_pair(Ours(), context, continuation) == Theirs()._encode_pair(context, continuation)


def test_wilson_interval(bench):
    assert bench.wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert bench.wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert bench.wilson(125, 500) == pytest.approx((0.2140, 0.2898), abs=1e-4)


def fake_bundle(folder: Path, sha: str, step: int) -> Path:
    from contract.bundle import write_manifest

    folder.mkdir()
    card = "# m — Shalik bundle\n\n## Evaluation\n\nNLL.\n\n## Limits\n\n- small.\n"
    (folder / "README.md").write_text(card, encoding="utf-8")
    write_manifest(folder, complete=False, source={"sha256": sha, "step": step})
    return folder


def entry(name: str, sha: str, step: int, acc: float, twin: str | None = None) -> dict:
    r = {"n": 500, "acc": acc, "acc_ci": [acc - 0.04, acc + 0.04], "acc_norm": acc, "acc_norm_ci": [acc - 0.04, acc + 0.04]}
    return {"name": name, "source": {"sha256": sha, "step": step}, "twin": twin, "results": {"bn_next_sentence": r}}


def test_card_shows_a_checkpoints_own_figures_only(tmp_path):
    from export.card import EVAL_BEGIN, refresh_card

    bundle = fake_bundle(tmp_path / "bundle", "a" * 64, 200)
    results = tmp_path / "eval.json"
    base = {"chance": 0.25, "created": "2026-01-01", "tasks": {"bn_next_sentence": {"seed": 13}}}
    results.write_text(json.dumps({**base, "models": [entry("other", "b" * 64, 200, 0.61),
                                                      entry("same-sha-other-step", "a" * 64, 100, 0.55)]}))
    assert refresh_card(bundle, results)
    card = (bundle / "README.md").read_text(encoding="utf-8")
    assert "have not been run on this checkpoint" in card and "61.0" not in card and "55.0" not in card
    assert card.index(EVAL_BEGIN) < card.index("## Limits")
    overlap = {"bn_next_sentence": {"n": 500, "acc": 0.438, "acc_ci": [0.395, 0.482]}}
    results.write_text(json.dumps({**base, "baselines": {"word_overlap": overlap},
                                   "models": [entry("mine", "a" * 64, 200, 0.432, twin="c" * 64),
                                              entry("mine-init", "c" * 64, 0, 0.251)]}))
    assert refresh_card(bundle, results)
    card = (bundle / "README.md").read_text(encoding="utf-8")
    assert ("| bn-next-sentence | 500 | 43.2 % (39.2–47.2) | 43.2 % (39.2–47.2) | 25.1 % (21.1–29.1) | "
            "25.1 % (21.1–29.1) | 43.8 % (39.5–48.2) | 25.0 % |") in card
    assert "not been run" not in card and card.count(EVAL_BEGIN) == 1 and card.count("## Limits") == 1
    assert not refresh_card(bundle, results)  # idempotent
    listed = json.loads((bundle / "manifest.json").read_text())["files"]["README.md"]
    assert listed == {"sha256": hashlib.sha256(card.encode()).hexdigest(), "bytes": len(card.encode())}


def test_word_overlap_baseline(bench):
    item = {"context": "নদী বয়ে যায় দূরে।", "choices": ["আকাশ নীল।", "সে নদী দেখে না।", "নদী দূরে যায়।", "নদী।"], "gold": 0}
    assert bench.word_overlap_pick(item) == 2  # 3 of 3 words shared; "নদী।" ties at 1 of 1 and comes later
    assert bench.accuracy([2], [item]) == {"n": 1, "acc": 0.0, "acc_ci": list(bench.wilson(0, 1)), "acc_correct": 0}
