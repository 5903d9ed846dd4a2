"""Supervised fine-tuning (``python -m train.sft``): conversation rows, the loss mask, the grown embedding, the
run end to end (resume, export), bad input, and the set built from the corpus."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from contract.chat_format import IM_END, IM_START, render
from train import windows as W
from train.corpus import DataError
from train.sft.encode import encode_conversation, pad_windows, to_window
from train.sft.formats import ReadStats, read_conversations, to_messages
from train.tokenizer import add_chat_tokens

ROOT = Path(__file__).resolve().parent.parent
MINI = ROOT / "tests" / "data" / "mini"

CONVS = [
    {"messages": [{"role": "user", "content": "বাংলা ভাষা কী?"}, {"role": "assistant", "content": "একটি ভাষা।"}]},
    {"instruction": "Say hi", "input": "", "output": "hi there"},
    {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "name?"},
                       {"from": "gpt", "value": "Shalik"}]},
    {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "two turns"},
                  {"role": "assistant", "content": "one"}, {"role": "user", "content": "and?"},
                  {"role": "assistant", "content": "two"}]},
]


def write_jsonl(path: Path, rows: list, raw_lines: list[str] = ()) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + "".join(raw_lines),
                    encoding="utf-8")
    return path


def test_alpaca_and_sharegpt_rows_become_messages():
    assert to_messages({"instruction": "Do", "input": "this", "output": "done", "system": "sys"}) == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "Do\n\nthis"},
        {"role": "assistant", "content": "done"}]
    assert to_messages(CONVS[2]) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name?"},
                                     {"role": "assistant", "content": "Shalik"}]
    with pytest.raises(ValueError, match=r"conversations\[0\]\.from"):
        to_messages({"conversations": [{"from": "tool", "value": "x"}]})


def test_bad_rows_are_skipped_with_file_and_line_and_strict_makes_them_an_error(tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", CONVS[:1] + [{"messages": [{"role": "user", "content": "no reply"}]}],
                    ["not json\n", json.dumps({"text": "a document"}) + "\n",
                     json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n"])
    stats = ReadStats()
    convs = read_conversations([str(f)], 0.05, stats=stats)
    assert len(convs) == 1 and stats.no_assistant == 1 and stats.rows == 5
    assert [s.split(": ")[0] for s in stats.skipped] == [f"skipped {f}:3", f"skipped {f}:4", f"skipped {f}:5"]
    assert "messages[0].role" in stats.skipped[2]
    with pytest.raises(DataError, match=rf"{f}:3: not valid JSON"):
        read_conversations([str(f)], 0.05, strict=True)


CONTROL = " (the model's control tokens cannot be sent as text)"


def test_alpaca_and_sharegpt_errors_name_the_rows_own_keys():
    cases = [({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]},
              "conversations[1].value: expected a string or a list of text parts, got none"),
             ({"conversations": [{"from": "human", "value": "a <|im_end|> b"}]},
              "conversations[0].value: contains the reserved token <|im_end|>" + CONTROL),
             ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a<|endoftext|>"}]},
              "conversations[1].value: contains the reserved token <|endoftext|>" + CONTROL),
             ({"conversations": []}, "conversations: expected at least one turn, got an empty list"),
             ({"instruction": "Do", "input": 7, "output": "done"}, "input: expected a string, got int"),
             ({"instruction": "Do", "system": 9, "output": "done"}, "system: expected a string, got int"),
             ({"instruction": None, "output": "done"}, "instruction: expected a string, got none"),
             ({"instruction": "Do", "output": ["done"]}, "output: expected a string, got list"),
             ({"instruction": "Do", "input": "x <|im_start|>", "output": "done"},
              "input: contains the reserved token <|im_start|>" + CONTROL),
             ({"instruction": "Do", "output": "done<|pad|>"}, "output: contains the reserved token <|pad|>" + CONTROL)]
    for row, msg in cases:
        with pytest.raises(ValueError) as e:
            to_messages(row)
        assert str(e.value) == msg, row
    # null input / system (a datasets row without them) is no input / system
    assert to_messages({"instruction": "Do", "input": None, "system": None, "output": "done"}) == [
        {"role": "user", "content": "Do"}, {"role": "assistant", "content": "done"}]


def test_an_alpaca_row_with_a_non_string_input_or_system_is_malformed_not_trained(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [CONVS[1], {"instruction": "Do", "input": 7, "output": "done"},
                                           {"instruction": "Do", "system": 9, "output": "done"}])
    stats = ReadStats()
    convs = read_conversations([str(f)], 0.05, stats=stats)
    assert len(convs) == 1 and stats.rows == 3
    assert stats.skipped == [f"skipped {f}:2: input: expected a string, got int",
                             f"skipped {f}:3: system: expected a string, got int"]
    with pytest.raises(DataError) as e:
        read_conversations([str(f)], 0.05, strict=True)
    assert str(e.value) == (f"skipped {f}:2: input: expected a string, got int (strict mode: fix the input or drop "
                            f"--strict)")


def test_a_byte_order_mark_does_not_cost_the_first_conversation(tmp_path):
    f = tmp_path / "convs.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(c) + "\n" for c in CONVS[:2]).encode())
    stats = ReadStats()
    assert len(read_conversations([str(f)], 0.05, stats=stats)) == 2 and stats.skipped == []


def test_a_data_folder_reads_its_jsonl_files_and_skips_the_others(tmp_path):
    d = tmp_path / "convs"
    (d / "more").mkdir(parents=True)
    write_jsonl(d / "a.jsonl", CONVS[:2])
    (d / "more" / "b.jsonl.gz").write_bytes(gzip.compress((json.dumps(CONVS[2]) + "\n").encode()))
    (d / "README.txt").write_text("about these conversations\n")
    (d / "notes.md").write_text("# notes\n")
    stats = ReadStats()
    convs = read_conversations([str(d)], 0.05, stats=stats)
    assert len(convs) == 3 and stats.skipped == []
    assert stats.skipped_files == [str(d / "README.txt"), str(d / "notes.md")] and stats.unexpected_files == []
    # a file named on its own must be JSON Lines; the message lists what fine-tuning reads, not .txt
    with pytest.raises(DataError) as e:
        read_conversations([str(d / "README.txt")], 0.05)
    assert str(e.value) == (f"data file {str(d / 'README.txt')!r}: conversations are read from files ending in "
                            f".jsonl or .jsonl.gz, folders of them or hf:NAME[:CONFIG][:SPLIT] sources")
    txt_only = tmp_path / "txt"
    txt_only.mkdir()
    (txt_only / "pairs.txt").write_text("q\n\na\n")
    with pytest.raises(DataError) as e:
        read_conversations([str(txt_only)], 0.05)
    assert str(e.value) == (f"folder {str(txt_only)!r} holds no input files: conversations are read from files "
                            f"ending in .jsonl or .jsonl.gz, folders of them or hf:NAME[:CONFIG][:SPLIT] sources "
                            f"(it holds 1 other file(s), e.g. 'pairs.txt')")


def test_split_follows_the_row_then_the_group(tmp_path):
    rows = [{**CONVS[0], "split": "validation"}, {**CONVS[1], "split": "train"}]
    rows += [{**CONVS[0], "group": "work-a"}, {**CONVS[1], "group": "work-a"}]
    convs = read_conversations([str(write_jsonl(tmp_path / "c.jsonl", rows))], 0.5)
    assert [c.split for c in convs[:2]] == ["validation", "train"]
    assert convs[2].split == convs[3].split  # one group, one side


@pytest.fixture(scope="module")
def chat_tok(fixture_tok):
    from train.tokenizer import load_tokenizer

    tok = load_tokenizer(fixture_tok)
    if tok.token_to_id(IM_START) is None:  # a tokenizer from before the chat tokens were reserved
        add_chat_tokens(tok)
    return tok


def test_chat_tokens_are_appended_as_the_last_ids(chat_tok):
    v = chat_tok.get_vocab_size(with_added_tokens=True)
    assert (chat_tok.token_to_id(IM_START), chat_tok.token_to_id(IM_END)) == (v - 2, v - 1)


@pytest.mark.parametrize("row", CONVS)
def test_loss_mask_is_exactly_the_replies_and_their_end_of_turn(chat_tok, row):
    msgs = to_messages(row)
    ids, mask = encode_conversation(chat_tok, msgs, 0)
    assert ids.tolist() == [0] + chat_tok.encode(render(msgs, False), add_special_tokens=False).ids
    replies = [m["content"] + IM_END for m in msgs if m["role"] == "assistant"]
    # the masked tokens decode to the replies, each closed by <|im_end|>, and nothing else
    runs, cur = [], []
    for i, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    assert cur == []
    assert [chat_tok.decode(r, skip_special_tokens=False) for r in runs] == replies


def test_windows_carry_the_mask_through_padding(chat_tok):
    rows = [to_window(*encode_conversation(chat_tok, to_messages(r), 0)) for r in CONVS]
    batch = pad_windows(rows, pad_id=1, multiple=8)
    assert batch.shape[1] % 8 == 0 and batch.shape[1] >= max(map(len, rows))
    x, y = W.inputs(batch), W.labels(batch)
    assert x.min() >= 0 and (x[0, :len(rows[0]) - 1] == W.token_ids(rows[0])[:-1]).all()
    assert (x[0, len(rows[0]):] == 1).all() and (y[0, len(rows[0]) - 1:] == W.IGNORE).all()
    assert W.target_count(batch) == sum(W.target_count(r) for r in rows) == int((y != W.IGNORE).sum())
    t = torch.from_numpy(batch)
    assert torch.equal(W.inputs(t), torch.from_numpy(x)) and torch.equal(W.labels(t), torch.from_numpy(y))


@pytest.mark.parametrize("fixed_length", [False, True])
def test_every_end_of_turn_is_a_target_in_a_training_step(chat_tok, fixed_length):
    from train.sft.data import ConversationLoader

    im_end = chat_tok.token_to_id(IM_END)
    rows = [to_window(*encode_conversation(chat_tok, to_messages(r), 0)) for r in CONVS]
    loader = ConversationLoader(rows, step_size=len(rows), seq_len=64, seed=0, pad_id=1, fixed_length=fixed_length)
    batch = loader.collate([loader.window(i) for i in range(len(rows))])  # what a step feeds the loss
    assert batch.shape == (4, 65) if fixed_length else batch.shape[1] == 8 * -(-max(map(len, rows)) // 8)
    y = W.labels(torch.from_numpy(batch))
    for row, conv, labels in zip(rows, CONVS, y, strict=True):
        targets = labels[labels != W.IGNORE]
        replies = sum(m["role"] == "assistant" for m in to_messages(conv))
        # each reply's <|im_end|> is a target, the last target of the row is the last one, padding adds none
        assert int((targets == im_end).sum()) == replies and int(targets[-1]) == im_end
        assert int(labels[len(row) - 3]) == im_end and (labels[len(row) - 2:] == W.IGNORE).all()
    logits = torch.zeros(*y.shape, chat_tok.get_vocab_size(with_added_tokens=True), requires_grad=True)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=W.IGNORE).backward()
    grad_end = logits.grad[torch.arange(len(rows)), torch.tensor([len(r) - 3 for r in rows]), im_end]
    assert (grad_end < 0).all()  # the loss pulls <|im_end|> up where a reply ends


def test_the_embedding_grows_by_the_mean_row(trained_run):
    from train.components.checkpoint import find_checkpoint, load_model
    from train.model import LlamaForCausalLM, ModelConfig
    from train.sft.init import load_base

    ckpt = find_checkpoint(trained_run)
    base, cfg = load_model(ckpt)
    grown = LlamaForCausalLM(ModelConfig(**{**cfg.to_dict(), "vocab_size": cfg.vocab_size + 2}))
    logs = []
    assert load_base(grown, ckpt, logs.append) == 2
    e_old, e_new = base.model.embed_tokens.weight, grown.model.embed_tokens.weight
    assert torch.equal(e_new[:cfg.vocab_size], e_old)
    assert torch.allclose(e_new[cfg.vocab_size:], e_old.mean(0).expand(2, -1))
    assert grown.lm_head.weight is grown.model.embed_tokens.weight
    assert "mean of the pretrained rows" in logs[0]
    x = torch.tensor([[0, 5, 9, 3]])
    assert torch.allclose(grown(x)[0][..., :cfg.vocab_size], base(x)[0], atol=1e-5)


def sft(*args, cwd=ROOT, timeout=600):
    return subprocess.run([sys.executable, "-m", "train.sft", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def fast_sets(tmp: Path, **extra) -> list[str]:
    sets = {"run.out_dir": str(tmp / "runs"), "train.seq_len": 128, "train.micro_batch_size": 4, "train.max_steps": 6,
            "train.eval_every": 3, "train.ckpt_every": 3, "train.log_every": 1, "train.warmup_steps": 1,
            "train.preflight": False, "data.val_fraction": 0.3, **extra}
    out = []
    for k, v in sets.items():
        out += ["--set", f"{k}={json.dumps(v)}"]
    return out


@pytest.fixture(scope="module")
def conv_file(tmp_path_factory) -> Path:
    rows = []
    for i in range(24):
        rows.append({"messages": [{"role": "user", "content": f"প্রশ্ন {i}?"},
                                  {"role": "assistant", "content": f"উত্তর {i}।"}], "group": f"g{i % 6}"})
        rows.append({"instruction": f"Say {i}", "output": f"It is {i}.", "group": f"e{i % 6}"})
    return write_jsonl(tmp_path_factory.mktemp("sft") / "chat.jsonl", rows)


@pytest.fixture(scope="module")
def base_without_chat_tokens(trained_run, tmp_path_factory) -> Path:
    """The trained tiny run as a run from before the chat tokens were reserved: its tokenizer without them and its
    embedding without their two rows (the main job's runs/cpu of earlier tokenizer formats is such a run)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from train.components.checkpoint import find_checkpoint, write_sums

    src = find_checkpoint(trained_run)
    run = tmp_path_factory.mktemp("old") / "old"
    dst = run / "checkpoints" / src.name
    shutil.copytree(src, dst)
    shutil.copy(trained_run / "config.toml", run / "config.toml")
    (run / "checkpoints" / "latest").write_text(src.name + "\n")
    tok = json.loads((dst / "tokenizer.json").read_text())
    chat = [t for t in tok["added_tokens"] if t["content"] in (IM_START, IM_END)]
    if chat:
        tok["added_tokens"] = [t for t in tok["added_tokens"] if t not in chat]
        (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
        cfg = json.loads((dst / "config.json").read_text())
        cfg["vocab_size"] -= len(chat)
        (dst / "config.json").write_text(json.dumps(cfg))
        w = load_file(dst / "model.safetensors")
        w = {k: (v[:cfg["vocab_size"]].contiguous() if v.shape[0] == cfg["vocab_size"] + len(chat) else v)
             for k, v in w.items()}
        save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
        (dst / "SHA256SUMS").unlink()
        write_sums(dst)
    return run


def test_sft_run_end_to_end_resumes_exactly_and_exports(base_without_chat_tokens, conv_file, tmp_path):
    from safetensors.torch import load_file

    trained_run = base_without_chat_tokens
    out = sft(str(trained_run), "--data", str(conv_file), "--name", "full", *fast_sets(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    run = tmp_path / "runs" / "full"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["base_val"] and summary["val"]["all"]["nll"] < summary["base_val"]["all"]["nll"]
    assert {s["lang"] for s in summary["samples"]} == {"bn", "en"}
    # the final line gives both sides of the arrow (it printed the base figures alone)
    line = next(x for x in out.stderr.splitlines() if "base model with the template → fine-tuned:" in x)
    pairs = [f"{k} {v['nll']:.3f} → {summary['val'][k]['nll']:.3f}" for k, v in summary["base_val"].items()]
    assert line.endswith("fine-tuned: " + ", ".join(pairs)) and len(pairs) >= 2
    ckpt = run / "checkpoints" / "step-000006"
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    assert [t["content"] for t in tok["added_tokens"]][-2:] == [IM_START, IM_END]
    cfg = json.loads((ckpt / "config.json").read_text())
    base_cfg = json.loads((trained_run / "checkpoints" / "step-000040" / "config.json").read_text())
    assert tok["added_tokens"][-1]["id"] == base_cfg["vocab_size"] + 1
    assert cfg["vocab_size"] == base_cfg["vocab_size"] + 2
    assert "chat tokens: the embedding grew" in (run / "train.log").read_text()
    # exact resume: the run as it was at its step-3 checkpoint, resumed to step 6 = the 6 steps in one go
    import shutil

    part = tmp_path / "runs" / "part"
    shutil.copytree(run, part)
    shutil.rmtree(part / "checkpoints" / "step-000006")
    (part / "checkpoints" / "latest").write_text("step-000003\n")
    (part / "summary.json").unlink()
    res = sft(str(trained_run), "--data", str(conv_file), "--name", "part", "--resume", *fast_sets(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    a = load_file(ckpt / "model.safetensors")
    b = load_file(tmp_path / "runs" / "part" / "checkpoints" / "step-000006" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the fine-tuned run exports with export.onnx unchanged and passes its parity gate
    exp = subprocess.run([sys.executable, "-m", "export.onnx", str(run), "--out", str(tmp_path / "bundle")],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert exp.returncode == 0, exp.stderr[-2000:]
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert manifest["parity"]["ok"] is True
    from contract.bundle import has_chat_template  # a chat model: its base's bundle has no template, it has one

    assert has_chat_template(tmp_path / "bundle")


def test_preflight_checks_the_masked_loss(trained_run, conv_file, tmp_path):
    folder = tmp_path / "convs"
    folder.mkdir()
    (folder / conv_file.name).write_bytes(conv_file.read_bytes())
    (folder / "README.txt").write_text("where these conversations come from\n")
    (folder / ".gitattributes").write_text("*.jsonl.gz filter=lfs\n")
    (folder / "more.json").write_text("[]\n")
    out = sft(str(trained_run), "--data", str(folder), "--name", "pf",
              *fast_sets(tmp_path, **{"train.preflight": True, "train.max_steps": 1}))
    assert out.returncode == 0, out.stderr[-2000:]
    # files beside the conversations are skipped: the log names the one that looks like data, not the README or
    # the dot-file; data_summary.json counts all three
    log = (tmp_path / "runs" / "pf" / "train.log").read_text()
    assert (f"sft data: skipped 1 file(s) in the data folders that are not .jsonl or .jsonl.gz: "
            f"{folder / 'more.json'}\n") in log
    assert "README.txt" not in log and ".gitattributes" not in log
    ckpt = tmp_path / "runs" / "pf" / "checkpoints" / "step-000001"
    assert json.loads((ckpt / "data_summary.json").read_text())["skipped"]["files_not_read"] == 3
    report = json.loads((tmp_path / "runs" / "pf" / "preflight.json").read_text())
    assert report["ok"] and report["checks"][0]["name"] == "gradient_flow" and report["checks"][0]["ok"]


def test_bad_input_is_one_line_exit_2_and_no_run_folder(trained_run, tmp_path):
    empty = write_jsonl(tmp_path / "none.jsonl", [{"messages": [{"role": "user", "content": "no reply"}]}],
                        ["not json\n"])
    all_val = write_jsonl(tmp_path / "val.jsonl", [{**c, "split": "validation"} for c in CONVS[:2]])
    txt = tmp_path / "txt"
    txt.mkdir()
    (txt / "README.txt").write_text("not conversations\n")
    cases = [([str(trained_run), "--data", str(txt / "README.txt")],
              "conversations are read from files ending in .jsonl or .jsonl.gz, folders of them or hf:"),
             ([str(trained_run), "--data", str(txt)], "holds no input files: conversations are read from files "
                                                      "ending in .jsonl or .jsonl.gz, folders of them or hf:NAME"
                                                      "[:CONFIG][:SPLIT] sources (it holds 1 other file(s), e.g. "
                                                      "'README.txt')"),
             (["no/such/run"], "not a trained run"),
             ([str(trained_run), "--data", str(tmp_path / "missing.jsonl")], "does not exist"),
             ([str(trained_run), "--data", str(empty)], "no training conversation left"),
             ([str(trained_run), "--data", str(all_val)], "0 too long, 2 validation); all 2 usable ones are on the "
                                                         "validation side"),
             ([str(trained_run), "--data", str(empty), "--strict"], f"{empty}:2: not valid JSON"),
             ([str(trained_run), "--set", "train.nope=1"], "unknown key train.nope")]
    for args, msg in cases:
        assert ".txt," not in msg
        out = sft(*args, *fast_sets(tmp_path))
        assert out.returncode == 2, (args, out.stderr[-1500:])
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and msg in last and "Traceback" not in out.stderr, (args, out.stderr)
    assert not (tmp_path / "runs").exists()


def test_the_built_set_holds_works_out_by_work_and_keeps_licences(tmp_path):
    from train.sft.build import build, write

    rows, summary = build([str(MINI)], seed=0)
    assert summary["works"]["validation"] > 0 and summary["by_split"]["validation"]
    groups = {s: {r["group"] for r in rows if r["split"] == s} for s in ("train", "validation")}
    assert not groups["train"] & groups["validation"]
    assert {r["license"] for r in rows} <= {"public-domain", "CC-BY-SA-3.0"}
    assert {r["task"] for r in rows} >= {"title", "author", "continue"}
    for r in rows[:200]:
        to_messages(r)  # every row is a conversation the trainer reads
        assert r["messages"][-1]["role"] == "assistant" and r["lang"] in ("bn", "en")
    write(rows, tmp_path / "a.jsonl.gz")
    write(build([str(MINI)], seed=0)[0], tmp_path / "b.jsonl.gz")
    assert (tmp_path / "a.jsonl.gz").read_bytes() == (tmp_path / "b.jsonl.gz").read_bytes()


def build_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "train.sft.build", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def corpus_row(text_chars: int = 300, **meta) -> dict:
    return {"text": ("The river ran past the old mill. " * 20)[:text_chars], "source": "s", "license": "public-domain",
            **meta}


def test_build_refuses_bad_out_and_unreadable_corpus_in_one_line_and_writes_nothing(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [corpus_row(title="A tale", author="Someone")])
    (tmp_path / "nonutf8.jsonl").write_bytes(b'{"text": "caf\xe9 au lait", "title": "t"}\n')
    (tmp_path / "bad.jsonl.gz").write_bytes(b'{"text": "plain, not gzip", "title": "t"}\n')
    (tmp_path / "surrogate.jsonl").write_text('{"text": "a \\ud800 b", "title": "t"}\n')
    short = write_jsonl(tmp_path / "short.jsonl", [corpus_row(60, title="Short"), corpus_row(title=None),
                                                   corpus_row(title=["x"])])
    untitled = write_jsonl(tmp_path / "untitled.jsonl", [corpus_row()])
    (tmp_path / "outdir").mkdir()
    (tmp_path / "afile").write_text("x")
    expected = "expected a file path ending in .jsonl.gz (gzipped JSON Lines) or .jsonl (plain)"
    cases = [
        (["--out", f"{tmp_path}/outdir/"], f"--out '{tmp_path}/outdir/' is a folder: {expected}"),
        (["--out", str(tmp_path / "outdir")], f"--out '{tmp_path}/outdir' is a folder: {expected}"),
        (["--out", ""], f"--out is empty: {expected}"),
        (["--out", str(tmp_path / "set.json")], f"--out '{tmp_path}/set.json': {expected}"),
        (["--out", str(tmp_path / "afile" / "set.jsonl")],
         f"--out '{tmp_path}/afile/set.jsonl': '{tmp_path}/afile' is a file, not a folder: {expected} in a folder"),
        (["--data", str(tmp_path / "nonutf8.jsonl")],
         f"corpus file '{tmp_path}/nonutf8.jsonl': not valid UTF-8 at byte offset 13 in the file (invalid "
         f"continuation byte); expected the corpus's JSON Lines (UTF-8, gzipped or not as the name says)"),
        (["--data", str(tmp_path / "bad.jsonl.gz")],
         f"corpus file '{tmp_path}/bad.jsonl.gz': cannot read it as gzip (Not a gzipped file (b'{{\"')); expected "
         f"the corpus's JSON Lines (UTF-8, gzipped or not as the name says)"),
        (["--data", str(tmp_path / "surrogate.jsonl")],
         f"{tmp_path}/surrogate.jsonl:1: field \"text\" holds a lone surrogate U+D800 (expected Unicode text; a JSON "
         f"\\ud800-\\udfff escape needs its pair)"),
        (["--data", str(short)],
         f"{short}: no conversation to write: read 3 documents; 1 without a title, 1 with a title that is not a "
         f"string, 0 holding control-token text, 1 shorter than 120 characters, 0 with no task that fits (a later part without an author, too "
         f"short to continue); expected the corpus's JSON Lines: objects with a string \"title\" (and \"author\") "
         f"and a \"text\" of at least 120 characters"),
        (["--data", str(untitled)],
         f"{untitled}: no conversation to write: read 1 document; 1 without a title, 0 with a title that is not a "
         f"string, 0 holding control-token text, 0 shorter than 120 characters, 0 with no task that fits (a later "
         f"part without an author, too short to continue); expected the corpus's JSON Lines: objects with a string "
         f"\"title\" (and \"author\") and a \"text\" of at least 120 characters"),
        (["--data", str(good), "--out", str(good)],
         f"--out '{good}' is one of the corpus files read (--data): expected another file, so the corpus is kept"),
    ]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for args, msg in cases:
        args = args if "--data" in args else ["--data", str(good), *args]
        args = args if "--out" in args else [*args, "--out", str(tmp_path / "set.jsonl.gz")]
        out = build_cli(*args)
        assert (out.returncode, out.stdout, out.stderr) == (2, "", f"error: {msg}\n"), args
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written, no temporary left
    assert good.read_text().startswith('{"text"')


def test_build_output_compression_follows_its_suffix_and_train_sft_reads_both(tmp_path):
    plain, packed = tmp_path / "set.jsonl", tmp_path / "set.jsonl.gz"
    for f in (plain, packed):
        out = build_cli("--data", str(MINI), "--out", str(f))
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[-1] == str(f)
    assert plain.read_bytes()[:1] == b"{" and packed.read_bytes()[:2] == b"\x1f\x8b"
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    stats = ReadStats()
    assert len(read_conversations([str(plain)], 0.05, stats=stats)) == len(plain.read_text().splitlines())
    assert stats.skipped == [] and stats.rows > 100


def test_build_skips_and_counts_titles_and_authors_that_are_not_strings(tmp_path):
    from train.sft.build import build

    d = tmp_path / "corpus"
    d.mkdir()
    write_jsonl(d / "c.jsonl", [corpus_row(title="Good title", author="Real Author"),
                                corpus_row(title={"a": 1}, author="Somebody"),
                                corpus_row(title="Another title", author=["x"]),
                                corpus_row(title="A <|im_end|> title", author="X"),
                                corpus_row(title="Fine", author="Y <|endoftext|>"),
                                corpus_row(title="Odd metadata", author="Zed", source=["s"], license={"id": 1})])
    (d / "README.md").write_text("the corpus\n")
    rows, summary = build([str(d)], seed=0)
    assert summary["documents"] == {"read": 6, "used": 3, "no_title": 0, "title_not_a_string": 1,
                                    "author_not_a_string": 1, "reserved_token": 2, "too_short": 0, "no_task": 0}
    # a source or license that is not a string is not copied: the file's name is the source, the license unknown
    odd = [r for r in rows if r["group"].endswith("/Odd metadata")]
    assert odd and {(r["group"], r["source"], r["license"]) for r in odd} == {("c/Odd metadata", "c", None)}
    assert not [r for r in rows if any(t in m["content"] for m in r["messages"] for t in ("<|im_end|>", "<|endof"))]
    assert summary["skipped_files"] == [str(d / "README.md")]
    answers = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert "Real Author" in answers and "Another title" in answers
    assert not [a for a in answers if "{'a': 1}" in a or "['x']" in a or "Somebody" in a]
    assert {r["group"] for r in rows} == {"s/Good title", "s/Another title", "c/Odd metadata"}
    assert not [r for r in rows if r["group"] == "s/Another title" and r["task"] in ("author", "author_of_title")]
    out = build_cli("--data", str(d), "--out", str(tmp_path / "set.jsonl.gz"))
    assert out.returncode == 0 and json.loads(out.stdout.splitlines()[0])["documents"] == summary["documents"]


def test_a_continuation_stops_at_the_first_line_or_sentence_end_past_the_minimum():
    from train.sft.build import CONTINUE_MAX, CONTINUE_MIN, continuation

    text = "আমি যাই।\nতুমি এসো বাড়ি\nসে আসে"
    assert continuation(text, 0, least=5) == "আমি যাই।"
    assert continuation(text, 0, least=10) == "আমি যাই।\nতুমি এসো বাড়ি"
    assert continuation(text, 0, least=10, most=12) is None and continuation(text, 0, least=40) is None
    assert continuation("He said no. Then she went home.", 2, least=8) == "said no."
    assert continuation("He said no. Then she went home.", 2, least=9) == "said no. Then she went home."
    wrapped = "He went on\ntill he came home at last. Then"  # hard-wrapped prose: a line break is a wrap
    assert continuation(wrapped, 0, least=5) == "He went on"
    assert continuation(wrapped, 0, least=5, wrapped=True) == "He went on\ntill he came home at last."
    assert continuation("He went on\n\nShe did", 0, least=5, wrapped=True) == "He went on"
    assert (CONTINUE_MIN, CONTINUE_MAX) == (24, 140)


def test_the_embedded_sets_continuations_follow_the_stopping_rule():
    from train.sft.build import CONTINUE_MAX, CONTINUE_MIN, WRAPPED_SOURCES, continuation

    rows = [json.loads(line) for line in gzip.open(ROOT / "data" / "sft" / "shalik-sft.jsonl.gz", "rt")]
    share = {}
    for split in ("train", "validation"):
        for lang in ("bn", "en"):
            mine = [r for r in rows if r["split"] == split and r["lang"] == lang]
            share[split, lang] = sum(r["task"] == "continue" for r in mine) / len(mine)
    # training works give Bangla two continuation passages a document, held-out works one (the earlier mix: 21 %)
    assert 0.30 < share["train", "bn"] < 0.40 and 0.18 < share["validation", "bn"] < 0.24
    assert 0.40 < share["validation", "en"] < 0.50  # three a document, as before (43 %)
    for r in rows:
        if r["task"] == "continue":
            a = r["messages"][-1]["content"]
            # every reply stops at its first line or sentence end past the minimum: no earlier stop, none later
            assert CONTINUE_MIN <= len(a) <= CONTINUE_MAX, a
            assert continuation(a + "\n\n", 0, wrapped=r["source"] in WRAPPED_SOURCES) == a, a


def test_the_embedded_set_is_the_builders_output():
    rows = [json.loads(line) for line in gzip.open(ROOT / "data" / "sft" / "shalik-sft.jsonl.gz", "rt")]
    assert len(rows) > 1000 and {r["lang"] for r in rows} == {"bn", "en"}
    val = {r["group"] for r in rows if r["split"] == "validation"}
    assert val and not val & {r["group"] for r in rows if r["split"] == "train"}
    langs = np.unique([r["lang"] for r in rows if r["split"] == "validation"])
    assert list(langs) == ["bn", "en"]
