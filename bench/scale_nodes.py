"""A generate job over simulated nodes, one lost and one added mid-run: `python -m bench.scale_nodes [--prompts 5000]`.

Three runs of one job (the tiny target, Best-of-4, 16 new tokens, the logprob reward, 64 prompts per call,
`--prompts` synthetic prompts), each on a Ray cluster of its own made by `ray.cluster_utils.Cluster`: real raylets
and actors, all on this machine. The head has no CPUs (the driver and Ray's services run there; no actor fits it).

- **one node**: the head and one 1-CPU worker node, `resources.actors: 1`: the clean run, and the baseline;
- **3 nodes**: the head and three 1-CPU worker nodes, `resources.actors: {min: 4, max: 5}` (one actor more than
  the nodes hold: it waits for room), `max_retries: 2`;
- **3 nodes, one lost, one added**: the same, and a fourth worker node joins as the first batch runs (`--add-at`);
  at `--lose-at` of the prompts committed, once the added node has run a batch (at 0.8 whatever it ran), one of the
  first three is lost (`--lose kill`: all its processes SIGKILLed, as a machine that dies; `--lose drain`: its
  raylet told to stop, as a node the cloud takes back with notice). A run that fails on the loss (Ray can spend a
  batch's retries before it declares a killed node dead; docs/cluster.md) is run again, as a user would, and
  resumes.

Each run's driver is its own process (`--driver`), joined to the cluster, running `pipeline.job`'s steps; it samples
its own RSS every 0.5 s. Figures, never assertions:

- every prompt exactly once in each multi-node run, and its rows against the one-node run's (texts, token counts,
  finish reasons and best candidates equal; rewards within float32 rounding, as batches may group differently after
  a loss);
- the driver's RSS: after connecting, its peak, and at the end;
- throughput: prompts per wall-second of the generation step (`pipeline.job.execute`), and prompts per CPU-second of
  the whole simulated cluster (every process of it, the driver included, sampled once a second by psutil: on a
  2-core machine three nodes add no cores, so the CPU-seconds say what distributing the work costs), each as a
  ratio to the one-node run's;
- which nodes ran batches (the `_inflight/` records, polled every 0.2 s): the added node's count says it took work.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import table, write_json
from pipeline.faults import inflight_records
from runfolder.folder import RunFolder

ROOT = Path(__file__).resolve().parent.parent
THINGS = ["river", "lamp", "garden", "train", "violin", "market", "winter", "harbor", "kitchen", "mountain", "letter",
          "bridge", "forest", "clock", "island", "bakery"]


def write_prompts(path: Path, rows: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": f"s{i:06d}", "prompt": f"Write one short sentence about the "
                                f"{rng.choice(THINGS)} and the number {i}."}) + "\n")
    return path


def job(source: Path, out: Path, args, workers, max_retries: int) -> dict:
    return {
        "name": "scale-nodes", "seed": 0,
        "data": {"source": str(source), "prompt_column": "prompt", "id_column": "id"},
        "models": {"target": "builtin:tiny-target", "reward": {"kind": "logprob"}},
        "method": {"name": "best_of_n", "n": args.n},
        "generation": {"max_new_tokens": args.max_new_tokens},
        "output": {"path": str(out)},
        "resources": {"actors": workers, "prompts_per_call": args.prompts_per_batch, "max_retries": max_retries},
    }


# ---------------------------------------------------------------------------------------------------------------
# The driver, in its own process


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def driver(config_file: str, report: str) -> int:
    """`pipeline.job`'s steps for one config, joined to RAY_ADDRESS; a JSON report of the outcome and the RSS."""
    import resource

    from pipeline import job as pjob
    from pipeline.cluster import check_room
    from pipeline.raydata import set_verbose
    from schemas.config import validate_config

    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    start = time.monotonic()

    def sample():
        while not stop.wait(0.5):
            samples.append((time.monotonic() - start, _rss_mb()))

    threading.Thread(target=sample, daemon=True).start()
    config = validate_config(json.loads(Path(config_file).read_text()))
    set_verbose(False)
    plan = pjob.check(config, overwrite=False)
    print(pjob.connect(), flush=True)
    check_room(config)
    connected_mb = _rss_mb()
    staged = None if plan.reuses_prompts else pjob.stage_prompts(plan)
    t0 = time.monotonic()
    outcome = pjob.execute(plan, staged)
    seconds = time.monotonic() - t0
    stop.set()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    Path(report).write_text(json.dumps({
        "status": outcome.status, "error": outcome.error, "new_rows": outcome.new_rows, "seconds": seconds,
        "connected_mb": connected_mb, "end_mb": _rss_mb(), "samples": samples, "exec_from": t0 - start,
        "driver_cpu_s": usage.ru_utime + usage.ru_stime,
    }))
    return 0 if outcome.status == "succeeded" else 1


