#!/usr/bin/env bash
# The full-size engine on one CUDA GPU (hash-v1 weights, bf16, CUDA graphs), in under 8 minutes.
# Writes the "## GPU (H200)" section of BENCHMARKS.md. Without a GPU it stops at once with a
# message; `bash bench/gpu.sh --dry-run` runs the same code path on the tiny configs anywhere.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
has_torch() { "$1" -c 'import torch' >/dev/null 2>&1; }
has_cuda() { "$1" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1; }
if [[ -n "${PYTHON:-}" ]]; then py=$PYTHON
elif [[ -x .venv/bin/python ]] && has_cuda .venv/bin/python; then py=.venv/bin/python
elif has_torch python3; then py=python3
elif [[ -x .venv/bin/python ]]; then py=.venv/bin/python
else echo "bench/gpu.sh: no Python with torch found (set PYTHON=...)" >&2; exit 2
fi
export PYTHONUNBUFFERED=1
exec timeout --kill-after=10 470 "$py" bench/gpu.py "$@"
