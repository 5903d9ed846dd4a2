"""train.hf_files: the one builder of config.json, generation_config.json and tokenizer_config.json, used by
checkpoints (train.checkpoint.save_checkpoint) and bundles (export.bundle)."""

from __future__ import annotations

import json

import pytest

from train.checkpoint import save_checkpoint, verify_sums
from train.hf_files import NAMES, hf_files


def test_checkpoint_sidecars_come_from_the_one_builder(fixture_m, tmp_path):
    ck = save_checkpoint(tmp_path, 1, fixture_m, None, {"step": 1}, {"note.txt": "x"}, 2, special_ids=(0, 1))
    want = hf_files(fixture_m.config, 0, 1)
    assert set(want) == set(NAMES)
    for name in NAMES:
        assert json.loads((ck / name).read_text(encoding="utf-8")) == want[name]
    assert want["config.json"]["tie_word_embeddings"] is True and want["generation_config.json"]["eos_token_id"] == 0
    assert want["tokenizer_config.json"]["model_max_length"] == fixture_m.config.max_position_embeddings
    verify_sums(ck)
    assert not [p for p in ck.iterdir() if p.name.startswith(".tmp-")]
    with pytest.raises(ValueError, match="config.json"):
        save_checkpoint(tmp_path, 2, fixture_m, None, {}, {"config.json": "{}"}, 2, special_ids=(0, 1))
