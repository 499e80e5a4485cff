"""Shared pieces of the benchmarks: timing, statistics, the machine, markdown and BENCHMARKS.md.

Timing is interleaved: every case runs a few calls per round and the cases take turns, so a
neighbour process that loads the CPU for a while slows every case alike instead of one of them.
Results are medians over all calls; p99 is only meaningful with many calls (n is reported).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import platform
import re
import shlex
import socket
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = REPO / "BENCHMARKS.md"
FRAME_MS = 80.0  # one tick = one 80 ms audio frame (1920 samples at 24 kHz)
REFERENCE_MISSING = "reference: not installed (see BENCHMARKS.md for how)"


# ---- a launched app on loopback (the benchmarks' and the end-to-end tests') ---------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 3.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


# ---- statistics ---------------------------------------------------------------------------------


@dataclass
class Stats:
    """Per-call wall times of one case, in seconds."""

    samples: list[float] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.samples)

    def pct(self, q: float) -> float:
        return float(np.percentile(self.samples, q)) if self.samples else float("nan")

    @property
    def median(self) -> float:
        return self.pct(50)

    @property
    def p50(self) -> float:
        return self.pct(50)

    @property
    def p99(self) -> float:
        return self.pct(99)

    @property
    def min(self) -> float:
        return min(self.samples) if self.samples else float("nan")

    def ms(self, q: float = 50) -> float:
        return 1000.0 * self.pct(q)

    def budget(self, frames: float = 1.0) -> float:
        """Median as a fraction of `frames` x 80 ms."""
        return self.ms() / (FRAME_MS * frames)


def time_call(fn: Callable[[], object], sync: Callable[[], None] | None = None) -> float:
    t0 = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - t0


def measure(fn: Callable[[], object], warmup: int = 2, reps: int = 10, max_seconds: float | None = None,
            min_reps: int = 3, sync: Callable[[], None] | None = None) -> Stats:
    """Warm up, then time `reps` calls (fewer, but at least `min_reps`, past `max_seconds`)."""
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    st = Stats()
    start = time.perf_counter()
    for i in range(reps):
        st.samples.append(time_call(fn, sync))
        if max_seconds is not None and i + 1 >= min_reps and time.perf_counter() - start > max_seconds:
            break
    return st


def interleave(cases: dict[str, Callable[[], object]], rounds: int = 5, per_round: int = 3, warmup: int = 2,
               max_seconds: float | None = None, min_rounds: int = 2,
               sync: Callable[[], None] | None = None) -> dict[str, Stats]:
    """Time several cases in turns: each round runs `per_round` calls of every case, the order
    rotating between rounds. Stops after `rounds`, or after `max_seconds` once `min_rounds` are done."""
    names = list(cases)
    for name in names:
        for _ in range(warmup):
            cases[name]()
    if sync is not None:
        sync()
    out = {name: Stats() for name in names}
    start = time.perf_counter()
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            for _ in range(per_round):
                out[name].samples.append(time_call(cases[name], sync))
        if max_seconds is not None and r + 1 >= min_rounds and time.perf_counter() - start > max_seconds:
            break
    return out


# ---- the machine --------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def loadavg() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine(device: str = "cpu") -> dict[str, str]:
    import torch

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cores": f"{usable_cores()} usable of {os.cpu_count()}",
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "load": loadavg(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"
    return info


def machine_line(info: dict[str, str]) -> str:
    parts = [f"{info['cpu']} ({info['cores']} cores, {info['threads']} torch threads)"]
    if "gpu" in info:
        parts.insert(0, info["gpu"])
    parts += [info["platform"], f"Python {info['python']}", f"torch {info['torch']}"]
    return "; ".join(parts)


class LoadWatch:
    """CPU load while a benchmark runs: the load average, and how much of the machine this
    process got (its CPU time over wall time x cores) versus what was busy in total."""

    def __init__(self) -> None:
        self.start_load = loadavg()
        self._wall = time.perf_counter()
        self._cpu = time.process_time()
        self._stat = _proc_stat()

    def summary(self) -> str:
        wall = time.perf_counter() - self._wall
        mine = (time.process_time() - self._cpu) / max(wall, 1e-9)
        text = f"load average {self.start_load} at the start, {loadavg()} at the end"
        stat = _proc_stat()
        if self._stat and stat:
            busy = (stat[0] - self._stat[0]) / max(stat[1] - self._stat[1], 1)
            others = max(0.0, busy * usable_cores() - mine)
            text += f"; whole machine {100 * busy:.0f}% busy, of which other processes ~{others:.1f} cores"
        return text


def _proc_stat() -> tuple[int, int] | None:
    try:
        fields_ = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields_[3] + (fields_[4] if len(fields_) > 4 else 0)
    total = sum(fields_[:8])
    return total - idle, total


# ---- markdown -----------------------------------------------------------------------------------


def fmt_ms(seconds: float) -> str:
    ms = 1000.0 * seconds
    if ms != ms:
        return "n/a"
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def fmt_frac(x: float) -> str:
    return "n/a" if x != x else f"{x:.2f}"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line() -> str:
    """The command that produced a section, as typed from the repository root: the interpreter
    (relative when it lives in the repository), the script and its arguments."""
    exe = Path(sys.executable)
    try:
        python = str(exe.relative_to(REPO)) if exe.is_relative_to(REPO) else str(exe)
    except ValueError:
        python = str(exe)
    argv = list(sys.argv)
    if argv and argv[0].endswith(".py"):
        try:
            argv[0] = os.path.relpath(os.path.abspath(argv[0]), REPO)
        except ValueError:
            pass
    return shlex.join([python, *argv])


_HEADER = """# Benchmarks

