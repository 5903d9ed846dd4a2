"""Decode speed of the Rust runtime (f32 and int8 = q8_0) with PyTorch eager as a reference.

Builds a random-init model of the `small` shape (hidden 512, 6 layers, 8 heads / 4 KV heads,
intermediate 1280, vocab 32000, tied, context 512) in a temporary folder with transformers'
save_pretrained, plus a small tokenizer, then measures batch-1 prefill time and decode tokens/s,
the engines interleaved round by round so that load from other jobs hits them alike.

    python benchmarks/rust_decode.py [--threads 1 2] [--rounds 3] [--prompt 16] [--new 128] [--json OUT]

Rust decode is timed through Model.generate (greedy, whole token loop in Rust): decode tok/s =
generated tokens / (generate wall time − prefill wall time). Torch is timed with its KV cache,
greedy, in a Python loop, at torch.set_num_threads(threads). ONNX Runtime (when importable) runs a
decoder graph with past/present KV exported here with torch.onnx (TorchScript exporter, opset 17,
plain ops: MatMul, Softmax, Gather-based RoPE), checked against transformers before timing, in a
Python loop like the serve ONNX backend, intra_op_num_threads = threads. It stands in for
export/onnx.py's graph until that exists; pass --onnx FILE to time another graph with the same I/O
(Optimum names: input_ids, position_ids, past_key_values.{i}.key/value → logits, present.{i}.*).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

SHAPES = {
    # configs/base-400m.toml with vocab 32000 (≈0.39 B parameters, 1.6 GB in fp32)
    "base-400m": dict(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=4096,
        vocab_size=32000,
        max_position_embeddings=2048,
    ),
    "small": dict(
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1280,
        vocab_size=32000,
        max_position_embeddings=512,
    ),
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=384,
        vocab_size=32000,
        max_position_embeddings=256,
    ),
}

LINES = [
    "আমি বাংলায় গান গাই। আমি বাংলার গান গাই।",
    "বাংলা ভাষা দক্ষিণ এশিয়ার একটি ইন্দো-আর্য ভাষা।",
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times.",
] * 20


def build_bundle(out: Path, shape: str) -> None:
    import torch
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from serve.bundle import CONFIG, SPECIAL_TOKENS, TOKENIZER, write_manifest

    cfg = transformers.LlamaConfig(
        **SHAPES[shape],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    c = json.loads((out / CONFIG).read_text())
    c["rope_theta"] = c["rope_parameters"]["rope_theta"]
    (out / CONFIG).write_text(json.dumps(c, indent=2))
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(r" ?[\p{L}\p{M}\u200c\u200d]+| ?\p{N}+| ?[^\s\p{L}\p{M}\p{N}]+|\s+(?!\S)|\s+"), "isolated"
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        LINES,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.save(str(out / TOKENIZER))
    write_manifest(out, complete=False)  # rust_runtime.Model.load refuses a bundle without its manifest


def export_onnx(bundle: Path, out: Path, last_logits: bool = False) -> Path:
    """A plain-op ONNX decoder with KV cache, from the bundle's weights (for the ORT reference).

    ``last_logits``: the graph's logits are [1, 1, vocab] for the last position only (as Rust's prefill
    returns), instead of [1, s, vocab] for every position."""
    import torch
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(bundle, dtype=torch.float32).eval()
    c = hf.config
    nh, nkv = c.num_attention_heads, c.num_key_value_heads
    hd = c.hidden_size // nh
    theta = c.rope_parameters["rope_theta"]

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = hf.model
            inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
            ang = torch.arange(c.max_position_embeddings).float()[:, None] * inv[None, :]
            emb = torch.cat([ang, ang], -1)
            self.register_buffer("cos", emb.cos())
            self.register_buffer("sin", emb.sin())

        @staticmethod
        def rot(x):
            a, b = x.chunk(2, dim=-1)
            return torch.cat([-b, a], dim=-1)

        def norm(self, x, w):
            return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps))

        def forward(self, input_ids, position_ids, *past):
            x = self.m.embed_tokens(input_ids)
            s = input_ids.shape[1]
            cos, sin = self.cos[position_ids][:, None], self.sin[position_ids][:, None]
            presents = []
            for i, layer in enumerate(self.m.layers):
                a = layer.self_attn
                h = self.norm(x, layer.input_layernorm.weight)
                q = a.q_proj(h).view(1, s, nh, hd).transpose(1, 2)
                k = a.k_proj(h).view(1, s, nkv, hd).transpose(1, 2)
                v = a.v_proj(h).view(1, s, nkv, hd).transpose(1, 2)
                q, k = q * cos + self.rot(q) * sin, k * cos + self.rot(k) * sin
                k = torch.cat([past[2 * i], k], dim=2)
                v = torch.cat([past[2 * i + 1], v], dim=2)
                presents += [k, v]
                kr, vr = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
                att = q @ kr.transpose(2, 3) * (hd**-0.5)
                t = kr.shape[2]
                mask = torch.ones(s, t).triu(t - s + 1) * -1e9
                o = (att + mask).softmax(-1) @ vr
                x = x + a.o_proj(o.transpose(1, 2).reshape(1, s, nh * hd))
                m = layer.mlp
                h = self.norm(x, layer.post_attention_layernorm.weight)
                x = x + m.down_proj(torch.nn.functional.silu(m.gate_proj(h)) * m.up_proj(h))
            if last_logits:
                x = x[:, -1:]
            logits = self.norm(x, self.m.norm.weight) @ self.m.embed_tokens.weight.t()
            return (logits, *presents)

    L = c.num_hidden_layers
    names = [f"past_key_values.{i}.{kv}" for i in range(L) for kv in ("key", "value")]
    outs = ["logits"] + [f"present.{i}.{kv}" for i in range(L) for kv in ("key", "value")]
    past = [torch.zeros(1, nkv, 3, hd) for _ in names]
    dyn = {"input_ids": {1: "s"}, "position_ids": {1: "s"}, **({} if last_logits else {"logits": {1: "s"}})}
    dyn.update({n: {2: "p"} for n in names})
    dyn.update({n: {2: "t"} for n in outs[1:]})
    with torch.no_grad():
        torch.onnx.export(
            Decoder().eval(),
            (torch.tensor([[1, 2]]), torch.tensor([[3, 4]]), *past),
            str(out),
            input_names=["input_ids", "position_ids", *names],
            output_names=outs,
            dynamic_axes=dyn,
            opset_version=17,
            dynamo=False,
        )
        ids = [5, 9, 33, 7]
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    feed = {"input_ids": np.array([ids]), "position_ids": np.arange(len(ids))[None]}
    feed.update({n: np.zeros((1, nkv, 0, hd), np.float32) for n in names})
    got = sess.run(["logits"], feed)[0][0]
    err = float(np.abs(got - ref[-len(got) :]).max())
    assert err < 1e-3, f"exported ONNX graph differs from transformers by {err}"
    return out


def bench_ort(sess, spec, prompt: list[int], new: int) -> tuple[float, float, int]:
    import numpy as np

    names, nkv, hd = spec
    outs = ["logits"] + [n.replace("past_key_values", "present") for n in names]
    with_mask = "attention_mask" in {i.name for i in sess.get_inputs()}

    def feed_for(ids: list[int], pos: int, past) -> dict:
        f = {
            "input_ids": np.array([ids], dtype=np.int64),
            "position_ids": np.arange(pos, pos + len(ids), dtype=np.int64)[None],
        }
        if with_mask:
            f["attention_mask"] = np.ones((1, pos + len(ids)), dtype=np.int64)
        f.update(zip(names, past, strict=True))
        return f

    t0 = time.perf_counter()
    res = sess.run(outs, feed_for(prompt, 0, [np.zeros((1, nkv, 0, hd), np.float32)] * len(names)))
    prefill = time.perf_counter() - t0
    pos, n = len(prompt), 0
    t0 = time.perf_counter()
    for _ in range(new - 1):
        tok = int(res[0][0, -1].argmax())
        res = sess.run(outs, feed_for([tok], pos, res[1:]))
        pos += 1
        n += 1
    decode = time.perf_counter() - t0
    return prefill * 1e3, n / max(decode, 1e-9), n + 1


def bench_rust(model, prompt: list[int], new: int) -> tuple[float, float, int]:
    seq = model.new_sequence()
    t0 = time.perf_counter()
    seq.prefill(prompt)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(prompt, new, temperature=0.0)
    total = time.perf_counter() - t0
    n = max(len(out), 1)
    return prefill * 1e3, n / max(total - prefill, 1e-9), len(out)


def bench_torch(model, prompt: list[int], new: int) -> tuple[float, float, int]:
    import inspect

    import torch

    # transformers 5.2x renamed past_key_values to cache (the old name warns)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        prefill = time.perf_counter() - t0
        past, tok = getattr(out, key), int(out.logits[0, -1].argmax())
        n = 0
        t0 = time.perf_counter()
        for _ in range(new - 1):
            out = model(input_ids=torch.tensor([[tok]]), use_cache=True, **{key: past})
            past, tok = getattr(out, key), int(out.logits[0, -1].argmax())
            n += 1
        decode = time.perf_counter() - t0
    return prefill * 1e3, n / max(decode, 1e-9), n + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--new", type=int, default=128, help="tokens to generate")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-ort", action="store_true", help="skip the ONNX Runtime reference")
    ap.add_argument("--onnx", type=Path, help="time this ONNX decoder instead of exporting one")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()

    import rust_runtime

    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "bundle"
        build_bundle(bundle, args.shape)
        ort_spec = onnx_path = None
        if not args.no_ort:
            try:
                import onnxruntime as ort

                onnx_path = args.onnx or export_onnx(bundle, Path(tmp) / "decoder.onnx")
                sh = SHAPES[args.shape]
                hd = sh["hidden_size"] // sh["num_attention_heads"]
                names = [f"past_key_values.{i}.{kv}" for i in range(sh["num_hidden_layers"]) for kv in ("key", "value")]
                ort_spec = (names, sh["num_key_value_heads"], hd)
            except ImportError as e:
                print(f"(no ONNX Runtime reference: {e})")
        engines = {}
        for t in args.threads:
            engines[f"rust f32 t{t}"] = ("rust", rust_runtime.Model.load(str(bundle), threads=t))
            engines[f"rust int8 t{t}"] = ("rust", rust_runtime.Model.load(str(bundle), threads=t, quantize="int8"))
            if not args.no_torch:
                engines[f"torch eager f32 t{t}"] = ("torch", t)
            if ort_spec is not None:
                so = ort.SessionOptions()
                so.intra_op_num_threads = t
                so.inter_op_num_threads = 1
                sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
                engines[f"onnxruntime f32 t{t}"] = ("ort", sess)
        torch_model = None
        if not args.no_torch:
            import torch
            import transformers

            torch_model = transformers.LlamaForCausalLM.from_pretrained(bundle, dtype=torch.float32).eval()
        prompt = [(7 * i + 3) % 30000 + 2 for i in range(args.prompt)]
        results: dict[str, list[tuple[float, float, int]]] = {k: [] for k in engines}
        for _ in range(args.rounds + 1):  # the first round warms up and is dropped
            for name, (kind, obj) in engines.items():
                if kind == "rust":
                    r = bench_rust(obj, prompt, args.new)
                elif kind == "ort":
                    r = bench_ort(obj, ort_spec, prompt, args.new)
                else:
                    import torch

                    torch.set_num_threads(obj)
                    r = bench_torch(torch_model, prompt, args.new)
                results[name].append(r)
        rows = []
        print(f"shape {args.shape}, prompt {args.prompt}, new {args.new}, rounds {args.rounds} (median, best)")
        print(f"{'engine':<22} {'prefill ms':>18} {'decode tok/s':>20}")
        for name, rs in results.items():
            rs = rs[1:]
            pre = [r[0] for r in rs]
            tps = [r[1] for r in rs]
            rows.append(
                dict(
                    engine=name,
                    prefill_ms_median=statistics.median(pre),
                    prefill_ms_best=min(pre),
                    decode_tok_s_median=statistics.median(tps),
                    decode_tok_s_best=max(tps),
                    generated=rs[-1][2],
                )
            )
            print(
                f"{name:<22} {statistics.median(pre):>9.1f} ({min(pre):>6.1f}) {statistics.median(tps):>11.0f} ({max(tps):>6.0f})"
            )
        try:
            load = open("/proc/loadavg").read().split()[:3]
        except OSError:
            load = []
        print(f"load average during the run: {' '.join(load)}; simd: {rust_runtime.simd_level}")
        if args.json:
            args.json.write_text(
                json.dumps(
                    dict(
                        shape=args.shape,
                        prompt=args.prompt,
                        new=args.new,
                        rounds=args.rounds,
                        loadavg=load,
                        results=rows,
                    ),
                    indent=2,
                )
            )


if __name__ == "__main__":
    main()
