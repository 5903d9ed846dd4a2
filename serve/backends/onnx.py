"""The ONNX backend: a Shalik bundle's ``model.onnx`` (or ``model.int8.onnx``) run by onnxruntime on CPU.

numpy + onnxruntime only — serve never imports torch. The graph's I/O is docs/design.md's (Optimum decoder naming):
``input_ids``, ``attention_mask``, ``position_ids`` (int64) and ``past_key_values.{i}.key/.value``
``[batch, kv_heads, past, head_dim]`` → ``logits`` ``[batch, seq, vocab]`` and ``present.{i}.key/.value``
``[batch, kv_heads, past + seq, head_dim]``. One graph serves prefill (past length 0) and decode.

Session options follow notes/export-facts.md: intra-op threads = ``threads`` or every core this process may use,
inter-op 1, ``ORT_ENABLE_ALL`` (it folds the tied lm_head transpose), no spinning between calls (the cores are
shared).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np
import onnxruntime as ort

from serve.backends.base import BackendError, check_ids
from serve.bundle import eot_id, parse_quantize

MODEL_FILES = {None: "model.onnx", "int8": "model.int8.onnx"}

Past = list[tuple[np.ndarray, np.ndarray]]


def default_threads() -> int:
    """Cores this process may run on (``sched_getaffinity``), else ``os.cpu_count()``; at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class OnnxSequence:
    """One sequence's KV cache (numpy arrays returned by the previous step). Implements base.Sequence."""

    def __init__(self, backend: OnnxBackend):
        self._backend = backend
        self._past: Past | None = None
        self.position = 0

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
            self._past,
        )
        self.position = total
        return logits[0] if all_logits else logits[0, -1]

    def decode(self, token_id: int) -> np.ndarray:
        """Append one token; float32 logits ``[V]`` for the next position. Errors as :meth:`prefill`."""
        return self.prefill([token_id])

    def reset(self) -> None:
        """Empty the cache (position 0)."""
        self._past = None
        self.position = 0

    def fork(self) -> OnnxSequence:
        """A second sequence with the same cache (``n > 1`` choices of one prefill). The past arrays are shared:
        a step never writes into them, it replaces them with onnxruntime's new outputs."""
        other = OnnxSequence(self._backend)
        other._past = None if self._past is None else list(self._past)
        other.position = self.position
        return other


class OnnxBackend:
    """A bundle's ONNX graph in an onnxruntime session, plus a factory of KV caches.

    ``OnnxBackend(bundle_dir, quantize=None | "int8", threads=None)``: reads ``config.json`` (vocab size, context,
    layers, kv heads, head dim) and ``model.onnx`` (``model.int8.onnx`` with ``quantize="int8"``; ``model_file``
    names another graph in the folder). Raises BackendError when the folder, the config or the graph is missing or
    the graph's inputs are not the bundle's.
    """

    name = "onnx"

    def __init__(self, bundle_dir: str | Path, quantize: str | None = None, threads: int | None = None,
                 model_file: str | None = None):
        self.path = Path(bundle_dir)
        try:
            self.quantize = parse_quantize(quantize)
        except ValueError as e:
            raise BackendError(str(e)) from None
        cfg_path = self.path / "config.json"
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
        self.model_path = self.path / (model_file or MODEL_FILES[self.quantize])
        if not self.model_path.is_file():
            hint = " (export with --quantize int8)" if self.quantize == "int8" and model_file is None else ""
            raise BackendError(f"{self.model_path}: no such ONNX graph in the bundle{hint}")
        self.threads = int(threads) if threads else default_threads()
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:  # by path: external data (model.onnx.data) must be resolved beside the graph
            self.session = ort.InferenceSession(str(self.model_path), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception classes
            raise BackendError(f"{self.model_path}: onnxruntime cannot load it ({e})") from None
        self._past_names = [(f"past_key_values.{i}.key", f"past_key_values.{i}.value") for i in range(self.num_layers)]
        inputs = {i.name: i for i in self.session.get_inputs()}
        expected = ["input_ids", "attention_mask", "position_ids"] + [n for kv in self._past_names for n in kv]
        missing = [n for n in expected if n not in inputs]
        if missing:
            raise BackendError(f"{self.model_path}: graph inputs {missing[:4]} missing (got {sorted(inputs)[:6]} …); "
                               "not a Shalik bundle graph for this config.json")
        # fp16 bundles keep the cache in float16; logits always come back as float32
        self.kv_dtype = np.float16 if inputs["past_key_values.0.key"].type == "tensor(float16)" else np.float32
        self._out_names = ["logits"] + [f"present.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]

    @functools.cached_property
    def eot_id(self) -> int:
        """``<|endoftext|>``'s id, from the bundle's tokenizer.json (:func:`serve.bundle.eot_id`)."""
        from tokenizers import Tokenizer  # only for callers of this property (serve.lm holds its own tokenizer)

        return eot_id(Tokenizer.from_file(str(self.path / "tokenizer.json")))

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
        feed = {"input_ids": input_ids,
                "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.int64),
                "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64)}
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

    def logits(self, ids: Seq[int]) -> np.ndarray:
        """float32 logits ``[len(ids), V]`` for one sequence from position 0 (no cache kept)."""
        return self.new_sequence().prefill(ids, all_logits=True)

    def __repr__(self) -> str:
        return f"OnnxBackend({str(self.model_path)!r}, threads={self.threads})"
