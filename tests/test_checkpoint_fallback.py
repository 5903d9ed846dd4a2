"""A damaged newest checkpoint (SHA256SUMS truncated or with a garbage line, ``latest`` not UTF-8,
``trainer_state.json`` not JSON) makes find_checkpoint warn and fall back to the newest intact one, or fail with a
CheckpointError naming the file (issue 18)."""

from __future__ import annotations

import json

import pytest
import torch

from train.components.checkpoint import CheckpointError, find_checkpoint, save_checkpoint, write_sums
from train.model import LlamaForCausalLM, ModelConfig

CFG = ModelConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=32, max_position_embeddings=16)


def two_checkpoints(tmp_path):
    torch.manual_seed(0)
    m = LlamaForCausalLM(CFG)
    root = tmp_path / "run" / "checkpoints"
    for step in (5, 10):
        save_checkpoint(root, step, m, None, {"step": step}, {"config.json": json.dumps(CFG.to_dict())}, keep_last=3)
    return root


@pytest.mark.parametrize("damage", ["sums_truncated", "sums_garbage", "latest_binary", "state_not_json"])
def test_damaged_newest_falls_back_with_a_warning(tmp_path, capsys, damage):
    root = two_checkpoints(tmp_path)
    new = root / "step-000010"
    if damage == "sums_truncated":
        (new / "SHA256SUMS").write_bytes((new / "SHA256SUMS").read_bytes()[:30])
    elif damage == "sums_garbage":
        (new / "SHA256SUMS").write_text((new / "SHA256SUMS").read_text() + "garbage\n")
    elif damage == "latest_binary":
        (root / "latest").write_bytes(b"\xff\xfe step")
    else:
        (new / "trainer_state.json").write_text("{not json")
        write_sums(new)
    if damage == "latest_binary":
        assert find_checkpoint(root.parent).name == "step-000010"  # the newest step folder is intact
    else:
        assert find_checkpoint(root.parent).name == "step-000005"
    err = capsys.readouterr().err
    assert "warning:" in err and "newest intact" in err


def test_nothing_intact_is_a_clear_error(tmp_path):
    root = two_checkpoints(tmp_path)
    for step in ("step-000005", "step-000010"):
        (root / step / "SHA256SUMS").write_text("garbage\n")
    with pytest.raises(CheckpointError, match="no complete checkpoint.*SHA256SUMS: line 1"):
        find_checkpoint(root.parent)
