"""train.hf_files: the one builder of config.json, generation_config.json and tokenizer_config.json, used by
checkpoints (train.components.checkpoint.save_checkpoint) and bundles (export.bundle)."""

from __future__ import annotations

import json

import pytest

from train.components.checkpoint import save_checkpoint, verify_sums
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


def test_chat_parts_follow_the_model(fixture_m, fixture_tok, tmp_path):
    """A checkpoint trained on conversations (data_summary.json kind "sft") whose tokenizer has
    <|im_start|>/<|im_end|> gets the chat template and both end ids; a base model's checkpoint with the same
    tokenizer (which reserves the chat tokens untrained) gets neither; a folder whose tokenizer lacks them loses
    both (train.hf_files.sync_chat_files, as export runs it), other keys kept."""
    from tokenizers import Tokenizer

    from contract.chat_format import CHAT_TEMPLATE
    from train.hf_files import CHAT_DATA_KIND, sync_chat_files, trained_on_conversations

    tok = fixture_tok / "tokenizer.json"
    im_end, im_start = (Tokenizer.from_file(str(tok)).token_to_id(t) for t in ("<|im_end|>", "<|im_start|>"))
    sft = json.dumps({"kind": CHAT_DATA_KIND})
    ck = save_checkpoint(tmp_path / "a", 1, fixture_m, None, {"step": 1},
                         {"tokenizer.json": tok, "data_summary.json": sft}, 2, special_ids=(0, 1))
    tc = json.loads((ck / "tokenizer_config.json").read_text(encoding="utf-8"))
    gc = json.loads((ck / "generation_config.json").read_text(encoding="utf-8"))
    assert tc["chat_template"] == CHAT_TEMPLATE and gc["eos_token_id"] == [0, im_end, im_start]
    assert trained_on_conversations(ck)
    verify_sums(ck)
    base_ck = save_checkpoint(tmp_path / "b", 1, fixture_m, None, {"step": 1},
                              {"tokenizer.json": tok, "data_summary.json": json.dumps({"sources": []})}, 2,
                              special_ids=(0, 1))
    base_tc = json.loads((base_ck / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "chat_template" not in base_tc and base_tc == {k: v for k, v in tc.items() if k != "chat_template"}
    assert json.loads((base_ck / "generation_config.json").read_text(encoding="utf-8"))["eos_token_id"] == 0
    assert not trained_on_conversations(base_ck) and sync_chat_files(base_ck, chat=False) is False
    # a chat model's folder whose tokenizer lost the tokens loses the chat parts; they come back with the tokens
    base = json.loads(tok.read_text(encoding="utf-8"))
    base["added_tokens"] = [a for a in base["added_tokens"] if a["content"] not in ("<|im_start|>", "<|im_end|>")]
    (ck / "tokenizer.json").write_text(json.dumps(base), encoding="utf-8")
    assert sync_chat_files(ck, chat=True) is False
    tc2 = json.loads((ck / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "chat_template" not in tc2 and tc2 == {k: v for k, v in tc.items() if k != "chat_template"}
    assert json.loads((ck / "generation_config.json").read_text(encoding="utf-8"))["eos_token_id"] == 0
    (ck / "tokenizer.json").write_bytes(tok.read_bytes())
    assert sync_chat_files(ck, chat=True) is True
    assert json.loads((ck / "tokenizer_config.json").read_text(encoding="utf-8")) == tc
    # and a base model's stays without them (export: the checkpoint was not trained on conversations)
    assert sync_chat_files(ck, chat=False) is False
    assert "chat_template" not in json.loads((ck / "tokenizer_config.json").read_text(encoding="utf-8"))
