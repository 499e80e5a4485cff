"""Shared helpers of the benchmarks: timing, the machine, and BENCHMARKS.md sections."""

from __future__ import annotations

import datetime
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BENCHMARKS = ROOT / "BENCHMARKS.md"
BUDGET_MS = 80.0


def time_ms(fn: Callable[[], object], repeat: int = 20, warmup: int = 3) -> float:
    """Median wall time of `fn` in ms."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1000)
    return statistics.median(samples)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"Python {platform.python_version()}")


def table(header: list[str], rows: list[list[object]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_section(title: str, body: str, command: str) -> None:
    """Replace (or append) the `## title` section of BENCHMARKS.md."""
    head = f"## {title}"
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else "# Benchmarks\n"
    section = (f"{head}\n\n{datetime.date.today().isoformat()} · {machine()}\n\n"
               f"Command: `{command}`\n\n{body.strip()}\n")
    pattern = re.compile(rf"^{re.escape(head)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(section + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    BENCHMARKS.write_text(text)
