"""A scripted model for tests (a test double of a serving backend): emits fixed pieces (or seeded random logits) at a set pace.

``scripted_lm(["ABC", "DEF", "G"], delay_s=0.01)`` is an :class:`serve.lm.LM` whose tokenizer has each piece
as one token and whose backend, at every step, puts nearly all probability on the next piece of the script
(cycling, never end-of-text unless ``eos_after`` is given). ``script=None`` gives seeded random logits
instead (the same for every request, so only the sampler's randomness differs). It implements the backend
protocol of :mod:`serve.backends.base` and sleeps ``delay_s`` per token (blocking, like real compute).

``gate`` lets a test, not the clock, decide when the model moves on: every sequence makes its first
``gate_after`` tokens, then each further step blocks until the gate opens. The gate is a ``threading.Event``
(``set()`` opens it) or a file path (creating the file opens it: a server in another process, released by the
test), e.g. ``scripted_lm(["ab"], gate=str(tmp_path / "open"), gate_after=1)``. ``prefill_gate`` (the same
kinds) holds every prefill until it opens: the engine's step is held *inside* the first request's prefill, so
requests submitted meanwhile wait in the engine's queue and join the next step together.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np

from contract.bundle import EOT, PAD
from serve.backends.base import check_ids
from serve.detok import bytes_to_unicode
from serve.lm import LM

PEAK = 40.0  # logit of the scripted token; every other logit is 0


def scripted_tokenizer(pieces: Sequence[str] = (), chat: bool = False):
    """A byte-level BPE ``tokenizers.Tokenizer``: ``<|endoftext|>`` (0), ``<|pad|>`` (1), the 256 bytes, then
    the prefixes of each piece (so each piece is one token), then with ``chat`` ``<|im_start|>`` and
    ``<|im_end|>`` (``train.tokenizer.add_chat_tokens``). Returns the tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = bytes_to_unicode()
    vocab = {EOT: 0, PAD: 1}
    for b in range(256):
        vocab[alphabet[b]] = len(vocab)
    merges: list[tuple[str, str]] = []
    for piece in pieces:
        symbols = [alphabet[b] for b in piece.encode("utf-8")]
        left = symbols[0]
        for s in symbols[1:]:
            merged = left + s
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((left, s))
            left = merged
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOT, special=True), AddedToken(PAD, special=True)])
    if chat:
        from train.tokenizer import add_chat_tokens

        add_chat_tokens(tok)
    return tok


