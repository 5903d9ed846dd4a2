"""The Python API (``from serve import load``): generate / stream / complete / score on a scripted model
and on the exported tiny bundle with each backend (onnx; rust when ``rust_runtime`` is built)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from serve import ContextLengthError, RequestError, load
from serve.lm import LM
from serve.sampling import log_softmax
from tests.scripted import scripted_lm

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["আমি বাংলায়", "The river"]


def rust_available() -> bool:
    try:
        import rust_runtime  # noqa: F401
    except ImportError:
        return False
    return True


BACKENDS = ["onnx", pytest.param("rust", marks=pytest.mark.skipif(
    not rust_available(), reason="rust_runtime is not built (pip install -e '.[all]' builds it)"))]


class CountingBackend:
    """Wraps a backend and counts prefill/decode calls (the protocol is all it needs)."""

    def __init__(self, inner):
        self.inner = inner
        self.name, self.vocab_size = inner.name, inner.vocab_size
        self.max_position_embeddings = inner.max_position_embeddings
        self.prefills: list[int] = []
        self.decodes = 0

    def new_sequence(self):
        inner_seq, outer = self.inner.new_sequence(), self

        class Seq:
            @property
            def position(self):
                return inner_seq.position

            def prefill(self, ids, all_logits=False):
                outer.prefills.append(len(ids))
                return inner_seq.prefill(ids, all_logits)

            def decode(self, token_id):
                outer.decodes += 1
                return inner_seq.decode(token_id)

        return Seq()


@pytest.fixture
def random_lm() -> LM:
    """Scripted model with seeded random logits (so sampling really samples)."""
    return scripted_lm(None, context=256)


# ---- scripted model


def test_generate_equals_joined_stream_and_seed_reproduces(random_lm):
    opts = dict(temperature=0.9, top_p=0.95, seed=11)
    text = random_lm.generate("ab", 40, **opts)
    assert "".join(random_lm.stream("ab", 40, **opts)) == text
    assert random_lm.generate("ab", 40, **opts) == text
    assert random_lm.generate("ab", 40, temperature=0.9, top_p=0.95, seed=12) != text


def test_completion_fields_are_consistent(random_lm):
    c = random_lm.complete("ab", 12, temperature=1.0, seed=3, top_logprobs=3)
    n = c.completion_tokens
    assert n == 12 == len(c.token_ids) == len(c.tokens) == len(c.logprobs) == len(c.top_logprobs) == len(c.text_offset)
    assert c.prompt_tokens == 1 + len(random_lm.tokenize("ab")) and c.finish_reason == "length"
    assert c.tokens == random_lm.token_strings(c.token_ids)
    assert random_lm.detokenize(c.token_ids) == c.text
    assert all(len(d) == 3 and max(d.values()) >= lp - 1e-12 for d, lp in zip(c.top_logprobs, c.logprobs, strict=True))
    assert all(lp <= 0 for lp in c.logprobs)


def test_prompt_prefilled_once_then_one_decode_per_token():
    lm = scripted_lm(["x", "y"], context=64)
    counting = CountingBackend(lm.backend)
    lm2 = LM(counting, lm.tokenizer)
    c = lm2.complete("hello", 10, temperature=0)
    assert counting.prefills == [1 + len(lm.tokenize("hello"))]
    assert counting.decodes == 9 and c.completion_tokens == 10  # the last token is never fed back


def test_logprobs_are_under_the_raw_distribution():
    lm = scripted_lm(None, context=64)
    c = lm.complete("q", 1, temperature=0.5, repetition_penalty=3.0, presence_penalty=1.0, seed=0)
    raw = lm.backend.new_sequence().prefill([lm.eot_id, *lm.tokenize("q")])
    assert c.logprobs[0] == pytest.approx(float(log_softmax(raw)[c.token_ids[0]]))


def test_h4_context_capping_and_eos():
    lm = scripted_lm(["ab"], context=64)
    prompt = "abababababababababab"  # 10 tokens of "ab"; with <|endoftext|> the prompt uses 11 positions
    assert len(lm.tokenize(prompt)) == 10
    c = lm.complete(prompt, None, default_max_new_tokens=1000)
    assert (c.prompt_tokens, c.completion_tokens, c.finish_reason) == (11, 53, "length")
    assert c.prompt_tokens + c.completion_tokens == lm.context_length
    c = lm.complete(prompt, 5)
    assert (c.completion_tokens, c.finish_reason) == (5, "length")
    eos = scripted_lm(["ab"], eos_after=3)
    c = eos.complete(prompt, 20)
    assert (c.text, c.completion_tokens, c.finish_reason) == ("ababab", 3, "stop")
    assert "<|endoftext|>" not in c.text


def test_context_error_names_both_numbers():
    lm = scripted_lm(["ab"], context=64)
    with pytest.raises(ContextLengthError) as e:
        lm.complete("abab", 62)
    msg = str(e.value)
    assert "3 tokens" in msg and "62" in msg and "64" in msg and isinstance(e.value, ValueError)
    assert lm.complete("abab", 61).completion_tokens == 61
    with pytest.raises(ContextLengthError, match="context length 64"):
        lm.complete("ab" * 70, None)


@pytest.mark.parametrize("prompt,param", [([], "prompt"), ([5, 99999], "prompt"), ([1.5], "prompt"),
                                          (3.0, "prompt")])
def test_bad_prompts(prompt, param):
    lm = scripted_lm(["ab"])
    with pytest.raises(RequestError) as e:
        lm.complete(prompt, 2)
    assert e.value.param == param


@pytest.mark.parametrize("kw,param", [(dict(stop=[""]), "stop"), (dict(temperature=-1), "temperature"),
                                      (dict(top_logprobs=-1), "logprobs"), (dict(max_new_tokens=-2), "max_tokens")])
def test_bad_options(kw, param):
    lm = scripted_lm(["ab"])
    with pytest.raises(RequestError) as e:
        lm.complete("ab", **{"max_new_tokens": 2, **kw})
    assert e.value.param == param


def test_token_id_prompt_equals_text_prompt(random_lm):
    ids = random_lm.tokenize("abc")
    assert random_lm.generate(ids, 10, temperature=0) == random_lm.generate("abc", 10, temperature=0)


def test_score_equals_hand_computed_nll(random_lm):
    text = "hello there"
    s = random_lm.score(text)
    ids = random_lm.tokenize(text)
    rows = random_lm.backend.new_sequence().prefill([random_lm.eot_id, *ids[:-1]], all_logits=True)
    hand = [-float(log_softmax(rows[i])[t]) for i, t in enumerate(ids)]
    np.testing.assert_allclose(s.token_nll, hand, rtol=1e-12)
    assert s.nll_sum == pytest.approx(sum(hand)) and s.nll_mean == pytest.approx(sum(hand) / len(ids))
    assert s.chars == len(text) and s.bits_per_char == pytest.approx(sum(hand) / np.log(2) / len(text))
    with pytest.raises(RequestError):
        random_lm.score("")


def test_score_beyond_the_context_uses_a_sliding_window(monkeypatch):
    lm = scripted_lm(None, context=16)
    ids = [int(i) for i in np.random.default_rng(0).integers(2, lm.vocab_size, 40)]
    s = lm.score(ids)
    assert len(s.token_nll) == 40
    full = [lm.eot_id, *ids]

    def nll(begin, target):  # target full[target] predicted from the window full[begin:target]
        rows = lm.backend.new_sequence().prefill(full[begin:target], all_logits=True)
        return -float(log_softmax(rows[-1])[full[target]])

    # window 1: full[0:16] scores ids 0..15; window 2 starts at 8 and scores ids 16..23; window 3 at 16 ...
    expected = [nll(0, t) for t in range(1, 17)] + [nll(8, t) for t in range(17, 25)] + \
               [nll(16, t) for t in range(25, 33)] + [nll(24, t) for t in range(33, 41)]
    np.testing.assert_allclose(s.token_nll, expected, rtol=1e-12)
    monkeypatch.setattr("serve.lm.PREFILL_BLOCK", 3)  # block-wise prefill gives the same numbers
    assert lm.score(ids).token_nll == s.token_nll
    c = lm.complete(ids[:14], 1, echo=True, temperature=0)
    np.testing.assert_allclose(c.prompt.logprobs, [-x for x in s.token_nll[:14]], rtol=1e-12)


def test_echo_scores_prompt_from_endoftext(random_lm):
    ids = random_lm.tokenize("xyz")
    c = random_lm.complete(ids, 0, echo=True, top_logprobs=2)
    assert c.text == "" and c.completion_tokens == 0
    rows = random_lm.backend.new_sequence().prefill([random_lm.eot_id, *ids], all_logits=True)
    lp = log_softmax(rows)
    assert c.prompt.token_ids == ids
    np.testing.assert_allclose(c.prompt.logprobs, [lp[i, t] for i, t in enumerate(ids)])
    assert c.prompt.logprobs == pytest.approx([-x for x in random_lm.score(ids).token_nll])


def test_s5_seeded_generation_unaffected_by_concurrent_ones():
    lm = scripted_lm(None, context=256, delay_s=0.002)
    opts = dict(temperature=0.8, seed=42)
    alone = [lm.generate("p", 16, **opts) for _ in range(3)]
    assert len(set(alone)) == 1
    results: dict[str, str] = {}

    def run(key, **kw):
        results[key] = lm.generate("p", 16, **kw)

    threads = [threading.Thread(target=run, args=("A",), kwargs=opts),
               threading.Thread(target=run, args=("B",), kwargs=dict(temperature=0.8)),
               threading.Thread(target=run, args=("C",), kwargs=dict(temperature=0.8, seed=7))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["A"] == alone[0]


def test_s5_choices_get_derived_streams():
    lm = scripted_lm(None, context=256)
    choices = [c.text for c in lm.complete_batch(["p"], 12, n=4, temperature=1.0, seed=5)]
    assert len(set(choices)) > 1
    assert choices == [c.text for c in lm.complete_batch(["p"], 12, n=4, temperature=1.0, seed=5)]
    assert choices[0] == lm.generate("p", 12, temperature=1.0, seed=5)


def test_cancel_stops_before_next_step():
    lm = scripted_lm(["ab"], context=1000)
    gen = lm.start("x", 500)
    first = next(iter(gen))
    gen.cancel()
    rest = list(gen)
    assert first.text == "ab" and gen.finish_reason == "cancelled"
    assert gen.tokens_generated <= 2 and len(rest) <= 1


NO_TORCH = textwrap.dedent("""
    import sys
    import serve, serve.app
    from tests.scripted import scripted_lm
    lm = scripted_lm(None) if len(sys.argv) < 2 else serve.load(sys.argv[1], backend=sys.argv[2])
    text = lm.generate("আমি", 5, temperature=0.7, seed=1)
    "".join(lm.stream("hi", 5, temperature=0))
    lm.score("hi")
    bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    assert not bad, bad
    print("ok")
