"""A plan's steps, resumable: check, sample, sweep, project, answer, write (docs/planning.md).

The plan's folder (``--out``, local) holds::

    sample/prompts.jsonl    the sample (`planning.sample`), read by every sweep run
    sample/sample.json      what it was drawn from, the prompt set's size and lengths, the sweep's size and cuts
                            (`planning.budget`); written last
    sweep/LABEL.yaml        the job config of each sweep run (`planning.sweep`): `winnow generate` of it is the run
    sweep/LABEL/            its run folder (an ordinary one: resumable, reportable)
    sweep/warmup/           the warm-up probe's run (`planning.estimate`), on sweep/warmup-prompts.jsonl
    sweep/devices.json      what each sweep run ran on
    config.yaml             the picked config: the job's config with the method set, ready for `winnow generate`
    plan.md, plan.json      the projection, the answer and what it cannot know; plan_frontier.png, its plot

A plan that stops in any way (a kill, Ctrl-C, a failed run) continues where it stopped when the same command runs
again: the sample is reused when drawn from the same inputs, a finished sweep run is reused and an unfinished one
resumes (each prompt exactly once, `winnow generate`'s own resume). A plan whose sweep is finished answers another
question (`--target-reward`, `--budget-usd`, neither) without running anything.

Failures: bad input (the config, the methods, the sample's size, a job too small to plan within the sweep's share,
a folder holding something else or runs of another config, a question no swept config answers) raises
`schemas.base.InputError` before anything is written where it can be known before (exit 2); a failed sweep run
raises `PlanFailed` (exit 1), an interrupt `Interrupted` (exit 130). `generate` (the `winnow generate` entry point),
`connect` (`pipeline.job.connect`) and `resolve` (`assets.resolve`) are handed in by `jobs.plan`, which wires them.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import uuid
from typing import Callable

import yaml

from planning import estimate
from planning import sample as sampling
from planning.budget import Sizing, TooSmall, size_sweep
from planning.caveats import caveats, describe_device
from planning.projection import Measured, Question, Unanswerable, answer, fixed_seconds, measure, project
from planning.sweep import (PROBE, PROBE_CALLS, PROBE_PROMPTS, job_with_method, label, layout, probe_call,
                            probe_config, probe_rows, sweep_actors, sweep_config)
from reporting.cost import run_cost
from reporting.plancheck import PLAN_FILE, PLAN_FORMAT
from runfolder.folder import changed_keys, store
from runfolder.lease import Lease, out_lease_path
from runfolder.paths import location_key, overlap_problem
from runfolder.runs import Run, load_run, reward_definition
from schemas.base import InputError
from schemas.compat import current, current_section
from schemas.config import JobConfig, validate_config

COMMAND = "winnow plan"
SWEEP_DIR = "sweep"
DEVICES_FILE = "devices.json"
CONFIG_FILE = "config.yaml"
MARKDOWN_FILE = "plan.md"
PLOT_FILE = "plan_frontier.png"
PROBE_FILE = f"{PROBE}-prompts.jsonl"  # in sweep/: the warm-up probe's prompts
OWNED = {sampling.SAMPLE_DIR, SWEEP_DIR, CONFIG_FILE, MARKDOWN_FILE, PLAN_FILE, PLOT_FILE}
# the highest value of the rewards that have one
HIGHEST = {"lexical": 1.0, "process": 1.0, "logprob": 0.0, "math": 1.0, "code": 1.0}


class PlanFailed(Exception):
    """A sweep run failed at run time; what it wrote is kept and the same command continues it."""


class Interrupted(Exception):
    """The plan was interrupted (Ctrl-C, SIGTERM); the same command continues it."""


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _seconds(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    parse = (lambda s: dt.datetime.fromisoformat(s.replace("Z", "+00:00")))
    return (parse(end) - parse(start)).total_seconds()


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def device_record(job: JobConfig) -> dict:
    """What the sweep's actors ran on: the per-actor resources, engine and dtype of the config, the cluster's
    accelerator types (Ray's ``accelerator_type:*`` resources), the driver host's CPU model, cores and load."""
    import ray

    res = ray.cluster_resources() if ray.is_initialized() else {}
    r = job.resources
    return {"kind": "gpu" if r.gpus_per_actor > 0 else "cpu", "gpus_per_actor": r.gpus_per_actor,
            "cpus_per_actor": r.cpus_per_actor, "engine": job.models.engine, "dtype": job.models.dtype,
            "accelerators": sorted(k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")),
            "cluster_cpus": res.get("CPU"), "cluster_gpus": res.get("GPU"), "cpu_model": _cpu_model(),
            "host_cpus": os.cpu_count(), "load_average": os.getloadavg()[0], "at": now_iso()}


class Planner:
    """One plan's folder and inputs; `run` does every step not yet done (module docstring)."""

    def __init__(self, raw: dict, job: JobConfig, config_path: str, out: str, question: Question,
                 size: sampling.SampleSize, methods: list[dict], command: str, generate: Callable[[list[str]], int],
                 connect: Callable[[], str], resolve: Callable[[str], str], log: Callable[[str], None] = print,
                 basis: str = "compute", share: float = 0.1):
        self.raw, self.job, self.config_path = raw, job, config_path
        self.out = os.path.abspath(os.path.expanduser(out)) if "://" not in out else out.rstrip("/")
        self.question, self.size, self.methods = question, size, methods
        self.config_labels = [label(m) for m in methods]
        self.command, self.generate, self.connect, self.resolve, self.say = command, generate, connect, resolve, log
        self.basis, self.share = basis, share
        self.layout = layout(raw, methods)  # the runs that measure every config, before the share cuts any
        own = job.method.model_dump(mode="json")
        self.own = next((name for m, name in zip(methods, self.config_labels)
                         if job_with_method(raw, m).method.model_dump(mode="json") == own), None)
        self.sized: Sizing | None = None  # the sweep as the share sized it (`sizing`)
        self.ready: dict | None = None  # the plan, when `check` found the sweep finished and projected it

    def log(self, line: str) -> None:
        self.say(f"{COMMAND}: {line}")

    def at(self, *parts: str) -> str:
        return os.path.join(self.out, *parts)

    def folder(self, name: str) -> str:
        return self.at(SWEEP_DIR, name)

    # -- what the plan is made of ------------------------------------------------------------------------------

    def location(self) -> str:
        from pipeline.prompts import source_location

        return location_key(source_location(self.job.data.source))

    def fit_sweep(self, prompts: int, asked: int, floor: int | None = None) -> Sizing:
        """The sweep sized to the share (`planning.budget.size_sweep`); InputError when the job is too small."""
        try:
            return size_sweep(self.layout, self.raw, prompts, asked, self.share,
                              self.job.method.candidates(), self.own, floor)
        except TooSmall as err:
            raise InputError(f"{err}; nothing was written") from None

    def sizing(self, meta: dict) -> Sizing:
        """The sweep of a drawn sample: as it was sized when drawn, or, for other --methods than it was drawn for,
        those methods' runs cut to fit its sample."""
        if self.sized is None:
            record, k = meta["sweep"], meta["sample"]["prompts"]
            same = record.get("methods") == self.methods
            self.sized = (self.fit_sweep(meta["dataset"]["prompts"], record["asked"]) if same
                          else self.fit_sweep(meta["dataset"]["prompts"], k, floor=k))
            if self.sized.sample != k:
                raise InputError(f"--out {self.out}: its sample of {k} prompts does not fit the sweep's share now "
                                 f"({self.sized.sample} would); give another --out")
        return self.sized

    @property
    def labels(self) -> list[str]:
        """The sweep's runs (the warm-up probe apart), once sized."""
        return [r.label for r in self.sized.runs] if self.sized is not None else []

    def probe_method(self) -> dict:
        """The warm-up probe's method: the cheapest run's, or for a Best-of-N run its smallest config's. Its warm
        calls, narrow beside the sweep's runs, also give the device model a point of its own."""
        cheapest = min(self.sized.runs, key=lambda r: r.units)
        return dict(zip(self.config_labels, self.methods))[cheapest.serves[0][0]]

    def sweep_configs(self, meta: dict) -> list[dict]:
        """The job config of each run (`labels`), then the probe's."""
        runs = self.sizing(meta).runs
        actors = sweep_actors(self.job, meta["sample"]["prompts"])
        sample_file = self.at(sampling.SAMPLE_DIR, sampling.PROMPTS_FILE)
        return ([sweep_config(self.job, r.method, sample_file, meta["columns"], self.folder(r.label), actors)
                 for r in runs]
                + [probe_config(self.job, self.probe_method(), self.at(SWEEP_DIR, PROBE_FILE), meta["columns"],
                                self.folder(PROBE))])

    def _manifest(self, name: str) -> dict | None:
        path = os.path.join(self.folder(name), "manifest.json")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)

    # -- checks before anything is written ---------------------------------------------------------------------

    def check(self, meta: dict | None) -> None:
        """Every problem at once (InputError); nothing is written. With a finished sweep, the question too."""
        if "://" in self.out:
            raise InputError(f"--out {self.out}: a plan's folder must be local (winnow generate reads its sweep "
                             "configs from it); give a local folder (a shared one for a cluster of several nodes)")
        problems: list[str] = []
        shown = f"--out {self.out}"
        problems += [p for p in (overlap_problem(shown, self.out, "job's run folder (output.path)",
                                                 self.job.output.path),) if p]
        if os.path.isfile(self.out):
            problems.append(f"{shown}: exists and is a file, not a folder")
        elif os.path.isdir(self.out):
            other = sorted(set(os.listdir(self.out)) - OWNED)
            if other or (meta is None and os.path.isdir(self.at(SWEEP_DIR))):
                problems.append(f"{shown}: holds {', '.join(other) or 'sweep runs without their sample'}, which no "
                                "plan writes; give an empty or new folder")
        from pipeline.preflight import model_problems
        from pipeline.prompts import check_source, source_bytes

        problems += model_problems(self.job)
        try:
            location = self.location()
            if "://" not in location or location.startswith("file://"):
                problems += [p for p in (overlap_problem(shown, self.out, "data source (data.source)",
                                                         location[len("file://"):]),) if p]
        except InputError as err:
            problems += err.problems
            location = None
        if meta is None:
            try:
                check_source(self.job)
            except InputError as err:
                problems += err.problems
            limit, count = self.job.data.limit, self.size.count
            if limit is not None and count is not None and count > limit and not self.size.at_most:
                problems.append(f"--sample {self.size.text}: {count} prompts asked for, but data.limit keeps "
                                f"{limit}; give --sample {limit} or fewer")
        elif location is not None:
            now = sampling.inputs(self.job, self.size, location, self.share)
            changed = changed_keys(meta["inputs"], now)
            if changed:
                problems.append(f"{shown}: its sample was drawn from other inputs ({', '.join(changed)} changed); "
                                "give another --out, or the config and --sample it was drawn with")
            elif meta.get("source_bytes") is not None:
                try:
                    size = source_bytes(check_source(self.job))
                except InputError as err:
                    problems += err.problems
                else:
                    if size != meta["source_bytes"]:
                        problems.append(f"data.source: {self.job.data.source} changed since the plan's sample was "
                                        f"drawn ({meta['source_bytes']} bytes then, {size} now); give another --out")
        problems += self.question_bounds()
        done = meta is not None and not problems
        if meta is not None and not problems:
            configs = self.sweep_configs(meta)  # sizes the sweep first: `labels` are then known
            for name, cfg in zip([*self.labels, PROBE], configs):
                manifest = self._manifest(name)
                if manifest is None:
                    done = False
                    continue
                planned = validate_config(cfg)
                if manifest.get("config_hash") != planned.hash():
                    keys = changed_keys(current(manifest.get("config") or {}), planned.model_dump(mode="json"))
                    problems.append(f"{shown}: sweep run {name} was made with another config ("
                                    + ", ".join(keys[:6]) + ("; ..." if len(keys) > 6 else "")
                                    + "); give another --out, or the config it was made with")
                done = done and manifest.get("status") == "succeeded"
        if problems:
            raise InputError(problems)
        if done:  # every sweep run finished: the question is answered or refused before anything runs
            try:
                self.ready = self.project(meta)
            except Unanswerable as err:
                raise InputError(f"{err}; nothing was written") from None

    def question_bounds(self) -> list[str]:
        """A target reward no config can reach: the job has no reward, or the reward cannot be that high (lexical
        and process: 1; logprob: 0)."""
        if self.question.kind != "target_reward":
            return []
        reward = self.job.models.reward
        if reward is None:
            return ["--target-reward: the job has no reward (models.reward is null): there is no reward to reach"]
        high = HIGHEST.get(reward.kind)
        if high is not None and self.question.value > high:
            return [f"--target-reward {self.question.value:g}: the {reward.kind} reward is at most {high:g}; no "
                    "config reaches it"]
        return []

    # -- running -----------------------------------------------------------------------------------------------

    def run(self) -> dict:
        """Every step not yet done; returns the plan (plan.json's content, with ``markdown`` and ``summary``)."""
        fs, _ = store(self.out)
        try:
            meta = sampling.read_meta(fs, self.out)
        except (ValueError, OSError) as err:
            raise InputError(f"--out {self.out}: {err}") from None
        self.check(meta)
        lease = Lease(fs, out_lease_path(self.out), COMMAND, f"--out {self.out}")
        lease.acquire()  # one plan at a time in a folder: a second one exits 2 naming this one
        try:
            for leftover in fs.glob(f"{self.out}{sampling.STAGING}*"):  # a killed plan's staging: ours to remove
                fs.rm(leftover, recursive=True)
                self.log(f"removed {leftover}, left by a plan that was stopped while drawing its sample")
            try:
                if meta is None:
                    meta = self.draw(fs)
                else:
                    self.log(f"reusing the sample in {self.at(sampling.SAMPLE_DIR)} "
                             f"({meta['sample']['prompts']} of {meta['dataset']['prompts']} prompts)")
                self.sweep(meta)
            except KeyboardInterrupt:
                raise Interrupted("interrupted; run the same command again to continue") from None
            try:
                plan = self.ready if self.ready is not None else self.project(meta)
            except Unanswerable as err:
                raise InputError(f"{err}; the plan's files were not written; its sample and sweep runs are kept in "
                                 f"{self.out}, and the same command with another question reuses them") from None
            self.write(plan)
            return plan
        finally:
            lease.release()

    def draw(self, fs) -> dict:
        """Draw the sample (`planning.sample.draw`) through a staging folder beside the plan's, removed after."""
        from pipeline.prompts import check_source, source_bytes

        self.log(self.connect())
        source = check_source(self.job)
        staging = f"{self.out}{sampling.STAGING}{uuid.uuid4().hex[:12]}"
        size = source_bytes(source) if source.local else None
        self.log(f"reading the prompt set ({self.job.data.source}) to draw a sample of {self.size.text}")
        def fit(prompts: int, asked: int) -> tuple[int, dict]:
            self.sized = self.fit_sweep(prompts, asked)
            return self.sized.sample, {**self.sized.record(), "methods": self.methods}

        try:
            meta = sampling.draw(self.job, self.size, fs, self.out, staging, staging, None, source, self.location(),
                                 size, self.share, fit)
        finally:
            if fs.exists(staging):
                fs.rm(staging, recursive=True)
        d = meta["dataset"]
        self.log(f"sample: {meta['sample']['prompts']} of {d['prompts']} prompts (seed {self.job.seed}) -> "
                 f"{meta['file']}")
        return meta

    def say_sizing(self, meta: dict) -> None:
        """One line: the sweep's runs, and what the share cut."""
        sized = self.sizing(meta)
        line = (f"the sweep: {', '.join(self.labels)} and the warm-up probe on {sized.sample} prompts, at most "
                f"{100 * sized.planned / sized.allowed * sized.share:.2g}% of the job by the candidates it counts "
                f"(--sweep-share {sized.share:g})")
        if sized.sample < sized.asked:
            line += f"; the sample cut from {sized.asked}"
        if sized.cut:
            line += f"; cut to fit: {', '.join(sized.cut)}"
        self.log(line)

    def write_probe_prompts(self, meta: dict) -> None:
        """The warm-up probe's prompts (`planning.sweep.probe_rows`), from the sample."""
        path = self.at(SWEEP_DIR, PROBE_FILE)
        with open(self.at(sampling.SAMPLE_DIR, sampling.PROMPTS_FILE), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in probe_rows(rows, meta["columns"]["id"]))
        if not os.path.isfile(path):
            sampling.write_atomic(store(path)[0], path, text.encode("utf-8"))

    def sweep(self, meta: dict) -> None:
        """Run (or resume) the warm-up probe and every sweep run not yet finished, through `winnow generate`."""
        self.say_sizing(meta)
        configs = self.sweep_configs(meta)
        configs = configs[-1:] + configs[:-1]  # the probe first
        devices_path = self.at(SWEEP_DIR, DEVICES_FILE)
        devices = self._devices()
        self.write_probe_prompts(meta)
        for n, (name, cfg) in enumerate(zip([PROBE, *self.labels], configs), 1):
            manifest = self._manifest(name)
            if manifest is not None and manifest.get("status") == "succeeded":
                self.log(f"[{n}/{len(configs)}] sweep {name}: finished before; reused")
                continue
            path = self.at(SWEEP_DIR, f"{name}.yaml")
            sampling.write_atomic(store(path)[0], path, yaml.safe_dump(cfg, sort_keys=False).encode("utf-8"))
            self.log(f"[{n}/{len(configs)}] sweep {name}: winnow generate {path}")
            code = self.generate([path])
            if code == 2:
                raise InputError(f"sweep {name}: winnow generate {path} exited 2 (bad input: its message is above)")
            if code == 130:
                raise KeyboardInterrupt
            if code != 0:
                raise PlanFailed(f"sweep {name}: winnow generate {path} failed (exit {code}; its message is above); "
                                 "the rows it wrote are kept: run the same command again to continue")
            devices[name] = device_record(self.job)
            sampling.write_atomic(store(devices_path)[0], devices_path,
                                  json.dumps(devices, indent=2).encode("utf-8"))

    def _devices(self) -> dict:
        path = self.at(SWEEP_DIR, DEVICES_FILE)
        if not os.path.isfile(path):
            return {}
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}  # a sweep run written before the rename records its resources under their old names
        return {name: current_section("resources", d) if isinstance(d, dict) else d for name, d in data.items()}

    # -- the projection ------------------------------------------------------------------------------------------

    def sample_ids(self, meta: dict) -> list[str]:
        with open(self.at(sampling.SAMPLE_DIR, sampling.PROMPTS_FILE), encoding="utf-8") as f:
            return [json.loads(line)[meta["columns"]["id"]] for line in f if line.strip()]

    def project(self, meta: dict) -> dict:
        """The plan (plan.json's content) from the finished sweep runs; Unanswerable when no config answers."""
        sized = self.sizing(meta)
        runs = [load_run(self.folder(name)) for name in self.labels]
        probe = load_run(self.folder(PROBE))
        ids = self.sample_ids(meta)
        costs = [run_cost(run, self.resolve) for run in runs]
        k, n = meta["sample"]["prompts"], meta["dataset"]["prompts"]
        actors = sweep_actors(self.job, k)
        warmup = estimate.warmup_seconds(probe.rows)
        warm = warmup["seconds"] or 0.0
        seconds = [run.manifest.cost.device_seconds for run in runs]
        scales = [max(0.0, s - warm * actors) / s if s > 0 else 1.0 for s in seconds]
        by_id = [{r["prompt_id"]: r for r in run.rows} for run in runs]
        probe_cost = run_cost(probe, self.resolve)
        warm_calls = [r for r in probe.rows if (probe_call(r["prompt_id"]) or 0) >= 1]
        points = [(s * f, rows.values(), cost) for s, f, rows, cost in zip(seconds, scales, by_id, costs)]
        points.append((sum(r["cost"]["device_seconds"] or 0.0 for r in warm_calls), warm_calls, probe_cost))
        model = estimate.fit_device_model([
            (s, sum(estimate.forwards_of(r) or 0.0 for r in rows if r["error"] is None),
             sum(w for r in rows if r["error"] is None
                 and (w := (cost.flops(r) if cost.problem is None else estimate.processed(r))) is not None))
            for s, rows, cost in points])
        verifier = self.job.verifier is not None
        source: dict[str, tuple[int, int | None]] = {}  # config label -> (run index, k)
        for i, r in enumerate(sized.runs):
            for name, kk in r.serves:
                source[name] = (i, kk)
        labels = [name for name in self.config_labels if name in source]
        measured: list[Measured] = []
        for name in labels:
            i, kk = source[name]
            if kk is None:
                measured.append(measure(name, ids, by_id[i], costs[i].flops, scales[i], verifier))
            else:
                measured.append(estimate.best_of_k(name, kk, ids, by_id[i], costs[i].flops, model, scales[i],
                                                   verifier))
        walls = [(w, run.manifest.cost.device_seconds, actors) for run in runs
                 if (w := _seconds(run.manifest.started_at, run.manifest.finished_at)) is not None]
        fixed = fixed_seconds(walls)
        price = self.job.cost.usd_per_device_hour
        least, most = self.job.resources.pool  # an elastic pool's wall-clock is projected at its most
        projected = project(measured, n, most, price, fixed, warm)
        picked = answer(projected, self.question, k, self.basis)
        verdicts = picked.pop("verdicts")
        devices = list(self._devices().values())
        no_cut = [name for name, run in zip(self.labels, runs) if run.manifest.no_cut]
        given = dict(zip(self.config_labels, self.methods))
        configs = []
        for name, p in zip(labels, projected):
            i, kk = source[name]
            m, run, cost = given[name], runs[i], costs[i]
            full = job_with_method(self.raw, m)
            configs.append({"label": name, "method": full.method.model_dump(mode="json"), "given": m,
                            "run": run.uri, "measured_from": self.labels[i], "best_of_k": kk,
                            "sweep_config_hash": run.manifest.config_hash,
                            "sample_errors": p["sample_errors"], "errors": p["errors"],
                            "reward_prompts": p["reward_prompts"], "projection": p["figures"],
                            "frontier": verdicts.get(name), "no_cut": bool(run.manifest.no_cut),
                            "compute_problem": cost.problem})
        pick = next(c for c in configs if c["label"] == picked["label"])
        own = next((c for c in configs if c["label"] == self.own), None)
        sweep_cost = self._sweep_cost([*runs, probe], [*costs, probe_cost], pick, own)
        full_config = job_with_method(self.raw, pick["given"])
        definition = reward_definition(runs[0])
        plan = {
            "format": PLAN_FORMAT,
            "command": self.command,
            "created_at": now_iso(),
            "folder": self.out,
            "job": {"config_file": self.config_path, "name": self.job.name,
                    "config": self.job.model_dump(mode="json"), "actors": most, "least_actors": least,
                    "usd_per_device_hour": price, "output": self.job.output.path, "own_config": self.own},
            "reward": {"definition": definition.text, "kind": definition.kind, "units": definition.units},
            "verifier": verifier,
            "question": {"kind": self.question.kind, "value": self.question.value, "text": self.question.text},
            "dataset": {**meta["dataset"], "source": self.job.data.source, "limit": self.job.data.limit},
            "sample": {**meta["sample"], "file": meta["file"], "sha256": meta["sha256"],
                       "prompt_chars": meta["prompt_chars"], "sweep_actors": actors},
            "sweep": {**sized.record(), "probe": {"method": self.probe_method(), "prompts": PROBE_PROMPTS,
                                                  "calls": PROBE_CALLS, "run": probe.uri}},
            "device": devices[-1] if devices else None,
            "devices": devices,
            "warmup": {**warmup, "removed_seconds": [warm * actors if s > 0 else 0.0 for s in seconds],
                       "full_run_seconds": warm * most},
            "device_model": {"a_seconds_per_forward": model.a, "b_seconds_per_work": model.b, "why": model.why},
            "wall_model": {"fixed_seconds": fixed, "actors": most,
                           "sweep_runs": [{"wall_seconds": w, "device_seconds": s, "actors": wk}
                                          for w, s, wk in walls]},
            "configs": configs,
            "frontier": {"order": picked["order"], "knee": picked["knee"], "basis": picked["basis"]},
            "answer": {"label": pick["label"], "method": pick["method"], "given": pick["given"], "why": picked["why"],
                       "config_file": self.at(CONFIG_FILE), "config_hash": full_config.hash()},
            "sweep_cost": sweep_cost,
            "level": picked["level"],
        }
        plan["caveats"] = caveats(meta, devices, projected, picked["notes"], no_cut, plan)
        if least != most:
            plan["caveats"].append(f"resources.actors is an elastic pool of {least} to {most} actors: wall-clock is "
                                   f"projected for {most}, as if the cluster has room for them all from the start")
        plan["device_line"] = describe_device(plan["device"]) if plan["device"] else None
        return plan

    def _sweep_cost(self, runs: list[Run], costs: list, pick: dict, own: dict | None) -> dict:
        """What the sweep spent (its runs' manifests, the probe's included), and its share of the projected full run
        of the pick and of the job's own method."""
        seconds = sum(r.manifest.cost.device_seconds for r in runs)
        usd = sum(r.manifest.cost.usd for r in runs)
        tokens = sum(r.manifest.cost.target_tokens + r.manifest.cost.draft_tokens + r.manifest.cost.reward_tokens
                     for r in runs)
        flops = (sum(c.flops(row) for run, c in zip(runs, costs) for row in run.rows
                     if row["error"] is None) if all(c.problem is None for c in costs) else None)

        def share(config: dict | None) -> dict | None:
            if config is None:
                return None
            proj = config["projection"]
            usd_full = proj["usd"]["value"]
            flops_full = proj["flops"]["value"] if proj["flops"] else None
            return {"label": config["label"], "usd": usd_full, "flops": flops_full,
                    "fraction_usd": usd / usd_full if usd_full else None,
                    "fraction_flops": flops / flops_full if (flops is not None and flops_full) else None}

        of_pick = share(pick)
        return {"device_seconds": seconds, "usd": usd, "processed_tokens": tokens, "flops": flops,
                "fraction_of_full_run_usd": of_pick["fraction_usd"],
                "fraction_of_full_run_flops": of_pick["fraction_flops"], "full_run": pick["label"],
                "of_job": share(own)}

    # -- the files -------------------------------------------------------------------------------------------------

    def write(self, plan: dict) -> None:
        """config.yaml, the plot, plan.md, then plan.json (last: a plan.json is always of a whole plan)."""
        from planning.render import markdown, plot, summary

        fs, _ = store(self.out)
        pick = plan["answer"]
        cfg = json.loads(json.dumps(self.raw))
        cfg["method"] = pick["given"]
        head = (f"# winnow plan: {pick['label']}, {pick['why']}.\n# Written by: {plan['command']}\n"
                f"# Run it: winnow generate {shlex.quote(self.at(CONFIG_FILE))}   (or ray job submit ... -- python -m "
                "jobs.generate ...)\n")
        sampling.write_atomic(fs, self.at(CONFIG_FILE), (head + yaml.safe_dump(cfg, sort_keys=False)).encode())
        png = plot(plan)
        plan["plot"] = PLOT_FILE if png else None
        if png:
            sampling.write_atomic(fs, self.at(PLOT_FILE), png)
        plan["markdown"] = markdown(plan)
        sampling.write_atomic(fs, self.at(MARKDOWN_FILE), plan["markdown"].encode("utf-8"))
        body = {k: v for k, v in plan.items() if k != "markdown"}
        sampling.write_atomic(fs, self.at(PLAN_FILE), json.dumps(body, indent=2, allow_nan=False).encode("utf-8"))
        plan["summary"] = summary(plan)

