"""A Llama-style decoder in PyTorch whose parameter names are Hugging Face ``LlamaForCausalLM``'s.

Architecture (Touvron et al. 2023, "Llama 2"; transformers' ``modeling_llama.py``): token embedding →
``num_hidden_layers`` × [RMSNorm → grouped-query self-attention with rotary embeddings → residual, RMSNorm →
SwiGLU MLP → residual] → RMSNorm → lm_head (optionally tied to the embedding). No biases, no dropout.

* RMSNorm reduces in float32 whatever the input dtype (an fp16 ``x.pow(2).mean()`` overflows past 256² and
  returns zeros: case TR6), then multiplies the weight in the input dtype, as transformers does.
* Rotary embeddings use the Hugging Face rotate-half layout: ``inv_freq = 1 / theta^(2i/d)``, ``emb =
  cat(freqs, freqs)``, ``q·cos + rotate_half(q)·sin`` with ``rotate_half(x) = cat(-x2, x1)``. cos/sin are computed
  from ``position_ids`` in the graph (no table frozen at a traced length); q and k are never modified in place.
* Attention goes through ``F.scaled_dot_product_attention``. Without a cache or mask it uses ``is_causal``;
  with a cache or an attention mask it builds a boolean mask (key ≤ query position, key not padding). A query
  always sees itself, so a fully padded row never becomes NaN (case TR8) in any backend. A training step may swap
  the mask-free causal case for :func:`blocked_causal_attention` (``Attention.training_kernel``, set by
  :class:`CausalLMLoss`; only in training mode, so evaluation, export and serving always run SDPA).
* KV cache: ``forward(..., past_key_values=[(k, v)] * L)`` with k, v ``[batch, num_key_value_heads, past, head_dim]``
  returns the presents ``[batch, kv, past + seq, head_dim]`` — the ONNX I/O of docs/design.md. K/V are cached before
  the GQA repeat; q head h reads kv head ``h // (num_attention_heads // num_key_value_heads)``.
* Precision: under autocast cos/sin are built in the autocast dtype, so q and k reach SDPA in bf16 (not upcast
  by an fp32 cos); outside autocast everything stays in the weights' dtype. :func:`forward` returns float32 logits
  (export and serving read them); training goes through :class:`CausalLMLoss`, which never holds the full float32
  logits in reduced precision (a chunked lm_head + cross-entropy, each chunk recomputed in the backward).
* Init: normal(0, initializer_range) for embeddings and projections, with the residual projections (o_proj,
  down_proj) scaled by 1/sqrt(2·num_hidden_layers) (GPT-2, Radford et al. 2019); norms at 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from train.config import ModelSection

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ModelConfig(ModelSection):
    """Model hyper-parameters: the config's ``[model]`` section (Hugging Face ``LlamaConfig`` names) plus the
    tokenizer's ``vocab_size``."""

    vocab_size: int = 32000

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Build from a dict that may hold extra keys (an HF config.json, say); ``rope_theta`` is read from the
        top level or from ``rope_parameters`` — never silently defaulted when a file gives one."""
        keys = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in keys}
        rp = d.get("rope_parameters") or {}
        if "rope_theta" not in kw and isinstance(rp, dict) and "rope_theta" in rp:
            kw["rope_theta"] = rp["rope_theta"]
        return cls(**kw)

    def hf_config(self, torch_dtype: str = "float32", eot_id: int = 0, pad_id: int = 1) -> dict:
        """``config.json`` for ``transformers.LlamaConfig``: every key explicit (LlamaConfig's defaults differ:
        rms_norm_eps 1e-6, tie_word_embeddings false), rope_theta at the top level and in rope_parameters."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": eot_id,
            "eos_token_id": eot_id,
            "pad_token_id": pad_id,
            "torch_dtype": torch_dtype,
            "use_cache": True,
        }


