"""The benchmarks' shared modules (benchmarks/timing.py, roofline.py, bundles.py, lanes.py) and the rule that every
script runs by path and loads no other script by path."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bundles, lanes, roofline, timing
from contract.bundle import write_manifest

ROOT = Path(__file__).resolve().parent.parent
# the scripts that time lanes against each other (each uses benchmarks/timing.py)
TIMED_SCRIPTS = ("decode", "prefill", "onnx_batching", "serve_batching", "batch_invariance_cost", "serve_latency",
                 "serve_load", "verify_startup", "train_throughput", "prepare_scale", "cpu_bf16", "onnx_q8_0", "muon_ns")


def test_rotated_gives_every_item_the_lead_equally_often():
    assert [timing.rotated("AB", r) for r in range(4)] == [list("AB"), list("BA"), list("AB"), list("BA")]
    orders = [timing.rotated(("x", "y", "z"), r) for r in range(6)]
    assert orders[:3] == [["x", "y", "z"], ["y", "z", "x"], ["z", "x", "y"]] and orders[3:] == orders[:3]
    assert timing.rotated([], 3) == []


def test_median_ratio_is_the_median_of_the_rounds_own_ratios():
    a, b = [10.0, 30.0, 20.0], [5.0, 10.0, 20.0]
    assert timing.ratios(a, b) == [2.0, 3.0, 1.0]
    assert timing.median_ratio(a, b) == 2.0
    assert timing.median_ratio([1.0, 9.0, 4.0], [1.0, 3.0, 1.0]) == 3.0  # the ratio of the medians says 4.0
    with pytest.raises(ValueError):
        timing.median_ratio([1.0, 2.0], [1.0])
    assert math.isnan(timing.median([]))


def test_percentile_is_the_nearest_rank():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [timing.percentile(xs, q) for q in (0, 50, 99, 100)] == [1.0, 3.0, 5.0, 5.0]
    assert math.isnan(timing.percentile([], 50))


def test_relative_keeps_machine_paths_out_of_results(tmp_path):
    assert timing.relative(ROOT / "runs" / "small" / "bundle") == "runs/small/bundle"
    assert timing.relative(tmp_path) == str(tmp_path)


def test_shapes_come_from_configs():
    assert bundles.preset_names() == ["base-400m", "cpu", "small", "tiny"]
    small = bundles.shape("small")
    assert {k: small[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                  "intermediate_size", "max_position_embeddings", "vocab_size")} == {
        "hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
        "intermediate_size": 1280, "max_position_embeddings": 512, "vocab_size": 32000}
    from train.config import ConfigError

    with pytest.raises(ConfigError, match="presets are"):
        bundles.shape("no-such-preset")


@pytest.mark.parametrize("preset", ["tiny", "small", "base-400m"])
def test_matmul_weights_are_the_model_parameters_but_the_norms(preset):
    """The roofline's weight count equals train.model's parameter count less the RMSNorm weights (2 a layer and the
    final one; tied embeddings: the lm_head is the embedding, read once per token)."""
    import torch

    from train.model import LlamaForCausalLM, ModelConfig

    cfg = bundles.shape(preset)
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig(**cfg))
    norms = (2 * cfg["num_hidden_layers"] + 1) * cfg["hidden_size"]
    assert roofline.matmul_weights(cfg) + norms == model.num_params()


def test_prefill_flops_of_base_400m_are_the_committed_ones():
    """benchmarks/results/prefill.md's GFLOP column (written before the count moved to roofline.py)."""
    cfg = bundles.shape("base-400m")
    assert [round(roofline.prefill_gflop(cfg, t), 1) for t in (64, 512)] == [48.6, 399.5]


