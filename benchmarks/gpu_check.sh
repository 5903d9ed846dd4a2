#!/usr/bin/env bash
# The device check: base-400m at its real micro-batch (16 × 2048) and grad_accum (16), compiled, ≥ 50 optimizer
# steps after the compile warm-up timed with CUDA events; figures in $OUT/gpu_check.json, the log in
# $OUT/gpu_check.log. Budget: 6 minutes with the machine's start, so the script itself ≈ 4 minutes (LIMIT_S=230
# for training; the planner, data check and compile warm-up are inside it).
#
# Needs torch, numpy, tokenizers, safetensors, tqdm. Carry the prepared cache (cache/, made here with
# `python -m train.data prepare --config base-400m`) so no tokenizer or shards are built on the GPU's clock.
#
#   bash benchmarks/gpu_check.sh                     # base-400m, 53 steps (3 untimed + 50 timed)
#   CONFIG=tiny bash benchmarks/gpu_check.sh         # CPU dry run (5 steps, 3 untimed, limit 600 s)
#
# Environment: CONFIG (base-400m), STEPS, UNTIMED (3), NAME (gpu-check), OUT (runs/gpu-check-out), LIMIT_S (230 GPU),
# PREFLIGHT=1 (also run preflight; does not fit the budget), SETS (space-separated section.key=value overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
CONFIG=${CONFIG:-base-400m}
UNTIMED=${UNTIMED:-3}
NAME=${NAME:-gpu-check}
OUT=${OUT:-runs/gpu-check-out}
PY=${PYTHON:-python3}
if $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  STEPS=${STEPS:-$((UNTIMED + 50))}; LIMIT_S=${LIMIT_S:-230}
else  # CPU dry run: the same code path, few steps, a limit that survives a loaded machine
  STEPS=${STEPS:-$((UNTIMED + 2))}; LIMIT_S=${LIMIT_S:-600}
fi
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"

{
echo "== environment"
$PY - <<'PYEOF'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
else:
    print("gpu: none (CPU dry run)")
PYEOF
} 2>&1 | tee -a "$LOG"

rm -rf "runs/${NAME:?}"
sets=()
for s in ${SETS:-}; do sets+=(--set "$s"); done
pf=()
[ "${PREFLIGHT:-0}" = "1" ] && pf=(--preflight)

echo "== ${CONFIG}: ${STEPS} steps (${UNTIMED} untimed), limit ${LIMIT_S} s" | tee -a "$LOG"
start=$(date +%s)
status=0
timeout --signal=TERM --kill-after=30 "${LIMIT_S}" \
  $PY benchmarks/gpu_check.py --config "${CONFIG}" --name "${NAME}" --steps "${STEPS}" --untimed "${UNTIMED}" \
  --out "${OUT}" "${pf[@]}" "${sets[@]}" 2>&1 | tee -a "$LOG" || status=${PIPESTATUS[0]}
echo "== exited ${status} after $(( $(date +%s) - start )) s (124 = stopped at the time limit)" | tee -a "$LOG"
[ -f "runs/${NAME}/train.log" ] && cp "runs/${NAME}/train.log" "$OUT/train.log"

$PY - "$OUT/gpu_check.json" <<'PYEOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
p = Path(sys.argv[1])
if not p.is_file():
    print("no gpu_check.json: no step was timed (see gpu_check.log)")
    sys.exit(0)
d = json.loads(p.read_text())
def fmt(v, f):
    return "n/a" if v is None else format(v, f)
print(f"{d['gpu'] or d['device']}, torch {d['torch']}: {d['timed_steps']} timed steps of {d['micro_batch_size']} × "
      f"{d['seq_len']} × {d['grad_accum']} accum ({'complete' if d['complete'] else 'INCOMPLETE'})")
print(f"tokens/s {fmt(d['tokens_per_s'], ',.0f')}   MFU {fmt(d['mfu'], '.1%')}   peak memory (timed steps) "
      f"{fmt(d['peak_memory_gib_timed_steps'], '.1f')} GiB   compile: {d['compile']['path']} "
      f"({d['compile']['recompiles']} recompiles)   attention: {d['attention_backend']['name']}")
if d.get("plan"):
    print(f"planner: peak {d['plan']['peak_bytes'] / 2**30:.1f} GiB")
PYEOF
exit "${status}"
