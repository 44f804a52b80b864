"""Rounds of Expert Iteration, closed: generate, build the SFT set, fine-tune, evaluate, and start again from the
fine-tuned model (docs/expert-iteration.md).

The recipe's steps, in order (``K`` a round, ``S`` a data source of `sources`)::

    prompts                 the training and held-out prompt files (generated concept sets), or the two sources
    round-0/eval-sample     `winnow generate`: round 0's model on the held-out prompts, one sample per prompt
    round-0/eval-greedy     the same, greedy (evaluation.greedy)
    round-K/S/data          `winnow generate`: round K-1's model of chain S on the training prompts, method S
    round-K/S/sft           the SFT set of that run (`sftdata`: what `winnow build-sft` writes)
    round-K/S/train         TRL's SFTTrainer on it, from round K-1's model (`rounds.train`): round K's model
    round-K/S/eval-sample   round K's model on the held-out prompts, one sample per prompt
    round-K/S/eval-greedy   and greedy

Every step writes under the recipe's folder (``out``) at the path of its id (a run folder, an SFT folder; a
training, its model folder ``round-K/S/model``), and each run's job config beside it (``round-1/bon/data.yaml``:
``winnow generate`` of that file is the step). The recipe's manifest (``recipe.json``, `rounds.ledger`) records
each finished step, so a recipe that is stopped in any way continues at the step it was in: finished steps are
reused, a generate step resumes its run folder (each prompt exactly once), an SFT set is rebuilt whole, and a
training starts again (the model folder only appears complete, `rounds.train`). The end writes the summary (`rounds.summary`).

Failures: bad input (the config, a model that is not one, a finished step whose inputs changed, an SFT set left
empty by its filters) raises `schemas.base.InputError` before the step writes anything (exit 2); a failed run or
training raises `StepFailed` (exit 1), keeping every earlier step; an interrupt raises `Interrupted` (exit 130).
Either way the same command continues.

`generate` (the `winnow generate` entry point), `concept_sets` (`assets.concept_sets.split`) and `resolve`
(`assets.resolve`) are handed in by `jobs.rounds`, which wires them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shlex
import time
from dataclasses import dataclass
from typing import Callable

import yaml

from pipeline.preflight import model_problems
from pipeline.prompts import check_source
from reporting.rounds import CostOf, ModelLineage, add_costs, read_lineage, run_costs, write_lineage
from rounds.config import RECIPE_MODEL_KEYS, RecipeConfig
from rounds.ledger import Ledger, flat_diff
from rounds.train import INSTALL, fine_tune, missing_packages
from runfolder.folder import store
from runfolder.lease import LEASE_FILE, Lease, lease_path
from runfolder.runs import load_run, load_runs
from schemas.base import ConfigError, InputError
from schemas.compat import current
from schemas.config import JobConfig, validate_config
from sftdata.select import DROP_REASONS, Selection, parse_select, select
from sftdata.write import HF_DIR, write_sft

COMMAND = "winnow rounds"


class StepFailed(Exception):
    """A step failed at run time (a run, a training); the earlier steps are kept and the recipe can continue."""


class Interrupted(Exception):
    """The recipe was interrupted (Ctrl-C, SIGTERM); the same command continues it."""


@dataclass
class Step:
    id: str  # also its path under the recipe folder
    kind: str  # prompts | generate | sft | train
    round: int
    source: str | None
    path: str
    config: dict | None = None  # generate: the run's job config
    config_path: str | None = None

    @property
    def yaml_path(self) -> str:
        return f"{self.path}.yaml"


# How to keep candidates that a filter of `winnow build-sft` dropped, in the recipe's terms.
FIXES = {
    "errored_row": "every row of the data run has an error (its `error` column says why)",
    "rejected": "set sft.include_rejected: true to keep rejected candidates that have a reward",
    "truncated": "set sft.include_truncated: true, or raise job.generation.max_new_tokens so that answers end",
    "null_reward": "the reward gave no score: check the recipe's reward",
    "empty_text": "the model answered with nothing",
    "duplicate": "",
    "below_min_reward": "lower sft.min_reward or set it to null",
    "unverified": "no candidate verified: set sft.include_unverified: true to keep the ranker's best anyway",
    "not_selected": "",
}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def current_inputs(inputs: dict) -> dict:
    """A step's inputs with its job config under the settings' new names (`schemas.compat.current`), so that a step
    finished under the old names still counts as finished with the same settings."""
    config = inputs.get("config")
    return {**inputs, "config": current(config)} if isinstance(config, dict) else inputs


class Recipe:
    """One recipe folder and its config; `run` does every step not yet done (module docstring)."""

    def __init__(self, config: RecipeConfig, command: str, generate: Callable[[list[str]], int],
                 concept_sets: Callable, resolve: Callable[[str], str], log: Callable[[str], None] = print,
                 problems: list[str] | None = None, broken: frozenset[str] = frozenset()):
        """`problems` and `broken`: what `rounds.config.check_recipe` found in the recipe's sections and which
        sections it replaced; `check` says them with every other problem, and leaves those sections out."""
        self.config = config
        self.schema_problems = list(problems or [])
        self.broken = broken
        self.command = command
        self.generate = generate
        self.concept_sets = concept_sets
        self.resolve = resolve
        self.say = log
        self.root = os.path.abspath(os.path.expanduser(config.out)) if "://" not in config.out else config.out
        self.steps = self.plan()

    def log(self, line: str) -> None:
        self.say(f"{COMMAND}: {line}")

    # -- the plan ------------------------------------------------------------------------------------------------

    def at(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def model(self, source: str, k: int) -> str:
        """The model of round k of chain `source`: round 0's is the config's `model`."""
        return self.config.model if k == 0 else self.at(f"round-{k}", source, "model")

    def prompts_source(self, split: str) -> tuple[str, int | None, str | None, str]:
        """(data.source, data.limit, data.id_column, data.prompt_column) of the training or held-out prompts."""
        p = self.config.prompts
        if p.vocabulary is not None:
            return self.at("prompts", f"{split}.jsonl"), None, "id", "prompt"
        source, limit = (p.train_source, p.train) if split == "train" else (p.heldout_source, p.heldout)
        return source, limit, p.id_column, p.prompt_column

    def run_config(self, name: str, split: str, target: str, method: dict, output: str) -> dict:
        """A `winnow generate` job config: the recipe's `job` keys, its seed, reward and the step's own keys."""
        job = copy.deepcopy(self.config.job)
        models = dict(job.pop("models", None) or {})
        models.update(target=target, reward=self.config.reward.model_dump(mode="json"))
        source, limit, id_column, prompt_column = self.prompts_source(split)
        return {**job, "name": name, "seed": self.config.seed,
                "data": {"source": source, "prompt_column": prompt_column, "id_column": id_column, "limit": limit},
                "models": models, "method": method, "output": {"path": output}}

    def _eval_steps(self, k: int, source: str | None) -> list[Step]:
        where = ["round-0"] if source is None else [f"round-{k}", source]
        name = f"{self.config.name}-round-{k}" + (f"-{source}" if source else "")
        target = self.model(source or "", k)
        evals = [("eval-sample", self.config.evaluation.sample.model_dump(mode="json"))]
        if self.config.evaluation.greedy:
            evals.append(("eval-greedy", {"name": "greedy"}))
        out = []
        for role, method in evals:
            path = self.at(*where, role)
            out.append(Step("/".join([*where, role]), "generate", k, source, path,
                            self.run_config(f"{name}-{role}", "heldout", target, method, path)))
        return out

    def plan(self) -> list[Step]:
        steps = [Step("prompts", "prompts", 0, None, self.at("prompts"))]
        steps += self._eval_steps(0, None)
        for k in range(1, self.config.rounds + 1):
            for source, method in self.config.sources.items():
                base = f"round-{k}/{source}"
                data = self.at(f"round-{k}", source, "data")
                steps.append(Step(f"{base}/data", "generate", k, source, data,
                                  self.run_config(f"{self.config.name}-round-{k}-{source}-data", "train",
                                                  self.model(source, k - 1), method.model_dump(mode="json"), data)))
                steps.append(Step(f"{base}/sft", "sft", k, source, self.at(f"round-{k}", source, "sft")))
                steps.append(Step(f"{base}/train", "train", k, source, self.model(source, k)))
                steps += self._eval_steps(k, source)
        return steps

    def step(self, step_id: str) -> Step:
        return next(s for s in self.steps if s.id == step_id)

    def inputs(self, step: Step) -> dict:
        """What a step is made from: a finished step is reused only when these are unchanged."""
        c = self.config
        if step.kind == "prompts":
            return {"prompts": c.prompts.model_dump(mode="json")}
        if step.kind == "generate":
            return {"config": step.config}
        if step.kind == "sft":  # its data run is a step of its own, checked as one
            data = self.step(f"round-{step.round}/{step.source}/data")
            return {"sft": c.sft.model_dump(mode="json"), "data": data.path}
        return {"train": c.train.model_dump(mode="json"), "seed": c.seed,
                "parent": self.model(step.source, step.round - 1)}

    # -- checks before anything is written -----------------------------------------------------------------------

    def check(self, ledger: Ledger | None) -> None:
        """Every problem of every stage at once (InputError), before any step runs; nothing is written: the recipe's
        sections (`rounds.config.check_recipe`), its folder, the job config of every step, the models, the prompts,
        the training's packages, and the finished steps' settings. A section that broke a rule is left out of the
        later checks (its stand-in would be checked instead)."""
        problems: list[str] = list(self.schema_problems)
        if "out" not in self.broken:
            problems += self.out_problems(ledger)
        seen: dict[str, str] = {}
        first_eval = None
        for step in self.steps:
            if step.kind != "generate":
                continue
            try:
                cfg = validate_config(step.config)
            except ConfigError as err:
                for line in err.problems:
                    seen.setdefault(line, step.id)
                continue
            if first_eval is None:
                first_eval = cfg
        for line, step_id in seen.items():
            problems.append(f"the job config of {step_id} (and perhaps others): {line}; the recipe's `job`, "
                            "`reward`, `sources` or `evaluation` set it")
        if first_eval is None and seen:  # the models are checked all the same, in a config of the recipe's own keys
            first_eval = self.own_config(next(s for s in self.steps if s.kind == "generate"))
        if first_eval is not None:
            renamed = {"models.target": "model", "models.reward.path": "reward.path",
                       "models.reward.function": "reward.function", "models.draft": "job.models.draft"}
            for line in model_problems(first_eval):
                field, _, rest = line.partition(": ")
                name = renamed.get(field, field)
                if name.split(".")[0] not in self.broken:  # a broken section's stand-in is not the user's
                    problems.append(f"{name}: {rest}" if field in renamed else line)
        if "prompts" not in self.broken:
            problems += self.prompts_problems()
        if self.config.rounds > 0:
            missing = missing_packages(self.config.train.lora is not None)
            if missing:
                problems.append(f"train: training needs {', '.join(missing)} (the `train` extra), not installed "
                                f"here; install it with: {INSTALL}")
        if ledger is not None and not self.broken:  # stand-ins are not the settings a step finished with
            for step in self.steps:
                record = ledger.done(step.id)
                if record is None:
                    continue
                changed = flat_diff(current_inputs(record["inputs"]), current_inputs(self.inputs(step)))
                if changed:
                    problems.append(f"{step.id}: finished with other settings than the recipe's now ("
                                    + "; ".join(changed[:6]) + ("; ..." if len(changed) > 6 else "")
                                    + f"); restore them, or give another out than {self.root}")
        if problems:
            raise InputError(problems)

    def out_problems(self, ledger: Ledger | None) -> list[str]:
        """Why `out` cannot be the recipe's folder: not local, a file, or a folder that holds something else."""
        if "://" in self.config.out:
            return [f"out: {self.config.out!r}: the recipe's folder must be local (models are trained and saved "
                    "there)"]
        if os.path.isfile(self.root):
            return [f"out: {self.root} is a file, not a folder"]
        if ledger is None and os.path.isdir(self.root) and set(os.listdir(self.root)) - {LEASE_FILE}:
            return [f"out: {self.root} exists, is not empty and holds no {self.at('recipe.json')}; give an empty "
                    "or new folder"]
        return []

    def own_config(self, step: Step) -> JobConfig | None:
        """The job config of a generate step from the recipe's own keys alone (no `job` keys: those may be what is
        wrong), or None when even those break a rule (said with the job configs' problems)."""
        own = {k: v for k, v in step.config.items() if k not in self.config.job}
        own["models"] = {k: v for k, v in step.config["models"].items() if k in RECIPE_MODEL_KEYS}
        try:
            return validate_config(own)
        except ConfigError:
            return None

    def prompts_problems(self) -> list[str]:
        """What the prompts step would refuse, found before any step runs: more concept sets than the vocabulary
        holds, or a training or held-out source that cannot be read (`pipeline.prompts.check_source`)."""
        p = self.config.prompts
        if p.vocabulary is not None:
            if self.concept_sets is None:
                return []
            try:
                self.concept_sets(p.vocabulary, p.train, p.heldout, p.seed)
            except ValueError as err:
                return [f"prompts: {err}"]
            return []
        problems = []
        for split in ("heldout", "train"):
            step = next((s for s in self.steps if s.kind == "generate"
                         and (s.id.endswith("/data") == (split == "train"))), None)
            config = self.own_config(step) if step is not None else None  # None: rounds: 0 reads no training prompts
            if config is None:
                continue
            try:
                check_source(config)
            except InputError as err:
                problems += [line.replace("data.source:", f"prompts.{split}_source:", 1) for line in err.problems]
        return problems

    # -- running -------------------------------------------------------------------------------------------------

    def run(self) -> dict:
        """Do every step not yet done, then write the summary; returns it (`rounds.summary.write_summary`)."""
        from rounds.summary import write_summary  # it imports the plots (matplotlib): only when a recipe runs

        try:
            ledger = None if "out" in self.broken else Ledger.read(self.root)
        except (ValueError, OSError) as err:
            raise InputError(f"out: {err}") from None
        self.check(ledger)
        fs, _ = store(self.root)
        lease = Lease(fs, lease_path(self.root), COMMAND, f"out: {self.root}")
        lease.acquire()  # one recipe at a time in a folder: a second one exits 2 naming this one
        try:
            config_dump = self.config.model_dump(mode="json")
            if ledger is None:
                ledger = Ledger.new(self.root, self.config.name, config_dump, self.command)
            ledger.end("running", None, config_dump, self.command)
            done = [s for s in self.steps if ledger.done(s.id)]
            self.log(f"{self.root}: {len(self.steps)} steps, {len(done)} done"
                     + (f" (continuing at {next(s.id for s in self.steps if not ledger.done(s.id))})"
                        if done and len(done) < len(self.steps) else ""))
            try:
                for n, step in enumerate(self.steps, 1):
                    if ledger.done(step.id):
                        continue
                    self.log(f"[{n}/{len(self.steps)}] {step.id}")
                    ledger.start(step.id)
                    started = time.monotonic()
                    outputs = getattr(self, f"_{step.kind}")(step)
                    ledger.finish(step.id, step.kind, self.inputs(step), outputs, time.monotonic() - started)
                summary = write_summary(self, ledger)
            except KeyboardInterrupt:
                where = (ledger.data.get("current") or {}).get("step")
                ledger.end("failed", f"interrupted at {where}" if where else "interrupted")
                raise Interrupted(f"interrupted at {where}; run the same command again to continue") from None
            except (InputError, StepFailed, Interrupted) as err:
                ledger.end("failed", str(err))
                raise
            except Exception as err:
                where = (ledger.data.get("current") or {}).get("step")
                ledger.end("failed", f"{where}: {type(err).__name__}: {err}")
                raise StepFailed(f"{where or 'summary'}: {type(err).__name__}: {err}; the finished steps are "
                                 "kept: run the same command again to continue") from err
            ledger.end("succeeded")
            return summary
        finally:
            lease.release()

    def _prompts(self, step: Step) -> dict:
        p = self.config.prompts
        if p.vocabulary is None:
            return {"train_source": p.train_source, "heldout_source": p.heldout_source, "train": p.train,
                    "heldout": p.heldout}
        try:
            train, heldout = self.concept_sets(p.vocabulary, p.train, p.heldout, p.seed)
        except ValueError as err:
            raise InputError(f"prompts: {err}") from None
        out = {"vocabulary": p.vocabulary, "seed": p.seed}
        for split, rows in (("train", train), ("heldout", heldout)):
            path = self.at("prompts", f"{split}.jsonl")
            _write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
            out[split] = {"path": path, "prompts": len(rows), "sha256": _sha256(path)}
        return out

    def _generate(self, step: Step) -> dict:
        _write_atomic(step.yaml_path, yaml.safe_dump(step.config, sort_keys=False))
        self.log(f"{step.id}: {generate_command(step)}")
        code = self.generate([step.yaml_path])
        if code == 2:
            raise InputError(f"{step.id}: {generate_command(step)} exited 2 (bad input: its message is "
                             "above)")
        if code == 130:
            raise KeyboardInterrupt
        if code != 0:
            raise StepFailed(f"{step.id}: {generate_command(step)} failed (exit {code}; its message is "
                             "above); the rows it wrote are kept: run the same command again to continue")
        run = load_run(step.path)
        m = run.manifest
        rewards = [r["best_reward"] for r in run.rows if r["error"] is None and r["best_reward"] is not None]
        return {"run": step.path, "config": step.yaml_path, "command": generate_command(step),
                "config_hash": m.config_hash, "rows": m.rows, "errors": m.errors,
                "mean_best_reward": sum(rewards) / len(rewards) if rewards else None,
                "device_seconds": m.cost.device_seconds, "usd": m.cost.usd}

    def _sft(self, step: Step) -> dict:
        data = self.step(f"round-{step.round}/{step.source}/data")
        runs = load_runs([data.path])
        s = self.config.sft
        sel = Selection(k=parse_select(s.select), min_reward=s.min_reward, include_rejected=s.include_rejected,
                        include_truncated=s.include_truncated, include_unverified=s.include_unverified)
        result = select(runs, sel)
        if result.table.num_rows == 0:
            raise InputError(empty_message(step, data.id, result, s))
        argv = [data.path, "--out", step.path, "--select", sel.flag]
        argv += ["--min-reward", f"{s.min_reward:g}"] if s.min_reward is not None else []
        argv += ["--include-rejected"] if s.include_rejected else []
        argv += ["--include-truncated"] if s.include_truncated else []
        argv += ["--include-unverified"] if s.include_unverified else []
        write_sft(result, runs, sel, step.path, argv)
        rewards = result.table.column("reward").to_pylist()
        self.log(f"{step.id}: {result.table.num_rows} examples for {result.prompts_kept} of "
                 f"{result.prompts_seen} prompts (mean reward {sum(rewards) / len(rewards):.4f})")
        return {"sft": step.path, "examples": result.table.num_rows, "prompts_kept": result.prompts_kept,
                "prompts_seen": result.prompts_seen, "mean_reward": sum(rewards) / len(rewards),
                "dropped": {k: v for k, v in result.dropped.items() if v},
                "command": shlex.join(["winnow", "build-sft", *argv])}

    def _train(self, step: Step) -> dict:
        k, source = step.round, step.source
        lineage = read_lineage(step.path) if os.path.isdir(step.path) else None
        if lineage is not None:  # trained and renamed into place before the step was recorded: keep it
            self.log(f"{step.id}: {step.path} is complete; keeping it")
            return {"model": step.path, "lineage": lineage.model_dump(mode="json")}
        if os.path.exists(step.path):
            raise StepFailed(f"{step.id}: {step.path} exists but holds no winnow-round.json: it was not written by "
                             "this recipe; move it away and run the same command again")
        parent_spec = self.model(source, k - 1)
        data_run = load_run(self.step(f"round-{k}/{source}/data").path)
        generation = run_costs(data_run)
        previous = read_lineage(parent_spec) if k > 1 else None
        price = data_run.usd_per_device_hour
        made: dict = {}

        def finish(tmp: str, trained) -> None:
            details = {key: v for key, v in trained.record().items() if key not in ("device_seconds", "flops")}
            training = CostOf(device_seconds=trained.device_seconds, usd=trained.device_seconds / 3600.0 * price,
                              flops=trained.flops, **details)
            lineage = ModelLineage(
                recipe=self.config.name, recipe_folder=self.root, source=source,
                source_method=self.config.sources[source].model_dump(mode="json"), round=k,
                base_model=self.config.model, parent_model=parent_spec, data_runs=[data_run.uri],
                sft=self.at(f"round-{k}", source, "sft"), examples=trained.examples, generation=generation,
                training=training,
                cumulative_generation=add_costs(previous.cumulative_generation, generation) if previous
                else generation,
                cumulative_training=add_costs(previous.cumulative_training, training) if previous else training,
            )
            write_lineage(tmp, lineage)
            made["lineage"] = lineage

        try:
            parent = self.resolve(parent_spec)
            trained = fine_tune(parent, os.path.join(self.at(f"round-{k}", source, "sft"), HF_DIR), step.path,
                                self.config.train, self.config.seed, finish, self.log)
        except KeyboardInterrupt:
            raise
        except Exception as err:
            raise StepFailed(f"{step.id}: training failed: {type(err).__name__}: {err}; the finished steps are "
                             "kept: run the same command again to retry the training") from err
        loss = "n/a" if trained.train_loss is None else f"{trained.train_loss:.4f}"
        self.log(f"{step.id}: {trained.method} in {trained.wall_seconds:.1f} s on {trained.device} "
                 f"({trained.steps} steps, {trained.tokens} tokens, mean loss {loss}) -> {step.path}")
        return {"model": step.path, "lineage": made["lineage"].model_dump(mode="json")}


