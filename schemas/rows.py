"""The Arrow schema of one output row (one prompt) of `candidates/*.parquet`: the interface contract's output columns.

The "Output columns" of docs/config.md are rendered from the meanings below by `python -m schemas.reference` (a test
keeps the two equal).

``stats`` is one struct for every method, so Parquet files of different methods share a schema and can be read
and pooled together; a field a method does not measure is null.
"""

from __future__ import annotations

import pyarrow as pa

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # the roles chat templates render


def shown_value(value, most: int = 120) -> str:
    """A value as an error message quotes it: its repr, cut to `most` characters."""
    text = repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."


def prompt_problem(messages) -> str | None:
    """Why a prompt (a list of chat messages) cannot run, or None: the one rule, applied when the driver normalises
    the source (`pipeline.prompts`) and again by the actors on what they are handed (`workers.actor.runner`). A
    message must be a {role, content} pair of strings, its role one that chat templates render (`CHAT_ROLES`:
    another is not an error of the template, which would render it or drop it without a word)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        return "empty prompt: no messages"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"prompt message {i} is not a {{role, content}} pair of strings: {shown_value(m)}"
    for i, m in enumerate(messages):
        if m["role"] not in CHAT_ROLES:
            return f"prompt message {i} has role {m['role']!r}; chat roles are {', '.join(CHAT_ROLES)}"
    if not any(m["content"].strip() for m in messages):
        return "empty prompt: every message is blank"
    return None


def well_formed(messages) -> bool:
    """Whether `messages` fit the `prompt` column (a list of {role, content} pairs of strings), whatever else is
    wrong with them: then an error row keeps them."""
    return isinstance(messages, (list, tuple)) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)

CANDIDATE = pa.struct(
    [
        ("text", pa.string()),
        ("num_tokens", pa.int32()),
        ("reward", pa.float64()),  # null for a rejected candidate, or when no reward is configured
        ("finish_reason", pa.string()),  # eos | length | rejected
        ("partial_rewards", pa.list_(pa.float64())),  # one per decision token the candidate was running at
        ("verified", pa.bool_()),  # the verifier's verdict; null without a verifier or for a candidate it did not judge
        ("answer", pa.string()),  # the final answer the math verifier read in the response
        ("verifier_reason", pa.string()),  # why the verifier did not accept it; null when it did
    ]
)

# Fields of CANDIDATE and STATS added after the first release: a run folder written before them reads them as null
# (runfolder.runs reads every file with the whole schema).
LATE_CANDIDATE_FIELDS = ("verified", "answer", "verifier_reason")

COST = pa.struct(
    [
        ("target_tokens", pa.int64()),
        ("draft_tokens", pa.int64()),
        ("reward_tokens", pa.int64()),
        ("target_forwards", pa.int64()),
        ("draft_forwards", pa.int64()),
        ("reward_forwards", pa.int64()),
        ("wall_seconds", pa.float64()),
        ("device_seconds", pa.float64()),
    ]
)

# name -> (type, meaning). Kept in one place so README and tests can list it.
STATS_FIELDS: dict[str, tuple[pa.DataType, str]] = {
    "prompt_tokens": (pa.int32(), "tokens of the rendered prompt under the target tokenizer"),
    "generated_tokens": (pa.int64(), "tokens generated over all candidates, rejected ones included"),
    "finished_candidates": (pa.int32(), "candidates that reached EOS or max_new_tokens"),
    "rejection_rounds": (pa.int32(), "decision tokens at which Speculative Rejection cut candidates"),
    "decision_tokens": (pa.list_(pa.int32()), "response length (tokens) at each decision"),
    "reward_mean": (pa.float64(), "mean final reward over finished candidates"),
    "reward_std": (pa.float64(), "standard deviation of final rewards over finished candidates"),
    "acceptance_rate": (pa.float64(), "accepted draft tokens / proposed draft tokens"),
    "mean_accepted_tokens": (pa.float64(), "tokens emitted per target call (accepted + bonus/recovered)"),
    "draft_calls_per_token": (pa.float64(), "draft forward calls per generated token"),
    "target_calls_per_token": (pa.float64(), "target forward calls per generated token"),
    "perplexity": (pa.float64(), "perplexity of the best response under the target (temperature 1)"),
    "hard_constraint": (pa.float64(), "1 if the best response covers every concept, else 0 (lexical tasks)"),
    "soft_constraint": (pa.float64(), "fraction of concepts the best response covers (lexical tasks)"),
    "state_counts": (pa.list_(pa.int64()), "CDSL: iterations in states S1, S2, S3, S4"),
    "reward_inputs_truncated": (
        pa.int64(), "reward inputs (prompt and response in the reward model's template) longer than the reward "
        "model's context, scored on their last tokens, over every scoring round; null unless the reward is a model"
    ),
    "kv_space_bytes": (pa.int64(), "the prompt's KV space under Speculative Rejection's memory schedule, in bytes "
                       "(method.memory_candidates of its candidates at full length); null for other schedules and "
                       "methods (older runs name it memory_budget_bytes)"),
    "decoding_steps": (pa.float64(), "the prompt's share of its actor's decoding steps (its batched target forwards: "
                       "on the hf engine a prefill is one, of a sequence per prompt, many prompts prefilled in one "
                       "ahead of their start; on vllm it rides in a step): "
                       "at each step it ran in, its running candidates over the step's width (summed over a run's "
                       "rows: the steps its actors took); null for methods that are not candidate pools"),
    "sequence_steps": (pa.int64(), "steps of the prompt's candidates (a prefill of the hf engine: one), summed "
                       "(sequence_steps / decoding_steps over a run is the actors' mean width); null for methods that "
                       "are not candidate pools"),
    "reward_steps": (pa.float64(), "the prompt's share of its actor's reward-model forwards (each forward shared "
                     "among the prompts in it by their rows; summed over a run's rows: the forwards its actors' reward "
                     "models made): on a device where a forward costs about the same at any width (a GPU at small "
                     "sizes), the reward model's part of the bill, as decoding_steps are the target's; 0 without a "
                     "reward model's forward; null for methods that are not candidate pools"),
    "judged_candidates": (pa.int32(), "candidates the verifier judged (every finished one); null without a verifier"),
    "verified_candidates": (pa.int32(), "candidates the verifier accepted; null without a verifier"),
    "best_verified": (pa.bool_(), "whether the answer (best_index) verified; false when no candidate did, and the "
                      "answer is then the ranker's best; null without a verifier"),
    "pass_at_1": (pa.float64(), "the chance that one sample verifies, from the judged candidates (verified / judged); "
                  "null without a verifier, or where candidates were cut before they finished (a biased sample)"),
    "pass_at_k": (pa.list_(pa.struct([("k", pa.int32()), ("value", pa.float64())])),
                  "pass@k by the unbiased estimator 1 - C(n-c, k) / C(n, k) (n judged, c verified) at k = 1, 2, 4, "
                  "... and n; null where pass_at_1 is"),
}
STATS = pa.struct([(name, t) for name, (t, _) in STATS_FIELDS.items()])

ROW_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("prompt", pa.list_(MESSAGE)),
        ("method", pa.string()),
        ("candidates", pa.list_(CANDIDATE)),
        ("best_index", pa.int32()),
        ("best_text", pa.string()),
        ("best_reward", pa.float64()),
        ("cost", COST),
        ("stats", STATS),
        ("error", pa.string()),
        ("run_name", pa.string()),
        ("config_hash", pa.string()),
    ]
)

COST_FIELDS = [f.name for f in COST]

# Meanings of the columns and nested fields other than `stats` (whose meanings are in STATS_FIELDS).
COLUMN_MEANINGS: dict[str, str] = {
    "prompt_id": "the prompt's id: `data.id_column` as a string, or a hash of the prompt (a later duplicate gets "
    "`ID#dup1`, ...)",
    "prompt": "the prompt as chat messages ({role, content})",
    "method": "`method.name` of the run",
    "candidates": "every candidate the method started for the prompt, rejected ones included",
    "candidates[].text": "the response, decoded without special tokens",
    "candidates[].num_tokens": "tokens of the response under the target tokenizer",
    "candidates[].reward": "final reward; null for a rejected candidate or without a reward",
    "candidates[].finish_reason": "`eos`, `length` (token limit) or `rejected` (stopped by a Speculative Rejection "
    "cut)",
    "candidates[].partial_rewards": "the candidate's reward at each decision token it was running at",
    "candidates[].verified": "whether the verifier (`models.verifier`, or a `math` or `code` reward) accepted the "
    "response; null without a verifier, and for a candidate it did not judge (rejected, or stopped once enough "
    "candidates verified)",
    "candidates[].answer": "the final answer the math verifier read in the response (`\\boxed{}`, \"the answer is\", "
    "or the last number); null for other verifiers or when the response states none",
    "candidates[].verifier_reason": "why the verifier did not accept the response: `wrong answer`, `no answer`, a "
    "failing test, `timeout`, `memory`, ...; null when it did, or without a verifier",
    "best_index": "index in `candidates` of the answer: the finished candidate with the highest final reward (the "
    "method's own answer for single-response methods); null when there is none",
    "best_text": "`candidates[best_index].text`",
    "best_reward": "`candidates[best_index].reward`",
    "cost": "what the prompt cost (below); its actor's device time is shared among the prompts it decoded by the "
    "tokens they caused (cost.device_seconds)",
    "cost.target_tokens": "tokens the target processed for this prompt (prefill and decoding)",
    "cost.draft_tokens": "tokens the draft processed",
    "cost.reward_tokens": "tokens the reward model processed",
    "cost.target_forwards": "batched target forwards that included this prompt",
    "cost.draft_forwards": "batched draft forwards that included this prompt",
    "cost.reward_forwards": "batched reward-model forwards that included this prompt",
    "cost.wall_seconds": "wall time of the prompt's actor call, from its start to its rows",
    "cost.device_seconds": "the prompt's share of its actor's device time (GPUs held, or 1 on CPU, x wall time): each "
    "stretch of decoding is shared among the prompts by the tokens they caused in it, so an actor's prompts sum to "
    "its busy time however its calls overlapped",
    "stats": "per-method measures (below); a field a method does not measure is null",
    "error": "why the prompt could not run (an error row has no candidates), or null",
    "run_name": "the run's `name`, so rows pooled from several runs say which run they came from (null in runs "
    "written before this column)",
    "config_hash": "the run's config hash (as in manifest.json): two runs of one name with different configs differ "
    "here (null in runs written before this column)",
}


def empty_stats() -> dict:
    return {name: None for name in STATS_FIELDS}


def empty_cost() -> dict:
    out = {name: 0 for name in COST_FIELDS}
    out["wall_seconds"] = 0.0
    out["device_seconds"] = 0.0
    return out


def error_row(prompt_id: str, prompt: list[dict], method: str, error: str) -> dict:
    """A row for a prompt that could not run: no candidates, the reason in `error`."""
    return {
        "prompt_id": prompt_id,
        "prompt": prompt,
        "method": method,
        "candidates": [],
        "best_index": None,
        "best_text": None,
        "best_reward": None,
        "cost": empty_cost(),
        "stats": empty_stats(),
        "error": error,
    }


def rows_to_table(rows: list[dict]) -> pa.Table:
    """Rows (dicts) to an Arrow table with exactly ROW_SCHEMA; missing stats fields become null."""
    fixed = []
    for r in rows:
        r = dict(r)
        stats = empty_stats()
        stats.update(r.get("stats") or {})
        unknown = set(stats) - set(STATS_FIELDS)
        if unknown:
            raise KeyError(f"stats fields not in schemas.rows.STATS_FIELDS: {sorted(unknown)}")
        r["stats"] = stats
        fixed.append(r)
    return pa.Table.from_pylist(fixed, schema=ROW_SCHEMA)
