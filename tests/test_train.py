"""The training loop: run folder layout, exact resume (TR4), atomic checkpoints (TR5), signals, the non-finite
guard, refusal of a changed model on resume, --init-from, and preflight leaving the run bit-identical."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

import contract.cpu
from tests.conftest import MINI, ROOT, fast_config, fast_overrides
from train.components.checkpoint import find_checkpoint, read_latest_name, verify_sums
from train.run import NonFiniteStop, Trainer, TrainError

QUIET = {"log": lambda m: None}


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """~4k characters (about ten steps of 8 windows of 32 tokens) so a run crosses epochs within a few steps."""
    import gzip

    out = tmp_path_factory.mktemp("small-corpus")
    for name, n, cut in (("bn-literature", 6, 500), ("bn-modern", 2, 700), ("en-literature", 3, 700)):
        rows = [json.loads(line) for line in gzip.open(MINI / f"{name}.jsonl.gz", "rt", encoding="utf-8")][:n]
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for r in rows:
                r["text"] = r["text"][:cut]
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return out


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(find_checkpoint(run_dir) / "model.safetensors"))


def rows(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "train.run", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, **kw)


def set_args(tmp, cache, **extra) -> list[str]:
    return [a for o in fast_overrides(tmp, cache, **extra) for a in ("--set", o)]


# ---------------------------------------------------------------------------------------------- layout

def test_run_folder_layout(tmp_path, session_cache):
    cfg = fast_config(tmp_path, session_cache, **{"run.name": "layout", "train.max_steps": 6, "train.eval_every": 3,
                                                  "train.ckpt_every": 4, "train.keep_last": 1})
    summary = Trainer(cfg, **QUIET).train()
    run = tmp_path / "runs" / "layout"
    for f in ("config.toml", "metrics.jsonl", "samples.jsonl", "loss.png", "summary.json"):
        assert (run / f).is_file(), f
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-000006"]  # keep_last 1
    ck = run / "checkpoints" / "step-000006"
    assert sorted(p.name for p in ck.iterdir()) == sorted([
        "model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "optimizer.pt", "trainer_state.json", "data_summary.json", "SHA256SUMS"])
    verify_sums(ck)
    from contract.atomic import DIR_MODE, FILE_MODE

    assert (ck.stat().st_mode & 0o777) == DIR_MODE and ((run / "summary.json").stat().st_mode & 0o777) == FILE_MODE
    torch.load(ck / "optimizer.pt", weights_only=True)
    state = json.loads((ck / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["tokens"] == 6 * 8 * 32
    assert {"data_position", "scheduler", "rng", "config_sha256"} <= set(state)
    train = rows(run, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert set(train[0]) == {"kind", "step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "elapsed_s"}
    evals = rows(run, "eval")
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert set(evals[0]["val"]) == {"all", "bn", "en"} and "random_init" in evals[0]
    assert {"nll", "bpc", "tokens"} <= set(evals[0]["val"]["bn"])
    assert evals[0]["random_init"]["all"]["nll"] == pytest.approx(evals[0]["val"]["all"]["nll"])
    assert set(summary) >= {"name", "params", "device", "dtype", "steps", "tokens", "wall_s", "tokens_per_s", "mfu",
                            "val", "random_init", "checkpoint"}
    assert summary["device_name"] == contract.cpu.cpu_label()  # the CPU its speed was measured on, by name
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["lang"] for s in samples} == {"bn", "en"} and {"step", "prompt", "lang", "text"} <= set(samples[0])
    data = json.loads((ck / "data_summary.json").read_text())
    assert any(s["license"] == "CC-BY-SA-3.0" for s in data["sources"])


def test_existing_run_needs_resume_or_new_name(tmp_path, session_cache):
    cfg = fast_config(tmp_path, session_cache, **{"run.name": "dup", "train.max_steps": 2})
    Trainer(cfg, **QUIET).train()
    cfg.train.max_steps = 4
    with pytest.raises(TrainError, match="--resume"):
        Trainer(cfg, **QUIET).train()


def test_the_same_command_again_continues_an_unfinished_run(tmp_path, session_cache, monkeypatch, capsys):
    """Re-running the README's line after an interruption continues the run (it exited 2 asking for --resume), a
    finished one is a no-op, and a run of another config is refused naming why. The continued run is the run that
    was never stopped."""
    from train.run import main

    args = ["--config", "tiny", "--name", "again", *set_args(tmp_path, session_cache, **{"train.max_steps": 4})]
    assert main([*args[:3], "whole", *args[4:]]) == 0
    real_step = Trainer._train_step

    def sigterm_after_2(self, model):
        out = real_step(self, model)
        if self.state.step == 2:
            self.stop._handler(signal.SIGTERM, None)
        return out

    monkeypatch.setattr(Trainer, "_train_step", sigterm_after_2)
    assert main(args) == 143
    monkeypatch.setattr(Trainer, "_train_step", real_step)
    run = tmp_path / "runs" / "again"
    assert read_latest_name(run / "checkpoints") == "step-000002"
    # Ctrl-C during the final evaluation (after the last checkpoint): one line, exit 130 (it was a traceback and
    # exit 1, and the run could then never be finished by the same command)
    from train.components.evaluation import Evaluator
    from train.components.signals import Interrupted

    real_final = Evaluator.final

    def interrupted(*a, **k):
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(Evaluator, "final", interrupted)
    capsys.readouterr()
    assert main(args) == 130
    err = capsys.readouterr().err
    assert "holds an unfinished run of this config (checkpoint at step 2 of 4); continuing it" in err
    assert err.strip().splitlines()[-1].startswith("stopped by SIGINT;") and "Traceback" not in err
    assert read_latest_name(run / "checkpoints") == "step-000004"
    monkeypatch.setattr(Evaluator, "final", real_final)
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "(checkpoint at step 4 of 4); continuing it" in err and "final evaluation" in err
    assert "val_sources" in json.loads((run / "summary.json").read_text())
    whole = weights(tmp_path / "runs" / "whole")
    assert all(torch.equal(whole[k], v) for k, v in weights(run).items())
    assert main(args) == 0 and "already trained to step 4 with this config; nothing to do" in capsys.readouterr().err
    other = [*args, "--set", "train.lr=0.002"]
    assert main(other) == 2
    assert "already holds a run of another config (train.lr 0.01 → 0.002), checkpoint at step 4" in \
        capsys.readouterr().err


def test_the_checkpoint_a_run_started_from_is_part_of_the_same_run(tmp_path, session_cache, capsys):
    """--init-from another checkpoint with the same config was taken for the finished run ("nothing to do"), and
    would have continued an unfinished one from the old start; runs/NAME/init.json records the start now."""
    from train.run import main

    sets = set_args(tmp_path, session_cache, **{"train.max_steps": 2})
    assert main(["--config", "tiny", "--name", "b1", *sets]) == 0
    assert main(["--config", "tiny", "--name", "b2", *sets, "--set", "run.seed=2"]) == 0
    ft = ["--config", "tiny", "--name", "ft", *sets, "--init-from"]
    runs = tmp_path / "runs"
    assert main([*ft, str(runs / "b1")]) == 0
    init = json.loads((runs / "ft" / "init.json").read_text())
    assert init["checkpoint"] == str((runs / "b1" / "checkpoints" / "step-000002").resolve())
    capsys.readouterr()
    assert main([*ft, str(runs / "b1")]) == 0 and "nothing to do" in capsys.readouterr().err
    assert main([*ft, str(runs / "b2")]) == 2
    assert "already holds a run of another config (init.json: it started from another checkpoint)" in \
        capsys.readouterr().err


def test_a_run_stopped_in_its_step_0_evaluation_is_not_evaluated_twice(tmp_path, session_cache, monkeypatch):
    """SIGTERM during the step-0 evaluation saves a step-0 checkpoint; continuing from it logged the step-0
    evaluation (and its samples) a second time."""
    from train.components.evaluation import Evaluator
    from train.run import main

    args = ["--config", "tiny", "--name", "e0", *set_args(tmp_path, session_cache, **{"train.max_steps": 2})]
    real_call = Evaluator.__call__

    def sigterm_in_eval(self, model, state):
        row = real_call(self, model, state)
        if state.step == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return row

    monkeypatch.setattr(Evaluator, "__call__", sigterm_in_eval)
    assert main(args) == 143
    run = tmp_path / "runs" / "e0"
    assert read_latest_name(run / "checkpoints") == "step-000000"
    monkeypatch.setattr(Evaluator, "__call__", real_call)
    assert main(args) == 0
    assert [r["step"] for r in rows(run, "eval")].count(0) == 1
    step0 = [r["prompt"] for r in map(json.loads, (run / "samples.jsonl").read_text().splitlines()) if r["step"] == 0]
    assert step0 and len(step0) == len(set(step0))   # each prompt's step-0 sample once


def test_a_run_folder_in_use_is_refused_and_a_fresh_start_drops_stale_rows(tmp_path, session_cache, capsys):
    """Two copies of the same command both trained into one folder (the second continuing the first's run), and a
    run killed before its first checkpoint left rows that the next start appended to."""
    from train.run import main

    args = ["--config", "tiny", "--name", "busy", *set_args(tmp_path, session_cache, **{"train.max_steps": 2})]
    run = tmp_path / "runs" / "busy"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 9.0}\n' * 5)
    (run / "samples.jsonl").write_text('{"step": 0, "lang": "bn", "text": "stale"}\n')
    other = Trainer(fast_config(tmp_path, session_cache, **{"run.name": "busy"}), **QUIET)
    other.run_log.lock()   # another process's train.run holds it
    capsys.readouterr()
    assert main(args) == 2
    assert "busy is in use: another train.run or train.sft is writing it" in capsys.readouterr().err
    other.run_log.unlock()
    assert main(args) == 0
    train_rows = rows(run, "train")
    assert [r["step"] for r in train_rows] == [1, 2] and all(r["loss"] != 9.0 for r in train_rows)
    assert "stale" not in (run / "samples.jsonl").read_text()


# ---------------------------------------------------------------------------------------------- TR4

@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_tr4_resume_is_bit_identical(tmp_path, session_cache, small_corpus, monkeypatch, optimizer):
    extra = {"data.paths": [str(small_corpus)], "train.max_steps": 24, "train.warmup_steps": 5,
             "train.optimizer": optimizer}
    cfg_a = fast_config(tmp_path, session_cache, **extra, **{"run.name": "a"})
    trainer = Trainer(cfg_a, **QUIET)
    trainer.train()
    n_windows = trainer.data.loader.n_windows
    assert 13 * 8 > n_windows, f"the resumed step must lie in the second epoch (epoch has {n_windows} windows)"

    cfg_b = fast_config(tmp_path, session_cache, **extra, **{"run.name": "b"})
    tb = Trainer(cfg_b, **QUIET)
    real_step = Trainer._train_step

    def stop_at_13(self, model):
        loss = real_step(self, model)
        if self.state.step == 13:
            self.stop.requested = True
        return loss

    monkeypatch.setattr(Trainer, "_train_step", stop_at_13)
    tb.train()
    monkeypatch.setattr(Trainer, "_train_step", real_step)
    run_b = tmp_path / "runs" / "b"
    assert read_latest_name(run_b / "checkpoints") == "step-000013"
    state = json.loads((run_b / "checkpoints/step-000013/trainer_state.json").read_text())
    assert state["data_position"]["epoch"] == 1  # 3 batches into the second epoch, or thereabouts
    # a new process continues
    res = cli(["--config", "tiny", "--name", "b", "--resume", *set_args(tmp_path, session_cache, **extra)])
    assert res.returncode == 0, res.stderr[-2000:]
    wa, wb = weights(tmp_path / "runs" / "a"), weights(run_b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    ra, rb = rows(tmp_path / "runs" / "a", "train"), rows(run_b, "train")
    assert [(r["step"], r["loss"], r["lr"]) for r in ra] == [(r["step"], r["loss"], r["lr"]) for r in rb]


def test_resume_refuses_changed_model(tmp_path, session_cache):
    cfg = fast_config(tmp_path, session_cache, **{"run.name": "chg", "train.max_steps": 2})
    Trainer(cfg, **QUIET).train()
    cfg2 = fast_config(tmp_path, session_cache, **{"run.name": "chg", "train.max_steps": 4, "model.hidden_size": 48,
                                                   "model.num_attention_heads": 4})
    with pytest.raises(TrainError, match=r"--resume refused.*hidden_size: 32 in the checkpoint → 48 now"):
        Trainer(cfg2, resume=True, **QUIET).train()


def test_resume_without_checkpoint_is_clear(tmp_path, session_cache):
    cfg = fast_config(tmp_path, session_cache, **{"run.name": "none"})
    with pytest.raises(TrainError, match="--resume: .*none holds no checkpoint to continue"):
        Trainer(cfg, resume=True, **QUIET).train()
    assert not (tmp_path / "runs" / "none").exists()   # refused before the run folder is written (it was left)


def test_init_from_loads_weights_with_fresh_optimizer(tmp_path, session_cache):
    cfg = fast_config(tmp_path, session_cache, **{"run.name": "base", "train.max_steps": 4})
    Trainer(cfg, **QUIET).train()
    src = tmp_path / "runs" / "base"
    cfg2 = fast_config(tmp_path, session_cache, **{"run.name": "ft", "train.max_steps": 0})
    t = Trainer(cfg2, init_from=str(src), **QUIET)
    t.train()
    wa, wb = weights(src), weights(tmp_path / "runs" / "ft")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not t.optimizer.state  # fresh
    bad = fast_config(tmp_path, session_cache, **{"run.name": "ft2", "model.num_hidden_layers": 3})
    with pytest.raises(TrainError, match="--init-from.*num_hidden_layers"):
        Trainer(bad, init_from=str(src), **QUIET).train()


# ---------------------------------------------------------------------------------------------- TR5

def test_tr5_failed_save_keeps_previous_checkpoint(tmp_path, session_cache):
    cfg = fast_config(tmp_path, session_cache, **{"run.name": "tr5", "train.max_steps": 10})
    t = Trainer(cfg, **QUIET)
    t.train()
    root = tmp_path / "runs" / "tr5" / "checkpoints"
    assert read_latest_name(root) == "step-000010"

    def half_then_raise(obj, path):
        import io

        buf = io.BytesIO()
        torch.save(obj, buf)
        Path(path).write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError("disk full (simulated)")

    t.state.step = 20
    with pytest.raises(OSError, match="simulated"):
        t.save(serializer=half_then_raise)
    assert read_latest_name(root) == "step-000010"
    assert not (root / "step-000020").exists()
    assert find_checkpoint(root.parent).name == "step-000010"
    verify_sums(root / "step-000010")


def test_tr5_process_killed_mid_write(tmp_path, session_cache):
    cfg = fast_config(tmp_path, session_cache, **{"run.name": "kill", "train.max_steps": 10})
    Trainer(cfg, **QUIET).train()
    root = tmp_path / "runs" / "kill" / "checkpoints"
    script = textwrap.dedent(f"""
        import os, io, json, sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        from tests.conftest import fast_config
        from pathlib import Path
        from train.run import Trainer
        cfg = fast_config(Path({str(tmp_path)!r}), Path({str(session_cache)!r}),
                          **{{"run.name": "kill", "train.max_steps": 10}})
        t = Trainer(cfg, resume=True, log=lambda m: None)
        t.start()
        t.state.step = 20
        def half_then_die(obj, path):
            buf = io.BytesIO(); torch.save(obj, buf)
            with open(path, "wb") as f:
                f.write(buf.getvalue()[: len(buf.getvalue()) // 2]); f.flush()
            os._exit(1)
        t.save(serializer=half_then_die)
    """)
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-2000:]
    assert read_latest_name(root) == "step-000010"
    assert not (root / "step-000020").exists()
    assert any(p.name.startswith(".tmp-") for p in root.iterdir())  # the leftover of the killed write
    ck = find_checkpoint(root.parent)
    assert ck.name == "step-000010"
    safetensors.torch.load_file(str(ck / "model.safetensors"))
    # the next save cleans the leftover
    t = Trainer(fast_config(tmp_path, session_cache, **{"run.name": "kill", "train.max_steps": 11}), resume=True, **QUIET)
    t.train()
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
    assert read_latest_name(root) == "step-000011"


# ---------------------------------------------------------------------------------------------- signals

def test_sigterm_saves_and_exits_143(tmp_path, session_cache):
    """A stopped run exits 128 + SIGTERM, so the README's ``train.run && export.onnx`` line stops there (it exited 0
    and the line exported a half-trained model)."""
    args = ["--config", "tiny", "--name", "sig", *set_args(tmp_path, session_cache, **{"train.max_steps": 100000})]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "train.run", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "runs" / "sig" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline:
        if metrics.is_file() and sum('"kind": "train"' in x for x in metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("training did not start")
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM == 143, err[-2000:]
    assert "received SIGTERM" in err and "the same command again continues it" in err
    assert "done:" not in err and "random-init twin" not in err  # a finished run's last lines, not a stopped one's
    run = tmp_path / "runs" / "sig"
    ck = find_checkpoint(run)
    step = json.loads((ck / "trainer_state.json").read_text())["step"]
    assert step >= 3 and ck.name == f"step-{step:06d}"


def test_a_second_signal_stops_at_once():
    """The first Ctrl-C asks the loop to save after its step; a second one does not wait for the step (it raised
    nothing and the user had to wait, or kill -9 the run)."""
    from train.components.signals import Interrupted, StopRequest

    said = []
    stop = StopRequest(said.append)
    with stop.installed():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # Python runs the handler between bytecodes of the main thread
        assert stop.requested and stop.exit_code == 130 and "a second signal stops at once" in said[0]
        with pytest.raises(Interrupted) as e:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert e.value.signum == signal.SIGINT
    agreed = StopRequest(said.append)  # another rank asked: this rank's own first signal still only requests
    agreed.agree()
    with agreed.installed():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    assert agreed.exit_code == 143 and len(said) == 2


def test_the_progress_bar_loss_is_a_debiased_moving_average():
    """The bar's loss is the trend, not one step's (fine-tuning's bar jumped 0.19 → 4.06 → 0.58 between steps of
    short replies and long continuations); a skipped step's NaN leaves it alone."""
    from train.run import SmoothedLoss

    s = SmoothedLoss()
    assert math.isnan(s.value)
    s.add(2.0)
    assert s.value == pytest.approx(2.0)   # debiased: the first step is itself
    s.add(4.0)
    assert s.value == pytest.approx((0.9 * 0.2 + 0.4) / (1 - 0.81))   # 3.0526: between, nearer the newer
    s.add(float("nan"))
    assert s.value == pytest.approx(3.0526, abs=1e-4)
    for _ in range(200):
        s.add(1.0)
    assert s.value == pytest.approx(1.0, abs=1e-6)


# ---------------------------------------------------------------------------------------------- non-finite

def test_nonfinite_step_skipped_then_training_continues(tmp_path, session_cache, monkeypatch):
    import train.model as model_mod

    calls = {"n": 0}
    real = model_mod.causal_lm_loss

    def poisoned(logits, labels, reduction="sum"):
        calls["n"] += 1
        out = real(logits, labels, reduction)
        return out * float("nan") if calls["n"] == 5 else out

    monkeypatch.setattr(model_mod, "causal_lm_loss", poisoned)
    cfg = fast_config(tmp_path, session_cache, **{"run.name": "nan1", "train.max_steps": 6})
    t = Trainer(cfg, **QUIET)
    t.train()
    assert t.state.step == 6 and t.state.nonfinite == 0
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    losses = [r["loss"] for r in rows(tmp_path / "runs" / "nan1", "train")]
    assert sum(1 for x in losses if x != x) == 1  # exactly one NaN step, skipped


def test_nonfinite_guard_stops_run_fed_nan(tmp_path, session_cache, monkeypatch):
    cfg = fast_config(tmp_path, session_cache, **{"run.name": "nan", "train.max_steps": 20, "train.ckpt_every": 2,
                                                  "train.max_nonfinite": 3})
    real_step = Trainer._train_step

    def poison_after_4(self, model):
        if self.state.step == 4:
            with torch.no_grad():
                self.model.model.embed_tokens.weight.fill_(float("nan"))
        return real_step(self, model)

    monkeypatch.setattr(Trainer, "_train_step", poison_after_4)
    t = Trainer(cfg, **QUIET)
    with pytest.raises(NonFiniteStop, match=r"3 non-finite steps in a row.*last good checkpoint is .*step-000004"):
        t.train()
    assert read_latest_name(tmp_path / "runs" / "nan" / "checkpoints") == "step-000004"


# ---------------------------------------------------------------------------------------------- preflight

def test_run_with_preflight_is_bit_identical_to_one_without(tmp_path, session_cache):
    # float32 pinned: under "auto" a CPU with native bfloat16 lets preflight choose the dtype (test_cpu_bf16.py)
    base = {"train.max_steps": 5, "train.dtype": "float32"}
    a = Trainer(fast_config(tmp_path, session_cache, **base, **{"run.name": "pf", "train.preflight": True}), **QUIET)
    a.train()
    report = json.loads((tmp_path / "runs/pf/preflight.json").read_text())
    assert report["ok"] is True
    log = (tmp_path / "runs/pf/train.log").read_text()
    for check in report["checks"]:  # each check's line once, as it ran; then one summary line, not the table
        assert log.count(f"preflight {check['name']} ") == 1 and f"PASS  {check['name']}" not in log
    assert f"all {len(report['checks'])} checks passed in " in log
    b = Trainer(fast_config(tmp_path, session_cache, **base, **{"run.name": "nopf"}), **QUIET)
    b.train()
    assert not (tmp_path / "runs/nopf/preflight.json").exists()
    wa, wb = weights(tmp_path / "runs/pf"), weights(tmp_path / "runs/nopf")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_preflight_failure_blocks_the_run(tmp_path, session_cache, monkeypatch):
    import train.preflight.gradients as pf

    monkeypatch.setattr(pf, "GRAD_NORM_MIN", float("inf"))  # every gradient now counts as "zero"
    cfg = fast_config(tmp_path, session_cache, **{"run.name": "blocked", "train.preflight": True})
    with pytest.raises(TrainError, match="preflight failed"):
        Trainer(cfg, **QUIET).train()
    report = json.loads((tmp_path / "runs/blocked/preflight.json").read_text())
    assert report["ok"] is False and report["checks"][0]["name"] == "gradient_flow"
    log = (tmp_path / "runs/blocked/train.log").read_text()
    assert "  FAIL  gradient_flow" in log and "FAILED — the run will not start" in log  # the table, culprits and all
    assert not (tmp_path / "runs/blocked/checkpoints").exists()


def test_max_steps_zero_writes_step0_checkpoint(tmp_path, session_cache):
    cfg = fast_config(tmp_path, session_cache, **{"run.name": "init", "train.max_steps": 0})
    Trainer(cfg, **QUIET).train()
    assert find_checkpoint(tmp_path / "runs" / "init").name == "step-000000"


def test_cli_bad_config_is_clear(capsys):
    from train.run import main

    assert main(["--set", "train.nope=1"]) == 2
    assert "unknown key train.nope" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_learns(tmp_path):
    """docs/design.md: tiny on data/sample, vocab 3,000, 200 steps of 4,096 tokens: val NLL ≥ 2 nats below the
    random-init twin (the 2-minute budget is measured by benchmarks/tiny_learns.py, not here)."""
    cfg = fast_config(tmp_path, tmp_path / "cache")
    from train.config import load_config

    cfg = load_config("tiny", [f"run.out_dir={json.dumps(str(tmp_path / 'runs'))}", "tokenizer.vocab_size=3000",
                               f"data.cache_dir={json.dumps(str(ROOT / 'cache'))}", "train.eval_every=200",
                               "train.preflight=false"])
    s = Trainer(cfg, **QUIET).train()
    assert s["random_init"]["all"]["nll"] - s["val"]["all"]["nll"] >= 2.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_cpu_allocator_thresholds_are_set():
    """train.device.setup_cpu_allocator raises glibc's mmap/trim thresholds (mallopt returns 1 on success)."""
    from train.device import setup_cpu_allocator

    assert setup_cpu_allocator() is True


def test_bad_data_path_exits_2_and_leaves_no_run_folder(tmp_path, capsys):
    """A data path that does not exist is a clear error (exit 2, naming the path) before runs/NAME is created."""
    from train.run import main

    missing = tmp_path / "no-such-corpus"
    out = tmp_path / "runs"
    rc = main(["--config", "tiny", "--data", str(missing), "--name", "bad", "--set", f"run.out_dir={json.dumps(str(out))}"])
    assert rc == 2
    assert f"data path '{missing}' does not exist" in capsys.readouterr().err
    assert not (out / "bad").exists()
