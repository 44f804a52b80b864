"""Expert-Iteration SFT data from runs: pool every run's candidates per prompt, filter, select, write.

Terms (docs/glossary.md). A *candidate* is one response a method started for a prompt (a row's `candidates`). A
*finished* candidate ended at EOS (finish_reason ``eos``) or at its token limit (``length``, called *truncated*
here, since its text stops mid-way); a *rejected* one was stopped early by Speculative Rejection (its reward is
null). By default only candidates that ended at EOS are kept. Candidates of one prompt_id are *pooled* across
runs, so the best response across methods wins; that compares rewards across runs, so every run must be scored by
one reward definition (`runfolder.runs.reward_definition`), and runs scored by different ones are refused
(`one_reward`). The output is TRL's conversational prompt-completion form:
``prompt`` is the chat messages and ``completion`` is a list with one assistant message.

Runs with a verifier (`runfolder.runs.verifier_kind`) give only candidates that *verified* (`verified` true), so a
prompt none of whose candidates verified is left out; `include_unverified` lets the others in, ranked after every
verified one, as the run chose its answer. ``top-k`` then keeps up to k distinct verified answers per prompt (distinct
texts: duplicates are dropped first). Runs with and without a verifier are pooled only with `include_unverified`
(`one_verdict`): otherwise candidates nobody checked would compete with verified ones.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa

from runfolder.runs import Run, RewardDefinition, describe_groups, reward_groups, unique_labels, verifier_kind
from schemas.base import InputError
from schemas.rows import MESSAGE

SFT_SCHEMA = pa.schema(
    [
        ("prompt", pa.list_(MESSAGE)),
        ("completion", pa.list_(MESSAGE)),
        ("prompt_id", pa.string()),
        ("reward", pa.float64()),
        ("source_run", pa.string()),
        ("source_method", pa.string()),
        ("source_config_hash", pa.string()),
        ("finish_reason", pa.string()),
        ("verified", pa.bool_()),  # the verifier's verdict in its source run; null where that run has no verifier
    ]
)

# Reasons a candidate is dropped, in the order the filters apply; the dataset card lists them in this order.
DROP_REASONS = {
    "errored_row": "the prompt's row has an error",
    "rejected": "finish_reason 'rejected' (stopped early by Speculative Rejection); see --include-rejected",
    "truncated": "finish_reason 'length' (hit max_new_tokens); see --include-truncated",
    "null_reward": "no final reward",
    "empty_text": "null or empty text",
    "unverified": "its run has a verifier and the candidate did not verify; see --include-unverified",
    "duplicate": "same prompt_id and same text as another candidate (a verified one, else the higher reward, is "
    "kept)",
    "below_min_reward": "reward below --min-reward",
    "not_selected": "not among the prompt's selected candidates (--select)",
}


@dataclass(frozen=True)
class Selection:
    """How candidates are chosen per prompt: the top ``k`` by reward (``best`` is k = 1), at least ``min_reward``."""

    k: int = 1
    min_reward: float | None = None
    include_rejected: bool = False
    include_truncated: bool = False
    include_unverified: bool = False

    def describe(self, verifier: bool = False) -> str:
        """The rule in words; `verifier`: a source run has a verifier (the verified rule is said only then)."""
        rule = "the best candidate" if self.k == 1 else f"the top {self.k} candidates"
        parts = [f"{rule} by final reward per prompt_id, pooled over all source runs"]
        if verifier and self.include_unverified:
            parts.append("candidates that did not verify included, ranked after every verified one")
        elif verifier:
            parts.append("only candidates that verified (a prompt without one is left out)")
        if self.min_reward is not None:
            parts.append(f"with reward >= {self.min_reward:g}")
        parts.append("rejected candidates " + ("included" if self.include_rejected else "excluded"))
        parts.append("truncated (finish_reason 'length') candidates "
                     + ("included" if self.include_truncated else "excluded"))
        parts.append("duplicate texts per prompt_id dropped")
        return "; ".join(parts)

    @property
    def flag(self) -> str:
        return "best" if self.k == 1 else f"top-k={self.k}"


def parse_select(text: str) -> int:
    """``best`` -> 1, ``top-k=K`` -> K (K >= 1); anything else is an InputError naming --select."""
    if text == "best":
        return 1
    m = re.fullmatch(r"top-k=(\d+)", text)
    if not m or int(m.group(1)) < 1:
        raise InputError(f"--select {text!r}: expected 'best' or 'top-k=K' with K >= 1, e.g. top-k=4")
    return int(m.group(1))


@dataclass
class SftResult:
    """The selected examples (an Arrow table in SFT_SCHEMA) and the counts the dataset card reports."""

    table: pa.Table
    prompts_seen: int
    prompts_errored_everywhere: int
    prompts_kept: int
    candidates_seen: int
    reward: RewardDefinition
    dropped: Counter = field(default_factory=Counter)
    verifier_runs: list[str] = field(default_factory=list)  # labels of the source runs that have a verifier
    prompts_unverified: int = 0  # prompts left out because none of their candidates verified


def _check_same_prompt(pooled: dict, pid: str, prompt: list[dict], label: str) -> None:
    first = pooled.get(pid)
    if first is not None and first[0] != prompt:
        raise InputError(
            f"prompt_id {pid!r}: different prompt messages in runs {first[1]!r} and {label!r}; "
            "pooling needs the same prompt under one prompt_id"
        )


def _keep_candidate(cand: dict, sel: Selection, verifier: bool) -> str | None:
    """The drop reason of one candidate under the per-candidate filters, or None to keep it; `verifier`: its run
    has one."""
    reason = cand["finish_reason"]
    if reason == "rejected" and not sel.include_rejected:
        return "rejected"
    if reason == "length" and not sel.include_truncated:
        return "truncated"
    if cand["reward"] is None:
        return "null_reward"
    if not cand["text"]:
        return "empty_text"
    if verifier and cand["verified"] is not True and not sel.include_unverified:
        return "unverified"
    return None


def _rank(record: dict) -> tuple[bool, float]:
    """The order of a prompt's candidates, highest first: verified ones before the others, then by reward."""
    return record["verified"] is True, record["reward"]