class RMSNorm(nn.Module):
    """y = w · x / sqrt(mean(x²) + eps), the mean taken in float32 or wider (Zhang & Sennrich 2019)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = _upcast(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x2, x1) over the last dimension (the GPT-NeoX / Hugging Face rotary layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin ``[batch, seq, head_dim]`` for ``position_ids`` ``[batch, seq]`` (RoFormer, Su et al. 2021)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.to(torch.float32)[:, :, None] * self.inv_freq.to(torch.float32)[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q, k ``[batch, heads, seq, head_dim]`` by cos/sin ``[batch, seq, head_dim]``; returns new tensors."""
    cos, sin = cos[:, None], sin[:, None]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[b, kv, t, d]`` → ``[b, kv·n_rep, t, d]`` so query head h reads kv head ``h // n_rep``."""
    if n_rep == 1:
        return x
    b, kv, t, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, t, d).reshape(b, kv * n_rep, t, d)


ATTENTION_KERNELS = ("sdpa", "blocked")  # the training step's causal attention: CausalLMLoss(attention=...)
ATTENTION_BLOCK = 128  # query rows a block of blocked_causal_attention (32 to 256 tried at 512 positions: 128 fastest)


def blocked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             block_size: int = ATTENTION_BLOCK) -> torch.Tensor:
    """Causal softmax attention computed a block of ``block_size`` query rows at a time, each against only the keys
    it can see (rows ``[i, j)`` against keys ``[0, j)``): about half the work of the full square, in a few large
    matmuls and small elementwise passes the compiler fuses. Under ``torch.compile`` (the decoder layers compiled, on
    CPU) a training step runs faster with it than with SDPA's CPU flash kernel (benchmarks/results/cpu_bf16_t2.md);
    eager it is no faster, so only compiled steps choose it.

    q, k, v: ``[..., seq, head_dim]`` (k and v already repeated to the query heads), one floating dtype; returns
    ``[..., seq, head_dim]`` in that dtype. The scores ``q·kᵀ/√head_dim`` are a float32 matmul of the upcast q and k
    (float64 stays float64), so large logits keep float32's precision and fp16 cannot overflow, and the softmax is
    float32; the probabilities are rounded to the inputs' dtype for the ``P·V`` matmul, as FlashAttention-2 does
    (Dao 2023, "FlashAttention-2", §3.1). Agrees with ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` to
    the inputs' rounding. Raises ``ValueError`` when k's or v's sequence length differs from q's (no cache: mask-free
    causal attention only), the dtypes differ or are not floating, or ``block_size`` is not an integer >= 1.
    """
    t, head_dim = q.shape[-2], q.shape[-1]
    if k.shape[-2] != t or v.shape[-2] != t:
        raise ValueError(f"blocked_causal_attention: q, k and v need one sequence length, got {t}, {k.shape[-2]} "
                         f"and {v.shape[-2]}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"blocked_causal_attention: q, k and v need one floating dtype, got {q.dtype}, {k.dtype} "
                         f"and {v.dtype}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"blocked_causal_attention: block_size must be an integer >= 1, got {block_size!r}")
    if t == 0:
        return v.new_empty((*q.shape[:-1], v.shape[-1]))
    scale = head_dim ** -0.5
    visible = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    qs, ks = _upcast(q), _upcast(k)
    out = []
    for i in range(0, t, block_size):
        j = min(i + block_size, t)
        with torch.autocast(q.device.type, enabled=False):  # autocast would cast the float32 scores' matmul down
            scores = (qs[..., i:j, :] @ ks[..., :j, :].mT) * scale
        scores = scores.masked_fill(~visible[i:j, :j], float("-inf"))
        out.append(torch.softmax(scores, dim=-1).to(v.dtype) @ v[..., :j, :])
    return torch.cat(out, dim=-2)


class Attention(nn.Module):
    training_kernel = "sdpa"  # one of ATTENTION_KERNELS: mask-free causal attention in training mode

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, past: tuple[torch.Tensor, torch.Tensor] | None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        present = (k, v)
        rep = self.n_heads // self.n_kv
        # K/V repeated to the query heads (as transformers does), not SDPA's enable_gqa: on CPU that saved under 1 %
        # of a step and its different rounding alone moved the design's "tiny learns" by 0.4 nats (see the README).
        kr, vr = repeat_kv(k, rep), repeat_kv(v, rep)
        if mask is None and self.training and self.training_kernel == "blocked":
            out = blocked_causal_attention(q, kr, vr)
        elif mask is None:
            out = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
        else:  # with a cache or padding: an explicit mask (exports with both ONNX exporters)
            out = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
        out = out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)
        return self.o_proj(out), present


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)) (Shazeer 2020)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past):
        h, present = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, present


