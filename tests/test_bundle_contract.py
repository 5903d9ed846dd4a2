"""The bundle contract (contract/bundle.py) has one owner: its facts are spelled nowhere else, the Rust mirror
(rust_runtime/src/bundle.rs) equals it, and readers check the manifest alike (a newer format_version and a missing
manifest are refused by Python and Rust with the same rule). The import rules that let serve/ and export/ share it
are tests/test_import_rules.py's.

``python -m tests.test_bundle_contract [ROOT]`` prints the census of how often each bundle fact is spelled in a tree
(string literals outside docstrings: file names, special tokens, sha256 implementations, manifest readers).
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from contract import bundle as B
from serve import load

ROOT = Path(__file__).resolve().parents[1]
RUST_SRC = ROOT / "rust_runtime" / "src"
# every string constant of the contract (a new file name is found without editing this test), the ONNX graphs and
# their external data
FACTS = ({v for k, v in vars(B).items() if k.isupper() and isinstance(v, str)
          and k not in ("EXTERNAL_DATA_SUFFIX", "GGUF_PATTERN")}
         | set(B.ONNX_GRAPHS.values()) | {B.external_data(g) for g in B.ONNX_GRAPHS.values()}
         | set(B.LEGACY_GRAPHS.values()))
# the Rust constants and the Python value each must equal
RUST_MIRROR = {"CONFIG": B.CONFIG, "WEIGHTS": B.WEIGHTS, "TOKENIZER": B.TOKENIZER, "MANIFEST": B.MANIFEST,
               "FORMAT": B.FORMAT, "FORMAT_VERSION": B.FORMAT_VERSION, "FORMAT_MINOR": B.FORMAT_MINOR, "EOT": B.EOT,
               "SKIP_VERIFY": B.SKIP_VERIFY}


# ---------------------------------------------------------------- scanning sources


def python_literals(path: Path, docstrings: bool = True) -> list[tuple[int, str]]:
    """(line, value) of every string constant in a Python file (f-string parts included); ``docstrings=False``
    leaves out module, class and function docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set()
    if not docstrings:
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                    skip.add(id(first.value))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip]


def rust_literals(path: Path) -> list[tuple[int, str]]:
    """(line, value) of every string literal in a Rust file before its ``#[cfg(test)]`` module (comments
    left out)."""
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip().startswith("#[cfg(test)]"):
            break
        if line.lstrip().startswith("//"):
            continue
        out += [(i, m.group(1)) for m in re.finditer(r'"((?:[^"\\]|\\.)*)"', line)]
    return out


def sources(root: Path, folders=("contract", "serve", "export", "benchmarks")) -> list[Path]:
    """The Python files of ``folders`` and the Rust sources under ``root``."""
    py = [p for f in folders for p in sorted((root / f).rglob("*.py"))]
    return py + sorted((root / "rust_runtime" / "src").rglob("*.rs"))


def literals(path: Path, docstrings: bool = True) -> list[tuple[int, str]]:
    return python_literals(path, docstrings) if path.suffix == ".py" else rust_literals(path)


def rust_constants(path: Path = RUST_SRC / "bundle.rs") -> dict[str, object]:
    """``pub const NAME: T = VALUE;`` of a Rust file: strings and integers as Python values, arrays of other
    constants as tuples of their values."""
    raw = dict(re.findall(r"^pub const (\w+): [^=]+= (.+?);$", path.read_text(encoding="utf-8"), re.M))
    out: dict[str, object] = {}
    for name, value in raw.items():
        if value.startswith('"'):
            out[name] = json.loads(value)
        elif value.isdigit():
            out[name] = int(value)
    for name, value in raw.items():
        if value.startswith("["):
            out[name] = tuple(out[v.strip()] for v in value.strip("[]").split(","))
    return out


# ---------------------------------------------------------------- one owner


def test_rust_constants_equal_python():
    rust = rust_constants()
    for name, value in RUST_MIRROR.items():
        assert rust.get(name) == value, f"rust_runtime/src/bundle.rs {name} = {rust.get(name)!r}, contract.bundle " \
                                        f"has {value!r}"
    assert set(rust["CHECKED_FILES"]) == set(B.backend_files("rust", None)), \
        "rust_runtime verifies other files than serve.load verifies for the rust backend"


def test_no_bundle_fact_is_spelled_outside_the_contract():
    """contract/, serve/, export/, benchmarks/ and the Rust sources name bundle files, special tokens and the manifest format
    through contract.bundle / bundle.rs, never as a literal value (messages may mention them)."""
    owners = {ROOT / "contract" / "bundle.py", ROOT / "contract" / "byte_level.py", RUST_SRC / "bundle.rs"}
    found = [f"{p.relative_to(ROOT)}:{line} {value!r}" for p in sources(ROOT) if p not in owners
             for line, value in literals(p) if value in FACTS]
    assert not found, "import these from contract.bundle (Rust: crate::bundle) instead: " + "; ".join(found)


