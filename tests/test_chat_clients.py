"""Chat through other people's code, against the tiny trained run fine-tuned by ``train.sft`` and exported (a base
model's bundle carries no chat template):

* ``transformers``' ``apply_chat_template`` (the bundle's tokenizer_config.json) gives the same ids as Shalik's
  server for 20 conversations (system / no system, multi-turn, Bangla, English, mixed, script-edge text);
* the OpenAI Python SDK, unchanged, against a real ``uvicorn serve.app:app``: ``chat.completions.create`` plain,
  streamed (concatenates to the plain reply), ``n=2`` with a seed, with logprobs, and a bad request as the SDK's
  own error — each compared with ``serve.load(bundle)``'s ``LM.chat``;
* llama.cpp (``slow``: llama-cpp-python, the ``bench`` extra): ``create_chat_completion`` on its GGUF with the GGUF's own template evaluates the server's template
  ids and gives the server's greedy reply, ending at ``<|im_end|>``, for 10 conversations per language; the GGUF
  and the Modelfile carry the template and the end-of-turn token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pytest

from contract.chat_format import CHAT_TEMPLATE, IM_END, render
from tests.client_helpers import uvicorn_server
from tests.test_http import _rust_available
from tests.test_llamacpp_tokenizer import _llama_cpp
from train.tokenizer.pretokenizers import SCRIPT_EDGES

ROOT = Path(__file__).resolve().parents[1]

NAME = "shalik-tiny-chat"
KEY = "sk-shalik-chat-test"
SYSTEM_BN = "তুমি একজন সহায়ক। বাংলায় উত্তর দাও।"
SYSTEM_EN = "You are a helpful assistant. Answer briefly."


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _turns(*texts: str) -> list[dict]:
    """user, assistant, user, ... from ``texts``."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]


BN_QUESTIONS = ["বাংলা ভাষা সম্পর্কে কিছু বলো।", "বাংলাদেশের রাজধানী কোথায়?", "রবীন্দ্রনাথ ঠাকুর কে ছিলেন?",
                "একটি ছোট গল্প লেখো।", "বর্ষাকাল কেমন লাগে?", "১৯৭১ সালে কী হয়েছিল?", "নদীর নাম বলো।",
                "তোমার প্রিয় খাবার কী?", "গ্রামের জীবন কেমন?", "পড়াশোনা কেন দরকার?"]
EN_QUESTIONS = ["Tell me about the Bangla language.", "What is the capital of Bangladesh?", "Who was Tagore?",
                "Write a short story.", "What is the rainy season like?", "What happened in 1971?",
                "Name a river.", "What is your favourite food?", "Describe village life.", "Why study?"]

# 20 conversations for the template-ids check
TEMPLATE_CONVERSATIONS: list[list[dict]] = [
    [_user(BN_QUESTIONS[0])],
    [{"role": "system", "content": SYSTEM_BN}, _user(BN_QUESTIONS[1])],
    _turns(BN_QUESTIONS[2], "তিনি একজন কবি ছিলেন।", "আর কী জানো?"),
    [{"role": "system", "content": SYSTEM_BN}, *_turns(BN_QUESTIONS[3], "একদা এক রাজা ছিলেন।", "তারপর?")],
    [_user(EN_QUESTIONS[0])],
    [{"role": "system", "content": SYSTEM_EN}, _user(EN_QUESTIONS[1])],
    _turns(EN_QUESTIONS[2], "A poet from Bengal.", "Tell me more.", "He wrote songs.", "Which ones?"),
    [{"role": "system", "content": SYSTEM_EN}, *_turns(EN_QUESTIONS[3], "Once upon a time.", "Go on.")],
    [_user("ঢাকা is the capital of Bangladesh, তাই না?")],
    [{"role": "system", "content": "Answer in Bangla."}, _user("What is নদী in English?")],
    _turns("Translate: আমি বাংলায় গান গাই।", "I sing in Bangla.", "এবার উল্টোটা: I read books."),
    *[[_user(text)] for text in list(SCRIPT_EDGES.values())[:5]],
    [_user("  leading spaces, a tab\tand\nnew lines\n\n")],
    [_user("digits 12345 ৬৭৮৯০ and emoji 🙂, quotes “like this”")],
    [{"role": "system", "content": ""}, _user("")],
    [_user(unicodedata.normalize("NFD", "প্রশ্ন: কোথায়?"))],  # decomposed input: NFC on every path
]


CONV = [{"role": "system", "content": SYSTEM_BN}, _user(BN_QUESTIONS[0])]


