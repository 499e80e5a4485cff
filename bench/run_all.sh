#!/usr/bin/env bash
# Runs the CPU benchmarks and rewrites their sections of BENCHMARKS.md.
#
#   bash bench/run_all.sh [--quick] [--skip-pool]
#
# bench/model.py times the reference (PyPI moshi==0.2.13) beside ours when an interpreter that
# has both is found: $REF_PYTHON, or /tmp/moshi-venv/bin/python (how to make it: BENCHMARKS.md,
# "Model: Mimi and LM step"). Everything else runs with $PYTHON or .venv/bin/python.
# The GPU benchmark is separate (bash bench/gpu.sh); here it only runs as a dry run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

quick=()
pool_args=()
pool=1
for arg in "$@"; do
    case "$arg" in
        --quick) quick=(--quick); pool_args=(--seconds 5 --slots 1,4) ;;
        --skip-pool) pool=0 ;;
        *) echo "usage: bash bench/run_all.sh [--quick] [--skip-pool]" >&2; exit 2 ;;
    esac
done

py=${PYTHON:-.venv/bin/python}
[[ -x "$py" ]] || py=python3
ref_py=${REF_PYTHON:-/tmp/moshi-venv/bin/python}
export NO_TORCH_COMPILE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export BENCH_WRAPPER="bash bench/run_all.sh${*:+ $*}"
if [[ -x "$ref_py" ]] && "$ref_py" -c 'import moshi, personaplex_demo' >/dev/null 2>&1; then
    model_py=$ref_py
else
    echo "reference: not installed (see BENCHMARKS.md for how); bench/model.py times ours alone"
    model_py=$py
fi

echo "== bench/model.py ($model_py)"
"$model_py" bench/model.py "${quick[@]}"
echo "== bench/engine.py"
"$py" bench/engine.py "${quick[@]}"
echo "== bench/ops.py (operators per engine tick at the real layer counts)"
"$py" bench/ops.py
echo "== bench/prefill_gap.py (callers arriving together: prefills between ticks)"
"$py" bench/prefill_gap.py
if [[ $pool == 1 && -f bench/pool.py ]]; then
    echo "== bench/pool.py"
    "$py" bench/pool.py "${pool_args[@]}"
fi
if [[ $pool == 1 ]]; then
    echo "== bench/media.py (real WebRTC callers against the launched app)"
    if [[ ${#quick[@]} -gt 0 ]]; then media_args=(--callers 1 4 --seconds 10); else media_args=(--engine-only); fi
    "$py" bench/media.py "${media_args[@]}" --write
fi
if [[ $pool == 1 ]]; then
    echo "== bench/admission.py (twelve real WebRTC callers in twelve slots: admission by headroom and by slots)"
    if [[ ${#quick[@]} -gt 0 ]]; then admission_args=(--seconds 10); else admission_args=(); fi
    "$py" bench/admission.py "${admission_args[@]}" --write
fi
echo "== bench/input_delay.py (a caller's sound through WebRTC into the server, loopback)"
if [[ ${#quick[@]} -gt 0 ]]; then delay_args=(--seconds 5 --rounds 1); else delay_args=(); fi
"$py" bench/input_delay.py "${delay_args[@]}" --write
echo "== bench/realtime.py (the Realtime API beside the page: first audio, audio per second, frame latency)"
if [[ ${#quick[@]} -gt 0 ]]; then realtime_args=(--rounds 2 --seconds 5); else realtime_args=(); fi
"$py" bench/realtime.py "${realtime_args[@]}" --write
echo "== bench/echo.py (the speaker-echo check's cost per call)"
"$py" bench/echo.py --write
echo "== bench/browser_call.py (time to first audio and the round trip, in Chromium)"
if [[ ${#quick[@]} -gt 0 ]]; then browser_args=(--runs 1 --seconds 8); else browser_args=(); fi
"$py" bench/browser_call.py "${browser_args[@]}" --write
echo "== bench/visitors.py (page loads and idle tabs beside two live callers)"
if [[ ${#quick[@]} -gt 0 ]]; then visitor_args=(--tabs 40 --loads 60 --seconds 10); else visitor_args=(); fi
"$py" bench/visitors.py "${visitor_args[@]}" --write
echo "== bench/int8.py (int8 weights against fp32: memory, error, CPU speed)"
"$py" bench/int8.py "${quick[@]}"
echo "== bench/gradio_events.py"
"$py" bench/gradio_events.py --write
echo "== bench/gpu.py --dry-run (the GPU benchmark's code path on the tiny configs)"
"$py" bench/gpu.py --dry-run > /dev/null && echo "gpu dry run: ok"