class LlamaModel(nn.Module):
    """The decoder stack (``model.*`` in Hugging Face names): the one loop over the decoder layers that inference
    (:meth:`LlamaForCausalLM.forward`) and training (:class:`CausalLMLoss`) both run."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        layers: list | None = None,
    ) -> tuple[torch.Tensor, KVCache | None]:
        """Hidden states ``[batch, seq, hidden_size]`` after the last decoder layer, **before** the final norm
        (unlike transformers' ``LlamaModel``: each head applies ``norm`` itself, the training head inside its
        compiled graph), and the presents when ``use_cache`` or a past is given (else None: training keeps no
        K/V alive beyond what the backward needs).

        input_ids int64 ``[batch, seq]``; attention_mask int/bool ``[batch, past + seq]`` (1 = real token);
        position_ids int64 ``[batch, seq]`` (default: ``cumsum(mask) - 1`` clipped at 0, or ``past + arange``);
        past_key_values: one (k, v) per layer, ``[batch, kv_heads, past, head_dim]``. Without a past or a mask
        attention is causal through SDPA's ``is_causal``, else through :func:`build_attention_mask`.
        ``layers`` replaces ``self.layers`` by callables of the same signature, one per layer (the training
        module's compiled or activation-checkpointed wrappers); the parameters stay these layers'.
        """
        b, s = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -s:]
            else:
                position_ids = (torch.arange(s, device=input_ids.device) + past_len)[None].expand(b, s)
        mask = None
        if past_key_values is not None or attention_mask is not None:
            mask = build_attention_mask(attention_mask, b, s, past_len, input_ids.device)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(position_ids, compute_dtype(x))
        presents: KVCache | None = [] if (use_cache or past_key_values is not None) else None
        for i, layer in enumerate(self.layers if layers is None else layers):
            x, present = layer(x, cos, sin, mask, past_key_values[i] if past_key_values is not None else None)
            if presents is not None:
                presents.append(present)
        return x, presents


def build_attention_mask(attention_mask: torch.Tensor | None, batch: int, q_len: int, past_len, device) -> torch.Tensor:
    """Boolean mask ``[batch, 1, q_len, past+q_len]``: True where query i may attend key j.

    Key j is visible when j ≤ past + i (causal) and ``attention_mask[:, j] == 1`` (not padding); the query's own
    position is always visible, so no row is empty. ``past_len`` may be symbolic (export keeps it so). Without
    an attention_mask the batch dimension is 1 and broadcasts.
    """
    q_pos = torch.arange(q_len, device=device) + past_len
    kv_len = q_len + past_len
    k_pos = torch.arange(kv_len, device=device)
    causal = k_pos[None, :] <= q_pos[:, None]
    keep = causal[None, None]
    if attention_mask is not None:
        keep = keep & attention_mask[:, None, None, :].to(torch.bool)
    return keep | (k_pos[None, :] == q_pos[:, None])[None, None]


class LlamaForCausalLM(nn.Module):
    """Causal LM head over :class:`LlamaModel`; ``state_dict()`` keys equal transformers' ``LlamaForCausalLM``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def tie_weights(self) -> None:
        """Re-point lm_head at the embedding (after a load that may have broken the tie)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, σ) weights, residual projections σ/sqrt(2L), norms 1 (GPT-2 / Llama init)."""
        std = self.config.initializer_range
        resid_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, resid_std)
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, std)
            else:
                nn.init.ones_(p)

    def set_training_attention(self, kernel: str) -> None:
        """Every decoder layer's mask-free causal attention in training mode (``Attention.training_kernel``), one of
        :data:`ATTENTION_KERNELS`; eval mode always runs SDPA. Raises ``ValueError`` for another name."""
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention: expected one of {', '.join(ATTENTION_KERNELS)}, got {kernel!r}")
        for layer in self.model.layers:
            layer.self_attn.training_kernel = kernel

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters counted once (a tied matrix once); ``non_embedding`` leaves out the token embedding."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.model.embed_tokens.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N_matmul + 12·L·hidden·seq (PaLM, Chowdhery et al. 2022, appendix B),
        where N_matmul counts every matmul weight including the lm_head (tied or not) and no embedding lookup."""
        c = self.config
        n_matmul = sum(p.numel() for n, p in self.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
        if c.tie_word_embeddings:
            n_matmul += c.vocab_size * c.hidden_size
        return 6.0 * n_matmul + 12.0 * c.num_hidden_layers * c.hidden_size * seq_len

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, KVCache | None]:
        """Logits ``[batch, seq, vocab]`` (float32 in autocast too) and, with ``use_cache`` or a past, the
        presents; the arguments are :meth:`LlamaModel.forward`'s (shapes and defaults there)."""
        x, presents = self.model(input_ids, attention_mask, position_ids, past_key_values, use_cache)
        return _upcast(self.lm_head(self.model.norm(x))), presents

    @torch.no_grad()
    def generate_greedy(self, ids: list[int], max_new_tokens: int, eot_id: int | Iterable[int] | None = None
                        ) -> list[int]:
        """Greedy continuation with the KV cache (ties → lowest id); stops at ``eot_id`` (an id or several: a chat
        reply ends at ``<|im_end|>`` or ``<|endoftext|>``) or the context; the stop id is not returned."""
        stops = stop_set(eot_id)
        device = self.lm_head.weight.device
        room = self.config.max_position_embeddings - len(ids)
        max_new_tokens = max(0, min(max_new_tokens, room))
        if max_new_tokens == 0:
            return []
        x = torch.tensor([ids], dtype=torch.long, device=device)
        logits, past = self(x, use_cache=True)
        out: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(torch.argmax(logits[0, -1]).item())
            if nxt in stops:
                break
            out.append(nxt)
            if len(out) == max_new_tokens:
                break
            logits, past = self(torch.tensor([[nxt]], device=device), past_key_values=past)
        return out


