"""The fine-tuning run's data, in the interface the Trainer reads from :class:`train.components.run_data.RunData`:
the tokenizer (the pretrained run's, with the chat tokens added when it lacks them), ``eot_id`` / ``pad_id``,
``char_counts``, the training ``loader`` and ``val`` (language → windows), the checkpoint's files.

Conversations are padded, not packed: each is one row of ``[<|endoftext|>] + its tokens``, right-padded with
context-only ``<|pad|>`` to the longest row of its step (rounded up to 8; to ``train.seq_len + 1`` when the decoder layers are compiled:
static shapes), so causal attention needs no mask and
positions start at 0 as they do when a runtime encodes the conversation; ``benchmarks/sft.py`` measured this
against packing with a block-diagonal mask (benchmarks/results/sft.md). To keep the padding small, each epoch's
order groups conversations of similar length: a permutation is cut into pools of :data:`POOL_STEPS` steps, each
pool is sorted by length and cut into steps, and the steps are shuffled.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contract.chat_format import CHAT_TOKENS, missing_chat_tokens
from train import windows as W
from train.components.checkpoint import CheckpointError, find_checkpoint
from train.config import Config
from train.corpus import DataError, is_hf_spec
from train.errors import TrainError
from train.hf_files import CHAT_DATA_KIND
from train.inputs import scan_inputs
from train.loader import EpochLoader
from train.sft.encode import encode_conversations, pad_windows, to_window
from train.sft.formats import ReadStats, jsonl_files, read_conversations
from train.tokenizer import EOT, PAD, TokenizerError, add_chat_tokens, load_tokenizer, token_char_counts

POOL_STEPS = 50  # steps per length-sorted pool
PAD_MULTIPLE = 8


def spread(windows: list[np.ndarray], max_targets: int) -> list[np.ndarray]:
    """Evenly spaced windows (every k-th, in reading order) holding at most ``max_targets`` targets in all: the
    periodic evaluation's share of the validation split (``train.eval_tokens``, as for pretraining)."""
    total = sum(W.target_count(w) for w in windows)
    if total <= max_targets:
        return windows
    keep = max(1, int(len(windows) * max_targets / total))
    return [windows[int(i)] for i in np.linspace(0, len(windows) - 1, keep).round().astype(int)]


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


class ConversationLoader(EpochLoader):
    """Deterministic, resumable steps of padded conversation windows (see the module doc). ``windows`` are
    :mod:`train.windows` rows of different lengths; ``step_size`` is the windows of one optimizer step (all
    ranks), which the pools are cut into; the position and its resume are :class:`train.loader.EpochLoader`'s."""

    def __init__(self, windows: list[np.ndarray], step_size: int, seq_len: int, seed: int, pad_id: int,
                 fixed_length: bool = False):
        if not windows:
            raise ValueError("no training conversations")
        super().__init__(len(windows), seed)
        self.windows = windows
        self.lengths = np.asarray([len(w) for w in windows], dtype=np.int64)
        self.step_size = step_size
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.fixed_length = fixed_length

    def epoch_order(self, epoch: int) -> np.ndarray:
        """A seeded permutation cut into pools of :data:`POOL_STEPS` steps, each sorted by length and cut into
        steps, the steps shuffled."""
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(self.n_windows)
        pool = self.step_size * POOL_STEPS
        steps = []
        for i in range(0, len(perm), pool):
            part = perm[i:i + pool]
            part = part[np.argsort(self.lengths[part], kind="stable")]
            steps += [part[j:j + self.step_size] for j in range(0, len(part), self.step_size)]
        return np.concatenate([steps[k] for k in rng.permutation(len(steps))])

    def window(self, i: int) -> np.ndarray:
        return self.windows[i]

    def collate(self, rows: list[np.ndarray]) -> np.ndarray:
        """``rows`` as int64 ``[n, L]`` (L ≤ seq_len + 1), right-padded to the longest (rounded up)."""
        multiple = self.seq_len + 1 if self.fixed_length else PAD_MULTIPLE
        return pad_windows(rows, self.pad_id, multiple, self.seq_len + 1)


def base_checkpoint(run: str | Path) -> Path:
    """The newest intact checkpoint of a pretrained run folder (or a checkpoint folder itself). TrainError
    naming the path when there is none."""
    try:
        return find_checkpoint(run)
    except CheckpointError as e:
        raise TrainError(f"{run}: not a trained run (expected a run folder as python -m train.run writes, e.g. "
                         f"runs/cpu): {e}") from None


