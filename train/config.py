"""Configuration: TOML presets in ``configs/``, ``--set section.key=value`` overrides, validation.

Sections and defaults are those of docs/design.md (``[run] [data] [tokenizer] [model] [train]``); the
``[model]`` keys are Hugging Face ``LlamaConfig`` names. ``load_config`` returns a :class:`Config` whose
every key is filled in; ``to_toml`` writes it back (``runs/NAME/config.toml``).

Errors are :class:`ConfigError` (a ``ValueError``) naming the file, section or key and listing the valid
choices.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = PROJECT_ROOT / "configs"


class ConfigError(ValueError):
    """A configuration file, section, key or value that is not valid."""


@dataclass
class RunSection:
    name: str = ""
    out_dir: str = "runs"
    seed: int = 1337


@dataclass
class DataSection:
    paths: list[str] = field(default_factory=lambda: ["data/sample"])
    languages: list[str] = field(default_factory=lambda: ["bn", "en"])
    mix: dict[str, float] = field(default_factory=lambda: {"bn": 0.7, "en": 0.3})
    val_fraction: float = 0.01
    strict: bool = False
    cache_dir: str = "cache"
    num_workers: int = 0  # processes that prepare the data; 0 = os.cpu_count() (not part of any fingerprint)
    clean: bool = True  # the cleaning stage of prepare (train/clean): dedup, quality rules, decontamination
    clean_off: list[str] = field(default_factory=list)  # rules switched off by name (train/clean/rules.toml, …)
    clean_set: dict[str, float] = field(default_factory=dict)  # thresholds, "bn.min_words.min" = 3


@dataclass
class TokenizerSection:
    path: str = ""
    vocab_size: int = 32000
    sample_chars: int = 20_000_000
    sample_weights: dict[str, float] = field(default_factory=lambda: {"bn": 0.6, "en": 0.4})
    min_frequency: int = 2


@dataclass
class ModelSection:
    hidden_size: int = 512
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 1280
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02


MAX_VOCAB = 1 << 20  # tokenizer.vocab_size: 4x the largest in use (Gemma's 262,144); 10^10 aborted in tokenizers
MAX_POSITIONS = 1 << 20  # model.max_position_embeddings: 8x Llama 3.1's 131,072; rust_runtime reads it as 32 bits
DEFAULT_PRESET = "cpu"  # the README's main job: every command's --config default (benchmarks/presets.py chose it)
OPTIMIZERS = ("adamw", "muon")  # train.optimizer: the names train/optim.py builds
SCHEDULES = ("cosine", "linear", "wsd")  # train.schedule: the names train/optim.py's lr_at computes


def _one_of(names: tuple[str, ...]) -> str:
    """``("a", "b", "c")`` → ``"a, b or c"`` for an error message."""
    return f"{', '.join(names[:-1])} or {names[-1]}"


@dataclass
class TrainSection:
    micro_batch_size: int = 8
    seq_len: int = 512
    grad_accum: int = 1
    max_steps: int = 1000
    lr: float = 1e-2  # benchmarks/results/recipe.md: Muon's best of the grid at tiny, confirmed at small
    min_lr: float = 0.0  # "Straight to Zero" (arXiv 2502.15938): decay to zero
    warmup_steps: int = 50
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    optimizer: str = "muon"  # "muon" or "adamw" (Muon on the hidden matrices, AdamW on the rest): train/optim.py
    muon_momentum: float = 0.95
    schedule: str = "linear"  # "linear" (to min_lr), "cosine" or "wsd" (hold, then a linear cooldown): train/optim.py
    cooldown_frac: float = 0.2  # wsd: the share of max_steps spent cooling down to min_lr
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_tokens: int = 32768
    ckpt_every: int = 500
    keep_last: int = 3
    log_every: int = 10
    compile: bool | str = False  # true (a failure is an error), false, "auto" (falls back to eager, loudly), or
    # "head" (only the head + loss, the layers eager; falls back to eager, loudly)
    attention: str = "auto"  # the training step's causal attention: "sdpa", "blocked" (train.model's
    # blocked_causal_attention) or "auto" (blocked on CPU in reduced precision with the layers compiled, where it
    # passes its numerics check; else SDPA): train/components/step_module.py
    activation_checkpoint: str = "none"  # "none", "selective" (every activation_checkpoint_every-th layer), "full"
    activation_checkpoint_every: int = 2
    dtype: str = "auto"
    device: str = "auto"
    max_nonfinite: int = 5
    preflight: bool = True
    final_eval: bool = True  # at the end: the whole val split per source file beside the compressor floor, and samples


SECTIONS: dict[str, type] = {
    "run": RunSection,
    "data": DataSection,
    "tokenizer": TokenizerSection,
    "model": ModelSection,
    "train": TrainSection,
}


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainSection = field(default_factory=TrainSection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict, section → key → value."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def sha256(self, sections: tuple[str, ...] | None = None) -> str:
        """sha256 of the canonical JSON of the given sections (all when None)."""
        d = self.to_dict()
        if sections is not None:
            d = {k: d[k] for k in sections}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def preset_names() -> list[str]:
    """Names of the presets in ``configs/`` (``tiny``, ``small``, ``base-400m``, …)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def resolve_config_path(name_or_path: str) -> Path:
    """A preset name in ``configs/`` or a path to a TOML file → the file's path.

    Raises ConfigError when neither exists, listing the presets.
    """
    p = Path(name_or_path)
    if p.suffix == ".toml" and p.is_file():
        return p
    preset = CONFIG_DIR / f"{name_or_path}.toml"
    if preset.is_file():
        return preset
    if p.is_file():
        return p
    raise ConfigError(
        f"config {name_or_path!r}: no such preset in {CONFIG_DIR} and no such TOML file; "
        f"presets are: {', '.join(preset_names())}"
    )


