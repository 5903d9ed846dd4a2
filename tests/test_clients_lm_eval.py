"""lm-evaluation-harness, unchanged, against a real ``uvicorn serve.app:app`` process: its ``local-completions``
model (remote tokenizer through ``/tokenizer_info`` and ``/tokenize``; echo + logprobs for log-likelihoods) runs
the repository's own task YAMLs (``benchmarks/eval_tasks``: the multiple-choice bn_next_sentence and the
``generate_until`` bn_continuation) through ``lm_eval.simple_evaluate``. Every item's log-likelihoods and picked
choice equal ``benchmarks/eval.py``'s direct scoring through ``serve.load(bundle).score``, and every generation
equals ``serve.load(bundle).complete`` with the same stop strings.

The tiny test bundle has a 128-token context, so the test runs on the 20 items that fit it best (shortest in its
tokens), handed to the YAMLs through the ``items_file`` metadata key."""

from __future__ import annotations

import json
import math

import pytest

from tests.client_helpers import ROOT, load_script, uvicorn_server

lm_eval = pytest.importorskip("lm_eval")

TASK_DIR = ROOT / "benchmarks" / "eval_tasks"
NAME = "shalik-tiny"
N_ITEMS = 20


@pytest.fixture(scope="module")
def run(bundle, tmp_path_factory):
    """The lm-eval run over the 20 shortest items: (lm-eval results, the items, the LM, benchmarks/eval.py)."""
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    import benchmarks.eval as bench
    from serve import load

    lm = load(bundle, threads=1)
    items = bench.read_items(TASK_DIR / "bn_next_sentence.jsonl")
    size = {it["id"]: max(len(lm.tokenize(it["context"] + " " + c)) for c in it["choices"]) for it in items}
    items = sorted(items, key=lambda it: (size[it["id"]], it["id"]))[:N_ITEMS]
    assert size[items[-1]["id"]] + 2 <= lm.context_length - 32  # fits, with room for the generation task
    items_file = tmp_path_factory.mktemp("lm-eval") / "items.jsonl"
    items_file.write_text("".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items), encoding="utf-8")
    with uvicorn_server(bundle, SHALIK_MODEL_NAME=NAME) as url:
        model = get_model("local-completions")(base_url=f"{url}/v1/completions", model=NAME,
                                               max_length=lm.context_length - 1, num_concurrent=1, max_retries=1,
                                               timeout=60)
        assert model.tokenizer_backend == "remote"  # it found /tokenizer_info and /tokenize
        results = lm_eval.simple_evaluate(
            model=model, tasks=["bn_next_sentence", "bn_continuation"], log_samples=True, bootstrap_iters=0,
            task_manager=TaskManager(include_path=str(TASK_DIR), metadata={"items_file": str(items_file)}))
    return results, items, lm, bench


def samples_by_id(results: dict, task: str) -> dict[str, dict]:
    return {s["doc"]["id"]: s for s in results["samples"][task]}


def test_multiple_choice_equals_direct_scoring_item_by_item(run):
    results, items, lm, bench = run
    samples = samples_by_id(results, "bn_next_sentence")
    assert sorted(samples) == sorted(it["id"] for it in items)
    direct = {it["id"]: bench.score_item(lm, it, max_length=lm.context_length - 1) for it in items}
    for item_id, s in samples.items():
        lls = [float(r[0]) for r in s["filtered_resps"]]
        assert lls == pytest.approx(direct[item_id]["lls"], abs=1e-3), item_id
        assert max(range(4), key=lambda i: (lls[i], -i)) == direct[item_id]["pred"], item_id
        assert s["acc"] == float(direct[item_id]["pred"] == s["doc"]["gold"])
        assert s["acc_norm"] == float(direct[item_id]["pred_norm"] == s["doc"]["gold"])
    summary = bench.summarize(list(direct.values()))
    got = results["results"]["bn_next_sentence"]
    assert got["acc,none"] == pytest.approx(summary["acc"]) and got["acc_norm,none"] == pytest.approx(summary["acc_norm"])


def test_generation_task_equals_direct_greedy(run):
    results, items, lm, _ = run
    samples = samples_by_id(results, "bn_continuation")
    assert len(samples) == N_ITEMS
    for it in items:
        ours = lm.complete(it["context"], 32, temperature=0, stop=["।", "\n", "<|endoftext|>"]).text
        assert samples[it["id"]]["resps"][0][0] == ours, it["id"]
    chrf = results["results"]["bn_continuation"]["chrf,none"]
    assert math.isfinite(chrf) and 0 <= chrf <= 100


def test_task_loaders_read_the_committed_files():
    """The YAMLs' loaders read the JSON Lines beside them, from any working directory."""
    tasks = load_script("benchmarks/eval_tasks/shalik_tasks.py")
    build = json.loads((TASK_DIR / "build.json").read_text(encoding="utf-8"))
    for task in ("bn_next_sentence", "en_next_sentence"):
        ds = getattr(tasks, task)(version=1.0)["test"]  # lm-eval passes the task's metadata as keywords
        assert len(ds) == build["tasks"][task]["items"] and set(ds.column_names) >= {"context", "choices", "gold"}
        assert all(len(c) == 4 for c in ds["choices"]) and set(ds["gold"]) <= {0, 1, 2, 3}


def test_echo_ending_at_end_of_text_keeps_every_prompt_token():
    """lm-eval reads ``token_logprobs[ctxlen:-1]`` of an echo with ``max_tokens: 1``: the step after the prompt must
    be there even when the model's next token is ``<|endoftext|>`` (as vLLM reports it), or the continuation's
    last token is dropped from the sum. A scripted model that ends the text at once, in-process."""
    from fastapi.testclient import TestClient
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from serve.http.app import create_app
    from serve.http.settings import Settings
    from tests.scripted import scripted_lm

    lm = scripted_lm(["ab", "cd"], context=64, eos_after=0)
    ctx, cont = lm.tokenize("ab"), lm.tokenize("cdab")
    body = {"prompt": ctx + cont, "echo": True, "max_tokens": 1, "logprobs": 1, "temperature": 0, "seed": 1234}
    with TestClient(create_app(Settings(), lm)) as client:
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "stop" and choice["text"] == "abcdab"  # no text for the end of the text
    assert lp["tokens"] == lm.token_strings(ctx + cont) + ["<|endoftext|>"]
    assert lp["text_offset"][-1] == len("abcdab") and lp["token_logprobs"][-1] == pytest.approx(0.0, abs=1e-6)
    (ll, _), = LocalCompletionsAPI.parse_logprobs({"choices": [choice]}, ctxlens=[len(ctx)])
    assert ll == pytest.approx(sum(lp["token_logprobs"][len(ctx):len(ctx) + len(cont)]))  # every continuation token
