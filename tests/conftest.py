"""Shared fixtures: the mini corpus, Fixture Tok, Fixture M, fast configs and a trained tiny run.

Fixtures follow ``docs/cases.md``:

* **Fixture M** — Llama-style decoder, vocab 512, hidden 64, 2 layers, 4 query / 2 KV heads (head_dim 16),
  RMSNorm eps 1e-6, rotate-half RoPE, theta 10000, max_position 128, tied embeddings, fp32, seed 0.
* **Fixture Tok** — Shalik's tokenizer trained on ``tests/data/mini`` (a fixed Bangla + English slice of the
  corpus checked into the repository), vocab 1000.

The suite needs no ``../shared``: tests that do (anchor tokenizers, the full corpus) skip with a reason.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MINI = ROOT / "tests" / "data" / "mini"
SHARED = Path(os.environ.get("SHALIK_SHARED", ROOT.parent / "shared"))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or skip the test with a clear reason when it is absent."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"needs {p} (../shared is not beside this checkout)")
    return p


@pytest.fixture(scope="session")
def mini_corpus() -> Path:
    return MINI


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    """One tokenizer/shard cache for the whole session (prepare is reused across tests)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def fixture_tok(tmp_path_factory) -> Path:
    """Fixture Tok: vocab 1000, trained on the train split of tests/data/mini. Returns its folder."""
    from train.corpus import list_input_files
    from train.tokenizer import save_tokenizer, train_tokenizer
    from train.tokenizer.sample import sample_texts

    files = list_input_files([str(MINI)])
    make_iter, _ = sample_texts(files, ["bn", "en"], {"bn": 0.6, "en": 0.4}, 10_000_000, 0.01)
    tok = train_tokenizer(make_iter(), vocab_size=1000, min_frequency=2)
    out = tmp_path_factory.mktemp("tok") / "fixture-tok"
    save_tokenizer(tok, out, 128)
    return out


@pytest.fixture
def fixture_m():
    """Fixture M (see module doc)."""
    import torch

    from train.model import LlamaForCausalLM, ModelConfig

    cfg = ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                      rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def fast_overrides(tmp: Path, cache: Path, **extra) -> list[str]:
    """``--set`` overrides for a seconds-long training run on the mini corpus."""
    base = {
        "data.paths": [str(MINI)],
        "data.cache_dir": str(cache),
        "data.val_fraction": 0.05,
        "run.out_dir": str(tmp / "runs"),
        "tokenizer.vocab_size": 600,
        "model.hidden_size": 32,
        "model.num_hidden_layers": 2,
        "model.num_attention_heads": 4,
        "model.num_key_value_heads": 2,
        "model.intermediate_size": 64,
        "model.max_position_embeddings": 64,
        "train.micro_batch_size": 4,
        "train.seq_len": 32,
        "train.grad_accum": 2,
        "train.max_steps": 12,
        "train.lr": 1e-2,
        "train.warmup_steps": 3,
        "train.eval_every": 1000,
        "train.eval_tokens": 256,
        "train.ckpt_every": 1000,
        "train.log_every": 1,
        "train.preflight": False,
    }
    base.update(extra)
    import json

    return [f"{k}={json.dumps(v)}" for k, v in base.items()]


def fast_config(tmp: Path, cache: Path, **extra):
    from train.config import load_config

    return load_config("tiny", fast_overrides(tmp, cache, **extra))


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, session_cache) -> Path:
    """A tiny model trained for 40 steps on the mini corpus (the export and serving tests use it)."""
    from train.run import Trainer

    tmp = tmp_path_factory.mktemp("trained")
    cfg = fast_config(tmp, session_cache, **{"run.name": "tiny-trained", "train.max_steps": 40,
                                              "model.hidden_size": 64, "model.intermediate_size": 128,
                                              "model.max_position_embeddings": 128, "train.seq_len": 64,
                                              "train.eval_every": 40})
    Trainer(cfg, log=lambda m: None).train()
    return tmp / "runs" / "tiny-trained"


@pytest.fixture(scope="session")
def bundle(tmp_path_factory, trained_run) -> Path:
    """The trained tiny run exported to a bundle with its q8_0 model (``export.onnx.export_bundle``; the parity
    gate is tested in test_export)."""
    export_onnx = pytest.importorskip("export.onnx")
    out = tmp_path_factory.mktemp("bundle") / "bundle"
    export_onnx.export_bundle(trained_run, out, parity=False, quantize="q8_0", log=lambda m: None)
    return out
