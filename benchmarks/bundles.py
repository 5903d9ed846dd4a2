"""The models the benchmarks run: the presets of ``configs/``, built by the project's own train and export.

* :func:`shape`: a preset's model shape (Hugging Face LlamaConfig names), read from ``configs/NAME.toml``:
  its ``[model]`` table with the tokenizer's ``vocab_size``. For scripts that need only the sizes.
* :func:`init_bundle`: ``runs/NAME-init/bundle``, the untrained (step 0) twin of a preset as a user would make it
  by hand (README, benchmarks/export_small.py, benchmarks/eval.py)::

      python -m train.run --config NAME --name NAME-init --no-preflight --set train.max_steps=0
      python -m export.onnx runs/NAME-init --no-parity [--quantize KIND]

  so the checkpoint is what ``train`` writes (its tokenizer trained on the config's data, ``run.seed``'s
  initialisation, SHA256SUMS) and the bundle is what ``export`` writes (safetensors, the ONNX graph that serving
  runs, its q8_0 twin, the manifest the loaders verify). Both commands are run as written, in subprocesses; the
  folder is kept and reused by the next run (delete it to rebuild: ``small`` takes 2–4 minutes on 2 cores,
  base-400m 10–20 and 5.3 GB of disk with q8_0). The parity gate is skipped unless asked for: it proves the
  exporter, which tests/test_export.py and benchmarks/export_small.py run through it, and a speed figure does not
  depend on it, while base-400m's cases at its full context need ~8 GB and half an hour on 2 shared cores (a
  bundle that passed it is reused all the same).
* :func:`given_or_newest`: the bundle named on a command line, else the newest ``runs/*/bundle``.
* :func:`eot_id`: the bundle's ``<|endoftext|>`` id, which starts every prompt.
* :func:`gguf`: the bundle as llama.cpp's GGUF, ``BUNDLE/model-TYPE.gguf`` (``export.gguf``; Q4_0 and Q4_K_M by
  llama.cpp's own quantizer, :func:`llama_quantize`), made once.

Random weights serve speed and memory figures: a dense float32 or q8_0 model does the same work whatever its
values. (They do not serve quality figures; greedy continuations of an untrained model are near ties.)
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.timing import ROOT, relative

RUNS = ROOT / "runs"


def preset_names() -> list[str]:
    """The presets of ``configs/`` (tiny, small, base-400m, …)."""
    from train.config import preset_names as names

    return names()


def shape(preset: str) -> dict:
    """``configs/<preset>.toml``'s model as a config.json-style dict: the ``[model]`` keys (hidden_size,
    num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size, max_position_embeddings,
    rope_theta, rms_norm_eps, tie_word_embeddings, initializer_range) and ``vocab_size`` = ``[tokenizer]
    vocab_size`` (what the trained tokenizer has: 32,000 for every preset). Raises train.config.ConfigError
    naming the presets when there is no such preset."""
    from train.config import load_config

    cfg = load_config(preset)
    return {**dataclasses.asdict(cfg.model), "vocab_size": cfg.tokenizer.vocab_size}


def _run(cmd: list[str], log: Callable[[str], None]) -> None:
    """Run one of the project's command lines from the repository root, its output passed through; raises
    RuntimeError naming the command and its exit status when it fails."""
    shown = " ".join(["python", *cmd[1:]])
    log(f"$ {shown}")
    t = time.time()
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    if rc != 0:
        raise RuntimeError(f"`{shown}` exited with status {rc} (its messages are above)")
    log(f"  ({time.time() - t:.0f} s)")


def _reusable(bundle: Path, quantize: str | None, parity: bool) -> bool:
    """True when ``bundle`` holds a finished export (its manifest, written last) with the ``quantize`` graph when
    asked for and a passed parity gate when asked for."""
    from contract.bundle import ONNX_GRAPHS, BundleError, read_manifest

    try:
        m = read_manifest(bundle)
    except BundleError:
        return False
    return ((quantize is None or (bundle / ONNX_GRAPHS[quantize]).is_file())
            and (not parity or bool(m.get("parity", {}).get("ok"))))


def init_bundle(preset: str, *, quantize: str | None = None, parity: bool = False, runs: Path = RUNS,
                log: Callable[[str], None] = print) -> Path:
    """``runs/<preset>-init/bundle`` (see the module doc), built now unless a reusable one is there (exported from
    the run's checkpoint when ``train.run`` has written one): with the ONNX graph of ``quantize`` (export.onnx's
    ``--quantize``: "q8_0" adds model.q8_0.onnx) when given, through the export's parity gate when ``parity`` (a
    rebuilt bundle replaces one that lacks what is asked). ``runs`` is the runs folder (default the repository's).
    Raises train.config.ConfigError for an unknown preset and RuntimeError when training or export fails."""
    shape(preset)  # an unknown preset fails here, with the list of presets
    name = f"{preset}-init"
    run, bundle = runs / name, runs / name / "bundle"
    if _reusable(bundle, quantize, parity):
        log(f"reusing {relative(bundle)} (delete {relative(run)} to rebuild it)")
        return bundle
    if not (run / "checkpoints" / "latest").is_file():  # train.components.checkpoint moves it last: the checkpoint is whole
        out_dir = [] if runs == RUNS else ["--set", f"run.out_dir={json.dumps(str(runs))}"]
        _run([sys.executable, "-m", "train.run", "--config", preset, "--name", name, "--no-preflight",
              "--set", "train.max_steps=0", *out_dir], log)
    _run([sys.executable, "-m", "export.onnx", relative(run)] + ([] if parity else ["--no-parity"])
         + (["--quantize", quantize] if quantize else []) + (["--force"] if bundle.exists() else []), log)
    return bundle


def given_or_newest(path: str | Path | None, required: bool = True) -> Path | None:
    """The bundle a script measures: ``path`` when given, else the newest ``runs/*/bundle`` (the server's default
    model, serve.http.settings.newest_bundle), else None when not ``required``. Raises SystemExit naming the command
    that makes one when a required bundle is missing or ``path`` is not a folder."""
    from serve.http.settings import newest_bundle

    bundle = Path(path) if path else newest_bundle(RUNS)
    if (bundle is None and required) or (bundle is not None and not bundle.is_dir()):
        raise SystemExit(f"{'no bundle' if bundle is None else f'{bundle}: not a folder'}: pass one (python -m "
                         "export.onnx runs/NAME writes runs/NAME/bundle)")
    return bundle


def eot_id(bundle: Path) -> int:
    """The id of ``<|endoftext|>`` in the bundle's tokenizer.json (contract.bundle.eot_id; every prompt starts with
    it). Raises contract.bundle.BundleError when the tokenizer has none."""
    from tokenizers import Tokenizer

    from contract.bundle import TOKENIZER
    from contract.bundle import eot_id as eot_of

    return eot_of(Tokenizer.from_file(str(Path(bundle) / TOKENIZER)))


def gguf_path(bundle: Path, kind: str) -> Path:
    """Where the bundle's GGUF of type ``kind`` (f32, f16, q8_0, q4_0, q4_k_m) lies: ``bundle/model-<kind>.gguf``
    (contract.bundle.gguf_file)."""
    from contract.bundle import gguf_file

    return Path(bundle) / gguf_file(kind)


# GGUF types the benchmarks take from llama.cpp's own quantizer (export.gguf_quant.llama_quantizer, as
# ``llama-quantize`` does) from the f32 GGUF, with its file-type rules: Q4_0 keeps the output matrix (the tied
# token_embd) at Q6_K, Q4_K_M gives it and half of attn_v / ffn_down Q6_K: the files people compare against.
LLAMA_KINDS = ("q4_0", "q4_k_m")


def gguf(bundle: Path, kind: str, log: Callable[[str], None] = print) -> Path:
    """:func:`gguf_path`, unless it exists written by ``export.gguf`` (with its approximated pre-tokenizer: the
    benchmarks feed token ids), or for a kind of :data:`LLAMA_KINDS` by llama.cpp's quantizer from the f32 one
    (:func:`llama_quantize`: the files people compare against). Raises export.errors.ExportError as export_gguf
    does, and llama_quantize's errors."""
    path = gguf_path(bundle, kind)
    if not path.is_file():
        if kind in LLAMA_KINDS:
            f32 = gguf(bundle, "f32", log)
            log(f"llama.cpp quantizes {f32.name} to {kind}")
            return llama_quantize(f32, path, kind)
        from export.gguf import export_gguf

        export_gguf(bundle, path, kind, log=log, approximate_pretokenizer=True)
    return path


def llama_quantize(src: Path, dst: Path, kind: str, threads: int = 2) -> Path:
    """Write ``dst`` = the f32 GGUF ``src`` quantized to ``kind`` (:data:`LLAMA_KINDS`) by llama.cpp on ``threads``
    threads, atomically (a temporary beside ``dst``, renamed when complete). Raises export.errors.ExportError as
    export.gguf_quant.llama_quantizer does (another kind, no llama-cpp-python, llama.cpp's failure)."""
    from contract.atomic import atomic_path
    from export.gguf_quant import llama_quantizer

    quantize = llama_quantizer(kind, threads)
    with atomic_path(dst) as tmp:
        quantize(src, tmp)
    return dst
