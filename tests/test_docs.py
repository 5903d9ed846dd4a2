"""The documents against the tree: docs/cases.md against the tests, docs/design.md's layout against the source
files, the README's commands against .ci/run, every relative link of the Markdown pages, the HTTP settings table
against the variables the code reads, and no pointer from code or tests to a document outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "docs" / "cases.md"
DESIGN = ROOT / "docs" / "design.md"
README = ROOT / "README.md"
README_MAX_LINES = 250
# Folders whose every file of the given kind docs/design.md's layout names (``__init__.py`` may go unnamed).
LAYOUT_CHECKED = {"contract": ".py", "train": ".py", "export": ".py", "serve": ".py", "rust_runtime/src": ".rs",
                  "rust_runtime/src/kernels": ".rs", "rust_runtime/src/kernels/int": ".rs",
                  "rust_runtime/examples": ".rs", "docs": ".md"}
# The Markdown pages a newcomer reads; their relative links must resolve (anchors included).
PAGES = ["README.md", "benchmarks/README.md", "rust_runtime/README.md", "data/sample/README.md",
         *sorted(f"docs/{f.name}" for f in (ROOT / "docs").glob("*.md"))]
CASE_ID = re.compile(r"(?:TR|T|X|S|H|R)\d+")


def _test_functions() -> dict[str, ast.FunctionDef]:
    """Every ``tests/test_*.py::test_*`` function, keyed by that path."""
    found = {}
    for f in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                found[f"tests/{f.name}::{node.name}"] = node
    return found


def _table() -> dict[str, list[str]]:
    """docs/cases.md's rows: case ID → the tests listed for it."""
    rows = {}
    for line in CASES.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and CASE_ID.fullmatch(cells[0]):
            rows[cells[0]] = re.findall(r"`([^`]+::[^`]+)`", cells[2])
    return rows


def test_every_listed_test_exists_and_every_case_has_one():
    tests, table = _test_functions(), _table()
    assert len(table) >= 39, f"docs/cases.md lists only {len(table)} cases"
    for case, listed in table.items():
        assert listed, f"case {case} has no test in docs/cases.md"
        missing = [t for t in listed if t not in tests]
        assert not missing, f"docs/cases.md lists tests that do not exist for {case}: {missing}"


def test_every_test_named_for_a_case_is_listed_under_it():
    table = _table()
    for path, node in _test_functions().items():
        named = {p.upper() for p in node.name.split("_")[1:] if CASE_ID.fullmatch(p.upper())}
        for case in named:
            assert case in table, f"{path} names case {case}, which docs/cases.md does not have"
            assert path in table[case], f"{path} names case {case} but docs/cases.md does not list it there"


def test_nothing_points_to_a_design_document_outside_the_repository():
    offenders = []
    for folder in ("contract", "train", "export", "serve", "tests", "benchmarks", "rust_runtime/src"):
        for f in (ROOT / folder).rglob("*"):
            if f.suffix not in {".py", ".rs", ".sh", ".md"} or f == Path(__file__):
                continue
            text = f.read_text(encoding="utf-8", errors="replace")
            for bad in ("DESIGN.md", "bugs.md", "shared/cases", "shared/notes"):
                if bad in text:
                    offenders.append(f"{f.relative_to(ROOT)}: {bad}")
    assert not offenders, "point to docs/design.md or docs/cases.md instead: " + "; ".join(offenders)


# ---------------------------------------------------------------- the layout block of docs/design.md


def _layout_block() -> str:
    """The fenced block under docs/design.md's "## Layout" heading."""
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```\n", 1)[1].split("```", 1)[0]


def _layout() -> dict[str, list[str]]:
    """docs/design.md's layout as folder → the names listed in it (a subfolder as ``name/``).

    A line at column 0 starts a top-level entry (``train/``); a line whose first word is ``name/`` (outside
    parentheses) opens that subfolder of the enclosing folder, and the lines indented deeper continue it; text in
    parentheses (across lines too) describes and a word ending in ``:`` labels, so neither is a name."""
    listing: dict[str, list[str]] = {}
    stack: list[tuple[int, str]] = []  # (column of the folder's name, folder path)
    depth = 0
    for line in _layout_block().splitlines():
        if not line.strip():
            continue
        col = len(line) - len(line.lstrip())
        words, starts_free = [], depth == 0
        word = ""
        for ch in line + " ":
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
            elif depth == 0 and not ch.isspace():
                word += ch
                continue
            if word:
                words.append(word)
                word = ""
        first = line.split()[0]
        if col == 0:
            stack = [(0, first.rstrip("/"))]
            words = words[1:]
        elif starts_free and first.rstrip(":").endswith("/") and words and words[0] == first:
            while len(stack) > 1 and stack[-1][0] >= col:
                stack.pop()
            stack.append((col, f"{stack[-1][1]}/{first.rstrip(':').rstrip('/')}"))
            words = words[1:]
        else:
            while len(stack) > 1 and stack[-1][0] >= col:
                stack.pop()
        listing.setdefault(stack[-1][1], []).extend(w for w in words if not w.endswith(":") or w.endswith("/:"))
    return listing