def test_the_census_sees_a_literal(tmp_path):
    """The scanner behind the test above finds a spelled name in Python and Rust, and not in a docstring."""
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "x.py").write_text('"""model.onnx"""\nGRAPH = "model.onnx"\nmsg = f"see {GRAPH} and model.onnx"\n')
    (tmp_path / "rust_runtime" / "src").mkdir(parents=True)
    (tmp_path / "rust_runtime" / "src" / "x.rs").write_text('// "config.json"\nlet p = dir.join("config.json");\n'
                                                            '#[cfg(test)]\nlet q = "config.json";\n')
    hits = {p.name: [v for _, v in literals(p, docstrings=False) if v in FACTS] for p in sources(tmp_path)}
    assert hits == {"x.py": ["model.onnx"], "x.rs": ["config.json"]}
    counts = census(tmp_path)
    assert counts["model.onnx"] == ["serve/x.py:2", "serve/x.py:3"]


# ---------------------------------------------------------------- the manifest


def manifest(**changes) -> dict:
    m = {"format": B.FORMAT, "format_version": B.FORMAT_VERSION,
         "files": {B.CONFIG: {"sha256": "0" * 64, "bytes": 3}}}
    return {**m, **changes}


@pytest.mark.parametrize("m,needle", [
    ([], "expected a JSON object"),
    ({"format": B.FORMAT, "format_version": 1}, "no 'files'"),
    (manifest(format="something-else"), "format is 'something-else', expected 'shalik-bundle'"),
    (manifest(format_version=B.FORMAT_VERSION + 1),
     f"format_version {B.FORMAT_VERSION + 1} is newer than this reader's {B.FORMAT_VERSION}"),
    (manifest(format_version=0), "format_version is 0, expected an integer >= 1"),
    (manifest(format_version=True), "format_version is True"),
    (manifest(format_version="1"), "format_version is '1'"),
    (manifest(files=[]), "files is list, expected dict"),
    (manifest(files={B.CONFIG: {"sha256": "0" * 64}}), f"files['{B.CONFIG}']"),
    (manifest(files={B.CONFIG: {"sha256": "abc", "bytes": 3}}), "64 hex digits"),
    (manifest(params="12"), "params is str, expected int"),
    (manifest(quantization=[1]), "quantization is list, expected dict or null"),
])
def test_check_manifest_names_what_is_wrong(m, needle):
    with pytest.raises(B.BundleError, match=re.escape(needle)):
        B.check_manifest(m, "x/manifest.json")


def test_manifest_writer_and_readers_share_one_schema(tmp_path):
    (tmp_path / B.CONFIG).write_text("{}")
    (tmp_path / B.TOKENIZER).write_text('{"model": 1}')
    with pytest.raises(B.BundleError, match="no 'created'"):  # the exporter's manifest is complete
        B.write_manifest(tmp_path, params=1)
    with pytest.raises(B.BundleError, match=r"unknown keys \['colour'\]"):
        B.write_manifest(tmp_path, complete=False, colour="red")
    assert not (tmp_path / B.MANIFEST).exists(), "a refused manifest must not be written"
    m = B.write_manifest(tmp_path, complete=False, params=7)
    assert B.read_manifest(tmp_path) == m and m["params"] == 7 and m["format_version"] == B.FORMAT_VERSION
    assert m["format_minor"] == B.FORMAT_MINOR
    assert m["files"] == {B.CONFIG: {"sha256": B.sha256_file(tmp_path / B.CONFIG), "bytes": 2},
                          B.TOKENIZER: {"sha256": B.sha256_file(tmp_path / B.TOKENIZER), "bytes": 12}}
    assert B.sha256_file(tmp_path / B.CONFIG) == "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
    (tmp_path / B.CONFIG).write_text("{ }")
    assert B.rehash(tmp_path, [B.CONFIG, "absent.txt"])["files"][B.CONFIG]["bytes"] == 3
    B.verify_files(tmp_path, [B.CONFIG, B.TOKENIZER])
    newer = {**m, "format_version": B.FORMAT_VERSION + 1}
    (tmp_path / B.MANIFEST).write_text(json.dumps(newer))
    assert B.is_bundle(tmp_path), "a newer Shalik bundle is still a Shalik bundle (export --force may replace it)"
    with pytest.raises(B.BundleError, match="is newer than this reader's"):
        B.read_manifest(tmp_path)


