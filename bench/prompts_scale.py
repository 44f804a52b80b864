"""The prompt stage at scale, read -> normalise -> write: `python -m bench.prompts_scale [--sizes 200000 2000000]`.

For each size, synthetic JSON-lines prompts (`--rows-per-file` rows per file; about 1% of the rows repeat an earlier
id, a few of them twice or more, 0.1% have a null id, and some ids look like ``ID#dup1``) go through

- **stream**: `pipeline.prompts.write_prompts`, the job's way: Ray tasks normalise, number and de-duplicate the rows
  and write Parquet files; the driver holds object references and row counts only;
- **gather** (for sizes up to `--gather-max`): `pipeline.prompts.load_prompts` gathers the normalised table on the
  driver, which writes it as one ``prompts.parquet``, the way earlier versions did.

Each run is its own driver process joined to one Ray instance (a fresh local one, or `--address`), so one run's heap
does not carry into the next. The figure that matters is the driver's **peak RSS increase**: the process's VmHWM
(peak resident set, from /proc/self/status) after the run, less its VmRSS before it, with the peak reset just
before the run by writing 5 to /proc/self/clear_refs; where that reset is refused, a thread sampling VmRSS every
10 ms gives the peak instead (the table says which). The driver first runs the same stage on 1,000 rows, so
imports and Ray's first tasks are not counted. Wall time is the stage alone (Ray's start-up excluded). The rows the
two ways wrote are compared, sorted by source_row, wherever both ran.

Prints a Markdown table and the ratios; figures, never assertions. Timings depend on the machine's load: the
header gives `uptime`'s load averages and the CPUs Ray has.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import table

WARMUP_ROWS = 1_000


# ---------------------------------------------------------------------------------------------------------------
# Synthetic prompts


def write_source(folder: Path, rows: int, per_file: int, seed: int = 0) -> Path:
    """`rows` prompts as JSON lines in `folder` (files of `per_file` rows): ids ``p<i>``; about 1% repeat an earlier
    id (some of those twice or more), 0.1% are null (error rows, themselves duplicates of each other), and every
    5,000th id is ``ID#dup1`` for an ID of the set, so the suffixes must skip it."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    colours = ["red", "green", "blue", "amber"]
    for start in range(0, rows, per_file):
        with open(folder / f"part-{start // per_file:04d}.jsonl", "w") as f:
            for i in range(start, min(rows, start + per_file)):
                r = rng.random()
                if i and r < 0.01:  # a repeat; one in five of an early id, so those come 3+ times
                    pid = f"p{rng.randrange(max(1, i // 100)) if r < 0.002 else rng.randrange(i)}"
                elif r < 0.011:
                    pid = None
                elif i % 5000 == 4999:
                    pid = f"p{rng.randrange(rows)}#dup1"
                else:
                    pid = f"p{i}"
                prompt = f"Write two sentences about item {i} and the colour {rng.choice(colours)}."
                f.write(json.dumps({"id": pid, "prompt": prompt}) + "\n")
    return folder


def job_config(source: Path, out: Path):
    from schemas.config import validate_config

    return validate_config({
        "name": "bench-prompts",
        "data": {"source": str(source), "prompt_column": "prompt", "id_column": "id", "limit": None},
        "models": {"target": "builtin:tiny-target", "reward": {"kind": "model", "path": "builtin:tiny-reward"}},
        "method": {"name": "best_of_n", "n": 2},
        "output": {"path": str(out)},
    })


# ---------------------------------------------------------------------------------------------------------------
# One run, in its own driver process


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class Peak:
    """The driver's peak RSS over a block: VmHWM reset through /proc/self/clear_refs, else a 10 ms VmRSS sampler."""

    def __enter__(self):
        self.method = "VmHWM"
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.method = "sampled VmRSS"
        self.before = _status_kb("VmRSS")
        self.sampled = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.01):
            self.sampled = max(self.sampled, _status_kb("VmRSS"))

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = _status_kb("VmHWM") if self.method == "VmHWM" else self.sampled
        self.increase_mb = (self.peak - self.before) / 1024


def stage(mode: str, source: Path, out: Path) -> int:
    import pyarrow.parquet as pq

    from pipeline.prompts import load_prompts, write_prompts

    cfg = job_config(source, out)
    if mode == "stream":
        return write_prompts(cfg, str(out / "prompts"), None)
    prompts = load_prompts(cfg)  # the earlier way: gathered on the driver, written as one prompts.parquet
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(prompts, str(out / "prompts.parquet"))
    return prompts.num_rows