def stop_set(ids: int | Iterable[int] | None) -> frozenset[int]:
    """The ids generation stops at: one id, several, or none."""
    if ids is None:
        return frozenset()
    return frozenset((ids,)) if isinstance(ids, int) else frozenset(int(i) for i in ids)


CHUNK_TOKENS = 8192  # rows of lm_head + cross-entropy per checkpointed chunk in reduced precision


class CausalLMLoss(nn.Module):
    """The training forward: summed next-token NLL of ``lm`` (a :class:`LlamaForCausalLM`), optionally compiled.
    It runs the model's own decoder loop (:meth:`LlamaModel.forward`) over its per-layer wrappers, then the head +
    loss.

    ``forward(input_ids, labels)`` takes int64 ``[b, s]`` inputs and already-shifted labels (-100 = ignored) and
    returns the float32 scalar sum of NLL in nats over the non-ignored labels. The parameters are ``lm``'s (this
    module holds no state of its own, so DDP can wrap it and checkpoints keep saving ``lm``).

    * float32 (no autocast): the full logits and one ``F.cross_entropy`` — the same ops, so the same bits, as
      ``causal_lm_loss(lm(x)[0], y)`` (with ``attention="sdpa"``);
    * reduced precision (autocast): lm_head + cross-entropy in chunks of ``chunk_tokens`` rows, each under
      activation checkpointing, so at most one chunk's float32 logits exist at a time (Liger-Kernel's fused linear
      cross-entropy does the same in one kernel); the price is one more lm_head matmul per chunk in the backward.
      ``chunk_tokens=None`` (the trainer's choice on CPU, where memory is plentiful and compute is not): the whole
      logits in the autocast dtype, upcast to float32 for one ``F.cross_entropy`` (on the ``cpu`` preset in
      bfloat16, 1.2× the step speed of one checkpointed chunk);
    * ``activation_checkpoint``: "none" (every layer saves its activations for the backward), "full" (every
      decoder layer under activation checkpointing: only its input is kept and its forward runs again in the
      backward) or "selective" (the layers ``i`` with ``i % checkpoint_every == 0`` only: torchtitan's per-layer
      selective AC). A checkpointed layer computes the same values, so the loss and gradients are unchanged; the
      price is one more forward of that layer per step (see :func:`checkpointed_layers`);
    * ``attention``: the decoder layers' mask-free causal attention in training mode, one of
      :data:`ATTENTION_KERNELS`: "sdpa" (``F.scaled_dot_product_attention``) or "blocked"
      (:func:`blocked_causal_attention`, the ``cpu`` preset's choice under compiled layers). It is set on ``lm``
      (:meth:`LlamaForCausalLM.set_training_attention`) and read only in training mode, so evaluation in eval mode
      runs SDPA whatever it is;
    * :meth:`compile_head`: the head + loss alone compiled, the layers eager;
    * :meth:`compile_blocks`: each decoder layer and the head + loss compiled on their own with static shapes
      (torchtitan's ``apply_compile``; the ``cpu`` preset's choice): one small graph reused by every layer compiles
      in seconds. Compiled, a
      micro-batch with fewer rows than ``static_batch`` is padded with ignored rows (label -100) to that size, so
      a short last micro-batch reuses the graph instead of recompiling; padded rows add 0 to the loss and the
      gradients (rows never interact), and dropping them instead would lose data.
    """

    def __init__(self, lm: LlamaForCausalLM, chunk_tokens: int | None = CHUNK_TOKENS,
                 activation_checkpoint: str = "none", checkpoint_every: int = 2, attention: str = "sdpa"):
        super().__init__()
        lm.set_training_attention(attention)
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.static_batch: int | None = None
        self.checkpointed = checkpointed_layers(activation_checkpoint, checkpoint_every, len(lm.model.layers))
        # plain list: compiled wrappers must not become submodules (the parameter names stay lm's)
        self._blocks = [self._wrap(i, b) for i, b in enumerate(lm.model.layers)]
        self._head = self._head_loss

    def _wrap(self, i: int, layer: nn.Module):
        return CheckpointedLayer(layer) if i in self.checkpointed else layer

    def compile_blocks(self, static_batch: int, backend: str = "inductor") -> None:
        """Compile each layer and the head + loss (``fullgraph=True``, ``dynamic=False``); ``static_batch`` is the
        micro-batch the graphs are traced at (call once, then warm up at that size). ``backend`` is
        ``torch.compile``'s (tests use "aot_eager": the same graphs without code generation)."""
        opts = {"fullgraph": True, "dynamic": False, "backend": backend}
        # the checkpoint goes inside the compiled graph (torchtitan's order: AC, then compile), where the
        # partitioner recomputes the whole layer in the backward
        self._blocks = [torch.compile(self._wrap(i, b), **opts) for i, b in enumerate(self.lm.model.layers)]
        self._head = torch.compile(self._head_loss, **opts)
        self.static_batch = static_batch

    def compile_head(self, backend: str = "inductor") -> None:
        """Compile only the head + loss (final norm, lm_head, the upcast and the cross-entropy; ``fullgraph=True``)
        and leave the decoder layers eager. On CPU the layers' matmuls and attention run as fast eager, while
        the head's log-softmax over ``[tokens, vocab]`` float32 logits, its backward and the casts around them are
        several passes over memory that the compiler fuses into a few loops (speed: benchmarks/results/cpu_bf16.md).
        Shapes are Dynamo's default (static first, one dynamic graph if a second shape comes), so padded
        fine-tuning batches of varying length recompile at most once."""
        self._head = torch.compile(self._head_loss, fullgraph=True, backend=backend)

    def _head_loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.lm.model.norm(x)
        if self.chunk_tokens is None or (not torch.is_autocast_enabled(h.device.type)
                                         and h.dtype in (torch.float32, torch.float64)):
            return causal_lm_loss(self.lm.lm_head(h), labels, reduction="sum")
        return chunked_lm_loss(h.flatten(0, 1), self.lm.lm_head.weight, labels.flatten(), self.chunk_tokens)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        input_ids, labels = input_ids.contiguous(), labels.contiguous()  # one stride layout: no stride guard fails
        b, s = input_ids.shape
        if self.static_batch is not None and b != self.static_batch:
            if b > self.static_batch:
                raise ValueError(f"micro-batch of {b} rows is larger than the compiled size {self.static_batch}")
            pad = self.static_batch - b
            input_ids = torch.cat([input_ids, input_ids.new_zeros(pad, s)])
            labels = torch.cat([labels, labels.new_full((pad, s), -100)])
        x, _ = self.lm.model(input_ids, layers=self._blocks)
        return self._head(x, labels)


