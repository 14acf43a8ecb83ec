#!/usr/bin/env bash
# GPU check of ckpttool (issue 7): optimizer/replay accelerator tests plus `replay-step --device cuda`
# on the sample checkpoint and a ~1 GiB CPU-offload checkpoint, with a short pass/fail summary
# (step time, D2H/H2D GB/s achieved vs torch's pinned copy bandwidth). Finishes in < 7 minutes (the 0.5B replay last, skipped when the budget runs short).
#
#   scripts/device_check.sh                 # on a machine with a GPU (or NPU)
#   scripts/device_check.sh --device cpu    # the CPU path (what runs when there is no GPU)
#
# Outputs (logs, summary.json) go to $OUT if set, else /tmp/ckpttool-device-check.
# Extra arguments go to scripts/device_check.py (--budget SECONDS, --big-gib N, --device cpu).
set -u
cd "$(dirname "$0")/.."
START=$(date +%s)
TOTAL=${DEVICE_CHECK_TOTAL:-420}   # seconds for everything, pip included
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3

probe() {
  timeout 90 "$PY" -c 'import torch; print("torch", torch.__version__, "cuda available:", torch.cuda.is_available())' 2>&1
}

echo "== environment =="
echo "python: $("$PY" --version 2>&1) at $(command -v "$PY")"
if ! FOUND=$(probe); then
  echo "torch not importable ($FOUND); installing the project: pip install -e . (torch from this machine's index)"
  timeout 150 "$PY" -m pip install -q -e ".[test]" 2>&1 | tail -5 || timeout 150 "$PY" -m pip install -q -e . 2>&1 | tail -5
  FOUND=$(probe) || { echo "FAIL: torch still not importable: $FOUND"; exit 1; }
fi
echo "$FOUND"
command -v nvidia-smi >/dev/null 2>&1 && timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
MISSING=$(timeout 60 "$PY" -c '
import importlib
need = ["typer", "rich", "safetensors", "numpy", "yaml", "pytest", "filelock"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))' 2>&1)
if [ -n "$MISSING" ]; then
  echo "missing python packages: $MISSING; trying pip install -e .[test]"
  timeout 120 "$PY" -m pip install -q -e ".[test]" 2>&1 | tail -5
fi

LEFT=$(( TOTAL - ($(date +%s) - START) ))
[ "$LEFT" -lt 60 ] && LEFT=60
timeout --kill-after=5 "$LEFT" "$PY" scripts/device_check.py --budget $(( LEFT - 10 )) "$@"
RC=$?
[ $RC -eq 124 ] && echo "FAIL: device check timed out after ${LEFT}s"
echo "total wall time: $(( $(date +%s) - START ))s"
exit $RC
