#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (continuous batching, `--parallel N`) for benchmarks/serve_batching.py.
# Benchmark-only: never run in CI. Build times: benchmarks/README.md, "Build and test times".
#
# Source: the llama-cpp-python sdist from the package index, which vendors llama.cpp (vendor/llama.cpp, tools/server).
# The sdist URL comes from the JSON project page (PEP 691) of the index pip is configured with (no `pip download`:
# that runs a metadata build of the sdist), and its sha256 is checked against the index's. The sdist is downloaded
# and extracted into a cache folder outside the repository, configured with cmake (Release, no curl/openssl, no
# tests/examples, the server on) and only the `llama-server` target is built. The last line printed is the binary's
# path.
#
# CPU flags: GGML_NATIVE=OFF, AMX off, and each of AVX2, FMA, F16C, AVX-512 (avx512f), AVX-512 VNNI, AVX512-BF16,
# AVX-512 VBMI and AVX-VNNI on exactly when this CPU's /proc/cpuinfo lists it (read by contract.cpu); SSE4.2, AVX and
# BMI2 are ggml's defaults (on). So the peer runs every instruction set the CPU has but AMX. On CPUs that advertise
# AMX, ggml's AMX backend was seen to crash (SIGILL in `tilezero`) as soon as a q8_0 model ran; an AMD Zen 4 has
# AVX-512 VNNI but not AVX-VNNI, and a build with AVX-VNNI on stopped there with SIGILL on the first Q4_0 model. The CPU repack buffer (llama.cpp's default)
# stays on. The flags the build was made with are written to isa.txt in the build folder (one cpuinfo name a line):
# benchmarks/serve_batching.py only takes a build whose isa.txt this CPU satisfies, and running this script on
# another CPU reconfigures the folder for it (only ggml's CPU backend is recompiled).
#
#   bash benchmarks/build_llama_server.sh            # prints .../llama-server
#
# Environment: LLAMA_CPP_PYTHON_VERSION (0.3.36), SHALIK_CACHE (${XDG_CACHE_HOME:-$HOME/.cache}/shalik),
# LLAMA_SDIST_DIR (an already-extracted sdist to use instead of downloading), JOBS (2), PYTHON (python3).
# Errors: exits non-zero naming the step (no sdist for the version, download failure, cmake/ninja install, a CPU
# without AVX2, build).
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${SHALIK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shalik}
JOBS=${JOBS:-2}
PY=${PYTHON:-python3}
mkdir -p "$CACHE"

if [[ -n "${LLAMA_SDIST_DIR:-}" ]]; then
  SRC="$LLAMA_SDIST_DIR"
else
  SRC="$CACHE/llama_cpp_python-$VERSION"
fi

if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
  TARBALL="$CACHE/llama_cpp_python-$VERSION.tar.gz"
  if [[ ! -s "$TARBALL" ]]; then
    echo "fetching the llama-cpp-python $VERSION sdist from the package index" >&2
    "$PY" - "$VERSION" "$TARBALL" <<'EOF'
import hashlib
import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request

version, out = sys.argv[1], sys.argv[2]
# the index pip is configured with (PIP_INDEX_URL, pip config, else pip's default), read through its JSON API
index = os.environ.get("PIP_INDEX_URL")
if not index:
    got = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                         capture_output=True, text=True)
    index = got.stdout.strip() if got.returncode == 0 else ""
if not index:
    from pip._internal.models.index import PyPI

    index = PyPI.simple_url
page = urllib.parse.urljoin(index.rstrip("/") + "/", "llama-cpp-python/")
req = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
with urllib.request.urlopen(req, timeout=60) as r:
    if "json" not in r.headers.get("Content-Type", ""):
        sys.exit(f"build_llama_server: {page} has no JSON project page (got {r.headers.get('Content-Type')})")
    meta = json.load(r)
name = f"llama_cpp_python-{version}.tar.gz"
files = [f for f in meta.get("files", []) if f.get("filename") == name]
if not files:
    sys.exit(f"build_llama_server: no sdist {name} on {page}")