def pool_candidates(runs: list[Run], sel: Selection) -> tuple[dict[str, list[dict]], dict, Counter, int, set, set]:
    """Per prompt_id, the candidates of every run that pass the per-candidate filters, duplicates removed (of two
    with one text, the verified one, else the higher reward, is kept).

    Returns (pool, prompts, dropped counts, candidates seen, prompt_ids with a successful row somewhere, prompt_ids
    with a candidate dropped as unverified).
    """
    pool: dict[str, dict[str, dict]] = {}  # prompt_id -> text -> candidate record
    prompts: dict[str, tuple[list[dict], str]] = {}
    dropped: Counter = Counter()
    seen = 0
    ok_ids: set[str] = set()
    unverified: set[str] = set()
    for label, run in zip(unique_labels(runs), runs):
        verifier = verifier_kind(run) is not None
        for row in run.rows:
            pid = row["prompt_id"]
            _check_same_prompt(prompts, pid, row["prompt"], label)
            prompts.setdefault(pid, (row["prompt"], label))
            cands = row["candidates"] or []
            seen += len(cands)
            if row["error"] is not None:
                dropped["errored_row"] += len(cands)
                continue
            ok_ids.add(pid)
            texts = pool.setdefault(pid, {})
            for index, cand in enumerate(cands):
                why = _keep_candidate(cand, sel, verifier)
                if why:
                    dropped[why] += 1
                    if why == "unverified":
                        unverified.add(pid)
                    continue
                record = {
                    "text": cand["text"], "reward": cand["reward"], "finish_reason": cand["finish_reason"],
                    "source_run": label, "source_method": run.method,
                    "source_config_hash": run.manifest.config_hash,
                    "verified": cand["verified"] if verifier else None,
                }
                other = texts.get(cand["text"])
                if other is not None:
                    dropped["duplicate"] += 1
                if other is None or _rank(record) > _rank(other):
                    texts[cand["text"]] = record
    flat = {pid: list(texts.values()) for pid, texts in pool.items()}
    return flat, prompts, dropped, seen, ok_ids, unverified