def _stem(name: str, suffix: str) -> str:
    return name[: -len(suffix)] if name.endswith(suffix) else name


def test_the_layout_names_every_source_file_and_nothing_that_is_gone():
    listing = _layout()
    problems = []
    for folder, suffix in LAYOUT_CHECKED.items():
        listed = listing.get(folder, [])
        names = {_stem(w, suffix) for w in listed if not w.endswith("/")}
        present = {f.stem for f in (ROOT / folder).glob(f"*{suffix}")}
        problems += [f"{folder}/{n}{suffix} is not in docs/design.md's layout"
                     for n in sorted(present - names) if n != "__init__"]
        problems += [f"docs/design.md's layout names {folder}/{n}, which does not exist"
                     for n in sorted(names - present)]
        for sub in (w.rstrip("/") for w in listed if w.endswith("/")):
            if not (ROOT / folder / sub).is_dir():
                problems.append(f"docs/design.md's layout names the folder {folder}/{sub}/, which does not exist")
        if suffix == ".py":  # every package below is opened and listed too
            for d in sorted(p for p in (ROOT / folder).iterdir() if p.is_dir() and any(p.glob("*.py"))):
                sub = f"{folder}/{d.name}"
                if sub not in LAYOUT_CHECKED and sub not in listing:
                    problems.append(f"the package {sub}/ is not opened in docs/design.md's layout")
    for sub in listing:
        top = sub.split("/")[0]
        if sub not in LAYOUT_CHECKED and top in LAYOUT_CHECKED and LAYOUT_CHECKED[top] == ".py":
            names = {w for w in listing[sub] if not w.endswith("/")}
            present = {f.stem for f in (ROOT / sub).glob("*.py")}
            problems += [f"{sub}/{n}.py is not in docs/design.md's layout" for n in sorted(present - names)
                         if n != "__init__"]
            problems += [f"docs/design.md's layout names {sub}/{n}, which does not exist"
                         for n in sorted(names - present)]
    assert not problems, "\n".join(problems)


def test_the_layout_parser_reads_labels_descriptions_and_subfolders():
    listing = _layout()
    assert "config" in listing["train"] and "data:" not in listing["train"]
    assert "placement" in listing["train/components"] and "device," not in listing["train/components"]
    assert "gemm" in listing["rust_runtime/src/kernels"] and "amx" in listing["rust_runtime/src/kernels/int"]
    assert "static/" in listing["serve"] and "admission" in listing["serve/http"]
    assert "README.md" not in LAYOUT_CHECKED and "design.md" in listing["docs"]


def test_the_layout_lives_in_design_md_alone():
    for page in PAGES:
        if page != "docs/design.md":
            text = (ROOT / page).read_text(encoding="utf-8")
            assert "pyproject.toml      distribution" not in text, f"{page} repeats docs/design.md's layout"


# ---------------------------------------------------------------- the README