# ---------------------------------------------------------------------------------------------------------------
# The simulated cluster and the orchestration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CpuMeter:
    """CPU-seconds of every descendant process of this one (the cluster's and the driver's), sampled every second;
    a process keeps its last sample once it is gone."""

    def __init__(self):
        import psutil

        self.me = psutil.Process()
        self.seen: dict[tuple[int, float], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(1.0):
            self.sample()

    def sample(self):
        import psutil

        for p in self.me.children(recursive=True):
            try:
                t = p.cpu_times()
                self.seen[(p.pid, p.create_time())] = t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.sample()
        self._stop.set()
        self._thread.join()

    @property
    def seconds(self) -> float:
        return sum(self.seen.values())


def committed(run: Path) -> int:
    ckpt = run / "_checkpoint"
    if not ckpt.exists():
        return 0
    import pyarrow.parquet as pq

    total = 0
    for p in ckpt.glob("*.parquet"):
        if not p.name.endswith(".pending.parquet"):
            try:
                total += pq.read_metadata(p).num_rows
            except Exception:  # noqa: BLE001 - being written: counted at the next look
                pass
    return total


def run_scenario(name: str, args, root: Path, source: Path, nodes: int, workers, max_retries: int,
                 events: bool) -> dict:
    """One cluster, one job (run again if it fails), the events at their marks; the figures."""
    from ray.cluster_utils import Cluster

    out = root / name / "run"
    cfg_file = root / name / "job.json"
    cfg_file.parent.mkdir(parents=True)
    cfg_file.write_text(json.dumps(job(source, out, args, workers, max_retries)))
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "dashboard_port": _free_port(),
        "dashboard_agent_listen_port": _free_port(), "metrics_export_port": _free_port(),
        "runtime_env_agent_port": _free_port(), "ray_client_server_port": _free_port()})
    result: dict = {"nodes at start": nodes, "attempts": 0, "events": []}
    batches: dict[str, set] = collections.defaultdict(set)
    try:
        first = [cluster.add_node(num_cpus=1) for _ in range(nodes)]
        cluster.wait_for_nodes()
        names = {n.node_id: f"node {i + 1}" for i, n in enumerate(first)}
        env = {**os.environ, "RAY_ADDRESS": cluster.address}
        added = lost = None
        started = time.monotonic()
        with CpuMeter() as cpu:
            reports = []
            while True:
                result["attempts"] += 1
                report = root / name / f"driver-{result['attempts']}.json"
                log = open(root / name / f"driver-{result['attempts']}.log", "w")
                proc = subprocess.Popen([sys.executable, "-m", "bench.scale_nodes", "--driver", str(cfg_file),
                                         "--report", str(report)], cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT)
                while proc.poll() is None:
                    done = committed(out)
                    for rec in inflight_records(RunFolder(str(out))):
                        batches[rec.get("node_id")].add((rec.get("pid"), rec.get("started_at"), rec.get("first")))
                    if events and added is None and batches and done >= args.add_at * args.prompts:
                        added = cluster.add_node(num_cpus=1)
                        names[added.node_id] = "added node"
                        result["events"].append(f"{time.monotonic() - started:.0f} s: a node joined ({done} rows "
                                                "committed)")
                    took = added is not None and bool(batches.get(added.node_id))
                    if events and added is not None and lost is None and (
                            (done >= args.lose_at * args.prompts and took) or done >= 0.8 * args.prompts):
                        lost = first[0]
                        cluster.remove_node(lost, allow_graceful=args.lose == "drain")
                        result["events"].append(f"{time.monotonic() - started:.0f} s: node 1 lost ({args.lose}; "
                                                f"{done} rows committed)")
                    time.sleep(0.2)
                log.close()
                reports.append(json.loads(report.read_text()) if report.exists() else {"status": "crashed"})
                if proc.returncode == 0 or result["attempts"] >= 3:
                    break
                result["events"].append(f"{time.monotonic() - started:.0f} s: the run ended "
                                        f"{reports[-1].get('status')}: {str(reports[-1].get('error'))[:160]}; "
                                        "run again (resume)")
        result["cpu_s"] = cpu.seconds
        result["wall_s"] = time.monotonic() - started
    finally:
        cluster.shutdown()
    last = reports[-1]
    result["status"] = last.get("status")
    result["generation_s"] = sum(r.get("seconds", 0.0) for r in reports)
    rss = [mb for r in reports for _, mb in r.get("samples", [])]
    result["driver_connected_mb"] = reports[0].get("connected_mb")
    result["driver_peak_mb"] = max(rss) if rss else None
    result["driver_end_mb"] = last.get("end_mb")
    result["driver_cpu_s"] = sum(r.get("driver_cpu_s", 0.0) for r in reports)
    tail = [mb for t, mb in last.get("samples", []) if t >= last.get("exec_from", 0)]
    if len(tail) >= 4:  # the generation step's RSS, first and last quarter: flat when these agree
        q = max(1, len(tail) // 4)
        result["driver_gen_first_q_mb"] = sum(tail[:q]) / q
        result["driver_gen_last_q_mb"] = sum(tail[-q:]) / q
    result["batches by node"] = {names.get(k, str(k)[:8]): len(v) for k, v in batches.items()}
    result["rows_dir"] = str(out)
    return result


def compare(nodes_run: str, one_run: str, prompts: int) -> dict:
    """Exactly once, and the nodes run's rows against the one-node run's."""
    import pyarrow.dataset as pads

    def rows(run):
        return pads.dataset(str(Path(run) / "candidates"), format="parquet").to_table(
            columns=["prompt_id", "candidates", "best_index", "best_text", "best_reward", "error"]).to_pylist()

    got, want = rows(nodes_run), {r["prompt_id"]: r for r in rows(one_run)}
    counts = collections.Counter(r["prompt_id"] for r in got)
    same = close = 0
    for r in got:
        w = want.get(r["prompt_id"])
        if w is None:
            continue
        key = [(c["text"], c["num_tokens"], c["finish_reason"]) for c in r["candidates"]]
        if key == [(c["text"], c["num_tokens"], c["finish_reason"]) for c in w["candidates"]] and \
                (r["best_index"], r["best_text"], r["error"]) == (w["best_index"], w["best_text"], w["error"]):
            same += 1
            a, b = r["best_reward"], w["best_reward"]
            close += a == b or (a is not None and b is not None and math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6))
    return {"prompts": prompts, "rows": len(got), "distinct": len(counts),
            "written twice or more": sum(1 for c in counts.values() if c > 1),
            "missing": prompts - len(counts), "same texts as one node": same, "rewards within 1e-5": close}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=5000)
    p.add_argument("--n", type=int, default=4, help="method.n (Best-of-n)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--prompts-per-batch", type=int, default=64)
    p.add_argument("--nodes", type=int, default=3, help="worker nodes of the multi-node runs at their start")
    p.add_argument("--add-at", type=float, default=0.0,
                   help="share of the prompts committed when a node joins, once a batch runs (0: at the first batch)")
    p.add_argument("--lose-at", type=float, default=0.5,
                   help="share committed when a first node is lost, once the added node has run a batch (at 0.8 "
                   "whatever it ran)")
    p.add_argument("--lose", choices=["kill", "drain"], default="kill")
    p.add_argument("--keep", help="keep the run folders here (default: a temporary folder, removed)")
    p.add_argument("--json", help="also write every figure to this file")
    p.add_argument("--driver", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.driver:
        return driver(args.driver, args.report)

    # A private Ray temp dir: no other Ray client on this machine finds these clusters, nor they another's
    temp = tempfile.mkdtemp(prefix="wsn", dir="/tmp")
    os.environ["RAY_TMPDIR"] = temp
    os.environ.pop("RAY_ADDRESS", None)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="scale-nodes-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    try:
        source = write_prompts(root / "prompts.jsonl", args.prompts)
        pool = {"min": args.nodes + 1, "max": args.nodes + 2}  # one actor more than the nodes hold: it waits for room
        scenarios = [("one node", 1, 1, 0, False), (f"{args.nodes} nodes", args.nodes, pool, 2, False),
                     (f"{args.nodes} nodes, one lost, one added", args.nodes, pool, 2, True)]
        for label, nodes, workers, retries, events in scenarios:
            results[label] = run_scenario(label.replace(" ", "-").replace(",", ""), args, root, source, nodes,
                                          workers, retries, events=events)
            print(f"{label}: {results[label]}", file=sys.stderr, flush=True)
        checks = {label: compare(results[label]["rows_dir"], results["one node"]["rows_dir"], args.prompts)
                  for label, *_ in scenarios[1:]}
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(temp, ignore_errors=True)

    load = os.getloadavg()
    one = results["one node"]
    for r in results.values():
        r["prompts/s"] = args.prompts / r["generation_s"]
        r["prompts/cpu-s"] = args.prompts / r["cpu_s"]
        r["x one node (prompts/s)"] = r["prompts/s"] / one["prompts/s"]
        r["x one node (prompts/cpu-s)"] = r["prompts/cpu-s"] / one["prompts/cpu-s"]
    print(f"\n{args.prompts} prompts, Best-of-{args.n}, {args.max_new_tokens} new tokens, logprob reward, "
          f"{args.prompts_per_batch} prompts per call; {os.cpu_count()} CPUs; load averages (1, 5, 15 min) at the end: "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(table("Runs", results, ["nodes at start", "attempts", "status", "generation_s", "wall_s", "cpu_s",
                                  "prompts/s", "x one node (prompts/s)", "prompts/cpu-s", "x one node (prompts/cpu-s)"],
                first="run"))
    print(table("The driver's RSS (MB)", results, ["driver_connected_mb", "driver_gen_first_q_mb",
                                                   "driver_gen_last_q_mb", "driver_peak_mb", "driver_end_mb",
                                                   "driver_cpu_s"], first="run"))
    for label, r in results.items():
        print(f"\n{label}: batches by node {r['batches by node']}" + ("; " + "; ".join(r["events"]) if r["events"]
                                                                       else ""))
    for label, check in checks.items():
        print(f"{label}, against one node: {check}")
    if args.json:
        write_json(args.json, {"results": results, "checks": checks})
    return 0


if __name__ == "__main__":
    sys.exit(main())
