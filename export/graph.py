"""Torch → ONNX: one decoder graph with a KV cache and docs/design.md's I/O names (:mod:`contract.bundle`), by either
exporter.

The graph takes ``input_ids``, ``attention_mask``, ``position_ids`` (int64) and ``past_key_values.{i}.key/.value``
``[batch, kv_heads, past_sequence_length, head_dim]`` and returns ``logits`` ``[batch, sequence_length, vocab]``
(float32) and ``present.{i}.key/.value`` ``[batch, kv_heads, total_sequence_length, head_dim]``. batch, sequence,
past and total lengths are symbolic (``dim_param``), so one graph serves prefill with an empty past and every
decode step (cases X2, X3). The model computes cos/sin from ``position_ids`` and its mask from shapes, so no
table is frozen at the traced length (case X1).

Traced with batch 2, sequence 5, past 3 (notes/export-facts.md: never sequence 1 under dynamo; sizes > 1 so no
axis is specialised).
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from pathlib import Path

import onnx
import torch
from torch.export import Dim

from contract.bundle import onnx_input_names, onnx_output_names
from train.model import LlamaForCausalLM

OPSET = 20
EXPORTERS = ("dynamo", "torchscript")
EXAMPLE_SIZES = (2, 5, 3)  # batch, sequence, past
AXES = ("batch", "sequence_length", "past_sequence_length", "total_sequence_length")


class FlatDecoder(torch.nn.Module):
    """``forward(input_ids, attention_mask, position_ids, *past)`` → ``(logits, *presents)`` with the cache as
    a flat list k0, v0, k1, v1, … (the exporters' input/output names apply to flat lists)."""

    def __init__(self, model: LlamaForCausalLM):
        super().__init__()
        self.model = model
        self.num_layers = model.config.num_hidden_layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        """int64 ids/mask/positions and 2·L past tensors → (float32 logits, 2·L presents)."""
        pkv = [(past[2 * i], past[2 * i + 1]) for i in range(self.num_layers)]
        logits, presents = self.model(input_ids, attention_mask, position_ids, pkv, True)
        return (logits, *[t for kv in presents for t in kv])


def example_inputs(model: LlamaForCausalLM, sizes: tuple[int, int, int] = EXAMPLE_SIZES,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Example feed for tracing: ``sizes`` = (batch, sequence, past); past K/V in ``dtype``."""
    c = model.config
    b, s, p = sizes
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (b, s), generator=g)
    mask = torch.ones(b, p + s, dtype=torch.int64)
    pos = torch.arange(p, p + s, dtype=torch.int64)[None].expand(b, s).contiguous()
    past = [torch.randn(b, c.num_key_value_heads, p, c.head_dim, generator=g).to(dtype)
            for _ in range(2 * c.num_hidden_layers)]
    return (ids, mask, pos, *past)


def check_example_sizes(sizes: tuple[int, int, int]) -> None:
    """Refuse example (batch, sequence, past) sizes below 2, naming the axis: torch.export specialises an axis
    traced at size 0 or 1 (its "0/1 specialization"), so the graph would accept no other size, and torch's own
    error for it names no axis. Raises ValueError."""
    for axis, n in zip(AXES, sizes, strict=False):
        if not isinstance(n, int) or n < 2:
            raise ValueError(f"example {axis} = {n}: trace with at least 2 on every axis (an axis traced at 0 or 1 "
                             f"is specialised to that size by torch.export); the default is {EXAMPLE_SIZES}")


def export_graph(model: LlamaForCausalLM, path: Path, exporter: str = "dynamo", dtype: str = "float32",
                 sizes: tuple[int, int, int] | None = None, opset: int = OPSET) -> None:
    """Write ``path`` (``model.onnx``) and its external data ``path.name + ".data"`` beside it.

    ``sizes``: the example (batch, sequence, past) traced, default :data:`EXAMPLE_SIZES`, each at least 2
    (:func:`check_example_sizes`, ValueError naming the axis). ``model`` is not
    modified (a float16 export works on a half-precision copy: weights and KV cache in float16, norms, rotary
    angles and logits in float32). ``exporter`` is "dynamo" (``torch.export``) or "torchscript".
    Raises whatever the exporter raises (the caller falls back to the other exporter).
    """
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter {exporter!r}; expected one of {EXPORTERS}")
    check_example_sizes(sizes or EXAMPLE_SIZES)
    tdtype = {"float32": torch.float32, "float16": torch.float16}[dtype]
    m = model if tdtype == torch.float32 else _half_copy(model)
    m.eval()
    wrapper = FlatDecoder(m).eval()
    L = model.config.num_hidden_layers
    ctx = model.config.max_position_embeddings
    ex = example_inputs(model, sizes or EXAMPLE_SIZES, tdtype)
    ins, outs = onnx_input_names(L), onnx_output_names(L)
    path = Path(path)
    for stale in (path, path.with_name(path.name + ".data")):  # onnx.save appends to an existing .data file
        stale.unlink(missing_ok=True)
    sink = io.StringIO()
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(sink):
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            B = Dim(AXES[0], min=1, max=1024)
            S = Dim(AXES[1], min=1, max=ctx)
            P = Dim(AXES[2], min=0, max=ctx)
            T = Dim(AXES[3], min=1, max=2 * ctx)
            dynamic = ({0: B, 1: S}, {0: B, 1: T}, {0: B, 1: S}, tuple({0: B, 2: P} for _ in range(2 * L)))
            prog = torch.onnx.export(wrapper, ex, None, dynamo=True, input_names=ins, output_names=outs,
                                     dynamic_shapes=dynamic, opset_version=opset)
            prog.save(str(path), external_data=True)
            _rename_total_axis(path)
        else:
            ids, mask, pos = ins[:3]
            axes = {ids: {0: AXES[0], 1: AXES[1]}, mask: {0: AXES[0], 1: AXES[3]},
                    pos: {0: AXES[0], 1: AXES[1]}, outs[0]: {0: AXES[0], 1: AXES[1]}}
            axes.update({n: {0: AXES[0], 2: AXES[2]} for n in ins[3:]})
            axes.update({n: {0: AXES[0], 2: AXES[3]} for n in outs[1:]})
            tmp = path.with_name(path.name + ".inline")
            try:
                torch.onnx.export(wrapper, ex, str(tmp), dynamo=False, input_names=ins, output_names=outs,
                                  dynamic_axes=axes, opset_version=opset)
                mp = onnx.load(str(tmp))
                onnx.save(mp, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                          location=path.name + ".data", size_threshold=1024)
            finally:
                tmp.unlink(missing_ok=True)


def _rename_total_axis(path: Path) -> None:
    """dynamo names the presents' length axis "past_sequence_length + sequence_length"; call it
    ``total_sequence_length``, the attention mask's name (ORT accepts the rename: export-facts.md). Rewrites
    only the graph file; the external data stays where it is."""
    mp = onnx.load(str(path), load_external_data=False)
    changed = False
    for v in mp.graph.output:
        for d in v.type.tensor_type.shape.dim:
            if d.dim_param.replace(" ", "") in ("past_sequence_length+sequence_length",
                                                 "sequence_length+past_sequence_length"):
                d.dim_param = AXES[3]
                changed = True
    if changed:
        onnx.save(mp, str(path))


def _half_copy(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A float16 copy of ``model`` (ties kept); the original stays float32."""
    return copy.deepcopy(model).half()