def test_a_new_onnx_graph_is_one_entry(monkeypatch):
    """Adding a quantized graph to the bundle is one entry of ONNX_GRAPHS: what serve.load verifies follows."""
    monkeypatch.setitem(B.ONNX_GRAPHS, "int4", "model.int4.onnx")
    assert B.backend_files("onnx", "int4") == [B.CONFIG, B.TOKENIZER, "model.int4.onnx", "model.int4.onnx.data"]
    assert B.backend_files("onnx", None) == [B.CONFIG, B.TOKENIZER, B.ONNX, B.ONNX + ".data"]
    assert B.backend_files("rust", "q8_0") == [B.CONFIG, B.TOKENIZER, B.WEIGHTS]


def old_bundle(bundle: Path, where: Path, gate_ok: bool = True) -> Path:
    """A copy of the fixture bundle as an export of format minor 0 wrote it: its q8_0 graph named
    ``model.int8.onnx`` and the gate's verdicts keyed ``"onnx int8"`` / ``"rust int8"`` (scheme ``int8``), no
    ``format_minor``. (The graph's content is today's; the loaders cannot tell, and it keeps the logits comparable.)"""
    shutil.copytree(bundle, where)
    m = json.loads((where / B.MANIFEST).read_text())
    new, old = B.ONNX_GRAPHS["q8_0"], B.LEGACY_GRAPHS["q8_0"]
    (where / new).rename(where / old)
    m["files"] = {(old if k == new else k): v for k, v in m["files"].items()}
    forms = m["quantization"]["forms"]
    for rt in ("onnx", "rust"):
        forms[f"{rt} int8"] = {**forms.pop(f"{rt} q8_0"), "scheme": "int8", "ok": gate_ok}
    del m["format_minor"]
    (where / B.MANIFEST).write_text(json.dumps(m))
    return where


def test_an_old_bundle_reads_its_int8_names_as_q8_0_and_serves(bundle, tmp_path, caplog):
    """A bundle exported before format minor 1 (model.int8.onnx, gate verdicts keyed int8) loads and serves with
    quantize "int8" or "q8_0" in both backends, its files verified and its verdicts held; the reader renames the
    verdicts in one place (contract.bundle.upgrade, rust_runtime's integrity::upgrade), the graph is found under its
    old name (contract.bundle.onnx_graph), and a manifest written back is today's."""
    import numpy as np
    rust_runtime = pytest.importorskip("rust_runtime", reason="rust_runtime is not built: pip install -e '.[all]'")
    from serve.verdict import UngatedError

    b = old_bundle(bundle, tmp_path / "old")
    m = B.read_manifest(b)
    assert m["format_minor"] == B.FORMAT_MINOR and "model.int8.onnx" in m["files"]
    assert {"onnx q8_0", "rust q8_0"} <= set(m["quantization"]["forms"])
    assert not any("int8" in k for k in m["quantization"]["forms"])
    assert m["quantization"]["forms"]["rust q8_0"]["scheme"] == "q8_0"
    assert B.onnx_graph(b, "q8_0") == "model.int8.onnx" and B.onnx_graph(bundle, "q8_0") == "model.q8_0.onnx"
    assert B.backend_files("onnx", "q8_0", b)[2] == "model.int8.onnx"
    ids = [0, 5, 9, 17]
    want = {be: load(bundle, backend=be, quantize="q8_0").backend.logits(ids) for be in ("onnx", "rust")}
    for q in ("int8", "q8_0"):
        for be in ("onnx", "rust"):
            with caplog.at_level("WARNING"):
                lm = load(b, backend=be, quantize=q)   # verified and gated: no override needed
            assert lm.backend.quantize == "q8_0" and np.array_equal(lm.backend.logits(ids), want[be]), (q, be)
        assert rust_runtime.Model.load(str(b), threads=1, quantize=q).quantize == "q8_0"
    assert any("serving model.int8.onnx" in r.getMessage() for r in caplog.records)
    bad = old_bundle(bundle, tmp_path / "bad", gate_ok=False)
    for be in ("onnx", "rust"):
        with pytest.raises(ValueError, match=rf"{be} q8_0 failed the export's quality gate"):
            load(bad, backend=be, quantize="int8")
    with pytest.raises(UngatedError):
        load(bad, backend="onnx", quantize="q8_0")
    with pytest.raises(ValueError, match="rust q8_0 failed the export's quality gate"):
        rust_runtime.Model.load(str(bad), threads=1, quantize="q8_0")
    written = B.update_manifest(b)   # what export.gguf does to a finished bundle: the manifest comes back today's
    on_disk = json.loads((b / B.MANIFEST).read_text())
    assert on_disk["format_minor"] == B.FORMAT_MINOR and on_disk["quantization"] == written["quantization"]
    assert load(b, backend="onnx", quantize="q8_0").backend.quantize == "q8_0"


# ---------------------------------------------------------------- Python and Rust agree