def _fenced(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def test_the_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    first = _fenced(text)[0].strip().splitlines()
    assert first[1] == 'pip install -e ".[all]" && pytest -q', first
    assert first[0].startswith('pip install -e ".[all]" && python -m train.run && '), first
    design_block = DESIGN.read_text(encoding="utf-8").split("## The two README commands", 1)[1]
    assert _fenced(design_block)[0].strip().splitlines() == first, "docs/design.md quotes other README commands"
    assert "uvicorn serve.app:app" in "\n".join(text.splitlines()[:40]), "the serving command is on the first screen"


def test_ci_runs_the_readme_test_command_verbatim():
    command = _fenced(README.read_text(encoding="utf-8"))[0].strip().splitlines()[1]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert any(line.strip() == command for line in ci.splitlines()), f".ci/run does not run `{command}`"


def test_every_speed_figure_in_the_readme_table_names_its_cpu():
    text = README.read_text(encoding="utf-8")
    rows = [r for r in text.split("\n## Figures", 1)[1].split("\n## ", 1)[0].splitlines() if r.startswith("| ")]
    assert len(rows) >= 6
    header, body = rows[0], rows[1:]
    assert "measured on" in header
    for row in body:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if set(cells[0]) <= set("-"):
            continue
        assert cells[2], f"README figure without the machine it was measured on: {row}"
        assert re.search(r"\]\((benchmarks/[^)]+)\)", cells[3]), f"README figure without its results page: {row}"
        if re.search(r"tok/s|min\b|×", cells[1]):
            assert re.search(r"Xeon|EPYC|GPU|H100|H200", cells[2]), f"a speed without its CPU: {row}"


# ---------------------------------------------------------------- links between the pages


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for name in PAGES:
        page = ROOT / name
        for link in _links(page):
            if re.match(r"[a-z]+:", link):
                continue
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{name}: {link} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{name}: {link} (no heading with that anchor)")
    assert not broken, "\n".join(broken)


def test_the_link_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A `code` heading, here\n[ok](#a-code-heading-here) [bad](#nope) [gone](missing.md)\n"
                    "```\n[not a link](nowhere.md)\n```\n", encoding="utf-8")
    assert _links(page) == ["#a-code-heading-here", "#nope", "missing.md"]
    assert _anchors(page) == {"a-code-heading-here"}


# ---------------------------------------------------------------- the presets


def test_the_preset_table_of_design_md_is_the_configs():
    """docs/design.md's preset table (the one the guides point to) against configs/: every preset, its shape, its
    vocabulary and its parameter count (embedding + per layer q, k, v, o, gate, up, down and two norms + the final
    norm; a head of its own unless tied)."""
    from train.config import load_config, preset_names

    rows = {}
    for line in DESIGN.read_text(encoding="utf-8").split("## Configuration (TOML)", 1)[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].split()[0] in preset_names():
            rows[cells[0].split()[0]] = cells[1:]
    assert sorted(rows) == preset_names()
    for name, cells in rows.items():
        cfg = load_config(name)
        m, vocab = cfg.model, cfg.tokenizer.vocab_size
        h, heads, kv, inter, layers = (m.hidden_size, m.num_attention_heads, m.num_key_value_heads,
                                       m.intermediate_size, m.num_hidden_layers)
        head_dim = h // heads
        layer = 2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * inter + 2 * h
        params = vocab * h * (1 if m.tie_word_embeddings else 2) + layers * layer + h
        assert cells == [str(h), str(layers), f"{heads} / {kv}", str(inter), str(m.max_position_embeddings),
                         f"{vocab:,}", f"{params:,}"], name


# ---------------------------------------------------------------- the HTTP settings table


def test_the_serving_guide_lists_every_shalik_variable_the_code_reads():
    read = set()
    for folder in ("serve", "rust_runtime/src", "rust_runtime"):  # what the server and its backends read
        for f in (ROOT / folder).glob("**/*" if folder != "rust_runtime" else "*.py"):
            if f.suffix in {".py", ".rs"} and "target" not in f.parts:
                read |= set(re.findall(r"SHALIK_[A-Z0-9_]+", f.read_text(encoding="utf-8")))
    table = set(re.findall(r"^\| `(SHALIK_[A-Z0-9_]+)`", (ROOT / "docs" / "serve.md").read_text(encoding="utf-8"),
                           flags=re.M))
    assert read - table == set(), f"docs/serve.md's table lacks {sorted(read - table)}"
    assert table - read == set(), f"docs/serve.md's table lists variables no code reads: {sorted(table - read)}"


def test_no_issue_numbers_in_product_code():
    """Issue numbers go stale in code (git history has them); a figure's home is its results page."""
    offenders = []
    for folder in ("contract", "train", "export", "serve", "rust_runtime/src"):
        for f in (ROOT / folder).rglob("*"):
            if f.suffix in {".py", ".rs", ".toml", ".pyi"}:
                for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                    if re.search(r"\bissues? #?\d+", line, flags=re.I):
                        offenders.append(f"{f.relative_to(ROOT)}:{n}")
    assert not offenders, "issue numbers in product code: " + ", ".join(offenders)
