"""The ONNX backend: a Shalik bundle's ``model.onnx`` (or the graph of a quantization scheme, :mod:`contract.quant`:
``model.q8_0.onnx``, ``model.q4_0.onnx``, ``model.q4_mix.onnx``; an older bundle's ``model.int8.onnx`` for q8_0,
:func:`contract.bundle.onnx_graph`) run by onnxruntime on CPU.

numpy + onnxruntime only — serve never imports torch. The graph's I/O is docs/design.md's (Optimum decoder naming,
:func:`contract.bundle.onnx_input_names` / :func:`contract.bundle.onnx_output_names`):
``input_ids``, ``attention_mask``, ``position_ids`` (int64) and ``past_key_values.{i}.key/.value``
``[batch, kv_heads, past, head_dim]`` → ``logits`` ``[batch, seq, vocab]`` and ``present.{i}.key/.value``
``[batch, kv_heads, past + seq, head_dim]``. One graph serves prefill (past length 0) and decode.

:meth:`OnnxBackend.decode_batch` steps several sequences in one session run: their caches left-padded to the
longest (attention_mask 0 over the padding, each row its own position_ids). The padded presents are kept as one
batched cache (:class:`_Batch`) so that the next step over the same sequences feeds them back without a copy; a
sequence's own cache is cut out of it only when it is used alone again (or the batch changes).

Session options follow notes/export-facts.md: intra-op threads = ``threads`` or every core this process may use,
inter-op 1, ``ORT_ENABLE_ALL`` (it folds the tied lm_head transpose), no spinning between calls (the cores are
shared).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import weakref
from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np
import onnxruntime as ort

from contract.bundle import CONFIG, ONNX_GRAPHS, TOKENIZER, eot_id, onnx_graph, onnx_input_names, onnx_output_names
from contract.quant import Scheme
from serve.backends.base import BackendError, check_ids, check_scheme

BATCH_PAYS_FROM = 2  # smallest batch at which decode_batch beats one-at-a-time decode (benchmarks/onnx_batching.py)

Past = list[tuple[np.ndarray, np.ndarray]]
log = logging.getLogger("shalik.serve")


def default_threads() -> int:
    """Cores this process may run on (``sched_getaffinity``), else ``os.cpu_count()``; at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class _Batch:
    """The left-padded KV cache of the sequences stepped together by the last :meth:`OnnxBackend.decode_batch`.

    ``past``: per layer (k, v) ``[rows, kv_heads, width, head_dim]``; row ``i`` holds ``members[i]``'s cache in
    its last ``position`` slots (the slots before are padding, zeros). ``members``: weak references, so a
    finished sequence that nobody holds any more does not keep its row alive by itself.
    """

    __slots__ = ("past", "width", "members")

    def __init__(self, past: Past, width: int, members: list[OnnxSequence]):
        self.past = past
        self.width = width
        self.members = [weakref.ref(m) for m in members]

    def rows(self, row: int, pad: int) -> Past:
        """Row ``row``'s cache without its ``pad`` padding slots (views, not copies)."""
        return [(k[row:row + 1, :, pad:], v[row:row + 1, :, pad:]) for k, v in self.past]


class OnnxSequence:
    """One sequence's KV cache (numpy arrays returned by the previous step). Implements base.Sequence.

    After :meth:`OnnxBackend.decode_batch` the cache lives in a row of the batch's padded cache (``_slot``); it
    is copied out into arrays of its own on the first call that uses this sequence alone.
    """

    def __init__(self, backend: OnnxBackend):
        self._backend = backend
        self._past: Past | None = None
        self._slot: tuple[_Batch, int] | None = None
        self.position = 0

    def _own_past(self) -> Past | None:
        """This sequence's cache as contiguous ``[1, kv_heads, position, head_dim]`` arrays (None when empty),
        leaving the batched cache it was part of."""
        if self._slot is not None:
            batch, row = self._slot
            self._past = [(np.ascontiguousarray(k), np.ascontiguousarray(v))
                          for k, v in batch.rows(row, batch.width - self.position)]
            self._slot = None
        return self._past

    def _rows(self) -> Past | None:
        """This sequence's cache as ``[1, kv_heads, position, head_dim]`` arrays or views, without copying."""
        if self._slot is not None:
            batch, row = self._slot
            return batch.rows(row, batch.width - self.position)
        return self._past

    def prefill(self, ids: Seq[int], all_logits: bool = False) -> np.ndarray:
        """Append ``ids`` (non-empty ints) to the cache; float32 logits ``[len(ids), V]`` or ``[V]`` (the last).

        Raises BackendError for an id outside ``[0, vocab_size)`` or a position past the context.
        """
        b = self._backend
        ids = check_ids(ids, b.vocab_size, self.position, b.max_position_embeddings)
        n = len(ids)
        total = self.position + n
        logits, self._past = b.forward(
            np.asarray([ids], dtype=np.int64),
            np.ones((1, total), dtype=np.int64),
            np.arange(self.position, total, dtype=np.int64)[None],
            self._own_past(),
        )
        self.position = total
        return logits[0] if all_logits else logits[0, -1]

    def decode(self, token_id: int) -> np.ndarray:
        """Append one token; float32 logits ``[V]`` for the next position. Errors as :meth:`prefill`."""
        return self.prefill([token_id])

    def reset(self) -> None:
        """Empty the cache (position 0)."""
        self._past = None
        self._slot = None
        self.position = 0

    def fork(self) -> OnnxSequence:
        """A second sequence with the same cache (``n > 1`` choices of one prefill). The past arrays are shared:
        a step never writes into them, it replaces them with onnxruntime's new outputs."""
        past = self._own_past()
        other = OnnxSequence(self._backend)
        other._past = None if past is None else list(past)
        other.position = self.position
        return other