def one_reward(runs: list[Run]) -> RewardDefinition:
    """The reward definition every run shares; InputError naming each definition and its runs when they differ:
    pooling picks the highest reward per prompt across runs, which means nothing across two scales."""
    groups = reward_groups(runs)
    if len(groups) == 1:
        return groups[0][0]
    raise InputError(
        [f"the runs are scored by {len(groups)} different reward definitions (models.reward kind and its model, "
         "function, column, or target for logprob), whose values cannot be pooled or compared; give the runs of "
         "one reward only (one dataset per reward):"]
        + [f"  {line}" for line in describe_groups(runs, groups)])


def one_verdict(runs: list[Run], sel: Selection) -> list[str]:
    """The labels of the runs with a verifier; InputError naming both sides when runs with and without one are
    given together without `include_unverified`: a set of verified answers cannot take candidates nobody checked."""
    labels = unique_labels(runs)
    have = [verifier_kind(run) is not None for run in runs]
    if any(have) and not all(have) and not sel.include_unverified:
        def names(flag: bool) -> str:
            return ", ".join(f"{label} ({run.uri})" for label, run, h in zip(labels, runs, have) if h == flag)

        raise InputError(f"the runs mix runs with a verifier ({names(True)}) and runs without one ({names(False)}); "
                         "build a dataset from each apart, or pass --include-unverified to pool every candidate "
                         "(verified ones ranked first)")
    return [label for label, h in zip(labels, have) if h]


def select(runs: list[Run], sel: Selection) -> SftResult:
    """Pool, filter and select candidates per prompt_id (see module docstring); rows sorted by prompt_id, then
    verified first, then reward. Runs scored by different reward definitions are refused (`one_reward`), and runs
    with and without a verifier unless `include_unverified` (`one_verdict`)."""
    reward = one_reward(runs)
    verifier_runs = one_verdict(runs, sel)
    pool, prompts, dropped, seen, ok_ids, unverified = pool_candidates(runs, sel)
    rows = []
    for pid in sorted(pool):
        # Verified first, then highest reward; ties keep the earlier run and candidate (the pool keeps insertion
        # order, and the sort is stable).
        cands = sorted(pool[pid], key=lambda c: (c["verified"] is not True, -c["reward"]))
        if sel.min_reward is not None:
            passing = [c for c in cands if c["reward"] >= sel.min_reward]
            dropped["below_min_reward"] += len(cands) - len(passing)
            cands = passing
        dropped["not_selected"] += max(0, len(cands) - sel.k)
        for c in cands[: sel.k]:
            rows.append({
                "prompt": prompts[pid][0],
                "completion": [{"role": "assistant", "content": c["text"]}],
                "prompt_id": pid,
                "reward": c["reward"],
                "source_run": c["source_run"],
                "source_method": c["source_method"],
                "source_config_hash": c["source_config_hash"],
                "finish_reason": c["finish_reason"],
                "verified": c["verified"],
            })
    table = pa.Table.from_pylist(rows, schema=SFT_SCHEMA)
    kept = len(set(r["prompt_id"] for r in rows))
    return SftResult(
        table=table,
        prompts_seen=len(prompts),
        prompts_errored_everywhere=len(set(prompts) - ok_ids),
        prompts_kept=kept,
        candidates_seen=seen,
        reward=reward,
        dropped=dropped,
        verifier_runs=verifier_runs,
        prompts_unverified=sum(1 for pid in unverified if not pool.get(pid)),
    )