url = urllib.parse.urljoin(page, files[0]["url"])  # the index may give a relative url
want = files[0].get("hashes", {}).get("sha256")
tmp, h = out + ".tmp", hashlib.sha256()
with urllib.request.urlopen(url, timeout=600) as r, open(tmp, "wb") as f:
    while chunk := r.read(1 << 20):
        f.write(chunk)
        h.update(chunk)
    f.flush()
    os.fsync(f.fileno())
if want and h.hexdigest() != want:
    os.unlink(tmp)
    sys.exit(f"build_llama_server: {url}: sha256 {h.hexdigest()}, the index says {want}")
os.replace(tmp, out)
print(f"downloaded {url} -> {out}", file=sys.stderr)
EOF
  fi
  echo "extracting $TARBALL" >&2
  TMPX=$(mktemp -d "$CACHE/extract.XXXXXX")
  tar -xzf "$TARBALL" -C "$TMPX"
  rm -rf "$SRC"
  mv "$TMPX/llama_cpp_python-$VERSION" "$SRC"
  rmdir "$TMPX"
fi
LLAMA="$SRC/vendor/llama.cpp"
[[ -f "$LLAMA/tools/server/server.cpp" ]] || { echo "build_llama_server: no tools/server in $LLAMA" >&2; exit 1; }

# cmake and ninja: from pip when missing (user site), then found via the scripts folder
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
  echo "installing cmake and ninja from the package index" >&2
  "$PY" -m pip install --user --quiet cmake ninja
  PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts", "posix_user"))'):$PATH"
  export PATH
fi
command -v cmake >/dev/null && command -v ninja >/dev/null || { echo "build_llama_server: cmake/ninja not on PATH" >&2; exit 1; }

BUILD="$CACHE/llama-server-build-$VERSION"
# a build folder configured from another copy of the source is reconfigured (cmake refuses a changed source dir)
if [[ -f "$BUILD/CMakeCache.txt" ]] && ! grep -qxF "CMAKE_HOME_DIRECTORY:INTERNAL=$LLAMA" "$BUILD/CMakeCache.txt"; then
  rm -rf "$BUILD/CMakeCache.txt" "$BUILD/CMakeFiles"
fi
# each ggml ISA option on exactly when /proc/cpuinfo lists its flag (cpuinfo name:GGML option)
CPU_FLAGS=" $(PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)" "$PY" -c 'from contract.cpu import cpu_flags; print(" ".join(sorted(cpu_flags() or ())))') "
[[ "$CPU_FLAGS" == *" avx2 "* ]] || { echo "build_llama_server: this CPU has no AVX2 (/proc/cpuinfo); expected an x86-64 CPU with AVX2" >&2; exit 1; }
ISA_OPTS=()
ISA=()
for pair in avx2:AVX2 fma:FMA f16c:F16C avx512f:AVX512 avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 \
            avx512vbmi:AVX512_VBMI avx_vnni:AVX_VNNI; do
  flag=${pair%%:*}
  if [[ "$CPU_FLAGS" == *" $flag "* ]]; then ISA_OPTS+=("-DGGML_${pair#*:}=ON"); ISA+=("$flag")
  else ISA_OPTS+=("-DGGML_${pair#*:}=OFF"); fi
done
echo "build_llama_server: instruction sets on: ${ISA[*]}" >&2
rm -f "$BUILD/isa.txt"   # written again only after a build for this CPU succeeds
cmake -S "$LLAMA" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
  -DGGML_NATIVE=OFF "${ISA_OPTS[@]}" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF >&2
cmake --build "$BUILD" --target llama-server -j "$JOBS" >&2
BIN="$BUILD/bin/llama-server"
[[ -x "$BIN" ]] || { echo "build_llama_server: $BIN was not built" >&2; exit 1; }
printf '%s\n' "${ISA[@]}" > "$BUILD/isa.txt.tmp" && mv "$BUILD/isa.txt.tmp" "$BUILD/isa.txt"
echo "$BIN"
