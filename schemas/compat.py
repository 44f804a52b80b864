"""What keeps older configs and run folders working, in one place, so that it can be dropped at 1.0: the settings
renamed, the fields added since the first release, the defaults changed, and how a config's hash treats each.

A renamed setting's old name (`ALIASES`) still reads as its new one, wherever a config comes from:

1. A section with renamed settings (`Renamed`: models, method, resources) reads an old name as the new one when it
   is validated. An old name and the new one set to different values is an error naming both.
2. The commands warn once per old name in a user's config, naming the new one (`deprecated`).
3. What reads a written config as a dict (a manifest's, a plan's) reads it under the new names (`current`).
4. A `--set` of a setting replaces it under whichever name the config holds it (`override_key`).
5. Code not yet renamed reads a few old Python attributes (`OLD_ATTRIBUTES`).

A run folder is matched to its config by the config's hash (`JobConfig.hash`). A config written before a field
existed, or under a name since changed, must keep its hash, or its run folder would not resume. So
`hashed(dump, spelt)` normalises a config's JSON dump before it is hashed:

1. A renamed setting is hashed under its first name (`HASHED_AS`), whichever name the config used. The others
   (models.kv_cache_mb, models.max_num_seqs) were hashed under the name they were written with, and still are
   (`spelt`: what the config wrote under an old name).
2. A setting holding one of its later defaults (`CHANGED_DEFAULTS`) is hashed as holding its first one. Only
   settings that decide how the work is batched, not what it is, are changed this way.
3. A field added later (`LATE_FIELDS`) is left out while it holds its default.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, ClassVar

from pydantic import PrivateAttr, model_validator

from schemas.base import CROSS_MARK, Strict

# Settings renamed, old dotted path -> new one (in the same section). Of two old names of one setting, the later
# comes first.
ALIASES: dict[str, str] = {
    "resources.workers": "resources.actors",
    "resources.gpus_per_worker": "resources.gpus_per_actor",
    "resources.cpus_per_worker": "resources.cpus_per_actor",
    "resources.prompts_per_batch": "resources.prompts_per_call",
    "models.vllm_kv_cache_mb": "models.kv_cache_mb",
    "models.vllm_max_num_seqs": "models.max_num_seqs",
    "method.kv_space_mb": "method.pool_kv_cache_mb",
    "method.memory_budget_mb": "method.pool_kv_cache_mb",
}

# Renamed settings hashed under their first name, new dotted path -> that name, whichever name the config used.
HASHED_AS: dict[str, str] = {
    "resources.actors": "resources.workers",
    "resources.gpus_per_actor": "resources.gpus_per_worker",
    "resources.cpus_per_actor": "resources.cpus_per_worker",
    "resources.prompts_per_call": "resources.prompts_per_batch",
    "method.pool_kv_cache_mb": "method.memory_budget_mb",
}

# Python attributes that code not yet renamed still reads, by class: old name -> new field ("()": a method).
OLD_ATTRIBUTES: dict[str, dict[str, str]] = {
    "ResourcesConfig": {"gpus_per_worker": "gpus_per_actor", "cpus_per_worker": "cpus_per_actor"},
    "ModelsConfig": {"kv_space_mb": "kv_cache_mb"},
    "SpeculativeRejection": {"kv_space_cap_mb()": "pool_kv_cache_mb"},
}

# Fields added after the first release, by the dotted path they are hashed under (step 1), with their default's JSON
# dump: `hashed` leaves them out while they hold it. A new field with a default goes here, or every existing run
# folder's hash changes.
LATE_FIELDS: dict[str, Callable[[], Any]] = {
    "models.engine": lambda: "hf",
    "models.vllm_kv_cache_mb": lambda: None,
    "models.kv_cache_mb": lambda: None,
    "resources.feed_calls": lambda: False,
    "method.memory_candidates": lambda: None,
    "models.vllm_max_num_seqs": lambda: 256,
    "models.max_num_seqs": lambda: None,
    "models.reward.engine": lambda: "hf",
    "models.reward.kv_cache_mb": lambda: None,
    "resources.wait_for_nodes_s": lambda: 600,
    "models.verifier": lambda: None,
    "models.reward.columns": lambda: [],
    "models.reward.timeout_s": lambda: 120.0,
    "method.stop_after_verified": lambda: None,
    "method.verdict_lag_steps": lambda: 8,
    "method.scoring_steps": lambda: 1,  # every step, as before the clock (NEW_WORK_DEFAULTS)
    "models.decode_step": lambda: "dynamic",
}

# Late fields whose default changes the work (the rows) from what a config without them meant: that meaning is
# their LATE_FIELDS value, and their default here stays in the hash, so a run folder of the older work is not resumed
# as the newer one (`winnow generate` names the changed setting).
NEW_WORK_DEFAULTS: dict[str, Any] = {
    "method.scoring_steps": 4,
}

# Defaults changed after the first release, by the dotted path they are hashed under: (the values that hash as the
# first default, the first default). A config that leaves the setting unset keeps the hash (and the run folders) it
# had, and so does one that sets a default of any version.
CHANGED_DEFAULTS: dict[str, tuple[tuple[Any, ...], Any]] = {
    "resources.prompts_per_batch": ((None, 64), 4),  # 4, then 64, then null: from the width and n
    "models.vllm_max_num_seqs": ((None,), 256),  # the width's old name, null now that max_num_seqs holds the default
}


def names_of(path: str) -> list[str]:
    """Every dotted name of the setting at `path` (new or old): the new one first, then its old ones."""
    new = ALIASES.get(path, path)
    return [new, *(old for old, n in ALIASES.items() if n == new)]


def old_names(path: str) -> list[str]:
    """The old dotted names of the setting whose new name is `path` (none for one never renamed)."""
    return [old for old, new in ALIASES.items() if new == path]


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else json.dumps(value)


def under_new_names(section: str, fields, data: dict) -> tuple[dict, dict[str, str]]:
    """A section's keys (`data`, of config section `section` whose model has `fields`) with each old name read as its
    new one, and {new dotted name: old dotted name} of those read. A null old name counts as unset. ValueError (with
    CROSS_MARK) naming both names where two names of one setting hold different values."""
    out, spelt, problems = dict(data), {}, []
    for old, new in ALIASES.items():
        where, old_key = old.split(".")
        new_key = new.split(".")[1]
        if where != section or old_key not in out or new_key not in fields:
            continue
        value = out.pop(old_key)
        if value is None:
            continue
        if out.get(new_key) is not None:
            if out[new_key] != value:
                problems.append(f"{old}: {_show(value)} differs from {spelt.get(new, new)} ({_show(out[new_key])}); "
                                f"{old} is an old name of {new}: set {new} alone")
            continue
        out[new_key] = value
        spelt[new] = old
    if problems:
        raise ValueError(CROSS_MARK + "\n".join(problems))
    return out, spelt


class Renamed(Strict):
    """A config section with renamed settings (`ALIASES` under `section`): validation reads each old name as its new
    one, and the section remembers what it wrote under an old name that its hash follows (`spelt`)."""

    section: ClassVar[str] = ""
    _spelt: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _old_names(cls, data: Any, handler):
        spelt: dict[str, str] = {}
        if isinstance(data, dict):
            data, spelt = under_new_names(cls.section, cls.model_fields, data)
        out = handler(data)
        if spelt:
            out._spelt = {new: old for new, old in spelt.items() if new not in HASHED_AS}
        return out

    @property
    def spelt(self) -> dict[str, str]:
        """{new dotted name: old one} of the settings this section wrote under an old name its hash follows."""
        return dict(self._spelt)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for old, new in OLD_ATTRIBUTES.get(cls.__name__, {}).items():
            if old.endswith("()"):
                setattr(cls, old[:-2], lambda self, new=new: getattr(self, new))
            else:
                setattr(cls, old, property(lambda self, new=new: getattr(self, new)))


def deprecated(config: dict, prefix: str = "") -> list[str]:
    """One warning line per old name that a user's job config (`config`, a dict; its keys under `prefix`) uses."""
    out = []
    for old, new in ALIASES.items():
        where, key = old.split(".")
        if isinstance(config.get(where), dict) and key in config[where]:
            out.append(f"{prefix}{old} is deprecated; use {prefix}{new}")
    return out