""")


def assert_no_torch(*args: str) -> None:
    out = subprocess.run([sys.executable, "-c", NO_TORCH, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "SHALIK_MODEL": "/nonexistent"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_serve_never_imports_torch():
    assert_no_torch()


EXIT_AFTER_STOP = textwrap.dedent("""
    import atexit, sys, threading
    # registered before serve is imported, so it runs after serve's own exit handler (last in, first out)
    atexit.register(lambda: print("engine thread alive at exit:",
                                  any(t.name == "shalik-engine" and t.is_alive() for t in threading.enumerate())))
    import serve
    lm = serve.load(sys.argv[1], backend="onnx")
    first = lm.generate("আমি", 8, temperature=0)[:1]
    print(lm.complete("আমি", 100, temperature=0, stop=[first]).finish_reason)  # stops at its first character
""")


def test_a_script_that_ends_right_after_an_early_stop_exits_cleanly(bundle):
    """A reply that stopped early (a stop string; a chat turn's <|im_end|>) left the engine stepping the sequence
    it had cancelled; a script that ended then aborted in onnxruntime as the interpreter finalized ("terminate
    called without an active exception", exit 134). The engine's thread is stopped at exit."""
    out = subprocess.run([sys.executable, "-c", EXIT_AFTER_STOP, str(bundle)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "terminate called" not in out.stderr, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["stop", "engine thread alive at exit: False"]


# ---- the exported bundle, each backend


@pytest.fixture(scope="module", params=BACKENDS)
def real_lm(request, bundle) -> LM:
    return load(bundle, backend=request.param)


@pytest.mark.parametrize("backend", BACKENDS)
def test_real_serving_never_imports_torch(bundle, backend):
    assert_no_torch(str(bundle), backend)


def test_real_generate_equals_stream_and_seed_reproduces(real_lm):
    for prompt in PROMPTS:
        greedy = real_lm.generate(prompt, 24, temperature=0)
        assert "".join(real_lm.stream(prompt, 24, temperature=0)) == greedy
        sampled = real_lm.generate(prompt, 24, temperature=0.9, top_k=50, seed=123)
        assert "".join(real_lm.stream(prompt, 24, temperature=0.9, top_k=50, seed=123)) == sampled
        assert real_lm.generate(prompt, 24, temperature=0.9, top_k=50, seed=123) == sampled


def test_real_greedy_matches_full_prefill_argmax(real_lm):
    """Cached decoding picks what recomputing the whole sequence picks (within docs/design.md's near-tie rule)."""
    c = real_lm.complete(PROMPTS[0], 12, temperature=0)
    ids = [real_lm.eot_id, *real_lm.tokenize(PROMPTS[0])]
    for tok in c.token_ids:
        logits = real_lm.backend.new_sequence().prefill(ids)
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] < 1e-3:
            break  # near-tie: the comparison stops here
        assert tok == int(np.argmax(logits))
        ids.append(tok)


def test_real_score_equals_hand_computed_nll(real_lm):
    text = "আমি বাংলায় গান গাই. The river is wide."
    s = real_lm.score(text)
    ids = real_lm.tokenize(text)
    rows = real_lm.backend.new_sequence().prefill([real_lm.eot_id, *ids[:-1]], all_logits=True)
    hand = [-float(log_softmax(rows[i])[t]) for i, t in enumerate(ids)]
    np.testing.assert_allclose(s.token_nll, hand, rtol=1e-9, atol=1e-9)
    assert s.chars == len(text) and np.isfinite(s.bits_per_char) and s.bits_per_char > 0


def test_real_context_limit(real_lm):
    ctx = real_lm.context_length
    with pytest.raises(ContextLengthError, match=str(ctx)):
        real_lm.complete("a", ctx)
    c = real_lm.complete("a", None, default_max_new_tokens=10 * ctx, temperature=0)
    assert c.prompt_tokens + c.completion_tokens <= ctx


def test_real_q8_0_loads_when_exported(bundle):
    if not (bundle / "model.q8_0.onnx").exists():
        pytest.skip("the bundle has no model.q8_0.onnx (export with --quantize q8_0)")
    lm = load(bundle, backend="onnx", quantize="q8_0")
    assert lm.generate(PROMPTS[1], 8, temperature=0)


def test_real_concurrent_seeded_generations_equal_sequential_ones(real_lm):
    """S5 on a real backend: sequences in threads share the weights but not their caches or RNGs."""
    alone = [real_lm.generate(PROMPTS[0], 24, temperature=0.8, seed=s) for s in range(4)]
    together: dict[int, str] = {}

    def run(s: int) -> None:
        together[s] = real_lm.generate(PROMPTS[0], 24, temperature=0.8, seed=s)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [together[s] for s in range(4)] == alone


# ---- bad input to the Python API: a RequestError / TypeError / ValueError that names the argument


@pytest.mark.parametrize("call,param", [
    (lambda lm: lm.generate("ab\ud800", 2), "prompt"),
    (lambda lm: list(lm.stream("x\udfff", 2)), "prompt"),
    (lambda lm: lm.score("\ud800"), "text"),
    (lambda lm: lm.tokenize("\ud800"), "text"),
])
def test_lone_surrogate_is_a_request_error_naming_the_field(call, param):
    with pytest.raises(RequestError, match="surrogate") as e:
        call(scripted_lm(["ab"], context=64))
    assert e.value.param == param


@pytest.mark.parametrize("call,param,needle", [
    (lambda lm: lm.generate(b"ab", 2), "prompt", "bytes"),
    (lambda lm: lm.generate("ab", 2, stop=5), "stop", "int"),
    (lambda lm: lm.generate("ab", 2, stop=["a", 5]), "stop", "5"),
    (lambda lm: lm.detokenize(None), "tokens", "NoneType"),
    (lambda lm: lm.detokenize("ab"), "tokens", "str"),
])
def test_wrong_argument_types_are_request_errors_naming_the_argument(call, param, needle):
    with pytest.raises(RequestError, match=needle) as e:
        call(scripted_lm(["ab"], context=64))
    assert e.value.param == param


@pytest.mark.parametrize("call,param,needle", [
    (lambda lm: lm.score("ab", top_logprobs="x"), "top_logprobs", r"top_logprobs must be an integer in \[0, 1000\]"),
    (lambda lm: lm.score("ab", top_logprobs=-1), "top_logprobs", "got -1"),
    (lambda lm: lm.score("ab", top_logprobs=True), "top_logprobs", "got True"),
    (lambda lm: lm.generate("ab", None, default_max_new_tokens=-5), "default_max_new_tokens", "got -5"),
    (lambda lm: lm.generate("ab", default_max_new_tokens=2.5), "default_max_new_tokens", "got 2.5"),
    (lambda lm: lm.generate("ab", 10**5000), "max_tokens", "more than 4300 digits"),
    (lambda lm: lm.generate("ab", 10**30), "max_tokens", "asks for a 31-digit number more"),
    (lambda lm: lm.generate([5, 10**5000], 1), "prompt", "token id a number of more than 4300 digits"),
    (lambda lm: lm.start_choices("ab", 10**5000), "n", "got a number of more than 4300 digits"),
    (lambda lm: lm.generate("ab", 1, top_logprobs=-(10**40)), "logprobs", "got a 41-digit number"),
])
def test_bad_arguments_name_themselves_and_never_format_a_huge_int(call, param, needle):
    """LM.score(top_logprobs='x') said "invalid literal for int()" and took -1; default_max_new_tokens=-5 gave ''; a
    huge int made the message itself raise (Python formats at most 4300 digits)."""
    with pytest.raises(RequestError, match=needle) as e:
        call(scripted_lm(["ab"], context=64))
    assert e.value.param == param


def test_score_takes_top_logprobs():
    s = scripted_lm(["ab"], context=64).score("abab", top_logprobs=np.int64(2))
    assert s.token_nll and s.nll_sum > 0


@pytest.mark.parametrize("kwargs,exc,needle", [
    ({"path": None}, TypeError, "path"), ({"path": 5}, TypeError, "path"),
    ({"threads": 0}, ValueError, "threads"), ({"threads": -1}, ValueError, "threads"),
    ({"threads": 100_000}, ValueError, r"threads must be an int from 1 to 1024 .*got 100000"),
    ({"threads": "2"}, TypeError, "threads"), ({"threads": 1.5}, TypeError, "threads"),
    ({"backend": "gpu"}, ValueError, "backend"), ({"quantize": "int4"}, ValueError, "quantize"),
])
def test_load_arguments_are_checked_before_anything_loads(bundle, kwargs, exc, needle):
    kwargs = {"path": bundle, **kwargs}
    with pytest.raises(exc, match=needle):
        load(kwargs.pop("path"), **kwargs)


# ---- bundle integrity: manifest.json's sha256 checked at load


def _copy_with_one_byte_flipped(bundle: Path, dst: Path, name: str) -> Path:
    import shutil

    shutil.copytree(bundle, dst)
    data = bytearray((dst / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (dst / name).write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("backend,name", [("onnx", "model.onnx.data"), ("onnx", "tokenizer.json"),
                                          pytest.param("rust", "model.safetensors", marks=BACKENDS[1].marks)])
def test_corrupt_bundle_file_is_refused_naming_it(bundle, tmp_path, backend, name):
    from contract.bundle import BundleError

    bad = _copy_with_one_byte_flipped(bundle, tmp_path / "b", name)
    with pytest.raises(BundleError, match=rf"{name} is corrupt: sha256"):
        load(bad, backend=backend)
    if name != "tokenizer.json":  # a flipped weight byte still loads for those who verify elsewhere
        assert load(bad, backend=backend, verify=False).vocab_size == load(bundle, backend=backend).vocab_size


def test_bundle_without_manifest_needs_verify_false(bundle, tmp_path):
    import shutil

    from contract.bundle import BundleError

    shutil.copytree(bundle, tmp_path / "b")
    (tmp_path / "b" / "manifest.json").unlink()
    with pytest.raises(BundleError, match="manifest.json is missing"):
        load(tmp_path / "b")
    assert load(tmp_path / "b", verify=False).generate("a", 2, temperature=0) == load(bundle).generate(
        "a", 2, temperature=0)


def test_negative_max_new_tokens_names_the_python_argument(bundle):
    """A Python caller passes max_new_tokens; the error names it (and the HTTP field it maps to)."""
    lm = load(bundle)
    with pytest.raises(RequestError, match=r"max_new_tokens \(max_tokens over HTTP\) must be an integer >= 0, got -1"):
        lm.generate("a", -1)