def parse_value(text: str) -> Any:
    """Parse an override value as TOML (``3e-4``, ``true``, ``[1,2]``, ``{bn=0.7,en=0.3}``, ``"x"``);
    anything that is not valid TOML is taken as a bare string (``--set run.name=my-run``)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _coerce(section: str, key: str, value: Any, default: Any) -> Any:
    """Check ``value`` against the type of the key's default and convert int → float where needed."""
    where = f"{section}.{key}"
    if (section, key) == ("train", "compile"):
        if value is True or value is False or value in ("auto", "head"):  # not 0 or 1: 0 == False, 1 == True
            return value
        raise ConfigError(f"{where}: expected true, false, \"auto\" or \"head\", got {spell(value)}")
    if (section, key) == ("train", "attention"):
        if value in ("auto", "sdpa", "blocked"):
            return value
        raise ConfigError(f"{where}: expected \"auto\", \"sdpa\" or \"blocked\", got {spell(value)}")
    if (section, key) == ("train", "activation_checkpoint"):
        if value in ("none", "selective", "full"):
            return value
        raise ConfigError(f"{where}: expected \"none\", \"selective\" or \"full\", got {spell(value)}")
    if (section, key) == ("train", "activation_checkpoint_every") and not (
        isinstance(value, int) and not isinstance(value, bool) and value >= 1
    ):
        raise ConfigError(f"{where}: expected an integer >= 1 (checkpoint every N-th decoder layer), got {spell(value)}")
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {spell(value)}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {spell(value)}")
        if not math.isfinite(value):  # no key of a config means anything at nan or inf; they only train NaNs
            raise ConfigError(f"{where}: expected a finite number, got {spell(value)}")
        return float(value)
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{where}: expected an integer, got {spell(value)}")
        return value
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {spell(value)}")
        return value
    if isinstance(default, list):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {spell(value)}")
        if default and isinstance(default[0], float):
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value):
                raise ConfigError(f"{where}: expected a list of finite numbers, got {spell(value)}")
            return [float(v) for v in value]
        if not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {spell(value)}")
        return list(value)
    if isinstance(default, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table like {{bn=0.7, en=0.3}}, got {spell(value)}")
        out = {}
        for k, v in value.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ConfigError(f"{where}.{k}: expected a non-negative number, got {spell(v)}")
            out[str(k)] = float(v)
        return out
    return value


def _apply(cfg: Config, section: str, key: str, value: Any, origin: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"{origin}: unknown section [{section}]; valid sections are: {', '.join(SECTIONS)}")
    sec = getattr(cfg, section)
    names = [f.name for f in fields(sec)]
    if key not in names:
        raise ConfigError(f"{origin}: unknown key {section}.{key}; valid keys of [{section}] are: {', '.join(names)}")
    setattr(sec, key, _coerce(section, key, value, getattr(sec, key)))


def load_config(name_or_path: str | None = DEFAULT_PRESET, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a preset or TOML file, apply ``section.key=value`` overrides, validate and fill defaults.

    ``run.name`` defaults to the preset's file stem. Raises :class:`ConfigError`.
    """
    cfg = Config()
    stem = "custom"
    if name_or_path:
        path = resolve_config_path(name_or_path)
        stem = path.stem
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path}: not valid TOML: {e}") from None
        for section, table in raw.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key {section!r} must be a [section]; valid sections are: "
                                  f"{', '.join(SECTIONS)}")
            for key, value in table.items():
                _apply(cfg, section, key, value, str(path))
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.lr=3e-4")
        lhs, rhs = item.split("=", 1)
        section, key = lhs.strip().split(".", 1)
        _apply(cfg, section, key, parse_value(rhs.strip()), f"--set {item}")
    if not cfg.run.name:
        cfg.run.name = stem
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-key checks (positive sizes, heads divide hidden, mix names match languages…)."""
    m, t, d = cfg.model, cfg.train, cfg.data
    name = cfg.run.name
    if not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ConfigError(f"run.name (--name): expected a folder name for {cfg.run.out_dir}/NAME, without / or \\ "
                          f"and not . or .., got {spell(name)}")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "max_position_embeddings"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key}: expected a positive integer, got {getattr(m, key)}")
    if m.max_position_embeddings > MAX_POSITIONS:
        raise ConfigError(f"model.max_position_embeddings: expected at most {MAX_POSITIONS:,}, got "
                          f"{m.max_position_embeddings:,}")
    for key in ("rope_theta", "rms_norm_eps", "initializer_range"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key}: expected a positive number, got {spell(getattr(m, key))}")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_attention_heads "
                          f"({m.num_attention_heads})")
    if (m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError("model: head_dim = hidden_size / num_attention_heads must be even for rotary embeddings")
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError(f"model.num_attention_heads ({m.num_attention_heads}) must be a multiple of "
                          f"model.num_key_value_heads ({m.num_key_value_heads})")
    for key in ("micro_batch_size", "seq_len", "grad_accum", "eval_every", "ckpt_every", "keep_last", "log_every",
                "max_nonfinite"):
        if getattr(t, key) <= 0:
            raise ConfigError(f"train.{key}: expected a positive integer, got {getattr(t, key)}")
    for key in ("max_steps", "warmup_steps"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}: expected an integer >= 0, got {getattr(t, key)}")
    if t.grad_clip <= 0:  # clip_grad_norm_ to 0 zeroes every gradient: the run would train nothing
        raise ConfigError(f"train.grad_clip: expected a positive number (the largest gradient norm), got "
                          f"{spell(t.grad_clip)}")
    if t.weight_decay < 0:
        raise ConfigError(f"train.weight_decay: expected a number >= 0, got {spell(t.weight_decay)}")
    if t.seq_len > m.max_position_embeddings:
        raise ConfigError(f"train.seq_len ({t.seq_len}) exceeds model.max_position_embeddings "
                          f"({m.max_position_embeddings})")
    if not (0 < t.lr) or t.min_lr < 0 or t.min_lr > t.lr:
        raise ConfigError(f"train.lr / train.min_lr: expected 0 <= min_lr <= lr and lr > 0, got {t.lr} / {t.min_lr}")
    if t.optimizer not in OPTIMIZERS:
        raise ConfigError(f"train.optimizer: expected {_one_of(OPTIMIZERS)}, got {spell(t.optimizer)}")
    if t.schedule not in SCHEDULES:
        raise ConfigError(f"train.schedule: expected {_one_of(SCHEDULES)}, got {spell(t.schedule)}")
    if isinstance(t.cooldown_frac, bool) or not 0 <= t.cooldown_frac <= 1:
        raise ConfigError(f"train.cooldown_frac: expected a number in [0, 1], got {spell(t.cooldown_frac)}")
    if not 0 <= t.muon_momentum < 1:
        raise ConfigError(f"train.muon_momentum: expected a number in [0, 1), got {spell(t.muon_momentum)}")
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        raise ConfigError(f"train.betas: expected two numbers in [0, 1), got {spell(t.betas)}")
    if t.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"train.dtype: expected auto, float32, bfloat16 or float16, got {spell(t.dtype)}")
    if not (t.device in ("auto", "cpu") or t.device.startswith("cuda")):
        raise ConfigError(f"train.device: expected auto, cpu or cuda[:N], got {spell(t.device)}")
    if not d.paths or any(not str(p).strip() for p in d.paths):
        raise ConfigError(f"data.paths: expected at least one non-empty path, got {spell(d.paths)}")
    if not d.languages or any(lang not in ("bn", "en") for lang in d.languages):
        raise ConfigError(f'data.languages: expected a non-empty subset of ["bn", "en"], got {spell(d.languages)}')
    if isinstance(d.num_workers, bool) or not isinstance(d.num_workers, int) or d.num_workers < 0:
        raise ConfigError(f"data.num_workers: expected 0 (all cores) or a positive integer, got {spell(d.num_workers)}")
    if not (0 < d.val_fraction < 1):
        raise ConfigError(f"data.val_fraction: expected a number in (0, 1), got {d.val_fraction}")
    for name, table in (("data.mix", d.mix), ("tokenizer.sample_weights", cfg.tokenizer.sample_weights)):
        extra = sorted(set(table) - set(d.languages))
        if extra:
            raise ConfigError(f"{name}: languages {spell(extra)} are not in data.languages {spell(d.languages)}")
        if sum(table.get(lang, 0.0) for lang in d.languages) <= 0:
            raise ConfigError(f"{name}: the weights of {spell(d.languages)} must not all be zero")
    tok = cfg.tokenizer
    if not 300 <= tok.vocab_size <= MAX_VOCAB:
        raise ConfigError(f"tokenizer.vocab_size: expected 300 (256 bytes + specials) to {MAX_VOCAB:,}, got "
                          f"{tok.vocab_size:,}")
    if tok.sample_chars <= 0 or tok.min_frequency < 1:
        raise ConfigError("tokenizer.sample_chars and tokenizer.min_frequency must be positive")


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML text (every key present), via ``tomli_w``; where it is not installed (a GPU
    image with torch preinstalled and no package index) a minimal writer for our flat sections is used."""
    try:
        import tomli_w
    except ImportError:
        return _dump_flat_toml(cfg.to_dict())
    return tomli_w.dumps(cfg.to_dict())


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} as TOML")


def spell(v: Any) -> str:
    """A config value as it is written in TOML (``true``, ``"head"``, ``[1, 2]``) for an error message, so the
    message shows what to type, not Python's spelling (``True``, ``'head'``); a value TOML cannot hold (a date
    parsed from ``--set``) as its text."""
    try:
        return _toml_value(v)
    except TypeError:
        return str(v)


def _dump_flat_toml(d: dict[str, dict[str, Any]]) -> str:
    return "\n".join(f"[{sec}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in table.items())
                     for sec, table in d.items())


def resolve_path(p: str | Path) -> Path:
    """A relative data path is taken from the working directory, or else from the project root
    (so the default ``data/sample`` works from anywhere)."""
    path = Path(p).expanduser()
    if path.is_absolute() or path.exists():
        return path
    alt = PROJECT_ROOT / path
    return alt if alt.exists() else path


def add_config_args(parser) -> None:
    """The shared ``--config``, ``--data`` and ``--set`` command-line options."""
    parser.add_argument("--config", default=DEFAULT_PRESET,
                        help=f"a preset in configs/ ({', '.join(preset_names())}) or a TOML file (default: %(default)s)")
    parser.add_argument("--data", nargs="+", metavar="PATH", default=None,
                        help="text inputs: folders, .jsonl/.txt[.gz] files, or hf:NAME[:CONFIG][:SPLIT] "
                             "(default: the config's data.paths, data/sample)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config key; the value is parsed as TOML (repeatable)")


def config_from_args(args) -> Config:
    """Build the config from parsed ``add_config_args`` options (``--data`` overrides ``data.paths``)."""
    overrides = list(args.overrides)
    if getattr(args, "data", None):
        overrides.append("data.paths=" + json.dumps(list(args.data)))
    return load_config(args.config, overrides)
