"""PersonaPlex-7B at full size on the CPU: write the files, load them with the app's loader, tick.

Not a test: it takes minutes and needs about 18 GB of disk and 18 GB of free memory.

1. Writes a full-size hash-v1 checkpoint set in the official repository layout to a temporary
   folder (as a Hugging Face cache entry of nvidia/personaplex-7b-v1): `model.safetensors` (the
   bf16 LM, 475 keys), `tokenizer-e351c8d8-checkpoint125.safetensors` (the fp32 Mimi),
   `voices.tgz` (18 voices) and `tokenizer_spm_32k_3.model`, tensor by tensor, never holding a
   whole tensor, then drops the files from the page cache so that the load reads the disk.
2. Loads them with `build_runtime` (HF_HUB_OFFLINE=1: the Hub cache lookup, the checkpoint
   checks, the safetensors memory map and the assignment into meta-built modules) on the CPU in
   bf16, and reports the load time and the peak RSS during the load against the file sizes.
3. Runs a B = 2 engine with a short context: a fast prefill per slot, a few ticks, a recycle of
   slot 0 (prefix-cache hit) and a few more ticks; tick times, peak RSS, finite outputs.

With `--weights int8` the load quantizes the transformer layers' weights as it reads them
(docs/model.md § Int8 weights) and the section "Full-size model on the CPU: int8 weights" gets
the figures, beside the bf16 ones.

    python bench/fullsize_cpu.py [--ticks 4] [--context 8] [--weights int8] [--keep] [--no-write]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from bench.common import machine, md_table, replace_section
from personaplex_demo.engine.pcm import SamplingParams
from personaplex_demo.model.checkpoint import meta_lm, meta_mimi, write_hash_checkpoint
from personaplex_demo.model.config import LMConfig, MimiConfig, ModelFiles
from personaplex_demo.runtime.build import RuntimeOptions, build_runtime
from personaplex_demo.runtime.capacity import context_frames
from personaplex_demo.runtime.hub import DEFAULT_HF_REPO
from personaplex_demo.runtime.tiny import LM_SEED, MIMI_SEED, build_tiny_tokenizer, tiny_voice_prompts
from personaplex_demo.runtime.voices import write_voices_archive
from tests.support.int8 import weight_bytes

SECTION = "Full-size model on the CPU"
LOAD_NOTES = {
    "dense": ("- The loader maps the safetensors file and assigns its bf16 tensors to the meta-built modules without "
              "a copy, so the load itself touches little; the weight pages come in at their first use (the first "
              "prefill), from the disk (the files were dropped from the page cache after writing). The goal is a "
              "peak of at most 1.2 x the weights."),
    "int8": ("- `--weights int8`: the loader reads each tensor with plain reads into one reused buffer (no "
             "mapping left resident), quantizes the transformer layers' matrices as it goes and hands freed "
             "working memory back (`malloc_trim`), so the load reads the whole file and holds the int8 model "
             "({loaded:.2f} GB of LM weights and scales) plus one tensor at full precision. The "
             "bf16 run (section \"Full-size model on the CPU\") holds its weights as the mapped file instead; the "
             "goal here is a load whose peak is at most 0.6 of the bf16 weights in memory."),
}
GB = 1e9
PERSONA = "You enjoy having a good conversation."
REVISION = "0" * 40

log = logging.getLogger("bench.fullsize_cpu")


# ---- memory -------------------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakRSS:
    """Peak resident memory of this process over a `with` block: the kernel's high-water mark
    (VmHWM, reset through /proc/self/clear_refs) and, where that cannot be reset, a sampler."""

    def __enter__(self) -> PeakRSS:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.resettable = True
        except OSError:
            self.resettable = False
        self.sampled = _status_kb("VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.sampled = max(self.sampled, _status_kb("VmRSS"))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        hwm = _status_kb("VmHWM") if self.resettable else 0
        self.peak = 1024 * max(hwm, self.sampled, _status_kb("VmRSS"))
        self.after = 1024 * _status_kb("VmRSS")


# ---- the files ----------------------------------------------------------------------------------


def drop_from_page_cache(path: Path) -> None:
    """Evict this file's pages (only its own), so that the load measures a read from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_repo(cache: Path) -> tuple[Path, dict[str, float]]:
    """The four official files as a Hub cache snapshot; returns (snapshot folder, seconds per file)."""
    repo = cache / ("models--" + DEFAULT_HF_REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    files = ModelFiles()
    took = {}
    t0 = time.perf_counter()
    write_hash_checkpoint(meta_lm(LMConfig()), snapshot / files.lm, "lm", LM_SEED, torch.bfloat16)
    took["lm"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_hash_checkpoint(meta_mimi(MimiConfig()), snapshot / files.mimi, "mimi", MIMI_SEED)
    took["mimi"] = time.perf_counter() - t0
    build_tiny_tokenizer(snapshot / files.tokenizer)
    write_voices_archive(snapshot / files.voices, tiny_voice_prompts(LMConfig().dim))
    for name in (files.lm, files.mimi):
        drop_from_page_cache(snapshot / name)
    return snapshot, took


# ---- the run ------------------------------------------------------------------------------------


def tick_phase(engine, rng: np.random.Generator, n: int, live: list[int]) -> tuple[list[float], bool]:
    """`n` engine ticks with noise on the live rows; (seconds per tick, every output finite and sane)."""
    times, sane = [], True
    for _ in range(n):
        pcm = np.zeros((engine.batch_size, 1920), np.float32)
        pcm[live] = 0.1 * rng.standard_normal((len(live), 1920)).astype(np.float32)
        t0 = time.perf_counter()
        out = engine.step(pcm)
        times.append(time.perf_counter() - t0)
        tokens = out.tokens[live]
        sane &= bool(np.isfinite(out.pcm).all() and (tokens >= 0).all() and (tokens[:, 1:] <= 2048).all()
                     and out.live[live].all())
    return times, sane


def run(args: argparse.Namespace, workdir: Path) -> dict:
    res: dict = {}
    print(f"writing the checkpoint to {workdir} ...", flush=True)
    snapshot, res["write_s"] = write_repo(workdir)
    files = ModelFiles()
    res["lm_bytes"] = (snapshot / files.lm).stat().st_size
    res["mimi_bytes"] = (snapshot / files.mimi).stat().st_size
    res["voices_bytes"] = (snapshot / files.voices).stat().st_size
    print(f"  LM {res['lm_bytes'] / GB:.2f} GB in {res['write_s']['lm']:.0f} s, Mimi {res['mimi_bytes'] / GB:.3f} GB "
          f"in {res['write_s']['mimi']:.0f} s", flush=True)
    weights = res["lm_bytes"] + res["mimi_bytes"]
    available = mem_available()
    if available < weights + 1.5 * GB:
        raise SystemExit(f"only {available / GB:.1f} GB of memory is available and the weights are "
                         f"{weights / GB:.1f} GB: not loading (other processes would be pushed out)")

    os.environ["HF_HUB_OFFLINE"] = "1"
    phases: dict[str, float] = {}
    t_start = time.perf_counter()
    options = RuntimeOptions(model="personaplex-7b-v1", device="cpu", dtype="bfloat16", weights=args.weights,
                             slots=2, cache_dir=workdir,
                             context=context_frames(args.context, LMConfig().context))
    res["rss_before"] = 1024 * _status_kb("VmRSS")
    with PeakRSS() as load_mem:
        runtime = build_runtime(options, lambda message, _: phases.setdefault(message, time.perf_counter()))
    res["load_s"] = time.perf_counter() - t_start
    res["lm_load_s"] = phases["loading the Mimi codec"] - phases["loading the language model"]
    res["load_peak"], res["load_after"] = load_mem.peak, load_mem.after
    res["weights_bytes"] = weights
    engine = runtime.engine
    lm = engine.core.lm
    res["mapped"] = all(not p.is_meta for p in lm.parameters())
    res["dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for p in [*lm.parameters(), *lm.buffers()]})
    res["params"] = sum(t.numel() for k, t in lm.state_dict().items() if not k.endswith("scales"))
    res["lm_bytes_loaded"] = weight_bytes(lm)
    print(f"loaded in {res['load_s']:.1f} s (LM {res['lm_load_s']:.1f} s); peak RSS during the load "
          f"{load_mem.peak / GB:.2f} GB", flush=True)

    rng = np.random.default_rng(0)
    voices = engine.voice_names
    with PeakRSS() as run_mem:
        t0 = time.perf_counter()
        engine.start_session(0, voices[0], PERSONA, SamplingParams(seed=1))
        res["prefill0_s"] = time.perf_counter() - t0
        print(f"slot 0: fast prefill in {res['prefill0_s']:.1f} s (first touch of the weights)", flush=True)
        first, ok1 = tick_phase(engine, rng, args.ticks, [0])
        t0 = time.perf_counter()
        engine.start_session(1, voices[1], PERSONA, SamplingParams(seed=2))
        res["prefill1_s"] = time.perf_counter() - t0
        both, ok2 = tick_phase(engine, rng, args.ticks, [0, 1])
        t0 = time.perf_counter()
        engine.end_session(0)
        engine.start_session(0, voices[0], PERSONA, SamplingParams(seed=3))  # recycle: a prefix-cache hit
        res["recycle_s"] = time.perf_counter() - t0
        after, ok3 = tick_phase(engine, rng, args.ticks, [0, 1])
    res.update(first=first, both=both, after=after, sane=ok1 and ok2 and ok3, run_peak=run_mem.peak,
               stats=engine.core.prefixes.stats, context_frames=engine.core.context,
               voice_t=engine.voices.load(voices[0]).length)
    print(f"ticks (s): one live {np.round(first, 2).tolist()}, two live {np.round(both, 2).tolist()}, after the "
          f"recycle {np.round(after, 2).tolist()}; outputs sane: {res['sane']}", flush=True)
    return res


def render(res: dict, args: argparse.Namespace) -> str:
    w = res["weights_bytes"]
    med = lambda xs: float(np.median(xs))  # noqa: E731
    rows = [
        ["write: LM (bf16, streamed, hash-v1)", f"{res['write_s']['lm']:.0f} s", f"{res['lm_bytes'] / GB:.2f} GB"],
        ["write: Mimi (fp32)", f"{res['write_s']['mimi']:.0f} s", f"{res['mimi_bytes'] / GB:.3f} GB"],
        ["load: `build_runtime` (Hub cache lookup, checks, map, assign, engine)", f"{res['load_s']:.1f} s",
         f"peak RSS {res['load_peak'] / GB:.2f} GB = {res['load_peak'] / w:.2f} x the weights "
         f"({w / GB:.2f} GB); {res['rss_before'] / GB:.2f} GB before, {res['load_after'] / GB:.2f} GB after"],
        ["&nbsp;&nbsp;of which the LM file", f"{res['lm_load_s']:.1f} s", ""],
        ["fast prefill, slot 0 (first use of every weight page)", f"{res['prefill0_s']:.1f} s", ""],
        [f"tick, B = 2, one slot live (median of {len(res['first'])})", f"{med(res['first']):.2f} s",
         f"{med(res['first']) / 0.08:.0f} x the 80 ms budget"],
        ["fast prefill, slot 1 (another voice)", f"{res['prefill1_s']:.1f} s", ""],
        [f"tick, B = 2, both live (median of {len(res['both'])})", f"{med(res['both']):.2f} s", ""],
        ["recycle slot 0 (prefix-cache hit)", f"{res['recycle_s'] * 1000:.0f} ms", ""],
        [f"tick after the recycle (median of {len(res['after'])})", f"{med(res['after']):.2f} s", ""],
        ["peak RSS from the first prefill to the last tick", "",
         f"{res['run_peak'] / GB:.2f} GB = {res['run_peak'] / w:.2f} x the weights"],
    ]
    s = res["stats"]
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()[:10]
    return (md_table(["step", "time", "memory"], rows)
            + f"\n\n- LM {res['params'] / 1e9:.2f} B parameters, {', '.join(res['dtypes'])}, all assigned from the "
              f"file (no meta tensor left: {res['mapped']}); files in the official names and key layout.\n"
            + f"- Engine: B = 2, `--context {args.context:g}` ({res['context_frames']} frames, to keep the KV small "
              f"beside the weights), voice T = {res['voice_t']}, persona \"{PERSONA}\"; prefills {s.prefills}, "
              f"prefix-cache hits {s.hits}. Every output finite, tokens in range and both rows live: "
              f"**{'yes' if res['sane'] else 'NO'}**.\n"
            + (LOAD_NOTES[args.weights].format(loaded=res["lm_bytes_loaded"] / GB) + "\n")
            + "- Machine (`lscpu | head`):\n\n```\n" + "\n".join(lscpu) + "\n```")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ticks", type=int, default=4, help="ticks per phase (three phases)")
    ap.add_argument("--context", type=float, default=8.0, help="--context of the engine, seconds")
    ap.add_argument("--tmp", type=Path, default=None, help="where the temporary folder goes")
    ap.add_argument("--keep", action="store_true", help="keep the written files (their folder is printed)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    ap.add_argument("--weights", choices=("dense", "int8"), default="dense", help="the LM's weights (`--weights`)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    need = 18 * GB
    free = shutil.disk_usage(a.tmp or tempfile.gettempdir()).free
    if free < need:
        print(f"bench/fullsize_cpu.py: {free / GB:.0f} GB free on the disk, {need / GB:.0f} GB needed", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="pp-fullsize-", dir=a.tmp))
    try:
        res = run(a, workdir)
    finally:
        if a.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    body = render(res, a)
    print("\n" + body)
    if not a.no_write:
        replace_section(SECTION if a.weights == "dense" else f"{SECTION}: int8 weights", body, info=machine())
    return 0


if __name__ == "__main__":
    sys.exit(main())