def generate_command(step: Step) -> str:
    """The `winnow generate` command of a generate step, quoted for a shell (a recipe folder may hold spaces)."""
    return shlex.join(["winnow", "generate", step.yaml_path])


def empty_message(step: Step, data_id: str, result, sft) -> str:
    """Why a round's SFT set is empty: every candidate dropped, by which filters, the one that removed the last
    candidates, and how to keep them."""
    counts = {why: result.dropped.get(why, 0) for why in DROP_REASONS if result.dropped.get(why, 0)}
    if not counts:
        return (f"{step.id}: the SFT set is empty: the data run {data_id} has no candidates "
                f"({result.prompts_seen} prompts)")
    last = [why for why in counts if why != "not_selected"][-1]
    setting = {"below_min_reward": f" (sft.min_reward: {sft.min_reward:g})" if sft.min_reward is not None else "",
               "truncated": " (sft.include_truncated: false)", "rejected": " (sft.include_rejected: false)",
               "unverified": " (sft.include_unverified: false)"}
    listed = "; ".join(f"{n} by `{why}` ({DROP_REASONS[why]})" for why, n in counts.items())
    return (f"{step.id}: the SFT set is empty: every one of the {result.candidates_seen} candidates of the "
            f"{result.prompts_seen} prompts of {data_id} was filtered out ({listed}). The filter that removed the "
            f"last of them is `{last}`{setting.get(last, '')}: {FIXES[last]}")