@dataclass
class SFTData:
    """See the module doc; the attributes are :class:`train.components.run_data.RunData`'s, plus ``added`` (the
    chat tokens added to the base tokenizer), ``stats`` (what reading skipped), ``too_long`` (conversations
    over ``seq_len + 1`` tokens, skipped), ``counts`` (per split and language), ``inputs`` (file, sha256, bytes),
    ``sources`` (per source and licence of the conversations: rows and characters) and ``base`` (the pretrained
    checkpoint's data_summary.json: its sources and licences go on into the model card)."""

    tokenizer: object
    eot_id: int
    pad_id: int
    char_counts: np.ndarray
    loader: ConversationLoader
    val: dict[str, list[np.ndarray]]
    added: list[str]
    stats: ReadStats
    too_long: int
    counts: dict
    inputs: list[dict]
    sources: list[dict]
    base: dict

    @classmethod
    def load(cls, cfg: Config, base: Path, step_size: int, log: Callable[[str], None],
             fixed_length: bool = False) -> SFTData:
        """Read ``cfg.data.paths`` with the tokenizer of the base checkpoint ``base``; TrainError (exit 2) on bad
        input or when no conversation is left to train on. ``fixed_length``: every step padded to
        ``train.seq_len + 1`` (the static shapes a compiled step module wants) instead of its longest row."""
        try:
            tok = load_tokenizer(base)
            added = missing_chat_tokens(tok.get_vocab(with_added_tokens=True))
            add_chat_tokens(tok)
        except (TokenizerError, ValueError) as e:
            raise TrainError(f"{base}: {e}") from None
        eot_id, pad_id = tok.token_to_id(EOT), tok.token_to_id(PAD)
        stats = ReadStats()
        try:
            convs = read_conversations(cfg.data.paths, cfg.data.val_fraction, cfg.data.strict, stats)
        except DataError as e:
            raise TrainError(str(e)) from None
        limit = cfg.train.seq_len + 1
        train, val, too_long = [], {}, 0
        counts: Counter = Counter()
        sources: dict[tuple, list[int]] = {}
        for c, (ids, mask) in zip(convs, encode_conversations(tok, [c.messages for c in convs], eot_id), strict=True):
            if len(ids) > limit or not mask[1:].any():
                too_long += 1
                continue
            w = to_window(ids, mask)
            counts[(c.split, c.lang)] += 1
            src = sources.setdefault((c.source, c.license), [0, 0])
            src[0] += 1
            src[1] += sum(len(m["content"]) for m in c.messages)
            (train if c.split == "train" else val.setdefault(c.lang, [])).append(w)
        if stats.unexpected_files:
            odd = stats.unexpected_files
            log(f"sft data: skipped {len(odd)} file(s) in the data folders that are not .jsonl or .jsonl.gz: "
                + ", ".join(odd[:5]) + (" …" if len(odd) > 5 else ""))
        for msg in stats.skipped[:5]:
            log(msg)
        if len(stats.skipped) > 5:
            log(f"… and {len(stats.skipped) - 5} more rows skipped")
        log(f"sft data: {stats.rows:,} rows → {len(train):,} train and {sum(map(len, val.values())):,} validation "
            f"conversations ({', '.join(f'{s} {lang} {n:,}' for (s, lang), n in sorted(counts.items()))}); skipped: "
            f"{len(stats.skipped)} not a conversation, {stats.no_assistant} without an assistant turn, {too_long} "
            f"longer than train.seq_len + 1 = {limit} tokens")
        if not train:
            n_val = sum(map(len, val.values()))
            hint = (f"all {n_val} usable ones are on the validation side (rows with \"split\": \"validation\", or "
                    f"drawn by data.val_fraction = {cfg.data.val_fraction}); give rows for training"
                    if n_val else "expected JSON Lines of messages, Alpaca or ShareGPT rows")
            raise TrainError(f"{', '.join(cfg.data.paths)}: no training conversation left (read {stats.rows} rows; "
                             f"{len(stats.skipped)} not conversations, {stats.no_assistant} without an assistant "
                             f"turn, {too_long} too long, {n_val} validation); {hint}")
        val = {lang: [pad_windows([w], pad_id, 32)[0] for w in spread(ws, cfg.train.eval_tokens)]
               for lang, ws in val.items()}
        loader = ConversationLoader(train, step_size, cfg.train.seq_len, cfg.run.seed, pad_id, fixed_length)
        files = jsonl_files(cfg.data.paths)[0]
        inputs = [i.fingerprint() for i in scan_inputs([f for f in files if not is_hf_spec(f)])]
        inputs += [{"path": f, "sha256": None, "bytes": None} for f in files if is_hf_spec(f)]
        return cls(tokenizer=tok, eot_id=eot_id, pad_id=pad_id,
                   char_counts=np.asarray(token_char_counts(tok), dtype=np.int64), loader=loader, val=val,
                   added=added, stats=stats, too_long=too_long,
                   counts={f"{s}/{lang}": n for (s, lang), n in sorted(counts.items())}, inputs=inputs,
                   sources=[{"source": f"sft: {s}", "license": lic, "docs": n, "chars": ch}
                            for (s, lic), (n, ch) in sorted(sources.items(), key=lambda kv: str(kv[0]))],
                   base=_read_json(base / "data_summary.json"))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def tokenizer_json(self) -> str:
        return self.tokenizer.to_str(pretty=True)

    @property
    def tokenizer_sha256(self) -> str:
        return hashlib.sha256(self.tokenizer_json.encode("utf-8")).hexdigest()

    @property
    def chat_ids(self) -> dict[str, int]:
        return {t: self.tokenizer.token_to_id(t) for t in CHAT_TOKENS}

    def summary(self, tokens_seen: int) -> dict:
        """``data_summary.json``: the conversations per split and language, what was skipped, the chat tokens
        added, the tokens seen, the tokenizer's sha256 and the inputs."""
        return {"kind": CHAT_DATA_KIND, "sources": [*self.base.get("sources", []), *self.sources],
                "languages": self.base.get("languages", {}), "conversations": self.counts,
                "skipped": {"not_a_conversation": len(self.stats.skipped), "no_assistant_turn": self.stats.no_assistant,
                            "too_long": self.too_long, "files_not_read": len(self.stats.skipped_files)},
                "chat_tokens_added": self.added, "tokens_seen": tokens_seen, "tokenizer_sha256": self.tokenizer_sha256,
                "inputs": [{**i, "path": Path(i["path"]).name if i["sha256"] else i["path"]} for i in self.inputs]}

    def checkpoint_files(self, tokens_seen: int) -> dict[str, Path | str]:
        """The tokenizer (with the chat tokens) and ``data_summary.json``."""
        return {"tokenizer.json": self.tokenizer_json,
                "data_summary.json": json.dumps(self.summary(tokens_seen), indent=2, ensure_ascii=False)}
