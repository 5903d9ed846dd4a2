"""The CUDA training path's code, run on CPU: compile per block with static shapes, bf16 autocast, fused AdamW,
the DDP settings (gloo, one rank), the chunked loss, RoPE in the compute dtype, the SDPA backend choice, and the
train.compile modes (docs/design.md, "Training at scale")."""

from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.conftest import fast_config
from train.components.step_module import no_buffer_sync
from train.device import choose_sdpa_backend
from train.model import CausalLMLoss, LlamaForCausalLM, ModelConfig, causal_lm_loss, chunked_lm_loss
from train.optim import build_optimizer
from train.run import Trainer, TrainError

QUIET = {"log": lambda m: None}
BF16 = {"device_type": "cpu", "dtype": torch.bfloat16}


def small_model(seed: int = 0) -> LlamaForCausalLM:
    cfg = ModelConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


@pytest.fixture
def gloo_one_rank(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_is_built_without_deprecated_arguments(gloo_one_rank):
    """The trainer's DDP keywords (no_buffer_sync) raise none of torch's deprecation warnings."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        DDP(torch.nn.Linear(4, 4), bucket_cap_mb=100, **no_buffer_sync(), gradient_as_bucket_view=True)


def _training_run(backend: str, activation_checkpoint: str = "none", optimizer: str = "adamw"):
    """Compile + bf16 autocast + fused AdamW + DDP(gloo, the run's settings), accumulation with no_sync, over steps
    whose last micro-batch is short; returns (graphs at warm-up, graphs after, losses)."""
    torch._dynamo.reset()
    model = small_model()
    step_model = CausalLMLoss(model, chunk_tokens=48, activation_checkpoint=activation_checkpoint)
    step_model.compile_blocks(4, backend=backend)
    # static_graph stays off with no_sync accumulation (the reducer asserts: expect_autograd_hooks_), as in train.run
    ddp = DDP(step_model, bucket_cap_mb=100, **no_buffer_sync(), gradient_as_bucket_view=True, static_graph=False)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if optimizer == "adamw" else
           build_optimizer(model, 1e-3, 0.1, (0.9, 0.95), optimizer=optimizer))
    data = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(1))
    g0 = counters["stats"]["unique_graphs"]
    with torch.autocast(**BF16):  # warm-up at the training micro-batch, on the unwrapped module
        loss = step_model(data[:, :-1], data[:, 1:])
    loss.backward()
    model.zero_grad(set_to_none=True)
    warm = counters["stats"]["unique_graphs"] - g0
    losses = []
    torch._dynamo.config.error_on_recompile = True
    try:
        for rows in ([4, 4], [4, 4], [4, 3]):  # the last micro-batch of the run has 3 rows, not 4
            for k, b in enumerate(rows):
                ctx = ddp.no_sync() if k < len(rows) - 1 else torch.enable_grad()
                with ctx, torch.autocast(**BF16):
                    loss = ddp(data[:b, :-1], data[:b, 1:])
                    loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    finally:
        torch._dynamo.config.error_on_recompile = False
    return warm, counters["stats"]["unique_graphs"] - g0 - warm, losses


def test_compiled_bf16_fused_ddp_step_no_recompiles_short_last_microbatch(gloo_one_rank):
    warm, after, losses = _training_run("aot_eager")
    assert warm == 2  # one graph shared by every decoder layer, one for the head + loss
    assert after == 0
    assert all(torch.isfinite(torch.tensor(losses)))


def test_compiled_step_with_selective_activation_checkpointing(gloo_one_rank):
    """Checkpointed layers compile to one more graph (the checkpoint inside it), shared by all of them; the losses
    are those of the run without checkpointing."""
    warm, after, losses = _training_run("aot_eager", "selective")
    assert (warm, after) == (3, 0)  # plain layer, checkpointed layer, head + loss
    _, _, plain = _training_run("aot_eager")
    assert losses == pytest.approx(plain, rel=1e-3)


def test_compiled_step_with_muon_no_recompiles(gloo_one_rank):
    """Muon steps outside the compiled graphs: the same 2 graphs, 0 recompiles, finite losses that fall."""
    warm, after, losses = _training_run("aot_eager", optimizer="muon")
    assert (warm, after) == (2, 0)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.slow
def test_inductor_compiled_step_no_recompiles(gloo_one_rank):
    warm, after, _ = _training_run("inductor")
    assert (warm, after) == (2, 0)


def test_training_step_has_no_graph_breaks():
    model = small_model()
    x = torch.randint(0, 512, (2, 17))
    torch._dynamo.reset()
    with torch.autocast(**BF16):
        ex = torch._dynamo.explain(CausalLMLoss(model, chunk_tokens=8))(x[:, :-1], x[:, 1:])
    assert ex.graph_break_count == 0, ex.break_reasons
    assert ex.graph_count == 1


def test_short_microbatch_padding_changes_nothing():
    model = small_model()
    x = torch.randint(0, 512, (3, 17), generator=torch.Generator().manual_seed(2))
    plain = CausalLMLoss(model)
    padded = CausalLMLoss(model)
    padded.static_batch = 4  # what compile_blocks sets; the eager path pads the same way
    a = plain(x[:, :-1], x[:, 1:])
    b = padded(x[:, :-1], x[:, 1:])
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-4)
    with pytest.raises(ValueError, match="larger than the compiled size 4"):
        padded(torch.zeros(5, 16, dtype=torch.long), torch.zeros(5, 16, dtype=torch.long))


def test_float32_training_loss_is_bitwise_the_old_one():
    model = small_model()
    x = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(3))
    old = causal_lm_loss(model(x[:, :-1])[0], x[:, 1:], reduction="sum")
    assert torch.equal(CausalLMLoss(model)(x[:, :-1], x[:, 1:]), old)


def test_chunked_loss_equals_full_loss_and_gradients():
    torch.manual_seed(0)
    h = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(300, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 300, (50,))
    y[7] = -100
    full = F.cross_entropy(h @ w.T, y, ignore_index=-100, reduction="sum")
    gh, gw = torch.autograd.grad(full, (h, w))
    got = chunked_lm_loss(h, w, y, chunk_tokens=16)
    ch, cw = torch.autograd.grad(got, (h, w))
    # the chunks compute the loss in float32 (as the bf16 path does): float32 tolerances
    torch.testing.assert_close(got.double(), full, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(ch, gh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cw, gw, rtol=1e-4, atol=1e-5)


def test_bf16_step_never_holds_full_fp32_logits():
    """In autocast no float32 tensor of n_tokens × vocab exists: the loss is chunked (was: the whole logits)."""
    model = small_model()
    x = torch.randint(0, 512, (4, 33))
    n_tokens, vocab = 4 * 32, 512
    biggest = []

    def pack(t):
        if t.dtype == torch.float32 and t.dim() >= 2 and t.shape[-1] == vocab:
            biggest.append(t.numel())
        return t

    with torch.autocast(**BF16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = CausalLMLoss(model, chunk_tokens=32)(x[:, :-1], x[:, 1:])
    loss.backward()
    assert max(biggest, default=0) <= 32 * vocab < n_tokens * vocab


def test_rope_keeps_q_and_k_in_bf16(monkeypatch):
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.dtype, k.dtype))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = small_model()
    with torch.autocast(**BF16):
        model(torch.randint(0, 512, (1, 8)))
    assert seen and all(d == (torch.bfloat16, torch.bfloat16) for d in seen)


def test_sdpa_choice_takes_the_first_backend_that_runs_and_agrees():
    # cuDNN attention does not run on CPU: skipped with its reason; math agrees with itself
    name, backend, detail = choose_sdpa_backend(
        torch.device("cpu"),
        torch.float32,
        2,
        16,
        32,
        candidates=[("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)],
    )
    assert (name, backend) == ("math", SDPBackend.MATH) and "vs float32 math" in detail
    assert choose_sdpa_backend(torch.device("cpu"), torch.bfloat16, 2, 16)[:2] == ("default", None)


# ------------------------------------------------------------------------------------------- train.compile modes


def _trained(tmp_path, session_cache, name: str, log=QUIET["log"], **keys) -> dict:
    """Train run ``name`` of the fast config with these keys (2 steps unless ``train.max_steps`` is given); returns
    its summary.json."""
    cfg = fast_config(tmp_path, session_cache, **{"run.name": name, "train.max_steps": 2, **keys})
    Trainer(cfg, log=log).train()
    return json.loads((tmp_path / f"runs/{name}/summary.json").read_text())


def _planted_failure(what: str):
    def fail(self, *args, **kwargs):
        raise RuntimeError(f"{what} (planted)")
    return fail


def test_compile_true_failure_is_an_error(tmp_path, session_cache, monkeypatch):
    monkeypatch.setattr(CausalLMLoss, "compile_blocks", _planted_failure("backend exploded"))
    with pytest.raises(TrainError, match=r"torch.compile failed \(RuntimeError: backend exploded.*\"auto\""):
        _trained(tmp_path, session_cache, "c-true", **{"train.compile": True})


@pytest.mark.parametrize("mode,method,why,reason", [
    ("auto", "compile_blocks", "backend exploded", "backend exploded"),
    ("head", "compile_head", "no C++ compiler", 'train.compile = "head" fell back')])
def test_compile_failure_falls_back_loudly_and_says_so(tmp_path, session_cache, monkeypatch, mode, method, why,
                                                       reason):
    monkeypatch.setattr(CausalLMLoss, method, _planted_failure(why))
    logs = []
    s = _trained(tmp_path, session_cache, f"c-{mode}", log=logs.append, **{"train.compile": mode})
    assert s["compile"]["path"] == "eager" and reason in s["compile"]["reason"] and why in s["compile"]["reason"]
    assert any(why in m and m.startswith("WARNING: training EAGERLY") for m in logs)
    assert "training EAGERLY" in (tmp_path / f"runs/c-{mode}/train.log").read_text()


def test_compiled_run_records_path_and_zero_recompiles(tmp_path, session_cache, monkeypatch):
    real = CausalLMLoss.compile_blocks
    monkeypatch.setattr(CausalLMLoss, "compile_blocks", lambda self, b, backend="inductor": real(self, b, "aot_eager"))
    torch._dynamo.reset()
    s = _trained(tmp_path, session_cache, "c-on", **{"train.compile": True, "train.max_steps": 3})
    assert s["compile"]["path"] == "compiled" and s["compile"]["graphs"] == 2 and s["compile"]["recompiles"] == 0
    assert s["attention_backend"]["name"] == "default"
    assert s["peak_memory_scope"].startswith("training steps only")


@pytest.mark.parametrize("value", ["sometimes", 0, 1, 1.0])
def test_compile_value_is_checked(tmp_path, session_cache, value):
    """0 and 1 equal false and true in Python but would be taken for neither by the builder (0 compiled the layers
    while the attention choice read it as eager; 1 fell back to eager where true is an error)."""
    from train.config import ConfigError

    with pytest.raises(ConfigError, match=r"train.compile: expected true, false, \"auto\" or \"head\""):
        fast_config(tmp_path, session_cache, **{"train.compile": value})


def test_compile_head_compiles_the_head_alone_and_keeps_the_loss(tmp_path, session_cache, monkeypatch):
    """train.compile = "head" (the cpu preset's): one graph, the head + loss; the layers stay eager; 0 recompiles;
    the losses those of the eager run to bf16-free float32 rounding."""
    real = CausalLMLoss.compile_head
    monkeypatch.setattr(CausalLMLoss, "compile_head", lambda self, backend="inductor": real(self, "aot_eager"))
    torch._dynamo.reset()
    runs = {name: _trained(tmp_path, session_cache, name, **{"train.compile": mode, "train.max_steps": 3,
                                                            "train.dtype": "float32"})
            for name, mode in (("h-on", "head"), ("h-off", False))}
    s = runs["h-on"]
    assert s["compile"]["path"] == "compiled" and s["compile"]["graphs"] == 1 and s["compile"]["recompiles"] == 0
    assert "the head + loss only" in s["compile"]["reason"]
    assert s["val"]["all"]["nll"] == pytest.approx(runs["h-off"]["val"]["all"]["nll"], rel=1e-5)
