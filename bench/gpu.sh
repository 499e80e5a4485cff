#!/usr/bin/env bash
# Full-size engine benchmark on one CUDA GPU (hash-v1 weights, bf16). Writes BENCHMARKS.md's "## GPU".
set -euo pipefail
cd "$(dirname "$0")"
timeout 470 python gpu.py "$@"