def current_section(section: str, keys: dict) -> dict:
    """A written section's keys (a dict, as a manifest or plan holds them) under the new names: an old name's value
    moves to the new one unless that holds a value."""
    out = dict(keys)
    for old, new in ALIASES.items():
        where, old_key = old.split(".")
        if where == section and old_key in out:
            value = out.pop(old_key)
            new_key = new.split(".")[1]
            if out.get(new_key) is None:
                out[new_key] = value
    return out


def current(config: dict) -> dict:
    """A written job config (a dict: a manifest's, a plan's) under the new names (`current_section`); a copy."""
    out = dict(config)
    for section in {old.split(".")[0] for old in ALIASES}:
        if isinstance(out.get(section), dict):
            out[section] = current_section(section, out[section])
    return out


# Keys of a plan (plan.json, `winnow plan`) renamed with resources.actors: where they sit -> {old key: new key}.
PLAN_KEYS: dict[str, dict[str, str]] = {
    "job": {"workers": "actors", "least_workers": "least_actors"},
    "sample": {"sweep_workers": "sweep_actors"},
    "wall_model": {"workers": "actors"},
}


def current_plan(plan: dict) -> dict:
    """A plan (plan.json's content) under the new names: its own keys (`PLAN_KEYS`, and each sweep run's of its wall
    model), its job's config (`current`), its configs' methods and its device records; a copy."""
    out = dict(plan)
    for where, keys in PLAN_KEYS.items():
        if isinstance(out.get(where), dict):
            out[where] = {keys.get(k, k): v for k, v in out[where].items()}
    wall = out.get("wall_model")
    if isinstance(wall, dict) and isinstance(wall.get("sweep_runs"), list):
        wall["sweep_runs"] = [{("actors" if k == "workers" else k): v for k, v in r.items()} if isinstance(r, dict)
                              else r for r in wall["sweep_runs"]]
    job = out.get("job")
    if isinstance(job, dict) and isinstance(job.get("config"), dict):
        job["config"] = current(job["config"])
    if isinstance(out.get("configs"), list):
        out["configs"] = [{k: current_section("method", v) if k in ("method", "given") and isinstance(v, dict)
                           else v for k, v in c.items()} if isinstance(c, dict) else c for c in out["configs"]]
    if isinstance(out.get("device"), dict):
        out["device"] = current_section("resources", out["device"])
    if isinstance(out.get("devices"), list):
        out["devices"] = [current_section("resources", d) if isinstance(d, dict) else d for d in out["devices"]]
    return out


