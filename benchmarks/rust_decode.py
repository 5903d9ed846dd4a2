"""Decode speed of the Rust runtime (f32 and int8 = q8_0) with PyTorch eager as a reference.

Builds a random-init model of the `small` shape (hidden 512, 6 layers, 8 heads / 4 KV heads,
intermediate 1280, vocab 32000, tied, context 512) in a temporary folder with transformers'
save_pretrained, plus a small tokenizer, then measures batch-1 prefill time and decode tokens/s,
the engines interleaved round by round so that load from other jobs hits them alike.

    python benchmarks/rust_decode.py [--threads 1 2] [--rounds 3] [--prompt 16] [--new 128] [--json OUT]

Rust decode is timed through Model.generate (greedy, whole token loop in Rust): decode tok/s =
generated tokens / (generate wall time − prefill wall time). Torch is timed with its KV cache
(past_key_values), greedy, in a Python loop, at torch.set_num_threads(threads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

SHAPES = {
    "small": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1280, vocab_size=32000, max_position_embeddings=512),
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=384, vocab_size=32000, max_position_embeddings=256),
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

    cfg = transformers.LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    c = json.loads((out / "config.json").read_text())
    c["rope_theta"] = c["rope_parameters"]["rope_theta"]
    (out / "config.json").write_text(json.dumps(c, indent=2))
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" ?[\p{L}\p{M}\u200c\u200d]+| ?\p{N}+| ?[^\s\p{L}\p{M}\p{N}]+|\s+(?!\S)|\s+"), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|pad|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.save(str(out / "tokenizer.json"))


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
    import torch

    with torch.inference_mode():
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        prefill = time.perf_counter() - t0
        past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
        n = 0
        t0 = time.perf_counter()
        for _ in range(new - 1):
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
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
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()

    import rust_runtime

    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "bundle"
        build_bundle(bundle, args.shape)
        engines = {}
        for t in args.threads:
            engines[f"rust f32 t{t}"] = ("rust", rust_runtime.Model.load(str(bundle), threads=t))
            engines[f"rust int8 t{t}"] = ("rust", rust_runtime.Model.load(str(bundle), threads=t, quantize="int8"))
            if not args.no_torch:
                engines[f"torch eager f32 t{t}"] = ("torch", t)
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
            rows.append(dict(engine=name, prefill_ms_median=statistics.median(pre), prefill_ms_best=min(pre),
                             decode_tok_s_median=statistics.median(tps), decode_tok_s_best=max(tps),
                             generated=rs[-1][2]))
            print(f"{name:<22} {statistics.median(pre):>9.1f} ({min(pre):>6.1f}) {statistics.median(tps):>11.0f} ({max(tps):>6.0f})")
        try:
            load = open("/proc/loadavg").read().split()[:3]
        except OSError:
            load = []
        print(f"load average during the run: {' '.join(load)}; simd: {rust_runtime.simd_level}")
        if args.json:
            args.json.write_text(json.dumps(dict(shape=args.shape, prompt=args.prompt, new=args.new,
                                                 rounds=args.rounds, loadavg=load, results=rows), indent=2))


if __name__ == "__main__":
    main()