def test_init_bundle_runs_the_readme_commands_and_reuses_a_finished_bundle(tmp_path, monkeypatch):
    """``runs/NAME-init`` is made by the two documented command lines (benchmarks/export_small.py, eval.py); a
    bundle whose manifest is there (with the q8_0 graph when asked for) is reused without running anything."""
    ran: list[list[str]] = []
    monkeypatch.setattr(bundles, "_run", lambda cmd, log: ran.append(cmd[1:]))
    monkeypatch.setattr(bundles, "RUNS", tmp_path)  # the repository's runs/ folder, here
    run = tmp_path / "small-init"
    assert bundles.init_bundle("small", quantize="q8_0", runs=tmp_path, log=print) == run / "bundle"
    assert ran == [["-m", "train.run", "--config", "small", "--name", "small-init", "--no-preflight",
                    "--set", "train.max_steps=0"],
                   ["-m", "export.onnx", str(run), "--no-parity", "--quantize", "q8_0"]]
    ran.clear()
    other = tmp_path / "elsewhere"
    bundles.init_bundle("tiny", runs=other, log=print)
    assert ran[0][-2:] == ["--set", f'run.out_dir="{other}"']
    assert ran[1] == ["-m", "export.onnx", str(other / "tiny-init"), "--no-parity"]
    ran.clear()
    bundle = other / "tiny-init" / "bundle"
    bundle.mkdir(parents=True)
    write_manifest(bundle, complete=False, parity={"ok": None})  # a finished export that never ran the gate
    assert bundles.init_bundle("tiny", runs=other, log=print) == bundle and ran == []
    (other / "tiny-init" / "checkpoints").mkdir()
    (other / "tiny-init" / "checkpoints" / "latest").write_text("step-000000\n")  # train.run's checkpoint is there
    bundles.init_bundle("tiny", quantize="q8_0", runs=other, log=print)  # no model.q8_0.onnx: rebuilt over it
    assert ran == [["-m", "export.onnx", str(other / "tiny-init"), "--no-parity", "--quantize", "q8_0", "--force"]]
    ran.clear()
    bundles.init_bundle("tiny", parity=True, runs=other, log=print)  # the gate asked for: this one never passed it
    assert ran == [["-m", "export.onnx", str(other / "tiny-init"), "--force"]]


def test_every_lane_names_a_known_runtime_and_the_peers_name_lanes():
    assert {lane.runtime for lane in lanes.LANES.values()} <= {"rust", "onnx", "torch", "llama"}
    assert lanes.export_quantize(["rust-f32", "rust-q8_0", "ort-fp32"]) is None
    assert lanes.export_quantize(["ort-fp32", "ort-q8_0", "llama-q8_0"]) == "q8_0"
    import benchmarks.decode as decode
    import benchmarks.prefill as prefill
    import benchmarks.serve_batching as serve_batching

    assert {n for a, b, _ in decode.TARGETS for n in (a, b)} <= set(lanes.LANES)
    assert {n for pair in prefill.PAIRS.values() for n in pair} <= set(lanes.LANES)
    assert set(serve_batching.ENGINES.values()) <= set(lanes.LANES)
    assert all(a in serve_batching.ENGINES and b in serve_batching.ENGINES for a, b in serve_batching.PEERS.items())


def test_serve_batching_page_states_its_command_and_replot_keeps_the_notes(tmp_path):
    """The page names the command that made it, the CPU and the commit; a hand-written block between the markers
    survives a rewrite from the JSON (--replot); a run from before a quantization was renamed (int8 → q8_0) still
    gets its Shalik / llama-server row."""
    import benchmarks.serve_batching as sb

    def row(engine, tok_s):
        run = {"tokens": 64, "wall_s": 64 / tok_s, "merged": 0, "ttft": [0.01], "itl": [0.002] * 63}
        r = sb.summarize(1, [run], [])
        r.update(engine=engine, tokens_per_s_x_c1=1.0, itl_p99_x_c1=1.0)
        return r

    rows = [row("rust int8", 600.0), row("llama-server q8_0", 400.0)]
    meta = {"command": "python benchmarks/serve_batching.py --concurrency 1 --rounds 1", "cpu": "Test CPU 9000",
            "commit": "abc1234", "threads": 2, "prompt": 32, "new": 64, "shape": "small", "rounds": 1}
    page = tmp_path / "page.md"
    sb.write_md(page, meta, rows, [1], None)
    text = page.read_text()
    assert text.startswith("# serve_batching: small, 2 threads, Test CPU 9000\n")
    assert "    python benchmarks/serve_batching.py --concurrency 1 --rounds 1\n" in text and "abc1234" in text
    assert "| 1 | rust int8 / llama-server q8_0 | 1.50 |" in text
    assert sb.page_notes(page) is None
    notes = f"{sb.NOTES_BEGIN}\n**Measured quiet**, by hand.\n{sb.NOTES_END}"
    page.write_text(text.replace("Every lane:", notes + "\n\nEvery lane:", 1))
    assert sb.page_notes(page) == notes
    sb.write_md(page, meta, rows, [1], None, sb.page_notes(page))
    assert page.read_text().count("**Measured quiet**, by hand.") == 1
    del meta["command"]
    sb.write_md(page, meta, rows, [1], None)
    assert "Command: not recorded" in page.read_text() and "by hand" not in page.read_text()
    assert sb.page_notes(tmp_path / "absent.md") is None


