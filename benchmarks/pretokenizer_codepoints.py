"""Every code point through llama.cpp's own pre-tokenizer: does Shalik's split (``train.tokenizer.PRETOKENIZER``,
written for Oniguruma) cut text exactly where llama.cpp's ``deepseek-v3`` does, beyond the corpus? (issue 28)

Token ids only show a different split where a merge crosses the boundary; this compares the pieces themselves.
A 30-line C++ program, compiled here with g++ against the ``libllama`` that llama-cpp-python installs, calls
llama.cpp's ``unicode_regex_split`` (exported by libllama) with the regexes llama.cpp runs for ``deepseek-v3``
(src/llama-vocab.cpp, ``LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM``); Python splits the same strings with the
``tokenizers`` pre-tokenizer of the table. One string per code point (all 1,112,064 but the surrogates), the code
point placed after and before letters, digits, spaces, a newline, a Bangla letter, a danda, '~' and itself.
Writes benchmarks/results/pretokenizer_codepoints.md: how many strings split alike, and the code points that do
not, by Unicode category (the usual cause: a code point assigned in a newer Unicode version than one side's tables).

    python benchmarks/pretokenizer_codepoints.py      # needs g++ and the bench extra (llama-cpp-python)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import unicodedata
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenizers import Regex, pre_tokenizers  # noqa: E402

from train.tokenizer import PRETOKENIZER  # noqa: E402

# llama-vocab.cpp's regex_exprs for deepseek-v3, as the C++ string literals hold them (\r \n are real characters
# in the last one there too)
LLAMA_CPP_REGEXES = {
    "deepseek-v3": ["\\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"],
}
SHIM = r"""
#include <cstdio>
#include <string>
#include <vector>
std::vector<std::string> unicode_regex_split(const std::string & text, const std::vector<std::string> & regex_exprs,
                                             bool byte_encode);
static bool record(std::string & out) {  // "<n>\n<n bytes>"
    size_t n;
    if (scanf("%zu", &n) != 1) return false;
    getchar();
    out.resize(n);
    return fread(&out[0], 1, n, stdin) == n;
}
int main() {  // first record: the regexes, separated by \x1f; then texts; prints "<pieces>\n" then each piece as a record
    std::string r, t;
    if (!record(r)) return 1;
    std::vector<std::string> regs;
    size_t p = 0, q;
    while ((q = r.find('\x1f', p)) != std::string::npos) { regs.push_back(r.substr(p, q - p)); p = q + 1; }
    regs.push_back(r.substr(p));
    while (record(t)) {
        auto pieces = unicode_regex_split(t, regs, false);
        printf("%zu\n", pieces.size());
        for (const auto & piece : pieces) {
            printf("%zu\n", piece.size());
            fwrite(piece.data(), 1, piece.size(), stdout);
        }
    }
    return 0;
}
"""


def context(c: str) -> str:
    return f"a{c}b {c}{c}1{c} {c}\nক{c}।{c}~{c}  {c}"


def parse(out: bytes) -> list[list[bytes]]:
    """The shim's output: per text, a count line, then each piece as ``<length>\\n<bytes>``."""
    texts, pos = [], 0
    while pos < len(out):
        nl = out.index(b"\n", pos)
        n, pos = int(out[pos:nl]), nl + 1
        pieces = []
        for _ in range(n):
            nl = out.index(b"\n", pos)
            size, pos = int(out[pos:nl]), nl + 1
            pieces.append(out[pos:pos + size])
            pos += size
        texts.append(pieces)
    return texts


def build_shim(folder: Path) -> Path:
    """Compile the shim against llama-cpp-python's libllama. Raises SystemExit naming what is missing."""
    try:
        import llama_cpp
    except ImportError as e:
        raise SystemExit(f"error: llama-cpp-python is not installed ({e}); pip install -e \".[bench]\"") from None
    lib = Path(llama_cpp.__file__).parent / "lib"
    (folder / "shim.cpp").write_text(SHIM)
    try:
        subprocess.run(["g++", "-O1", "-o", str(folder / "shim"), str(folder / "shim.cpp"), f"-L{lib}", "-lllama",
                        f"-Wl,-rpath,{lib}"], check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise SystemExit("error: g++ is not installed (apt-get install g++)") from None
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"error: cannot build the shim against {lib}: {e.stderr.strip()[-300:]}") from None
    return folder / "shim"


def main() -> int:
    name = PRETOKENIZER.name
    ours = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(p), behavior="isolated") for p in PRETOKENIZER.splits])
    cps = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    texts = [context(chr(c)) for c in cps]
    regs = "\x1f".join(LLAMA_CPP_REGEXES[name]).encode()
    payload = bytearray(f"{len(regs)}\n".encode() + regs)
    for t in texts:
        b = t.encode("utf-8")
        payload += f"{len(b)}\n".encode() + b
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="codepoints-") as tmp:
        shim = build_shim(Path(tmp))
        out = subprocess.run([str(shim)], input=bytes(payload), capture_output=True, check=True).stdout
    theirs = parse(out)
    print(f"llama.cpp split {len(theirs):,} strings in {time.time() - t0:.0f} s", flush=True)
    bad = []
    for i, (t, th) in enumerate(zip(texts, theirs, strict=True)):
        if [t[a:b].encode() for _, (a, b) in ours.pre_tokenize_str(t)] != th:
            bad.append(cps[i])
        if i % 200_000 == 0:
            print(f"compared {i:,} / {len(texts):,}", flush=True)
    cats = Counter(unicodedata.category(chr(c)) for c in bad)
    lines = [f"# Every code point through llama.cpp's `{name}` pre-tokenizer (issue 28)", "",
             "`python benchmarks/pretokenizer_codepoints.py`: llama.cpp's `unicode_regex_split` (libllama of "
             "llama-cpp-python) against `tokenizers` with `train.tokenizer.PRETOKENIZER`, one string per code point "
             f"(`{context('X')!r}` with X the code point).", "",
             f"**{len(texts) - len(bad):,} of {len(texts):,}** strings split alike; {len(bad):,} code points differ.",
             ""]
    if bad:
        lines += ["| Unicode category (Python's tables) | code points | examples |", "|---|---:|---|"]
        for cat, n in cats.most_common():
            ex = [f"U+{c:04X}" for c in bad if unicodedata.category(chr(c)) == cat][:6]
            lines.append(f"| {cat} | {n:,} | {' '.join(ex)} |")
        lines += ["", f"Python's Unicode version: {unicodedata.unidata_version}. A code point llama.cpp's tables and "
                  "Oniguruma's classify differently (newly assigned ones, mostly) splits differently."]
    md = "\n".join(lines) + "\n"
    out_path = ROOT / "benchmarks" / "results" / "pretokenizer_codepoints.md"
    out_path.write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