def child(args) -> None:
    """Join Ray, warm up on a small source, run the stage once under `Peak`; one JSON line on stdout."""
    import ray

    ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    work = Path(args.work)
    stage(args.mode, Path(args.warmup), work / "warmup")
    with Peak() as peak:
        started = time.perf_counter()
        rows = stage(args.mode, Path(args.source), work / "run")
        seconds = time.perf_counter() - started
    print(json.dumps({"rows": rows, "seconds": seconds, "peak_mb": peak.increase_mb, "method": peak.method,
                      "rss_before_mb": peak.before / 1024}), flush=True)


def run_child(mode: str, address: str, source: Path, warmup: Path, work: Path) -> dict:
    work.mkdir(parents=True)
    cmd = [sys.executable, "-m", "bench.prompts_scale", "--child", mode, "--address", address, "--source",
           str(source), "--warmup", str(warmup), "--work", str(work)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          cwd=Path(__file__).resolve().parent.parent)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def same_rows(stream_folder: Path, gather_file: Path) -> bool:
    import pyarrow.parquet as pq

    from pipeline.prompts import INPUT_SCHEMA

    a = pq.read_table(stream_folder).cast(INPUT_SCHEMA).sort_by("source_row")
    b = pq.read_table(gather_file).cast(INPUT_SCHEMA).sort_by("source_row")
    return a.equals(b)


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[200_000, 2_000_000])
    p.add_argument("--gather-max", type=int, default=2_000_000,
                   help="largest size also run the old way (its driver holds the whole set)")
    p.add_argument("--rows-per-file", type=int, default=250_000)
    p.add_argument("--address", default="local",
                   help="Ray to join (default: start a fresh local one for the bench)")
    p.add_argument("--json", help="also write every figure to this file")
    p.add_argument("--child", choices=["stream", "gather"], help=argparse.SUPPRESS)
    p.add_argument("--source", help=argparse.SUPPRESS)
    p.add_argument("--warmup", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.mode = args.child
        child(args)
        return 0

    import ray

    ray.init(address=args.address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    address = ray.get_runtime_context().gcs_address
    cpus = ray.cluster_resources().get("CPU", 0)
    root = Path(tempfile.mkdtemp(prefix="prompts-scale-"))
    results: dict[str, dict] = {}
    try:
        warmup = write_source(root / "warmup", WARMUP_ROWS, WARMUP_ROWS, seed=1)
        for n in args.sizes:
            started = time.perf_counter()
            source = write_source(root / f"src-{n}", n, args.rows_per_file)
            print(f"{n} rows: source written in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
            modes = ["stream"] + (["gather"] if n <= args.gather_max else [])
            for mode in modes:
                r = run_child(mode, address, source, warmup, root / f"{mode}-{n}")
                r["rows/s"] = round(r["rows"] / r["seconds"])
                results[f"{mode} {n}"] = r
                print(f"  {mode}: {r}", file=sys.stderr, flush=True)
            if "gather" in modes:
                results[f"gather {n}"]["same rows"] = same_rows(root / f"stream-{n}" / "run" / "prompts",
                                                                root / f"gather-{n}" / "run" / "prompts.parquet")
            shutil.rmtree(source)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        ray.shutdown()

    load = os.getloadavg()
    print(f"\nRay: {cpus:g} CPUs; load averages (1, 5, 15 min) at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(table("Driver peak RSS increase (MB) and wall time of the prompt stage", results,
                ["rows", "seconds", "rows/s", "peak_mb", "rss_before_mb", "method", "same rows"], first="run"))
    sizes = [n for n in args.sizes if f"stream {n}" in results]
    lines = []
    if len(sizes) > 1:
        a, b = results[f"stream {sizes[0]}"], results[f"stream {sizes[-1]}"]
        lines.append(f"stream: {sizes[-1] / sizes[0]:g}x the rows -> driver peak "
                     f"x{b['peak_mb'] / max(a['peak_mb'], 0.1):.2f}, time x{b['seconds'] / a['seconds']:.2f}")
    for n in sizes:
        if f"gather {n}" in results:
            g, s = results[f"gather {n}"], results[f"stream {n}"]
            lines.append(f"{n} rows: gather/stream driver peak {g['peak_mb'] / max(s['peak_mb'], 0.1):.1f}x, "
                         f"time {g['seconds'] / s['seconds']:.2f}x")
    print("\n" + "\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
