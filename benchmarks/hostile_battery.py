"""Hostile-input battery (the kinds of issue 18): counts 5xx, hangs, tracebacks shown to a user, partial files and
data lost, against 127.0.0.1 only, each input bounded in time. Writes ``benchmarks/results/hostile_battery.md``.

Run: ``python benchmarks/hostile_battery.py`` (a few minutes on 2 cores: trains and exports a tiny model first).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks import timing  # noqa: E402
from benchmarks.common import free_port  # noqa: E402
from contract.atomic import atomic_write_text  # noqa: E402
from contract.bundle import MANIFEST, ONNX, ONNX_Q8_0, TOKENIZER, WEIGHTS, external_data  # noqa: E402
from contract.chat_format import RESERVED_TOKENS  # noqa: E402

MINI = ROOT / "tests" / "data" / "mini"
OUT_MD = ROOT / "benchmarks" / "results" / os.environ.get("BATTERY_OUT", "hostile_battery.md")
HANG_S = 30
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

counts = {"tried": 0, "5xx": 0, "hangs": 0, "tracebacks": 0, "partial files": 0, "data lost": 0, "unclear errors": 0}
failures: list[str] = []
notes: list[str] = []


def fail(kind: str, repro: str, got: str) -> None:
    counts[kind] += 1
    failures.append(f"- **{kind}**: `{repro[:300]}` → {got[:300]!r}")


def cli(args: list[str], env: dict | None = None, timeout: int = 90, label: str | None = None):
    """Run a CLI; count a hang or a traceback on stderr. Returns (rc, stdout, stderr) or None on a hang."""
    counts["tried"] += 1
    label = label or " ".join(args)
    try:
        p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                           env={**ENV, **(env or {})}, cwd=ROOT)
    except subprocess.TimeoutExpired:
        fail("hangs", label, f"no exit within {timeout} s")
        return None
    if "Traceback" in p.stderr:
        fail("tracebacks", label, p.stderr.strip().splitlines()[-1])
    return p.returncode, p.stdout, p.stderr


# ---------------------------------------------------------------- HTTP
def raw(port: int, method: str, path: str, body: bytes, headers: dict | None = None, timeout: float = HANG_S):
    """One request over a raw socket; returns (status, body) or None on a hang."""
    h = {"Host": "127.0.0.1", "Content-Type": "application/json", "Content-Length": str(len(body)),
         "Connection": "close", **(headers or {})}
    req = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    data = b""
    try:
        try:
            s.sendall(req.encode() + body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer (413) and close before the whole body is sent
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        return (0, data)
    finally:
        s.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/") else 0
    return status, rest


def http_case(port: int, path: str, body: bytes | str, label: str, headers: dict | None = None,
              expect: int | None = 400) -> tuple[int, bytes] | None:
    counts["tried"] += 1
    if isinstance(body, str):
        body = body.encode()
    r = raw(port, "POST", path, body, headers)
    repro = f"POST {path} {label}"
    if r is None:
        fail("hangs", repro, f"no answer within {HANG_S} s")
        return None
    st, b = r
    if st >= 500 or st == 0:
        fail("5xx", repro, f"{st} {b[:200].decode(errors='replace')}")
    if b"Traceback" in b:
        fail("tracebacks", repro, b[:200].decode(errors="replace"))
    if expect is not None and st != expect and st < 500:
        fail("unclear errors", repro, f"{st} (expected {expect}) {b[:200].decode(errors='replace')}")
    return r


def start_server(bundle: Path, env: dict, log: Path, ready: bool = True):
    port = free_port()
    f = open(log, "w")
    p = subprocess.Popen([sys.executable, "-m", "uvicorn", "serve.app:app", "--host", "127.0.0.1", "--port",
                          str(port)], env={**ENV, "SHALIK_MODEL": str(bundle), **env}, stdout=f, stderr=subprocess.STDOUT,
                         cwd=ROOT)
    t0 = time.time()
    while time.time() - t0 < 90:
        if p.poll() is not None:
            break
        try:
            r = raw(port, "GET", "/health", b"", timeout=5)
            if r and r[0] == 200:
                return p, port
            # answering but not ready (a broken bundle answers 503 for ever)
            if r and r[0] and (not ready or time.time() - t0 > 60):
                return p, port
            time.sleep(0.5)
        except OSError:
            time.sleep(0.5)
    return p, None


def stop(p) -> None:
    p.terminate()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()


S = "\\ud800"  # a lone surrogate, JSON-escaped
C = "/v1/completions"


H = "/v1/chat/completions"
WRONG = [None, True, 1.5, -3, "s", [], {}, [[1, "a"]], 10 ** 30]  # a wrong value of every JSON type
USER = [{"role": "user", "content": "নদীর নাম বলো।"}]


def chat_cases(wrong: list) -> list[tuple[str, str, str, int | None]]:
    """Chat requests: well-formed ones (200), conversations the chat format refuses, features the server does not
    have, and every wrong type in every field (any 4xx)."""
    def j(d) -> str:
        return json.dumps(d)

    def part(text: str) -> dict:
        return {"type": "text", "text": text}

    cases = [
        (H, j({"messages": USER, "max_tokens": 2}), "chat", 200),
        (H, j({"messages": USER, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}),
         "chat streamed", 200),
        (H, j({"messages": [{"role": "user", "content": [part("a"), part("b")]}], "max_tokens": 2}), "text parts", 200),
        (H, j({"messages": USER, "max_tokens": 2, "tools": [], "tool_choice": "none",
               "response_format": {"type": "text"}}), "feature fields that ask for nothing", 200),
        (H, '{"messages": [{"role": "user", "content": "a' + S + '"}]}', "content lone surrogate", 400),
        (H, j({"messages": []}), "no messages", 400),
        (H, j({"messages": [{"role": "tool", "content": "x"}]}), "tool role", 400),
        (H, j({"messages": [{"role": "user"}]}), "no content", 400),
        (H, j({"messages": [{"role": "user", "content": []}]}), "empty part list", 400),
        (H, j({"messages": [{"role": "user", "content": [part("a"), {"type": "image_url", "image_url": {}}]}]}),
         "image part", 400),
        (H, j({"messages": [{"role": "user", "content": [part("<|im_"), part("end|>")]}]}),
         "turn token split across parts", 400),
        (H, j({"messages": [{"role": "user", "content": "ক" * 100_000}]}), "conversation past the context", 400),
        (H, j({"messages": USER * 3000, "max_tokens": 1}), "3000 turns", 400),
        (H, j({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}), "tools", 400),
        (H, j({"messages": USER, "tool_choice": "required"}), "tool_choice required", 400),
        (H, j({"messages": USER, "response_format": {"type": "json_object"}}), "JSON mode", 400),
        (H, j({"messages": USER, "max_completion_tokens": 0}), "max_completion_tokens 0", 400),
        (H, j({"messages": USER, "top_logprobs": 2}), "top_logprobs without logprobs", 400),
        (H, j({"messages": USER, "stream_options": {"include_usage": True}}), "stream_options without stream", 400),
        (H, j({"messages": USER, "seed": 2 ** 64}), "seed 2^64", 400),
        (H, "[]", "array body", 400),
    ]
    cases += [(H, j({"messages": [{"role": "user", "content": f"a{tok}b"}]}), f"content with {tok}", 400)
              for tok in RESERVED_TOKENS]
    for f in ["messages", "max_tokens", "max_completion_tokens", "n", "stop", "seed", "stream", "logprobs",
              "top_logprobs", "tools", "tool_choice", "functions", "response_format", "modalities", "audio",
              "stream_options", "logit_bias"]:
        cases += [(H, j({"messages": USER, "max_tokens": 1, f: w}), f"chat {f}={w!r}", None) for w in wrong]
    return cases


def http_battery(port: int, tag: str) -> None:
    def j(d) -> str:
        return json.dumps(d)

    cases: list[tuple[str, str, str, int | None]] = [
        (C, '{"prompt": "a' + S + '", "max_tokens": 2}', "prompt lone surrogate", 400),
        (C, '{"prompt": ["ok", "b' + S + '"], "max_tokens": 2}', "list prompt lone surrogate", 400),
        (C, '{"prompt": "a", "max_tokens": 2, "stop": "' + S + '"}', "stop lone surrogate", 400),
        (C, '{"prompt": "a", "max_tokens": 2, "stop": ["x", "' + S + '"]}', "stop list lone surrogate", 400),
        ("/tokenize", '{"prompt": "a' + S + '"}', "tokenize lone surrogate", 400),
        ("/detokenize", '{"tokens": ["' + S + '"]}', "detokenize surrogate as id", 400),
        ("/v1/score", '{"text": "a' + S + '"}', "score lone surrogate", 400),
        (C, '{"prompt": "a", "user": "' + S + '", "max_tokens": 1}', "user lone surrogate", None),
        (C, '{"prompt": "a", "model": "' + S + '", "max_tokens": 1}', "model lone surrogate", None),
        (C, '{"prompt": "' + "[" * 200_000 + "]" * 200_000 + '"}', "400k-char prompt past the context", 400),
        (C, '{"prompt": ' + "[" * 200_000 + "]" * 200_000 + "}", "200k-deep nesting", 400),
        (C, '{"prompt": "a", "max_tokens": ' + "9" * 5000 + "}", "5000-digit max_tokens", 400),
        (C, '{"prompt": [' + "1" * 5000 + "]}", "5000-digit token id", 400),
        (C, '{"prompt": "a", "seed": ' + "9" * 5000 + "}", "5000-digit seed", 400),
        (C, '{"prompt": "a", "seed": 18446744073709551616, "max_tokens": 1}', "seed 2^64", None),
        (C, '{"prompt": [18446744073709551616]}', "token id 2^64", 400),
        (C, j({"prompt": "a", "stop": ""}), "empty stop string", 400),
        (C, j({"prompt": "a", "stop": ["x", ""]}), "empty stop in list", 400),
        (C, j({"prompt": "a", "n": 10 ** 9}), "huge n", 400),
        (C, j({"prompt": "a", "max_tokens": 10 ** 12}), "huge max_tokens", 400),
        (C, j({"prompt": "a", "logprobs": 10 ** 9}), "huge logprobs", 400),
        (C, j({"prompt": "a", "temperature": -1}), "negative temperature", 400),
        (C, j({"prompt": "a", "temperature": 1e-310, "max_tokens": 3}), "temperature 1e-310", 200),
        (C, '{"prompt": "a", "temperature": 5e-324, "max_tokens": 3}', "temperature 5e-324", 200),
        (C, '{"prompt": "a", "repetition_penalty": 5e-324, "max_tokens": 3}', "repetition_penalty 5e-324", 400),
        (C, j({"prompt": "a", "top_p": 0, "max_tokens": 3}), "top_p 0", 200),
        (C, '{"prompt": "a", "temperature": NaN}', "temperature NaN", 400),
        (C, '{"prompt": "a", "temperature": Infinity}', "temperature Infinity", 400),
        (C, j({"prompt": "a", "echo": True, "logprobs": 1, "max_tokens": 1}), "echo+logprobs", 200),
        (C, j({"prompt": "a", "stream": True, "max_tokens": 2, "stop": ["\n"]}), "stream", 200),
        (C, j({"prompt": [], "max_tokens": 1}), "empty prompt list", 400),
        (C, j({"prompt": [[]], "max_tokens": 1}), "empty id list", 400),
        (C, j({"prompt": [-1]}), "negative id", 400),
        (C, j({"prompt": [10 ** 7]}), "id past vocab", 400),
        ("/detokenize", j({"tokens": [10 ** 7]}), "detokenize id past vocab", 400),
        ("/detokenize", j({"tokens": None}), "detokenize null", 400),
        ("/v1/score", j({"text": ""}), "score empty", 400),
        ("/v1/score", j({"text": [10 ** 7]}), "score id past vocab", 400),
        (C, '{"prompt": "a"', "truncated JSON", 400),
        (C, "", "empty body", 400),
        (C, "[]", "array body", 400),
        (C, "null", "null body", 400),
    ]
    wrong = WRONG
    fields = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream", "logprobs",
              "echo", "presence_penalty", "frequency_penalty", "repetition_penalty", "stream_options", "best_of",
              "logit_bias", "suffix", "model", "user"]
    for f in fields:
        for w in wrong:
            body = {"prompt": "a", "max_tokens": 1, f: w}
            cases.append((C, j(body), f"{f}={w!r}", None))
    for f, base in [("prompt", {}), ("model", {"prompt": "a"}), ("add_special_tokens", {"prompt": "a"})]:
        for w in wrong:
            cases.append(("/tokenize", j({**base, f: w}), f"tokenize {f}={w!r}", None))
    for w in wrong:
        cases.append(("/detokenize", j({"tokens": w}), f"detokenize tokens={w!r}", None))
        cases.append(("/v1/score", j({"text": w}), f"score text={w!r}", None))
    cases += chat_cases(wrong)
    for path, body, label, expect in cases:
        r = http_case(port, path, body, f"[{tag}] {label}", expect=expect)
        if r and label == "echo+logprobs" and r[0] == 200:
            lp = json.loads(r[1])["choices"][0]["logprobs"]["token_logprobs"]
            if lp[0] is not None:
                fail("unclear errors", f"POST {C} [{tag}] echo+logprobs", f"first token_logprob {lp[0]} (want null)")
    http_case(port, H, json.dumps({"messages": USER}), f"[{tag}] chat sent as text/plain",
              {"Content-Type": "text/plain"})
    # bodies that are not JSON text
    for label, body in [("invalid UTF-8", b'{"prompt": "\xff\xfe"}'), ("NUL bytes", b'{"prompt": "a\x00"}'),
                        ("latin-1 body", '{"prompt": "é"}'.encode("latin-1"))]:
        http_case(port, C, body, f"[{tag}] {label}", expect=None)
    http_case(port, C, b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}', f"[{tag}] 9 MiB body", expect=413)
    # Content-Length larger than the body: must be answered (408/400), not held open
    counts["tried"] += 1
    t0 = time.time()
    r = raw(port, "POST", C, b'{"prompt": "a"}', {"Content-Length": "1000"}, timeout=HANG_S + 10)
    took = time.time() - t0
    notes.append(f"[{tag}] Content-Length 1000 with a 15-byte body: {r[0] if r else 'no answer'} after {took:.1f} s "
                 "(SHALIK_BODY_TIMEOUT_S defaults to 30)")
    if r is None:
        fail("hangs", f"POST {C} [{tag}] Content-Length: 1000 with a 15-byte body", f"no answer within {took:.0f} s")
    elif r[0] >= 500:
        fail("5xx", f"[{tag}] Content-Length > body", str(r[0]))


def settings_battery(bundle: Path, tmp: Path) -> None:
    bad = [{"SHALIK_MAX_CONCURRENCY": "abc"}, {"SHALIK_MAX_CONCURRENCY": "-1"}, {"SHALIK_MAX_CONCURRENCY": "0"},
           {"SHALIK_BACKEND": "nope"}, {"SHALIK_DEFAULT_MAX_TOKENS": "x"}, {"SHALIK_MODEL": str(tmp / "missing")},
           {"SHALIK_MODEL": ""}, {"SHALIK_THREADS": "two"}, {"SHALIK_MAX_BODY_BYTES": "1e99"}]
    for env in bad:
        counts["tried"] += 1
        log = tmp / "srv.log"
        p, port = start_server(bundle, env, log, ready=False)
        label = " ".join(f"{k}={v}" for k, v in env.items()) + " uvicorn serve.app:app"
        if port is not None:
            r = raw(port, "GET", "/health", b"")
            st = r[0] if r else None
            if st is not None and st >= 500 and st != 503:
                fail("5xx", label, f"/health {st}")
        stop(p)
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            fail("tracebacks", label, [ln for ln in text.splitlines() if ln.strip()][-1])


def corrupt_bundle_battery(bundle: Path, tmp: Path) -> None:
    bad = tmp / "bad-bundle"
    shutil.copytree(bundle, bad)
    data = bad / external_data(ONNX)
    b = bytearray(data.read_bytes())
    b[len(b) // 2] ^= 0xFF
    data.write_bytes(bytes(b))
    for backend in ["onnx", "rust"]:
        counts["tried"] += 1
        if backend == "rust":
            st = bad / WEIGHTS
            sb = bytearray(st.read_bytes())
            sb[-10] ^= 0xFF
            st.write_bytes(bytes(sb))
        log = tmp / f"bad-{backend}.log"
        p, port = start_server(bad, {"SHALIK_BACKEND": backend}, log)
        label = f"SHALIK_BACKEND={backend} SHALIK_MODEL=<bundle with a flipped byte> uvicorn; POST {C}"
        if port is None:
            fail("unclear errors", label, "server did not start")
        else:
            r = raw(port, "POST", C, b'{"prompt": "a", "max_tokens": 1}')
            name = external_data(ONNX) if backend == "onnx" else WEIGHTS
            if r is None:
                fail("hangs", label, "no answer")
            elif r[0] != 503 or name.encode() not in r[1]:
                fail("5xx" if r[0] >= 500 and r[0] != 503 else "unclear errors", label, f"{r[0]} {r[1][:200]!r}")
        stop(p)
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            fail("tracebacks", label, "traceback in server log")
        if "sha256" not in text.lower() and external_data(ONNX) not in text and WEIGHTS not in text:
            fail("unclear errors", label, "cause not in the log: " + text[-200:])


# ---------------------------------------------------------------- Python API
def api_battery(bundle: Path) -> None:
    import serve

    lm = serve.load(bundle)
    allowed = tuple(getattr(serve, n) for n in ("RequestError", "BundleError") if hasattr(serve, n))
    cases = [
        ("serve.load(None)", lambda: serve.load(None), "path"),
        ("serve.load(b, threads=0)", lambda: serve.load(bundle, threads=0), "threads"),
        ("serve.load(b, threads=-1)", lambda: serve.load(bundle, threads=-1), "threads"),
        ("serve.load(b, threads='2')", lambda: serve.load(bundle, threads="2"), "threads"),
        ("serve.load(b, backend='x')", lambda: serve.load(bundle, backend="x"), "backend"),
        ("serve.load(b, quantize='int4')", lambda: serve.load(bundle, quantize="int4"), "quantize"),
        ("lm.generate(b'x')", lambda: lm.generate(b"x", 2), "prompt"),
        ("lm.generate('a', stop=5)", lambda: lm.generate("a", 2, stop=5), "stop"),
        ("lm.generate('a', stop='')", lambda: lm.generate("a", 2, stop=""), "stop"),
        ("lm.detokenize(None)", lambda: lm.detokenize(None), "ids"),
        ("lm.detokenize([2**64])", lambda: lm.detokenize([2 ** 64]), "id"),
        ("lm.generate('a\\ud800')", lambda: lm.generate("a\ud800", 2), "prompt"),
        ("lm.score('a\\ud800')", lambda: lm.score("a\ud800"), "text"),
        ("lm.tokenize('a\\ud800')", lambda: lm.tokenize("a\ud800"), "text"),
        ("lm.generate('a', temperature=-1)", lambda: lm.generate("a", 2, temperature=-1), "temperature"),
        ("lm.generate('a', max_new_tokens=-1)", lambda: lm.generate("a", -1), "max_new_tokens"),
    ]
    for label, fn, name in cases:
        counts["tried"] += 1
        try:
            fn()
            fail("unclear errors", label, "no error raised")
        except allowed + (ValueError, TypeError) as e:
            if name not in str(e) and not isinstance(e, allowed):
                fail("unclear errors", label, f"{type(e).__name__}: {e}")
            elif name not in str(e):
                fail("unclear errors", label, f"{type(e).__name__} not naming {name!r}: {e}")
        except Exception as e:  # noqa: BLE001 - any other class is what the battery counts
            fail("unclear errors", label, f"{type(e).__name__}: {e}")
    # temperature 1e-310 must be greedy
    counts["tried"] += 1
    g = lm.generate("আমি", 8, temperature=0)
    for t in (1e-310, 5e-324):
        counts["tried"] += 1
        try:
            if lm.generate("আমি", 8, temperature=t, seed=1) != g:
                fail("unclear errors", f"lm.generate('আমি', 8, temperature={t})", "differs from greedy")
        except Exception as e:  # noqa: BLE001
            fail("unclear errors", f"lm.generate(temperature={t})", f"{type(e).__name__}: {e}")


# ---------------------------------------------------------------- training / data
def fast_sets(tmp: Path, cache: Path, data: Path, **extra) -> list[str]:
    base = {"data.paths": [str(data)], "data.cache_dir": str(cache), "data.val_fraction": 0.05,
            "run.out_dir": str(tmp / "runs"), "tokenizer.vocab_size": 600, "model.hidden_size": 32,
            "model.num_hidden_layers": 2, "model.num_attention_heads": 4, "model.num_key_value_heads": 2,
            "model.intermediate_size": 64, "model.max_position_embeddings": 64, "train.micro_batch_size": 4,
            "train.seq_len": 32, "train.grad_accum": 1, "train.max_steps": 4, "train.warmup_steps": 1,
            "train.eval_every": 1000, "train.eval_tokens": 256, "train.ckpt_every": 2, "train.preflight": False}
    base.update(extra)
    out = []
    for k, v in base.items():
        out += ["--set", f"{k}={json.dumps(v)}"]
    return out


def data_battery(tmp: Path) -> None:
    # the good lines: the mini corpus's own documents (real text, so that the cleaning stage keeps them and the
    # hostile line goes through reading and cleaning alike)
    good = [ln for f in sorted(MINI.glob("*.jsonl.gz")) for ln in gzip.decompress(f.read_bytes()).decode().splitlines()
            if ln.strip()]
    cases = {
        "5000-digit integer": '{"text": "abc", "n": ' + "1" * 5000 + "}",
        "200k-deep nesting": '{"text": "abc", "x": ' + "[" * 200_000 + "]" * 200_000 + "}",
        "lone surrogate": '{"text": "ab\\ud800cd"}',
        "300 KB word": json.dumps({"text": "ক" * 100_000}),
        "2 MB ASCII word": json.dumps({"text": "a" * 2_000_000}),
    }
    for label, line in cases.items():
        d = tmp / f"data-{label.replace(' ', '_')}"
        d.mkdir()
        half = len(good) // 2
        (d / "c.jsonl").write_text("\n".join(good[:half] + [line] + good[half:]) + "\n")
        t0 = time.time()
        r = cli(["-m", "train.data", "prepare", "--config", "tiny", "--data", str(d),
                 *fast_sets(tmp, tmp / f"cache-{d.name}", d)], timeout=60,
                label=f"python -m train.data prepare --config tiny --data <jsonl with {label}>")
        if r and r[0] != 0:
            fail("unclear errors", f"prepare with {label}", r[2].strip().splitlines()[-1])
        elif r and "word" in label and time.time() - t0 > 45:
            fail("hangs", "prepare with a 300 KB word", f"{time.time() - t0:.0f} s")
    d = tmp / "data-nonutf8"
    d.mkdir()
    (d / "x.txt").write_bytes(b"\xff\xfe\x00bad \xc3\x28 latin \xe9t\xe9\n\n" * 50)
    r = cli(["-m", "train.data", "prepare", "--config", "tiny", "--data", str(d),
             *fast_sets(tmp, tmp / "cache-nonutf8", d)], timeout=60,
            label="python -m train.data prepare --data <folder with only a non-UTF-8 .txt>")
    if r and ("UTF-8" not in r[2] and "utf-8" not in r[2]):
        fail("unclear errors", "prepare on a folder with only a non-UTF-8 file",
             (r[2].strip().splitlines() or [""])[-1])


def resume_battery(tmp: Path, run_root: Path, cache: Path) -> None:
    ck = run_root / "runs" / "t" / "checkpoints"
    steps = sorted(p for p in ck.iterdir() if p.is_dir() and not p.name.startswith("."))
    newest = steps[-1]

    def corrupt_sums(r: Path):
        p = r / "runs/t/checkpoints" / newest.name / "SHA256SUMS"
        p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])

    def garbage_sums(r: Path):
        p = r / "runs/t/checkpoints" / newest.name / "SHA256SUMS"
        p.write_bytes(p.read_bytes() + b"not a sum line\n")

    def latest_bytes(r: Path):
        (r / "runs/t/checkpoints/latest").write_bytes(b"\xff\xfe\x80")

    def state_garbage(r: Path):
        (r / "runs/t/checkpoints" / newest.name / "trainer_state.json").write_text("{not json")

    for label, mutate in [("truncated SHA256SUMS", corrupt_sums), ("garbage line in SHA256SUMS", garbage_sums),
                          ("non-UTF-8 latest", latest_bytes), ("non-JSON trainer_state.json", state_garbage)]:
        r = tmp / f"resume-{label.replace(' ', '_')}"
        shutil.copytree(run_root / "runs", r / "runs")
        mutate(r)
        res = cli(["-m", "train.run", "--config", "tiny", "--name", "t", "--resume",
                   *fast_sets(r, cache, MINI, **{"train.max_steps": 6})], timeout=120,
                  label=f"python -m train.run --resume (newest checkpoint: {label})")
        if res and res[0] != 0 and "error" not in res[2].lower():
            fail("unclear errors", f"--resume with {label}", res[2][-200:])


# ---------------------------------------------------------------- export
def export_battery(tmp: Path, run: Path, bundle: Path) -> None:
    exp = ["-m", "export.onnx", str(run), "--no-parity"]
    x = tmp / "notabundle"
    x.mkdir()
    (x / "thesis.txt").write_text("precious")
    r = cli([*exp, "--out", str(x), "--force"], label="python -m export.onnx RUN --out <folder with thesis.txt> --force")
    if not (x / "thesis.txt").exists():
        fail("data lost", "export.onnx --out <non-bundle folder> --force", "thesis.txt deleted")
    elif r and r[0] == 0:
        fail("unclear errors", "export.onnx --out <non-bundle folder> --force", "accepted")
    ro = tmp / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)  # root ignores this; the case still checks the message path
    cli([*exp, "--out", str(ro / "b")], label="export.onnx --out <read-only dir>/b")
    os.chmod(ro, 0o755)
    f = tmp / "regular"
    f.write_text("x")
    r = cli([*exp, "--out", str(f / "b")], label="export.onnx --out <regular file>/b")
    if r and r[0] == 0:
        fail("unclear errors", "export.onnx --out <file>/b", "accepted")
    cli([*exp, "--out", "/proc/x"], label="export.onnx --out /proc/x")
    ef = tmp / "existing.bin"
    ef.write_text("keep me")
    r = cli([*exp, "--out", str(ef), "--force"], timeout=300, label="export.onnx --out <existing file> --force")
    left = [p.name for p in tmp.iterdir() if ".tmp" in p.name]
    if left:
        fail("partial files", "export.onnx --out <existing file> --force", f"left {left}")
    if ef.is_file() and ef.read_text() != "keep me":
        fail("data lost", "export.onnx --out <existing file> --force", "file changed")
    odd = tmp / "odd-split"   # a tokenizer whose split llama.cpp has no name for (issue 28)
    shutil.copytree(bundle, odd, ignore=shutil.ignore_patterns(f"{ONNX}*", f"{ONNX_Q8_0}*"))
    tj = json.loads((odd / TOKENIZER).read_text(encoding="utf-8"))
    tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\p{N}"
    (odd / TOKENIZER).write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    before = set(p.name for p in odd.iterdir())
    r = cli(["-m", "export.gguf", str(odd)], label="python -m export.gguf BUNDLE (a split llama.cpp has no name for)")
    after = set(p.name for p in odd.iterdir())
    if r and r[0] == 0:
        fail("unclear errors", "export.gguf BUNDLE", "accepted a split llama.cpp cannot reproduce")
    if after - before:
        fail("partial files", "export.gguf BUNDLE", f"left {sorted(after - before)}")


# ---------------------------------------------------------------- main
CONVERSATIONS = [("hi", "hello"), ("নদী?", "পদ্মা"), ("2+2?", "4"), ("name?", "Shalik")]


def setup(tmp: Path, cache: Path) -> None:
    """Train a seconds-long tiny run (checkpoints at steps 2 and 4), fine-tune it on a few short conversations for
    4 steps (a chat model: a base model's chat requests are refused whatever they hold), and export that with
    --no-parity: the bundle every section serves."""
    r = subprocess.run([sys.executable, "-m", "train.run", "--config", "tiny", "--name", "t",
                        *fast_sets(tmp, cache, MINI)], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    convs = tmp / "conversations.jsonl"
    convs.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant",
                                                                                      "content": a}]},
                                        ensure_ascii=False) + "\n" for q, a in CONVERSATIONS * 8), encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "train.sft", str(tmp / "runs" / "t"), "--data", str(convs),
                        "--name", "t-sft", "--set", "train.max_steps=4", "--set", "train.preflight=false",
                        "--set", "train.final_eval=false"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "export.onnx", str(tmp / "runs" / "t-sft"), "--out",
                        str(tmp / "bundle"), "--no-parity"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


def main() -> int:
    t_start = time.time()
    reuse = os.environ.get("BATTERY_WORK")  # a work dir of an earlier run whose bundle can be reused
    tmp = Path(reuse) if reuse else Path(tempfile.mkdtemp(prefix="hostile-"))
    cache = tmp / "cache"
    print(f"work dir {tmp}", file=sys.stderr)
    if not (tmp / "bundle" / MANIFEST).is_file():
        setup(tmp, cache)
    run = tmp / "runs" / "t"
    bundle = tmp / "bundle"
    print("setup done", time.time() - t_start, file=sys.stderr)
    sections = os.environ.get("BATTERY", "http,settings,bundle,api,data,resume,export").split(",")
    for backend in ["onnx", "rust"]:
        if "http" not in sections:
            break
        p, port = start_server(bundle, {"SHALIK_BACKEND": backend}, tmp / f"{backend}.log")
        if port is None:
            fail("unclear errors", f"SHALIK_BACKEND={backend} uvicorn", "did not start")
        else:
            http_battery(port, backend)
        stop(p)
        print(backend, "http done", counts, file=sys.stderr)
    if "settings" in sections:
        settings_battery(bundle, tmp)
    if "bundle" in sections:
        corrupt_bundle_battery(bundle, tmp)
    if "api" in sections:
        api_battery(bundle)
    print("serve done", counts, file=sys.stderr)
    if "data" in sections:
        data_battery(tmp)
    if "resume" in sections:
        resume_battery(tmp, tmp, cache)
    if "export" in sections:
        export_battery(tmp, run, bundle)
    elapsed = time.time() - t_start
    load = os.getloadavg()
    lines = ["# Hostile-input battery", "", f"`python benchmarks/hostile_battery.py` — {elapsed:.0f} s, load average "
             f"{load[0]:.2f} ({timing.cores()} cores, {timing.cpu_name()}), commit {timing.git_commit()}, sections: "
             f"{', '.join(sections)}.", "",
             f"HTTP: both backends (onnx, rust), 127.0.0.1 only; each gets {len(chat_cases(WRONG)) + 1} chat requests "
             "(`/v1/chat/completions`: well-formed ones, conversations the chat format refuses, features the server "
             "lacks, a wrong type in each field, a body sent as text/plain).", "",
             "| category | count |", "|---|---|"] + [f"| {k} | {v} |" for k, v in counts.items()]
    lines += ["", "## Failures", ""] + (failures or ["none"]) + ["", "## Notes", ""] + [f"- {n}" for n in notes]
    atomic_write_text(OUT_MD, "\n".join(lines) + "\n")
    print("\n".join(lines))
    if not reuse:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