Every section below is regenerated by the script named in it (`bash bench/run_all.sh` for the CPU
ones, `bash bench/gpu.sh` on a CUDA machine). Times are medians of interleaved runs; "budget" is
the median over the 80 ms that one tick (one audio frame) may take in real time.
"""


def publish(section: str, body: str, write: bool) -> None:
    """Print a benchmark's section; with `write`, put it into BENCHMARKS.md with the command and
    the machine."""
    print(body)
    if write:
        replace_section(section, body, command=command_line(), info=machine())
        logging.getLogger("bench").info("wrote BENCHMARKS.md § %s (%s)", section, machine_line(machine()))


def replace_section(title: str, body: str, command: str | None = None, info: dict[str, str] | None = None,
                    path: Path = BENCHMARKS_MD, extra: str | None = None) -> None:
    """Replace (or append) the `## {title}` section of BENCHMARKS.md, keeping every other section.

    The section starts with when, where and how it was measured."""
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    info = info or machine()
    wrapper = os.environ.get("BENCH_WRAPPER") if command is None else None
    meta = [f"- Measured {stamp} on {machine_line(info)}.",
            f"- Command: `{command or command_line()}`" + (f" (run by `{wrapper}`)" if wrapper else "")]
    if extra:
        meta.append(f"- {extra}")
    section = f"## {title}\n\n" + "\n".join(meta) + "\n\n" + body.strip() + "\n"
    text = path.read_text() if path.exists() else _HEADER
    text = _splice(text, title, section)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _splice(text: str, title: str, section: str) -> str:
    # A section runs from its "## " heading to the next "## " heading (### stays inside).
    pattern = re.compile(rf"^## {re.escape(title)}[ \t]*\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        return pattern.sub(lambda _: section.rstrip("\n") + "\n\n", text, count=1).rstrip("\n") + "\n"
    return text.rstrip("\n") + "\n\n" + section


# ---- the reference ------------------------------------------------------------------------------


def import_reference():
    """`moshi` (PyPI 0.2.13) if it is installed next to the project, else None (with a message)."""
    os.environ.setdefault("NO_TORCH_COMPILE", "1")
    try:
        import moshi  # noqa: F401
        from moshi.models import lm, loaders  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        print(REFERENCE_MISSING + (f" [{type(e).__name__}: {e}]" if not isinstance(e, ModuleNotFoundError) else ""))
        return None
    return moshi


def reference_version(mod) -> str:
    return getattr(mod, "__version__", "?") if mod is not None else "not installed"