class ScriptedSequence:
    """One sequence of :class:`ScriptedBackend` (the backend protocol's Sequence)."""

    def __init__(self, backend: ScriptedBackend):
        self.backend = backend
        self.position = 0
        self.steps = 0  # tokens decoded after the prefill

    def prefill(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        b = self.backend
        ids = check_ids(ids, b.vocab_size, self.position, b.max_position_embeddings)
        b.hold([self], first=True)
        b.wait_for(b.prefill_gate)
        b.pause()
        rows = np.stack([b.context_logits(self.position + i) for i in range(len(ids))])
        self.position += len(ids)
        rows[-1] = b.step_logits(0, self.position - 1)
        return rows if all_logits else rows[-1]

    def decode(self, token_id: int) -> np.ndarray:
        self.backend.hold([self])
        self.backend.pause()
        return self._advance(token_id)

    def fork(self) -> ScriptedSequence:
        """A copy of this sequence (same position and script step)."""
        other = ScriptedSequence(self.backend)
        other.position, other.steps = self.position, self.steps
        return other

    def _advance(self, token_id: int) -> np.ndarray:
        b = self.backend
        check_ids([token_id], b.vocab_size, self.position, b.max_position_embeddings)
        self.position += 1
        self.steps += 1
        b.decoded += 1
        return b.step_logits(self.steps, self.position - 1)


class ScriptedBackend:
    """Backend protocol implementation driven by a script of token ids.

    script: ids emitted in turn (cycled), or None for seeded random logits; delay_s: blocking delay per
    prefill and per decode step (``busy``: spin the CPU instead of sleeping); eos_after: emit end-of-text (id 0) as the token after this many;
    ``decoded`` counts decode steps over all sequences (a token counter for tests); gate, gate_after: see the
    module docstring (``gate_timeout_s``: a step held longer raises, so a test that never opens the gate fails
    instead of hanging); ``held`` counts the steps that have waited at the closed gate; prefill_gate: every
    prefill waits for it.
    """

    name = "scripted"

    def __init__(self, vocab_size: int, context: int = 128, script: Sequence[int] | None = None,
                 delay_s: float = 0.0, eos_after: int | None = None, seed: int = 0, busy: bool = False,
                 gate=None, gate_after: int = 0, gate_timeout_s: float = 300.0, prefill_gate=None, eos_id: int = 0):
        self.vocab_size = int(vocab_size)
        self.max_position_embeddings = int(context)
        self.script = None if script is None else list(script)
        self.delay_s = float(delay_s)
        self.eos_after = eos_after
        self.eos_id = eos_id
        self.seed = seed
        self.busy = busy
        self.decoded = 0
        self.gate = gate
        self.gate_after = int(gate_after)
        self.gate_timeout_s = float(gate_timeout_s)
        self.prefill_gate = prefill_gate
        self.held = 0

    def new_sequence(self) -> ScriptedSequence:
        return ScriptedSequence(self)

    def decode_batch(self, seqs: Sequence[ScriptedSequence], token_ids: Sequence[int]) -> np.ndarray:
        """One step of every sequence at the cost of one (as a batched forward that reads the weights once):
        one delay, then float32 logits ``[len(seqs), V]``."""
        self.hold(seqs)
        self.pause()
        return np.stack([s._advance(t) for s, t in zip(seqs, token_ids)])

    @staticmethod
    def is_open(gate) -> bool:
        """Whether ``gate`` lets a step through: None, an Event that is set, a path that exists."""
        if gate is None:
            return True
        return gate.is_set() if hasattr(gate, "is_set") else os.path.exists(gate)

    def hold(self, seqs: Sequence[ScriptedSequence], first: bool = False) -> None:
        """Block until ``gate`` opens when this step makes a token past the first ``gate_after`` of any of
        ``seqs`` (``first``: a prefill, which makes token 1; a decode makes token ``steps + 2``)."""
        if any((1 if first else s.steps + 2) > self.gate_after for s in seqs):
            self.wait_for(self.gate)

    def wait_for(self, gate) -> None:
        """Block until ``gate`` opens, as ``pause`` waits: sleeping, or (``busy``) spinning the CPU in Python
        between looks at the gate. Raises RuntimeError after ``gate_timeout_s``."""
        if self.is_open(gate):
            return
        self.held += 1
        end = time.monotonic() + self.gate_timeout_s
        while not self.is_open(gate):
            if time.monotonic() > end:
                raise RuntimeError(f"the scripted backend's gate stayed closed for {self.gate_timeout_s:g} s")
            if self.busy:
                spin = time.perf_counter() + 0.01
                while time.perf_counter() < spin:
                    pass
            else:
                time.sleep(0.002)

    def pause(self) -> None:
        """The per-step delay: blocks the calling thread, sleeping or (``busy``) spinning the CPU in Python
        (holding the GIL between switches, as numpy/onnxruntime glue would)."""
        if self.delay_s <= 0:
            return
        if not self.busy:
            time.sleep(self.delay_s)
            return
        end = time.perf_counter() + self.delay_s
        while time.perf_counter() < end:
            pass

    def context_logits(self, position: int) -> np.ndarray:
        """Deterministic float32 logits ``[V]`` after the token at ``position`` (prompt rows; random mode)."""
        return np.random.default_rng((self.seed, position)).normal(size=self.vocab_size).astype(np.float32)

    def step_logits(self, step: int, position: int) -> np.ndarray:
        """float32 logits ``[V]`` predicting generated token number ``step`` (0-based) after the token at
        ``position``."""
        if self.eos_after is not None and step >= self.eos_after:
            return self._peak(self.eos_id)
        if self.script is None:
            return self.context_logits(position)
        return self._peak(self.script[step % len(self.script)])

    def _peak(self, token_id: int) -> np.ndarray:
        out = np.zeros(self.vocab_size, dtype=np.float32)
        out[token_id] = PEAK
        return out


def scripted_lm(pieces: Sequence[str] | None = None, *, context: int = 128, delay_s: float = 0.0,
                eos_after: int | None = None, name: str = "scripted", extra_pieces: Sequence[str] = (),
                busy: bool = False, gate=None, gate_after: int = 0, prefill_gate=None, chat: bool = False) -> LM:
    """An :class:`LM` whose backend emits ``pieces`` in turn (one token each), or random logits when
    ``pieces`` is None. ``extra_pieces`` are added to the vocabulary without being scripted; ``gate``,
    ``gate_after``: hold every sequence after that many tokens until the gate opens; ``prefill_gate``: hold every
    prefill until it opens (module docstring); ``chat``: a chat model — the tokenizer has the chat tokens and
    ``eos_after`` ends the turn with ``<|im_end|>`` instead of ``<|endoftext|>``."""
    tok = scripted_tokenizer([*(pieces or ()), *extra_pieces], chat=chat)
    script = None if pieces is None else [tok.token_to_id(_spelled(p)) for p in pieces]
    backend = ScriptedBackend(tok.get_vocab_size(with_added_tokens=True), context, script, delay_s, eos_after,
                              busy=busy, gate=gate, gate_after=gate_after, prefill_gate=prefill_gate,
                              eos_id=tok.token_to_id("<|im_end|>") if chat else 0)
    return LM(backend, tok, name=name)


def _spelled(piece: str) -> str:
    alphabet = bytes_to_unicode()
    return "".join(alphabet[b] for b in piece.encode("utf-8"))