def test_no_script_loads_another_by_path():
    offenders = [f.name for f in (ROOT / "benchmarks").glob("*.py")
                 if re.search(r"spec_from_file_location|load_by_path|runpy\.", f.read_text(encoding="utf-8"))]
    assert offenders == []


@pytest.mark.parametrize("script", TIMED_SCRIPTS)
def test_timed_scripts_run_by_path_and_use_the_timing_module(script):
    path = ROOT / "benchmarks" / f"{script}.py"
    assert re.search(r"from benchmarks(\.| import .*)timing|from benchmarks import .*timing",
                     path.read_text(encoding="utf-8")), f"{script}.py does not use benchmarks/timing.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script puts the root on sys.path itself
    out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, cwd=ROOT / "tests",
                         env=env, timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-500:]


def test_default_llama_server_takes_only_a_build_this_cpu_can_run(tmp_path, monkeypatch):
    """A build made with AVX-VNNI stops with SIGILL on an AMD Zen 4 (AVX-512 VNNI only): the default binary is the
    newest build whose isa.txt this CPU's flags satisfy; a build without isa.txt is never taken."""
    import benchmarks.serve_batching as serve_batching

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no llama-server on PATH to fall back to

    def build(name: str, isa: list[str] | None, mtime: int) -> Path:
        binary = tmp_path / f"llama-server-build-{name}" / "bin" / "llama-server"
        binary.parent.mkdir(parents=True)
        binary.write_text("")
        os.utime(binary, (mtime, mtime))
        if isa is not None:
            (binary.parent.parent / "isa.txt").write_text("".join(f"{f}\n" for f in isa))
        return binary

    old = build("old", None, 3_000)                               # newest, but made before isa.txt existed
    intel = build("intel", ["avx2", "avx512f", "avx512_vnni", "avx_vnni"], 2_000)
    zen4 = build("zen4", ["avx2", "avx512f", "avx512_vnni"], 1_000)
    pick = serve_batching.default_llama_server
    assert pick(tmp_path, {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"}) == str(zen4)
    assert pick(tmp_path, {"avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile"}) == str(intel)
    assert pick(tmp_path, {"avx2", "fma"}) is None
    assert old.exists()


def test_serve_batching_http_lane_counts_every_token_through_uvicorn(bundle, tmp_path):
    """The ``http rust q4_0`` lane: Shalik's server on the fixture bundle, 2 slots; two concurrent streams of 5
    greedy tokens past end-of-text are counted exactly (run_concurrency, as the benchmark runs a cell)."""
    import benchmarks.serve_batching as serve_batching

    server = serve_batching.ShalikServer(bundle, "q4_0", 2, 1, tmp_path / "uvicorn.log")
    try:
        eot = bundles.eot_id(bundle)
        r = serve_batching.run_concurrency(server, 2, 4, 5, eot)
        assert r["tokens"] == 10 and len(r["ttft"]) == 2 and len(r["itl"]) == 8
    finally:
        server.close()
    assert server.proc.returncode is not None


def test_recipe_summary_names_each_split_and_lists_the_current_one_first(tmp_path):
    from benchmarks import recipe

    def result(preset, split, ttt):
        val = {"all": {"bpc": 2.5}, "bn": {"bpc": 2.75}, "en": {"bpc": 2.25}}
        seed = {"tokens_to_target": ttt, "step_time_ratio": 0.97, "final_old": val, "final_new": val}
        return {"preset": preset, "steps": 200, "seeds": [1337], "summary": {
            "best_lr": {"adamw-cosine": 0.003, "muon-linear": 0.01}, "per_seed": [seed]}} | (
            {"split": split} if split else {})

    for page, preset, split, ttt in (("recipe-small", "small", None, 2.10),
                                     ("recipe-tiny-old-split", "tiny", "old (documents by hash)", 4.06),
                                     ("recipe-tiny", "tiny", recipe.SPLIT, 4.21)):
        (tmp_path / f"{page}.json").write_text(json.dumps(result(preset, split, ttt)))
    (tmp_path / "recipe-tiny.partial.json").write_text("{}")  # an unfinished run is not a row
    recipe.write_summary(tmp_path)
    rows = [line for line in (tmp_path / "recipe.md").read_text().splitlines() if line.startswith("| [")]
    assert [r.split(" | ")[:2] for r in rows] == [
        ["| [tiny](recipe-tiny.md)", "whole works"], ["| [tiny](recipe-tiny-old-split.md)", "old (documents by hash)"],
        ["| [small](recipe-small.md)", "not recorded"]]
    assert "| 4.21× | 0.970 | bn 2.750 → 2.750, en 2.250 → 2.250 |" in rows[0]


def test_prepare_scale_builds_one_cleaning_cost_table_for_both_reports():
    from benchmarks import prepare_scale

    mbs = {"no clean": {1: 2.0, 2: 3.5}, "prepare": {1: 1.6, 2: 2.8}}
    wall = {1: [1.2, 1.3, 1.25], 2: [1.1, 1.4, 1.2]}
    short = prepare_scale.clean_cost_table([1, 2], mbs, wall, {1: 1.31, 2: 1.4})
    assert short == [
        "| processes | no clean MB/s | prepare MB/s | prepare / no clean, wall (median of rounds) | by round | "
        "CPU s: prepare / no clean |", "|---:|---:|---:|---:|---|---:|",
        "| 1 | 2.00 | 1.60 | 1.25× | 1.20×, 1.30×, 1.25× | 1.31× |",
        "| 2 | 3.50 | 2.80 | 1.20× | 1.10×, 1.40×, 1.20× | 1.40× |"]
    full = prepare_scale.clean_cost_table([2], mbs, wall, {2: 1.4}, cpu_by_round={2: [1.5, 1.4, 1.3]})
    assert full[0].endswith("wall (median) | by round | CPU s: prepare / no clean (median) | by round |")
    assert full[1] == "|---:|---:|---:|---:|---|---:|---|"
    assert full[2] == "| 2 | 3.50 | 2.80 | **1.20×** | 1.10×, 1.40×, 1.20× | 1.40× | 1.50×, 1.40×, 1.30× |"


def test_presets_report_names_the_cpu_the_split_and_the_floor():
    from benchmarks import presets

    floor = {"sources": {"bn-literature": {"lang": "bn", "ppmd16": 2.754, "xz": 3.387},
                         "en-literature": {"lang": "en", "ppmd16": 1.834, "xz": 2.252}}}
    run = {"steps": 100, "final_bpc": {"bn-literature": 2.5, "en-literature": 1.9}, "distinct_sampled": 0.85}
    res = {"budget_min": 12.0, "lr": 0.01, "tokens_per_step": 4096, "base": "small", "calib_load": 0.4,
           "cpu": "AMD EPYC 9R14", "split": "whole works", "date": "2026-12-06", "winner": "d128-l4-v8k",
           "runs": {"d128-l4-v8k": run}, "calib": {"d128-l4-v8k": {"step_s": 0.33}}, "floor": floor,
           "params": {"d128-l4-v8k": {"params": 1811584, "non_embedding": 787584, "vocab": 8000}}}
    page = presets.report(res).splitlines()
    assert page[2].startswith("`python benchmarks/presets.py --budget-min 12 --lr 0.01 --only d128-l4-v8k` (recipe")
    assert "2 threads of AMD EPYC 9R14 at load average 0.4; validation split: whole works; measured 2026-12-06" in page[2]
    assert page[6] == ("| d128-l4-v8k **winner** | 1.8 M | 0.79 M | 8,000 | 0.33 | 100 | 409,600 | 2.500 | 1.900 "
                       "| 0.85 |")
    assert page[7] == "| PPMd-16 (floor) | | | | | | | 2.754 | 1.834 | |"
    old = {k: v for k, v in res.items() if k not in ("cpu", "split")}  # a page measured before both were recorded
    assert "of an unnamed CPU at load average 0.4; validation split: hash of the text;" in presets.report(old)


def test_recipe_summary_puts_the_grid_seed_first_even_when_a_resumed_run_did_not():
    from benchmarks import recipe

    def run(rec, lr, seed, nlls, tps):
        evals = [{"step": 100 * i, "tokens": 1000 * i, "val": {"all": {"nll": n}}} for i, n in enumerate(nlls, 1)]
        return {"recipe": rec, "lr": lr, "seed": seed, "evals": evals, "tokens_per_s": tps}

    runs = [run("adamw-cosine", 0.003, 7, [8.0, 7.0], 100.0), run("muon-linear", 0.01, 7, [7.0, 6.0], 100.0),
            run("adamw-cosine", 0.003, 1337, [8.0, 7.5], 110.0), run("muon-linear", 0.01, 1337, [7.5, 6.5], 100.0)]
    s = recipe.summarise(runs, 1337)
    assert [p["seed"] for p in s["per_seed"]] == [1337, 7]
    assert s["best_lr"] == {"adamw-cosine": 0.003, "muon-linear": 0.01}
    assert s["per_seed"][0]["tokens_to_target"] == 2.0 and s["per_seed"][0]["step_time_ratio"] == 1.1
    assert s["per_seed"][1]["tokens_to_target"] == 2000 / 1000