ACTIVATION_CHECKPOINT_MODES = ("none", "selective", "full")


def checkpointed_layers(mode: str, every: int, num_layers: int) -> frozenset[int]:
    """Indices of the decoder layers run under activation checkpointing: none for "none", all for "full", and
    for "selective" the layers ``i % every == 0`` (0, every, 2·every, …: ``ceil(num_layers / every)`` of them).

    The bottom layer of each group is the checkpointed one, so its recompute in the backward happens after the
    layers above it have freed their activations and does not raise the peak (only a checkpointed top layer,
    as in "full", recomputes while every other layer still holds its own). Raises ValueError for an unknown
    ``mode`` or ``every < 1``.
    """
    if mode not in ACTIVATION_CHECKPOINT_MODES:
        raise ValueError(f"activation_checkpoint: expected one of {', '.join(ACTIVATION_CHECKPOINT_MODES)}, "
                         f"got {mode!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"activation_checkpoint_every: expected an integer >= 1, got {every!r}")
    if mode == "none":
        return frozenset()
    step = 1 if mode == "full" else every
    return frozenset(range(0, num_layers, step))


class CheckpointedLayer(nn.Module):
    """A decoder layer run under non-reentrant activation checkpointing (torchtitan's ``checkpoint_wrapper``).

    One class for every wrapped layer, so ``torch.compile`` traces one graph for all of them; :class:`CausalLMLoss`
    keeps it out of the model's modules, so the parameter names stay the model's."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x, cos, sin, mask, past):
        return checkpoint(self.layer, x, cos, sin, mask, past, use_reentrant=False)


def _chunk_nll(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(h, weight)  # the autocast dtype
    return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 8192):
    """Summed NLL (float32 scalar, nats) of ``hidden [n, hidden_size] @ weight.T`` against ``labels [n]``
    (-100 = ignored), ``chunk_tokens`` rows at a time with activation checkpointing: the float32 logits of only one
    chunk (``chunk_tokens × vocab × 4`` bytes) are alive at any time, forward or backward."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(hidden.split(chunk_tokens), labels.split(chunk_tokens), strict=True):
        total = total + checkpoint(_chunk_nll, h, weight, y, use_reentrant=False)
    return total


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls run in: the autocast dtype when autocast is on for ``x``'s device, else ``x.dtype``."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """Cross-entropy of ``logits [b, s, V]`` against ``labels [b, s]`` (already shifted; -100 = ignored), in
    nats; ``reduction`` "sum" (for token-normalised accumulation), "mean" or "none"."""
    return F.cross_entropy(_upcast(logits.reshape(-1, logits.shape[-1])), labels.reshape(-1), ignore_index=-100,
                           reduction=reduction)


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """float32 for reduced precision; float32 and float64 stay as they are."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()
