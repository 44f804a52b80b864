"""Parameter counts of model folders, read from their safetensors headers without loading a weight.

A safetensors file starts with 8 bytes (little-endian u64: the header's length) and a JSON header that gives every
tensor's dtype and shape, so a model's parameters are the sum over its tensors of the product of the shape: a few
kilobytes read per file, local or remote (fsspec). A sharded model is the shards listed in
``model.safetensors.index.json`` (its ``weight_map``), or every ``*.safetensors`` file of the folder without one.
A folder with only ``pytorch_model.bin`` weights cannot be counted without unpickling them: it gets no count, with the
reason said.

The count is of the tensors stored: an embedding tied to the output layer is stored (and counted) once.

`job_parameters` gives the counts a run records in its manifest (`schemas.manifest.ParameterCounts`, written by
`runfolder.manifest.new_manifest`); `winnow report` reads the same counts from the model folders named in an older
run's config when its manifest has none.
"""

from __future__ import annotations

import json
import math
import posixpath
import struct

from schemas.config import MODEL_REWARDS
from schemas.manifest import ParameterCounts
from stores.filesystems import filesystem

INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit on the header


class NotCounted(Exception):
    """Why a model folder's parameters could not be counted (the message says it)."""


def header_parameters(fs, path: str) -> int:
    """Parameters in one safetensors file: the sum of the product of every tensor's shape in its header."""
    with fs.open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise NotCounted(f"{path} is shorter than a safetensors header")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER_BYTES:
            raise NotCounted(f"{path}: a safetensors header of {size} bytes (not a safetensors file?)")
        raw = f.read(size)
    if len(raw) < size:
        raise NotCounted(f"{path}: its safetensors header is cut short")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise NotCounted(f"{path}: its safetensors header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise NotCounted(f"{path}: its safetensors header is not a JSON object")
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise NotCounted(f"{path}: tensor {name!r} has no valid shape in the header")
        total += math.prod(shape)
    return total


def count_parameters(location: str) -> int:
    """Parameters of the model folder at `location` (a local path or fsspec URL; `builtin:` names resolved by the
    caller); raises NotCounted saying why not, whatever went wrong: a count is never worth failing a run for, and
    the reason is recorded (`counts_of`)."""
    try:
        fs, root = filesystem(location)
        if not fs.isdir(root):
            raise NotCounted(f"{location} is not a folder here")
        names = {posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)}
        if INDEX in names:
            with fs.open(posixpath.join(root, INDEX), "rb") as f:
                index = json.loads(f.read().decode("utf-8"))
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise NotCounted(f"{location}/{INDEX} has no weight_map")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(n for n in names if n.endswith(".safetensors"))
        if not files:
            raise NotCounted(f"{location} holds no safetensors weights (only safetensors headers are read)")
        return sum(header_parameters(fs, posixpath.join(root, name)) for name in files)
    except NotCounted:
        raise
    except Exception as err:  # noqa: BLE001 - any store failure (S3 errors are not all OSError) becomes the reason
        raise NotCounted(f"{location} cannot be read ({type(err).__name__}: {err})") from None


def model_specs(models: dict) -> dict[str, str | None]:
    """role -> location of each model in a config's ``models`` (as a dict, as the manifest holds it): the target,
    the draft and the reward model (a `model` or `process` reward's path; other kinds have none); None for a model the run does
    not have."""
    reward = models.get("reward")
    rm = reward.get("path") if isinstance(reward, dict) and reward.get("kind") in MODEL_REWARDS else None
    return {role: spec if isinstance(spec, str) else None
            for role, spec in (("target", models.get("target")), ("draft", models.get("draft")), ("reward", rm))}


def counts_of(models: dict, resolve=lambda spec: spec, count=count_parameters) -> ParameterCounts:
    """`ParameterCounts` of the models of a config's ``models`` dict (`model_specs`), each location passed through
    `resolve` first (e.g. `assets.resolve` for `builtin:` names; a KeyError from it is a reason like any other), then
    counted by `count` (a model folder's safetensors headers). A model that cannot be counted gets no count and its
    reason in `not_counted`."""
    out: dict = {"not_counted": {}}
    for role, spec in model_specs(models).items():
        if spec is None:
            continue
        try:
            out[role] = count(resolve(spec))
        except KeyError as err:
            out["not_counted"][role] = f"{spec}: {err.args[0] if err.args else err}"
        except NotCounted as err:
            out["not_counted"][role] = str(err)
    return ParameterCounts(**out)


def job_parameters(resolved_config, count=count_parameters) -> ParameterCounts:
    """What a run records in its manifest: the parameter counts of its target, draft and reward model, from a config
    whose `builtin:` names are already resolved (`pipeline.preflight.resolved`), except those of assets built on the
    node that uses them, which `count` counts (`pipeline.preflight.count_model`)."""
    return counts_of(resolved_config.models.model_dump(mode="json"), count=count)
