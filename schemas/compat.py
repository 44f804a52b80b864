"""What keeps older configs and run folders working, in one place, so that it can be dropped at 1.0: the fields
added since the first release, the settings renamed, the defaults changed, and how a config's hash treats each.

A run folder is matched to its config by the config's hash (`JobConfig.hash`). A config written before a field
existed must keep its hash, or its run folder would not resume. So `hashed(dump)` normalises a config's JSON dump
before it is hashed:

1. A setting under its new name (`RENAMED`) is hashed under its old one.
2. A setting holding one of its later defaults (`CHANGED_DEFAULTS`) is hashed as holding its first one. Only
   settings that decide how the work is batched, not what it is, are changed this way.
3. A field added later (`LATE_FIELDS`) is left out while it holds its default.
"""

from __future__ import annotations

from typing import Any, Callable

# Fields added after the first release, by dotted path, with their default's JSON dump: `hashed` leaves them out
# while they hold it. A new field with a default goes here, or every existing run folder's hash changes.
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
    "method.kv_space_mb": lambda: None,
    "models.verifier": lambda: None,
    "models.reward.columns": lambda: [],
    "models.reward.timeout_s": lambda: 120.0,
    "method.stop_after_verified": lambda: None,
    "method.verdict_lag_steps": lambda: 8,
}

# Settings renamed after the first release, new dotted path -> old one (in the same section): the old name is still
# read, and `hashed` hashes the new one's value under the old name, so a run resumes under either.
RENAMED: dict[str, str] = {
    "method.kv_space_mb": "method.memory_budget_mb",
}

# Defaults changed after the first release, by dotted path: (the values that hash as the first default, the first
# default). A config that leaves the setting unset keeps the hash (and the run folders) it had, and so does one that
# sets a default of any version.
CHANGED_DEFAULTS: dict[str, tuple[tuple[Any, ...], Any]] = {
    "resources.prompts_per_batch": ((None, 64), 4),  # 4, then 64, then null: from the width and n
    "models.vllm_max_num_seqs": ((None,), 256),  # the width's old name, null now that max_num_seqs holds the default
}


def _parent(dump: dict, path: str) -> tuple[dict | None, str]:
    *parents, leaf = path.split(".")
    node: Any = dump
    for p in parents:
        node = node.get(p) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def hashed(dump: dict) -> dict:
    """A config's JSON dump as it is hashed (module docstring); changes `dump` in place and returns it."""
    for path, old in RENAMED.items():  # a setting under its new name hashes as under its old one
        node, leaf = _parent(dump, path)
        if node is not None and node.get(leaf) is not None:
            node[old.split(".")[-1]], node[leaf] = node[leaf], None
    for path, (now, before) in CHANGED_DEFAULTS.items():
        node, leaf = _parent(dump, path)
        if node is not None and leaf in node and node[leaf] in now:
            node[leaf] = before
    for path, default in LATE_FIELDS.items():
        node, leaf = _parent(dump, path)
        if node is not None and leaf in node and node[leaf] == default():
            del node[leaf]
    return dump