def as_written(lines: list[str], config: dict) -> list[str]:
    """Problem lines of a user's job config with each renamed setting named as `config` (a dict) writes it."""
    for old, new in ALIASES.items():
        where, old_key = old.split(".")
        section = config.get(where)
        if isinstance(section, dict) and old_key in section and new.split(".")[1] not in section:
            pattern = re.compile(rf"(?<![\w.]){re.escape(new)}(?!\w)")
            lines = [pattern.sub(old, line) for line in lines]
    return lines


def override_key(data: dict, parts: list[str]) -> list[str]:
    """The key of a `--set` override (`parts`, dotted) as it applies to `data`. An override of a renamed setting
    replaces it under any name: the other names are removed from `data`. A key below one (resources.workers.max)
    goes through the name `data` holds it under."""
    section = data.get(parts[0]) if len(parts) > 1 else None
    if not isinstance(section, dict):
        return parts
    held = [n.split(".")[1] for n in names_of(f"{parts[0]}.{parts[1]}")]
    held = [k for k in held if k != parts[1] and k in section]
    if len(parts) == 2:
        for key in held:
            del section[key]
    elif held and parts[1] not in section:
        return [parts[0], held[0], *parts[2:]]
    return parts


def _parent(dump: dict, path: str) -> tuple[dict | None, str]:
    *parents, leaf = path.split(".")
    node: Any = dump
    for p in parents:
        node = node.get(p) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def hashed(dump: dict, spelt: dict[str, str] | None = None) -> dict:
    """A config's JSON dump as it is hashed (module docstring); `spelt`: {new dotted name: old one} of what the
    config wrote under an old name. Changes `dump` in place and returns it."""
    for path, old in {**HASHED_AS, **(spelt or {})}.items():  # a renamed setting hashes under its old name
        node, leaf = _parent(dump, path)
        if node is not None and leaf in node:
            node[old.split(".")[-1]] = node.pop(leaf)
    for path, (now, before) in CHANGED_DEFAULTS.items():
        node, leaf = _parent(dump, path)
        if node is not None and leaf in node and node[leaf] in now:
            node[leaf] = before
    for path, default in LATE_FIELDS.items():
        node, leaf = _parent(dump, path)
        if node is not None and leaf in node and node[leaf] == default():
            del node[leaf]
    return dump