@pytest.fixture(scope="module")
def bundle(chat_bundle):
    """The chat bundle (a base model's bundle carries no chat template: it is no chat model)."""
    return chat_bundle


@pytest.fixture(scope="module")
def lm(bundle):
    from serve import load

    return load(bundle, threads=1)


def test_bundle_files_carry_the_chat_format(bundle):
    cfg = json.loads((bundle / "tokenizer_config.json").read_text(encoding="utf-8"))
    gen = json.loads((bundle / "generation_config.json").read_text(encoding="utf-8"))
    tok = json.loads((bundle / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {a["content"]: a["id"] for a in tok["added_tokens"]}
    assert cfg["chat_template"] == CHAT_TEMPLATE and cfg["bos_token"] == "<|endoftext|>"
    assert gen["eos_token_id"] == [ids["<|endoftext|>"], ids[IM_END], ids["<|im_start|>"]]


def test_transformers_apply_chat_template_ids_equal_the_servers(bundle, lm):
    transformers = pytest.importorskip("transformers")
    from serve.chat import chat_prompt_ids

    hf = transformers.AutoTokenizer.from_pretrained(str(bundle))
    assert len(TEMPLATE_CONVERSATIONS) == 20
    for conv in TEMPLATE_CONVERSATIONS:
        ours = [lm.eot_id, *chat_prompt_ids(lm, conv)]
        theirs = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
        assert list(theirs) == ours, conv
        text = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        assert unicodedata.normalize("NFC", text) == "<|endoftext|>" + render(conv, True)
    # a whole conversation (the form fine-tuning encodes) too
    conv = TEMPLATE_CONVERSATIONS[2] + [{"role": "assistant", "content": "শেষ।"}]
    assert list(hf.apply_chat_template(conv, tokenize=True, return_dict=False)) == \
        [lm.eot_id, *lm.tokenize(render(conv, False))]


def test_transformers_takes_text_parts_and_refuses_what_the_server_refuses(bundle, lm):
    """The bundle's template on OpenAI-style content parts gives the server's ids; on a reserved token, a tool
    message or an image part it raises (transformers' raise_exception), naming the field as the server does."""
    transformers = pytest.importorskip("transformers")
    from serve.chat import chat_prompt_ids

    hf = transformers.AutoTokenizer.from_pretrained(str(bundle))
    conv = [{"role": "system", "content": [{"type": "text", "text": "Answer "}, {"type": "text", "text": "briefly."}]},
            {"role": "user", "content": [{"type": "text", "text": "নদীর নাম বলো।"}]}]
    ids = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == [lm.eot_id, *chat_prompt_ids(lm, conv)]
    for bad, field in [([{"role": "user", "content": "a<|endoftext|>b"}], "messages[0].content"),
                       ([{"role": "user", "content": "x"}, {"role": "user", "content": f"y{IM_END}"}],
                        "messages[1].content"),
                       ([{"role": "tool", "content": "x"}], "messages[0].role"),
                       ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                        "messages[0].content[0]")]:
        with pytest.raises(Exception, match=field.replace("[", r"\[").replace("]", r"\]")):
            hf.apply_chat_template(bad, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("backend", ["onnx", pytest.param("rust", marks=pytest.mark.skipif(
    not _rust_available(), reason="rust_runtime is not built (pip install -e '.[all]' builds it)"))])
def test_both_engines_run_chat_unchanged_and_end_at_the_end_id(bundle, backend):
    """The server's chat on each backend equals that backend's LM.chat, and a choice ends at an end id (what
    <|im_end|> is to a chat reply) with finish_reason "stop", the id not in the output: the engines take ids and
    run it unchanged."""
    from fastapi.testclient import TestClient

    from serve import load
    from serve.chat import chat_prompt_ids
    from serve.http.app import create_app
    from serve.http.settings import Settings

    lm = load(bundle, backend=backend, threads=1)
    try:
        full = lm.chat(CONV, 8, temperature=0)
        assert len(full.token_ids) == 8 and full.finish_reason == "length"  # the tiny fine-tune: no end in 8
        end = full.token_ids[2]
        cut = lm.collect(lm.start_choices(chat_prompt_ids(lm, CONV), 1, 8, temperature=0, end_ids=frozenset({end}))[0])
        k = full.token_ids.index(end)
        assert cut.token_ids == full.token_ids[:k] and cut.finish_reason == "stop"
        assert cut.text == lm.detokenize(full.token_ids[:k])
    finally:
        lm.close()
    with TestClient(create_app(Settings(model=bundle, model_name="tiny", backend=backend))) as c:
        deadline = time.monotonic() + 120
        while c.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = c.post("/v1/chat/completions", json={"messages": CONV, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == full.text


# ----------------------------------------------------------------------------------------------- OpenAI SDK

@pytest.fixture(scope="module")
def client(bundle):
    openai = pytest.importorskip("openai")
    with uvicorn_server(bundle, SHALIK_API_KEY=KEY, SHALIK_MODEL_NAME=NAME) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_sdk_plain_chat_equals_lm_chat(client, lm):
    r = client.chat.completions.create(model=NAME, messages=CONV, max_tokens=16, temperature=0)
    ours = lm.chat(CONV, 16, temperature=0)
    assert r.object == "chat.completion" and r.model == NAME and len(r.choices) == 1
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ours.text
    assert r.choices[0].finish_reason == ours.finish_reason
    assert r.usage.prompt_tokens == ours.prompt_tokens and r.usage.completion_tokens == ours.completion_tokens
    assert IM_END not in r.choices[0].message.content


def test_sdk_streamed_chat_concatenates_to_the_plain_reply(client):
    kw = dict(model=NAME, messages=CONV, max_completion_tokens=16, temperature=0)
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == plain.choices[0].message.content and finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_sdk_n2_with_seed(client, lm):
    kw = dict(model=NAME, messages=CONV, max_tokens=16, temperature=2.0, seed=1234, n=2)
    first, again = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1] and texts[0] != texts[1]
    assert [c.message.content for c in sorted(again.choices, key=lambda c: c.index)] == texts
    assert texts == [lm.collect(g).text for g in lm.start_chat(CONV, 2, 16, temperature=2.0, seed=1234)]


def test_sdk_logprobs_match_the_direct_ones(client, lm):
    r = client.chat.completions.create(model=NAME, messages=CONV, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    ours = lm.chat(CONV, 8, temperature=0, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == ours.tokens
    assert [t.logprob for t in content] == pytest.approx(ours.logprobs, abs=1e-5)
    assert [len(t.top_logprobs) for t in content] == [3] * len(content)
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace") == ours.text


def test_sdk_bad_request_is_the_sdks_error(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[], max_tokens=4)
    assert e.value.status_code == 400 and "messages" in str(e.value)


# ----------------------------------------------------------------------------------------------- llama.cpp

LLAMA_CPP_CONVERSATIONS = [("bn", [_user(q)]) for q in BN_QUESTIONS[:7]] + \
    [("bn", [{"role": "system", "content": SYSTEM_BN}, _user(q)]) for q in BN_QUESTIONS[7:]] + \
    [("en", [_user(q)]) for q in EN_QUESTIONS[:7]] + \
    [("en", _turns(EN_QUESTIONS[7], "Rice.", q)) for q in EN_QUESTIONS[8:]] + \
    [("en", [{"role": "system", "content": SYSTEM_EN}, _user(EN_QUESTIONS[0])])]
BN_ANSWERS = ["বাংলা একটি ভাষা।", "ঢাকা।", "একজন কবি।", "একদা এক রাজা ছিলেন।", "ভালো লাগে।", "স্বাধীনতা যুদ্ধ।",
              "পদ্মা।", "ভাত।", "শান্ত।", "জানার জন্য।"]
EN_ANSWERS = ["It is a language.", "Dhaka.", "A poet.", "Once upon a time.", "It is wet.", "A war.", "The Padma.",
              "Rice.", "Quiet.", "To learn."]


def _chat_rows() -> list[dict]:
    """Short-answer conversations on the test's questions (with and without a system message, and the multi-turn
    ones) for the train split, two for validation: enough for the tiny model to learn to close its turn."""
    rows = []
    for qs, answers, system in ((BN_QUESTIONS, BN_ANSWERS, SYSTEM_BN), (EN_QUESTIONS, EN_ANSWERS, SYSTEM_EN)):
        for q, a in zip(qs, answers, strict=True):
            reply = {"role": "assistant", "content": a}
            rows.append({"messages": [_user(q), reply], "split": "train"})
            rows.append({"messages": [{"role": "system", "content": system}, _user(q), reply], "split": "train"})
        rows.append({"messages": _turns(qs[0], answers[0], qs[1], answers[1]), "split": "validation"})
    rows += [{"messages": _turns(EN_QUESTIONS[7], "Rice.", q, a), "split": "train"}
             for q, a in zip(EN_QUESTIONS[8:], EN_ANSWERS[8:], strict=True)]
    return rows


def test_chat_cli_in_a_pipe_is_lm_chat_turn_by_turn(bundle, lm):
    """python -m serve.chat_cli on the fine-tuned bundle, two messages piped: stdout holds the two greedy replies,
    each what LM.chat gives for the conversation so far, and the command exits 0 at the end of its input."""
    questions = [BN_QUESTIONS[0], EN_QUESTIONS[0]]
    out = subprocess.run([sys.executable, "-m", "serve.chat_cli", str(bundle), "--temperature", "0",
                          "--max-new-tokens", "24"], input="".join(q + "\n" for q in questions), capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    turns, replies = [], []
    for q in questions:
        turns.append(_user(q))
        replies.append(lm.chat(turns, 24, temperature=0).text)
        turns.append({"role": "assistant", "content": replies[-1]})
    assert out.stdout == "".join(r + "\n\n" for r in replies) and all(replies)
    assert out.stderr.startswith("chat with ")
    # a reader that goes away (| head) ends the command quietly
    gone = subprocess.run(["bash", "-o", "pipefail", "-c", f"yes hi | head -n 40 | {sys.executable} -m serve.chat_cli "
                           f"{bundle} --max-new-tokens 8 | head -c 5"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert gone.returncode == 1 and "Traceback" not in gone.stderr and "Error" not in gone.stderr, gone.stderr
    bad = subprocess.run([sys.executable, "-m", "serve.chat_cli", str(bundle), "--system", "be <|im_end|> brief"],
                         input="hi\n", capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr == (
        "error: --system: the system message contains the reserved token <|im_end|> (the model's control tokens "
        "cannot be sent as text)\n")


@pytest.fixture(scope="module")
def chat_bundle(trained_run, tmp_path_factory):
    """The tiny trained run fine-tuned by ``train.sft`` (SFTTrainer, as ``python -m train.sft`` runs it) on
    :func:`_chat_rows`, exported to a bundle: a chat model whose greedy replies end with ``<|im_end|>``."""
    export_onnx = pytest.importorskip("export.onnx")
    from train.sft.cli import sft_config
    from train.sft.data import base_checkpoint
    from train.sft.trainer import SFTTrainer

    tmp = tmp_path_factory.mktemp("chat")
    data = tmp / "chat.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _chat_rows()), encoding="utf-8")
    sets = {"run.out_dir": str(tmp / "runs"), "train.seq_len": 127, "train.micro_batch_size": 8,
            "train.max_steps": 80, "train.lr": 1e-2, "train.warmup_steps": 5, "train.eval_every": 80,
            "train.ckpt_every": 80, "train.log_every": 10, "train.preflight": False, "train.final_eval": False}
    ckpt = base_checkpoint(trained_run)
    cfg = sft_config(str(trained_run), ckpt, [str(data)], [f"{k}={json.dumps(v)}" for k, v in sets.items()],
                     False, "tiny-chat")
    SFTTrainer(cfg, base=ckpt, use_preflight=False, log=lambda m: None).train()
    out = tmp / "bundle"
    export_onnx.export_bundle(tmp / "runs" / "tiny-chat", out, parity=False, quantize="q8_0", log=lambda m: None)
    return out


@pytest.mark.slow
def test_llama_cpp_chat_completion_with_the_ggufs_template_equals_the_server(chat_bundle, tmp_path):
    """The fine-tuned bundle's GGUF in llama-cpp-python, ``create_chat_completion`` with no ``chat_format`` (so the
    GGUF's own tokenizer.chat_template through its Jinja2 formatter): for 10 conversations per language the ids
    llama.cpp evaluates as the prompt are the server's template ids (``<|endoftext|>`` + chat_prompt_ids), and the
    greedy reply and its finish reason equal the server's ``/v1/chat/completions`` (a difference only at a
    near-tie, as test_llamacpp_tokenizer's text check allows); the replies stop at ``<|im_end|>``, the GGUF's
    end-of-turn token, on both sides."""
    _llama_cpp()
    from fastapi.testclient import TestClient

    import export.gguf as G
    from export.llamacpp_check import GreedyResult
    from serve import load
    from serve.backends.llamacpp import LlamaCppBackend
    from serve.chat import chat_prompt_ids
    from serve.http.app import create_app
    from serve.http.settings import Settings

    path = G.export_gguf(chat_bundle, tmp_path / "m.gguf", log=lambda m: None)
    lm = load(chat_bundle, threads=1)
    lc = LlamaCppBackend(path, threads=1)
    results, ends = [], []
    try:
        meta = lc.llm.metadata
        assert meta["tokenizer.chat_template"] == CHAT_TEMPLATE
        assert int(meta["tokenizer.ggml.eot_token_id"]) == lm.tokenizer.token_to_id(IM_END)
        assert lc.llm.chat_format == "chat_template.default"  # the GGUF's own template, not a built-in guess
        assert len(LLAMA_CPP_CONVERSATIONS) == 20
        with TestClient(create_app(Settings(model=chat_bundle, model_name="tiny-chat"))) as c:
            deadline = time.monotonic() + 120
            while c.get("/health").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            for lang, conv in LLAMA_CPP_CONVERSATIONS:
                ids = [lm.eot_id, *chat_prompt_ids(lm, conv)]
                resp = c.post("/v1/chat/completions", json={"messages": conv, "max_tokens": 32, "temperature": 0})
                assert resp.status_code == 200, resp.text
                ours = resp.json()["choices"][0]
                r = lc.llm.create_chat_completion(messages=conv, max_tokens=32, temperature=0.0)
                theirs = r["choices"][0]
                assert r["usage"]["prompt_tokens"] == len(ids) and list(lc.llm.input_ids[:len(ids)]) == ids, conv
                res = GreedyResult(lang, conv[-1]["content"], ours["message"]["content"],
                                   theirs["message"]["content"], ours["message"]["content"].rstrip("\ufffd")
                                   == theirs["message"]["content"].rstrip("\ufffd"))
                if not res.equal:
                    direct = lm.chat(conv, 32, temperature=0, top_logprobs=2)
                    common = len(os.path.commonprefix([direct.text, res.theirs]))
                    at = max((i for i, off in enumerate(direct.text_offset) if off <= common), default=0)
                    top = sorted(direct.top_logprobs[at].values(), reverse=True)
                    res.near_tie = top[0] - top[1] if len(top) > 1 and top[0] - top[1] < 1e-3 else None
                results.append(res)
                assert IM_END not in theirs["message"]["content"]
                if res.equal:
                    assert theirs["finish_reason"] == ours["finish_reason"], conv
                ends.append(ours["finish_reason"] == "stop")
    finally:
        lc.close()
        lm.close()
    assert [(r.prompt, r.ours, r.theirs) for r in results if not r.ok] == []
    assert sum(r.equal for r in results) >= 18
    assert sum(ends) >= 16  # the fine-tuned model closes its turns, and llama.cpp stops at <|im_end|> as the server


def test_gguf_and_modelfile_carry_the_chat_format(bundle, tmp_path):
    """Without llama.cpp: the GGUF's keys (read back with gguf-py) and the Ollama Modelfile beside it."""
    gguf = pytest.importorskip("gguf")
    import export.gguf as G
    from contract.chat_format import OLLAMA_TEMPLATE

    path = G.export_gguf(bundle, tmp_path / "m.gguf", log=lambda m: None)
    r = gguf.GGUFReader(str(path))

    def value(key):
        f = r.fields[key]
        return f.contents() if hasattr(f, "contents") else bytes(f.parts[f.data[0]]).decode()

    assert value("tokenizer.chat_template") == CHAT_TEMPLATE
    tok = json.loads((bundle / "tokenizer.json").read_text(encoding="utf-8"))
    im_end = next(a["id"] for a in tok["added_tokens"] if a["content"] == IM_END)
    assert int(value("tokenizer.ggml.eot_token_id")) == im_end
    modelfile = (tmp_path / "Modelfile").read_text(encoding="utf-8")
    assert f'TEMPLATE """{OLLAMA_TEMPLATE}"""' in modelfile
    assert f'PARAMETER stop "{IM_END}"' in modelfile and 'PARAMETER stop "<|endoftext|>"' in modelfile


def test_modelfile_template_follows_the_tokenizer():
    """A base model's Modelfile keeps the raw template and only the <|endoftext|> stop; a chat model's has the
    ChatML template and both stops."""
    from contract.chat_format import OLLAMA_TEMPLATE
    from export.modelfile import modelfile_text

    sampling = {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "repetition_penalty": 1.1, "max_new_tokens": 64}
    base = modelfile_text("m.gguf", 128, sampling).splitlines()
    chat = modelfile_text("m.gguf", 128, sampling, chat=True)
    assert 'TEMPLATE """{{ .Prompt }}"""' in base and f'PARAMETER stop "{IM_END}"' not in base
    assert f'TEMPLATE """{OLLAMA_TEMPLATE}"""' in chat and f'PARAMETER stop "{IM_END}"' in chat.splitlines()
    assert 'PARAMETER stop "<|im_start|>"' in chat.splitlines() and 'PARAMETER stop "<|im_start|>"' not in base
    assert 'PARAMETER stop "<|endoftext|>"' in chat.splitlines()
