#!/usr/bin/env bash
# The GPU acceptance run on one CUDA GPU of any size, in under 8 minutes: the golden fixtures on
# the device, CUDA graphs against eager ticks (and on cuda:1 when there is one), the bf16 engine's
# divergence, the full-size engine's tick and memory at batches that the free memory holds, and
# `--slots auto` on the device (bench/gpu.py). Writes the "## GPU (<device name>)" section of
# BENCHMARKS.md (and, with --section-file PATH, to PATH); exits 1 if a check fails. Without a GPU
# it stops at once, saying why; `bash bench/gpu.sh --dry-run [--free-gib N]` runs the same code
# path on the tiny configs anywhere, and prints the batches a card with N GiB free would get.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dry_run=0
for arg in "$@"; do [[ $arg == --dry-run ]] && dry_run=1; done
if [[ $dry_run == 0 && ! -e /dev/nvidiactl && ! -e /proc/driver/nvidia/version ]] && ! command -v nvidia-smi >/dev/null; then
    echo "bench/gpu.sh: no NVIDIA GPU driver on this machine (no /dev/nvidiactl, no nvidia-smi): this run" \
         "measures the full-size engine on a CUDA GPU. Here, \`bash bench/gpu.sh --dry-run\` checks its code path." >&2
    exit 2
fi
has_torch() { "$1" -c 'import torch' >/dev/null 2>&1; }
has_cuda() { "$1" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1; }
if [[ -n "${PYTHON:-}" ]]; then py=$PYTHON
elif [[ $dry_run == 1 && -x .venv/bin/python ]]; then py=.venv/bin/python
elif [[ -x .venv/bin/python ]] && has_cuda .venv/bin/python; then py=.venv/bin/python
elif has_torch python3; then py=python3
elif [[ -x .venv/bin/python ]]; then py=.venv/bin/python
else echo "bench/gpu.sh: no Python with torch found (set PYTHON=...)" >&2; exit 2
fi
export PYTHONUNBUFFERED=1
# 470 s: the run is sized for under 8 minutes; a hang must not hold the machine.
exec timeout --kill-after=10 470 "$py" bench/gpu.py "$@"
