"""``OUT/recipe.json``, the recipe's manifest: the config, the step in progress, and what each finished step produced.

A step is recorded once it is finished, with its **inputs** (what made it: a run's config hash; the SFT selection and
its data run; the training settings, the model it started from and its SFT set) and its **outputs** (paths, counts,
costs). A recipe run again skips every recorded step whose inputs are unchanged and refuses, before anything runs,
one whose inputs changed (a finished round is never silently mixed with another config). The file is replaced
atomically (written beside, then renamed), so it is always whole.
"""

from __future__ import annotations

import datetime as dt
import json
import os

FORMAT = "winnow-expert-iteration/1"
FILE = "recipe.json"


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def flat_diff(old, new, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two JSON-like values, with both values. A key only `new` has is no
    difference: a setting added by a later version was not there to be set when `old` was recorded."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(old):
            out += flat_diff(old[key], new.get(key), f"{prefix}.{key}" if prefix else str(key))
        return out
    return [] if old == new else [f"{prefix or '(value)'}: {json.dumps(old)} -> {json.dumps(new)}"]


class Ledger:
    """The recipe manifest of the folder `root` (an absolute local path)."""

    def __init__(self, root: str, data: dict):
        self.root = root
        self.data = data

    @property
    def path(self) -> str:
        return os.path.join(self.root, FILE)

    @classmethod
    def read(cls, root: str) -> Ledger | None:
        """The folder's manifest, or None when there is none; ValueError when it is not one."""
        path = os.path.join(root, FILE)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("steps"), dict):
            raise ValueError(f"{path}: not a recipe manifest ({FORMAT})")
        return cls(root, data)

    @classmethod
    def new(cls, root: str, name: str, config: dict, command: str) -> Ledger:
        return cls(root, {"format": FORMAT, "name": name, "folder": root, "config": config, "command": command,
                          "status": "running", "error": None, "current": None, "created_at": now_iso(),
                          "updated_at": now_iso(), "steps": {}})

    def write(self) -> None:
        self.data["updated_at"] = now_iso()
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def done(self, step_id: str) -> dict | None:
        """The record of a finished step, or None."""
        return self.data["steps"].get(step_id)

    def start(self, step_id: str) -> None:
        self.data["current"] = {"step": step_id, "since": now_iso()}
        self.data["status"] = "running"
        self.data["error"] = None
        self.write()

    def finish(self, step_id: str, kind: str, inputs: dict, outputs: dict, seconds: float) -> dict:
        record = {"kind": kind, "inputs": inputs, "outputs": outputs, "seconds": seconds, "finished_at": now_iso()}
        self.data["steps"][step_id] = record
        self.data["current"] = None
        self.write()
        return record

    def end(self, status: str, error: str | None = None, config: dict | None = None, command: str | None = None):
        """The recipe's status (succeeded, failed); `config` and `command` as this run of it had them."""
        self.data["status"] = status
        self.data["error"] = error
        if config is not None:
            self.data["config"] = config
        if command is not None:
            self.data["command"] = command
        self.write()