def test_a_truncated_onnx_data_file_is_one_line_naming_the_cause(bundle, tmp_path, capfd):
    """With verification on, a truncated model.onnx.data is refused by its size; without it onnxruntime fails, and
    its error (a C++ signature, a source path, the reason) came out in 2 lines, with ORT's own red copy on stderr.
    It is now one line with the reason, and ORT prints nothing."""
    from serve.backends.base import BackendError

    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    data = b / "model.onnx.data"
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with pytest.raises(B.BundleError, match=r"model.onnx.data is corrupt: \d+ bytes, the manifest says"):
        load(b)
    capfd.readouterr()
    with pytest.raises(BackendError) as e:
        load(b, verify=False)
    msg = str(e.value)
    assert "\n" not in msg and ".cc:" not in msg and "[ONNXRuntimeError]" not in msg, msg
    assert re.search(r"model.onnx: onnxruntime cannot load it \((?:Deserialize tensor \S+ failed\. )?External "
                     r"initializer: \S+ offset: \d+ size to read: \d+ given file_length: \d+ are out of bounds", msg), msg
    assert "onnxruntime" not in capfd.readouterr().err


def test_python_and_rust_refuse_a_missing_or_newer_manifest_alike(bundle, tmp_path):
    """The rule (docs/design.md "The bundle"): the manifest is written last, so a folder without one is not a
    finished export — refused by serve.load (both backends) and rust_runtime.Model.load, with the same message and
    opt-out; a manifest of a newer format_version is refused naming both versions. verify=False loads it."""
    rust_runtime = pytest.importorskip("rust_runtime", reason="rust_runtime is not built: pip install -e '.[all]'")
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    (b / B.MANIFEST).unlink()
    missing = f"{B.MANIFEST} is missing: not an exported bundle, or its export did not finish"
    for backend in ("onnx", "rust"):
        with pytest.raises(B.BundleError, match=re.escape(missing)):
            load(b, backend=backend)
    with pytest.raises(RuntimeError, match=re.escape(missing)) as e:
        rust_runtime.Model.load(str(b))
    assert "verify=False" in str(e.value)
    want = load(bundle, backend="rust").generate("a", 3, temperature=0)
    assert load(b, backend="rust", verify=False).generate("a", 3, temperature=0) == want
    assert rust_runtime.Model.load(str(b), verify=False).vocab_size == load(bundle).vocab_size

    m = json.loads((bundle / B.MANIFEST).read_text(encoding="utf-8"))
    (b / B.MANIFEST).write_text(json.dumps({**m, "format_version": B.FORMAT_VERSION + 1}))
    newer = f"format_version {B.FORMAT_VERSION + 1} is newer than this reader's {B.FORMAT_VERSION}"
    with pytest.raises(B.BundleError, match=re.escape(newer)):
        load(b, backend="onnx")
    with pytest.raises(RuntimeError, match=re.escape(newer)):
        rust_runtime.Model.load(str(b))


# ---------------------------------------------------------------- the census (for reports)


def census(root: Path) -> dict[str, list[str]]:
    """{fact: ["path:line", ...]} for every string literal outside docstrings in serve/, export/, benchmarks/,
    train/ and the Rust sources that is or contains a bundle file name, special token or the manifest format."""
    hits = defaultdict(list)
    for p in sources(root, ("train", "serve", "export", "benchmarks")):
        for line, value in literals(p, docstrings=False):
            for fact in sorted(FACTS, key=len, reverse=True):  # "model.onnx.data" counts once, not also "model.onnx"
                if fact in value:
                    hits[fact].append(f"{p.relative_to(root)}:{line}")
                    break
    return dict(hits)


def main(argv: list[str]) -> int:
    """Print the census of ``argv[0]`` (default: this checkout): per fact, the string literals that are or contain it
    (outside docstrings) and the files holding them, in train/ and in the rest (serve/, export/, benchmarks/, the
    Rust sources) outside the owners (contract/bundle.py, rust_runtime/src/bundle.rs, contract/byte_level.py)."""
    root = Path(argv[0]) if argv else ROOT
    counts = census(root)
    owners = {"contract/bundle.py", "rust_runtime/src/bundle.rs", "contract/byte_level.py"}
    print(f"{'fact':<24} {'literals':>8} {'files':>6} | {'train/ literals':>15} | {'elsewhere, not owner':>20} {'files':>6}")
    rows = [(fact, counts.get(fact, [])) for fact in sorted(FACTS)] + [("all", [w for v in counts.values() for w in v])]
    for fact, where in rows:
        train = [w for w in where if w.startswith("train/")]
        rest = [w for w in where if not w.startswith("train/") and w.rsplit(":", 1)[0] not in owners]
        print(f"{fact:<24} {len(where):>8} {len({w.rsplit(':', 1)[0] for w in where}):>6} | {len(train):>15} | "
              f"{len(rest):>20} {len({w.rsplit(':', 1)[0] for w in rest}):>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
