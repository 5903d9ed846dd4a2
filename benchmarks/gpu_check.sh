#!/usr/bin/env bash
# One-shot GPU check: preflight, then base-400m for a few hundred steps with torch.compile (eager when compiling
# fails), printing tokens/s, MFU and peak memory — in at most about 5 minutes on one H100/H200.
#
# Needs only what a CUDA image with PyTorch already has (torch, numpy, tokenizers, safetensors, tqdm): no package
# index, no ../shared. The data is the repository's own data/sample/ (7 MB); the tokenizer and shards are built on
# the spot (or reused from cache/ if it was carried along). Run from anywhere:
#
#   bash benchmarks/gpu_check.sh                       # base-400m, 300 steps of 16 × 2048 tokens
#   CONFIG=tiny STEPS=30 bash benchmarks/gpu_check.sh  # a CPU dry run
#   THROUGHPUT=1 bash benchmarks/gpu_check.sh          # also our step vs transformers' (benchmarks/train_throughput.py)
#
# Environment: CONFIG (base-400m), STEPS (300), NAME (gpu-check), OUT_DIR (runs), LIMIT_S (300), extra --set
# overrides in SETS (space-separated section.key=value).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
CONFIG=${CONFIG:-base-400m}
STEPS=${STEPS:-300}
NAME=${NAME:-gpu-check}
OUT_DIR=${OUT_DIR:-runs}
LIMIT_S=${LIMIT_S:-300}
PY=${PYTHON:-python3}

echo "== environment"
$PY - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
else:
    print("gpu: none (CPU dry run)")
EOF

rm -rf "${OUT_DIR:?}/${NAME:?}"
sets=(--set "train.max_steps=${STEPS}" --set train.grad_accum=1 --set "train.eval_every=${STEPS}"
      --set train.eval_tokens=65536 --set train.ckpt_every=1000000 --set "run.out_dir=\"${OUT_DIR}\"")
for s in ${SETS:-}; do sets+=(--set "$s"); done

echo "== preflight + ${STEPS} steps of ${CONFIG} (limit ${LIMIT_S} s)"
start=$(date +%s)
status=0
timeout --signal=TERM --kill-after=60 "${LIMIT_S}" \
  $PY -m train.run --config "${CONFIG}" --name "${NAME}" "${sets[@]}" || status=$?
echo "== train.run exited ${status} after $(( $(date +%s) - start )) s (124 = stopped at the time limit; a SIGTERM saves a checkpoint)"

$PY - "${OUT_DIR}/${NAME}" <<'EOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
pf = run / "preflight.json"
if pf.is_file():
    rep = json.loads(pf.read_text())
    print(f"preflight: {'ok' if rep['ok'] else 'FAILED'} on {rep['device']} ({rep['dtype']})")
    for c in rep["checks"]:
        print(f"  {'PASS' if c['ok'] else 'FAIL'} {c['name']:<21} {c['seconds']:7.2f} s  {c['detail']}")
s = run / "summary.json"
if s.is_file():
    d = json.loads(s.read_text())
    mfu = f"{d['mfu']:.1%}" if d.get("mfu") is not None else "n/a (CPU)"
    print(f"summary: {d['steps']} steps, {d['tokens']:,} tokens, {d['params']:,} parameters, {d['device']} {d['dtype']}")
    print(f"tokens/s: {d['tokens_per_s']:,.0f}   MFU: {mfu}   peak memory: {d.get('peak_memory_gb', 0):.1f} GB   "
          f"wall: {d['wall_s']:.0f} s")
    if d.get("val"):
        print("val NLL: " + ", ".join(f"{k} {v['nll']:.3f}" for k, v in d["val"].items()))
else:
    m = run / "metrics.jsonl"
    rows = [json.loads(x) for x in m.read_text().splitlines()] if m.is_file() else []
    tr = [r for r in rows if r.get("kind") == "train"]
    if tr:
        r = tr[-1]
        print(f"last step {r['step']}: loss {r['loss']:.3f}, {r['tokens_per_s']:,.0f} tokens/s, mfu {r['mfu']}")
    else:
        print("no training step was logged")
EOF

if [ "${THROUGHPUT:-0}" = "1" ]; then
  echo "== our training step vs transformers'"
  $PY benchmarks/train_throughput.py --config "${CONFIG}" --rounds 5 $( [ "${CONFIG}" = base-400m ] && echo --micro-batch 8 )
fi
exit "${status}"