def ort_reason(e: BaseException) -> str:
    """onnxruntime's error without its wrapping: the text after the last ``[ONNXRuntimeError] : N : CODE :``
    without its source locations (``file.cc:123 Function``), on one line. ORT nests a C++ signature and a source path in
    front of the reason (``Exception during initialization: …/optimizer_execution_frame.cc:74 onnxruntime::…``)."""
    text = " ".join(str(e).split())
    text = re.split(r"\[ONNXRuntimeError\] : \d+ : \w+ : ", text)[-1]
    text = re.sub(r"(?:/[\w.-]+)*/?[A-Za-z_]\w*\.(?:cc|h|cpp):\d+(?: [\w:~]+(?= [A-Z]))?", " ", text)
    text = " ".join(text.removeprefix("Exception during initialization:").split())
    return text or str(e)


class OnnxBackend:
    """A bundle's ONNX graph in an onnxruntime session, plus a factory of KV caches.

    ``OnnxBackend(bundle_dir, quantize=None | Scheme, threads=None)``: reads ``config.json`` (vocab size, context,
    layers, kv heads, head dim) and ``model.onnx`` (with ``quantize``, a :class:`contract.quant.Scheme` parsed by
    the caller, the scheme's graph that the bundle holds, :func:`contract.bundle.onnx_graph`: a bundle of format
    minor 0 serves its per-channel ``model.int8.onnx`` as q8_0, logging so once; ``model_file`` names another graph
    in the folder). ``self.quantize`` is the scheme's name (None: float32). Raises TypeError for a ``quantize`` that is not
    a Scheme, BackendError for a scheme without an ONNX form, or when the folder, the config or the graph is missing
    or the graph's inputs are not the bundle's.
    """

    name = "onnx"

    def __init__(self, bundle_dir: str | Path, quantize: Scheme | None = None, threads: int | None = None,
                 model_file: str | None = None):
        self.path = Path(bundle_dir)
        scheme = check_scheme(quantize)
        if scheme is not None and not scheme.onnx:
            raise BackendError(f"quantize {scheme.name!r} has no ONNX form (the onnx backend offers "
                               f"{', '.join(n for n in ONNX_GRAPHS if n)})")
        self.quantize = scheme.name if scheme else None
        cfg_path = self.path / CONFIG
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise BackendError(f"{cfg_path}: cannot read the bundle's config ({e})") from None
        try:
            self.vocab_size = int(cfg["vocab_size"])
            self.max_position_embeddings = int(cfg["max_position_embeddings"])
            self.num_layers = int(cfg["num_hidden_layers"])
            self.num_kv_heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
            self.head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        except (KeyError, TypeError, ValueError) as e:
            raise BackendError(f"{cfg_path}: missing or invalid key {e}") from None
        self.model_path = self.path / (model_file or onnx_graph(self.path, self.quantize))
        if model_file is None and self.model_path.name != ONNX_GRAPHS[self.quantize]:
            log.warning("%s: serving %s (onnxruntime's per-channel 8-bit graph of a bundle exported before format "
                        "minor 1) as %s; export the bundle again for %s", self.path, self.model_path.name,
                        self.quantize, ONNX_GRAPHS[self.quantize])
        if not self.model_path.is_file():
            hint = f" (export with --quantize {self.quantize})" if self.quantize and model_file is None else ""
            raise BackendError(f"{self.model_path}: no such ONNX graph in the bundle{hint}")
        self.threads = int(threads) if threads else default_threads()
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.log_severity_level = 4  # fatal only: a load error is ours to report, in one line (ORT also printed it)
        try:  # by path: external data (model.onnx.data) must be resolved beside the graph
            self.session = ort.InferenceSession(str(self.model_path), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception classes
            raise BackendError(f"{self.model_path}: onnxruntime cannot load it ({ort_reason(e)}); a damaged or "
                               f"incomplete bundle? Loading with verification checks every file's sha256") from None
        self._in_names = onnx_input_names(self.num_layers)  # ids, mask, positions, then (key, value) per layer
        self._past_names = list(zip(self._in_names[3::2], self._in_names[4::2], strict=True))
        inputs = {i.name: i for i in self.session.get_inputs()}
        missing = [n for n in self._in_names if n not in inputs]
        if missing:
            raise BackendError(f"{self.model_path}: graph inputs {missing[:4]} missing (got {sorted(inputs)[:6]} …); "
                               f"not a Shalik bundle graph for this {CONFIG}")
        # fp16 bundles keep the cache in float16; logits always come back as float32
        self.kv_dtype = np.float16 if inputs[self._in_names[3]].type == "tensor(float16)" else np.float32
        self._out_names = onnx_output_names(self.num_layers)

    @functools.cached_property
    def eot_id(self) -> int:
        """``<|endoftext|>``'s id, from the bundle's tokenizer.json (:func:`contract.bundle.eot_id`)."""
        from tokenizers import Tokenizer  # only for callers of this property (serve.lm holds its own tokenizer)

        return eot_id(Tokenizer.from_file(str(self.path / TOKENIZER)))

    def new_sequence(self) -> OnnxSequence:
        """An empty KV cache at position 0."""
        return OnnxSequence(self)

    def empty_past(self, batch: int) -> Past:
        """Length-0 past for ``batch`` rows: per layer (k, v) of shape ``[batch, kv_heads, 0, head_dim]``."""
        z = np.zeros((batch, self.num_kv_heads, 0, self.head_dim), dtype=self.kv_dtype)
        return [(z, z) for _ in range(self.num_layers)]

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                past: Past | None = None) -> tuple[np.ndarray, Past]:
        """One batched graph call, no validation beyond shapes (the parity gate's entry point).

        input_ids, position_ids: int64 ``[batch, seq]``; attention_mask: int64 ``[batch, past + seq]`` (1 = real
        token, 0 = left padding); past: per layer (k, v) ``[batch, kv_heads, past, head_dim]`` or None (length 0).
        Returns float32 logits ``[batch, seq, vocab]`` and the presents ``[batch, kv_heads, past + seq, head_dim]``.
        Raises BackendError when onnxruntime rejects the feed (wrong shapes, say).
        """
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        if past is None:
            past = self.empty_past(input_ids.shape[0])
        elif len(past) != self.num_layers:
            raise BackendError(f"past: {len(past)} layers of (key, value), the model has {self.num_layers}")
        ids_name, mask_name, pos_name = self._in_names[:3]
        feed = {ids_name: input_ids,
                mask_name: np.ascontiguousarray(attention_mask, dtype=np.int64),
                pos_name: np.ascontiguousarray(position_ids, dtype=np.int64)}
        for (kn, vn), (k, v) in zip(self._past_names, past, strict=False):
            feed[kn] = np.asarray(k, dtype=self.kv_dtype)
            feed[vn] = np.asarray(v, dtype=self.kv_dtype)
        try:
            outs = self.session.run(self._out_names, feed)
        except Exception as e:  # noqa: BLE001 - onnxruntime's Fail / InvalidArgument
            raise BackendError(f"onnxruntime rejected the call: {e}") from None
        logits = np.asarray(outs[0], dtype=np.float32)
        presents = [(outs[1 + 2 * i], outs[2 + 2 * i]) for i in range(self.num_layers)]
        return logits, presents

    #: keep the padded presents of a batch for the next step over the same sequences (False: re-pad every step;
    #: benchmarks/onnx_batching.py measures the copy this saves)
    keep_batched_cache = True

    def decode_batch(self, seqs: Seq[OnnxSequence], token_ids: Seq[int]) -> np.ndarray:
        """Append ``token_ids[i]`` to ``seqs[i]`` for every i in ONE session run; float32 logits ``[B, V]``.

        Row i equals ``seqs[i].decode(token_ids[i])`` up to float noise (B = 1 is exactly that call), and each
        sequence's cache and ``position`` end as that call would leave them. The caches are left-padded to the
        longest (attention_mask 0 over the padding, ``position_ids`` = each row's own position). The padded
        presents stay shared by the sequences, so the next call with the same sequences in the same order feeds
        them back without a copy; a different set is re-padded (one copy of each cache), and a sequence used
        alone again copies its row out. Not thread-safe: one caller steps a backend's sequences.

        fp32: the padding is masked exactly (its slots get weight 0) and a row matches its single run to ~1e-6.
        The quantized graphs are not batched by the engine (:meth:`batch_pays`); an older bundle's per-channel
        ``model.int8.onnx`` takes one activation scale per tensor (DynamicQuantizeLinear), i.e. over all rows, so
        there a row's logits move with the other rows' activations (max |Δlogit| ~5e-2 on `small`).

        Raises BackendError, before any cache changes, for an empty list, ``len(seqs) != len(token_ids)``, a
        sequence given twice or not made by this backend's :meth:`new_sequence`, a token id that is not an int
        in ``[0, vocab_size)``, or a sequence already at the context length.
        """
        b = len(seqs)
        if b == 0:
            raise BackendError("decode_batch: expected at least one sequence, got an empty list")
        if len(token_ids) != b:
            raise BackendError(f"decode_batch: {b} sequences but {len(token_ids)} token ids; expected one id per "
                               "sequence")
        seen: dict[int, int] = {}
        ids = []
        for i, (seq, tok) in enumerate(zip(seqs, token_ids, strict=True)):
            if not isinstance(seq, OnnxSequence) or seq._backend is not self:
                raise BackendError(f"decode_batch: seqs[{i}] ({type(seq).__name__}) is not a sequence of this "
                                   f"backend; expected one made by {self!r}.new_sequence()")
            if id(seq) in seen:
                raise BackendError(f"decode_batch: seqs[{i}] is seqs[{seen[id(seq)]}] again; expected distinct "
                                   "sequences")
            seen[id(seq)] = i
            try:
                ids += check_ids([tok], self.vocab_size, seq.position, self.max_position_embeddings)
            except BackendError as e:
                raise BackendError(f"decode_batch: seqs[{i}] / token_ids[{i}]: {e}") from None
        if b == 1:
            return seqs[0].decode(ids[0])[None]
        positions = np.array([s.position for s in seqs], dtype=np.int64)
        first = seqs[0]._slot
        same = (self.keep_batched_cache and first is not None and len(first[0].members) == b
                and all(s._slot is not None and s._slot[0] is first[0] and s._slot[1] == i
                        for i, s in enumerate(seqs)))
        if same:
            width, past = first[0].width, first[0].past
        else:
            width, past = int(positions.max()), self._pad([s._rows() for s in seqs], positions)
        mask = (np.arange(width + 1)[None] >= (width - positions)[:, None]).astype(np.int64)
        logits, presents = self.forward(np.asarray(ids, dtype=np.int64)[:, None], mask, positions[:, None], past)
        old = {id(s._slot[0]): s._slot[0] for s in seqs if s._slot is not None and not same}
        batch = _Batch(presents, width + 1, list(seqs))
        for i, s in enumerate(seqs):
            s._slot, s._past = (batch, i), None
            s.position += 1
        for g in old.values():  # members left out of this batch take their rows, so the old batch can go
            for ref in g.members:
                m = ref()
                if m is not None and m._slot is not None and m._slot[0] is g:
                    m._own_past()
        return logits[:, -1]

    def _pad(self, pasts: list[Past | None], positions: np.ndarray) -> Past:
        """Per layer (k, v) ``[B, kv_heads, max(positions), head_dim]``: row i = ``pasts[i]`` right-aligned,
        zeros before it."""
        width = int(positions.max())
        out = []
        for layer in range(self.num_layers):
            kv = []
            for j in (0, 1):
                a = np.zeros((len(pasts), self.num_kv_heads, width, self.head_dim), dtype=self.kv_dtype)
                for i, p in enumerate(pasts):
                    if p is not None and positions[i]:
                        a[i, :, width - positions[i]:] = p[layer][j][0]
                kv.append(a)
            out.append((kv[0], kv[1]))
        return out

    def batch_pays(self, batch_size: int) -> bool:
        """Whether the engine (:mod:`serve.engine`) should step ``batch_size`` sequences with :meth:`decode_batch`:
        it beats as many :meth:`OnnxSequence.decode` calls in aggregate decode tokens/s from B = 2 on
        (benchmarks/onnx_batching.py, `small`, 2 threads: 1.6x at 2, 5.3x at 16 in fp32). Never for a quantized
        graph: an older bundle's per-channel int8 graph quantizes activations with one scale over the whole batch,
        so a row's tokens would depend on which requests share its steps (serving promises the same text for the
        same seed whatever runs beside), and the MatMulNBits graphs are not measured batched; the rust backend
        batches the quantized forms bit-exactly instead."""
        return self.quantize is None and batch_size >= BATCH_PAYS_FROM

    def logits(self, ids: Seq[int]) -> np.ndarray:
        """float32 logits ``[len(ids), V]`` for one sequence from position 0 (no cache kept)."""
        return self.new_sequence().prefill(ids, all_logits=True)

    def __repr__(self) -> str:
        return f"OnnxBackend({str(self.model_path)!r}, threads={self.threads})"
