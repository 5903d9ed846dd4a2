"""What checking a bundle's sha256 sums adds to start-up: ``serve.load(BUNDLE, verify=True)`` against
``verify=False``, interleaved round by round (so load from other jobs hits both alike), medians over rounds;
and the same check on a base-400m-sized set of files (synthetic bytes of the sizes a base-400m fp32 bundle has,
from its parameter count), where hashing is the whole cost.

    python benchmarks/verify_startup.py [BUNDLE] [--rounds 5] [--backend onnx] [--base-400m-params 410000000]
                                        [--skip-synthetic] [--out benchmarks/results]

Writes ``verify_startup.md`` and ``verify_startup.json`` to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bundles, timing  # noqa: E402
from contract.bundle import ONNX, backend_files, external_data, sha256_file  # noqa: E402
from serve import load  # noqa: E402


def time_load(bundle: Path, backend: str, rounds: int) -> dict[str, float]:
    """Median seconds of ``load`` with and without verification, interleaved."""
    times: dict[str, list[float]] = {"verify": [], "no_verify": []}
    for r in range(rounds):
        for kind in timing.rotated(("verify", "no_verify"), r):
            t = time.perf_counter()
            load(bundle, backend=backend, threads=1, verify=kind == "verify")
            times[kind].append(time.perf_counter() - t)
    return {k: timing.median(v) for k, v in times.items()}


def time_synthetic(params: int, rounds: int) -> dict[str, float]:
    """Median seconds to hash a base-400m fp32 bundle's weight file (4 bytes a parameter), warm page cache."""
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        path = Path(tmp) / external_data(ONNX)
        block = os.urandom(1 << 20)
        with open(path, "wb") as f:
            for _ in range(params * 4 // len(block)):
                f.write(block)
        size = path.stat().st_size
        sha256_file(path)  # warm the page cache, as a loader that reads the file finds it
        secs = []
        for _ in range(rounds):
            t = time.perf_counter()
            sha256_file(path)
            secs.append(time.perf_counter() - t)
    return {"bytes": size, "hash_s": timing.median(secs), "GB_per_s": size / timing.median(secs) / 1e9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", nargs="?", default=None, help="bundle folder (default: the newest runs/*/bundle)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--backend", default="onnx")
    p.add_argument("--base-400m-params", type=int, default=410_000_000)
    p.add_argument("--skip-synthetic", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    bundle = bundles.given_or_newest(args.bundle, required=False)
    result: dict = {"load_avg": timing.loadavg()}
    if bundle is not None:
        files = [f for f in backend_files(args.backend, None) if (bundle / f).is_file()]
        t = time_load(bundle, args.backend, args.rounds)
        result["bundle"] = {"name": bundle.resolve().parent.name, "backend": args.backend,
                            "bytes_verified": sum((bundle / f).stat().st_size for f in files), **t,
                            "added_s": t["verify"] - t["no_verify"], "ratio": t["verify"] / t["no_verify"]}
    if not args.skip_synthetic:
        result["base_400m_weights"] = time_synthetic(args.base_400m_params, args.rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_startup.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Bundle verification at start-up", "",
             f"load average at start: {', '.join(f'{x:.2f}' for x in result['load_avg'])}", ""]
    if "bundle" in result:
        b = result["bundle"]
        lines += [f"- `{b['name']}` ({b['backend']}, {b['bytes_verified'] / 1e6:.1f} MB verified): load "
                  f"{b['no_verify']:.3f} s without, {b['verify']:.3f} s with verification "
                  f"(+{b['added_s']:.3f} s, ×{b['ratio']:.2f}; medians of {args.rounds} interleaved rounds)"]
    if "base_400m_weights" in result:
        s = result["base_400m_weights"]
        lines += [f"- base-400m-sized weights ({s['bytes'] / 1e9:.2f} GB, fp32): sha256 takes {s['hash_s']:.2f} s "
                  f"({s['GB_per_s']:.2f} GB/s, warm page cache) — what verification adds to that bundle's start-up"]
    (out / "verify_startup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
