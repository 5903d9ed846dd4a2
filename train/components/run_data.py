"""The run's data: the prepared tokenizer and shards (rank 0 prepares while the other ranks wait under torchrun),
the training loader, the validation windows per language and the characters of every token."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from train.components.placement import DistInfo, publish, wait_for
from train.config import Config, ConfigError
from train.corpus import DataError
from train.data import Prepared, prepare
from train.errors import TrainError
from train.loader import TrainLoader, val_windows
from train.shards import open_shard
from train.tokenizer import EOT, PAD, load_tokenizer, token_char_counts

DATA_WAIT_S = 6 * 3600  # how long ranks > 0 wait for rank 0 to prepare the data under torchrun


def prepare_on_rank0(cfg: Config, dist: DistInfo, log: Callable[[str], None]) -> Prepared:
    """prepare() on rank 0; under torchrun the other ranks wait for rank 0's word on the store (never in a
    collective with a timeout), then open the cache it built. Bad input (DataError, ConfigError) and a wait past
    :data:`DATA_WAIT_S` raise TrainError naming it."""
    try:
        if not dist.enabled:
            return prepare(cfg, log=log)
        if dist.is_main:
            try:
                prepared = prepare(cfg, log=log)
            except (DataError, ConfigError) as e:
                publish(dist, "data", {"error": str(e)})
                raise
            publish(dist, "data", {"ok": True})
            return prepared
        word = wait_for(dist, "data", "data preparation (to skip the wait, run `python -m train.data "
                          "prepare` with the same config before torchrun)", DATA_WAIT_S, print)
        if "error" in word:
            raise TrainError(f"rank 0 could not prepare the data: {word['error']}")
        return prepare(cfg, log=lambda m: None)
    except (DataError, ConfigError, TimeoutError) as e:
        raise TrainError(str(e)) from None


@dataclass
class RunData:
    """What a run reads: ``prepared`` (the shard and tokenizer folders and ``index.json``), the ``tokenizer`` with
    its ``eot_id`` / ``pad_id``, ``char_counts`` (int64 ``[vocab_size]``: NFC characters each token decodes to,
    for bits per character), the training ``loader`` and ``val`` (language → int64 windows of ≤ seq_len + 1
    tokens, at most ``train.eval_tokens`` targets per language)."""

    prepared: Prepared
    tokenizer: object
    eot_id: int
    pad_id: int
    char_counts: np.ndarray
    loader: TrainLoader
    val: dict[str, list[np.ndarray]]

    @classmethod
    def load(cls, cfg: Config, dist: DistInfo, log: Callable[[str], None]) -> RunData:
        """Prepare (see :func:`prepare_on_rank0`) and open everything; raises TrainError on bad input."""
        prepared = prepare_on_rank0(cfg, dist, log)
        tokenizer = load_tokenizer(prepared.tokenizer_dir)
        idx = prepared.index
        loader = TrainLoader(prepared.shard_dir, idx, cfg.train.seq_len, cfg.run.seed)
        val = {}
        for lang, fname in idx["splits"]["val"]["files"].items():
            w = val_windows(open_shard(prepared.shard_dir / fname), cfg.train.seq_len, cfg.train.eval_tokens)
            if w:
                val[lang] = w
        return cls(prepared=prepared, tokenizer=tokenizer, eot_id=tokenizer.token_to_id(EOT),
                   pad_id=tokenizer.token_to_id(PAD),
                   char_counts=np.asarray(token_char_counts(tokenizer), dtype=np.int64), loader=loader, val=val)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def tokenizer_sha256(self) -> str:
        return self.prepared.index["tokenizer_sha256"]

    def summary(self, tokens_seen: int) -> dict:
        """``data_summary.json`` of a checkpoint: sources and licences (for the model card), languages, the target
        and actual token mix, the tokens seen so far, the tokenizer's sha256 and the inputs (file name, sha256,
        bytes)."""
        idx = self.prepared.index
        return {"sources": idx["sources"], "languages": idx["languages"], "target_mix": idx["target_mix"],
                "token_mix": idx["token_mix"], "tokens_seen": tokens_seen, "tokenizer_sha256": idx["tokenizer_sha256"],
                "inputs": [{"path": Path(i["path"]).name, "sha256": i["sha256"], "bytes": i["bytes"]}
                           for i in idx["inputs"]]}

    def checkpoint_files(self, tokens_seen: int) -> dict[str, Path | str]:
        """The data's files in a checkpoint: the tokenizer (copied) and ``data_summary.json``."""
        return {"tokenizer.json": self.prepared.tokenizer_dir / "tokenizer.json",
                "data_summary.json": json.dumps(self.summary(tokens_seen), indent=2, ensure_ascii=False)}
