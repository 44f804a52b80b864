"""How an actor takes its calls, from the config alone (the driver asks before any model is loaded, so this module
imports neither torch nor transformers).

Where a method's prompts join one decoding batch as room frees, and what a prompt gets does not depend on which
prompts share that batch, an actor runs two Ray Data calls at once and both feed one decoding loop (`workers.feed`
on the `hf` engine; the `vllm` engine's loop takes every call's requests): the next batch's prompts take the places
of rows that finish early. Elsewhere an actor runs one call at a time.
"""

from __future__ import annotations

from schemas.config import JobConfig

CONCURRENT_CALLS = 2  # actor calls one loop takes at once: the one draining and the next one


def admits(config: JobConfig) -> bool:
    """Whether `config`'s prompts join one decoding batch as room frees (continuous batching): the candidate-pool
    methods with the target-only sampler."""
    name = config.method.name
    return name in ("greedy", "nucleus") or (
        name in ("best_of_n", "speculative_rejection") and config.generation.sampler == "target")


def feeds_across_calls(config: JobConfig) -> bool:
    """Whether the prompts of several actor calls share one decoding loop: where they join one batch (`admits`, or
    any method the vLLM engine runs) and what a prompt gets does not depend on which prompts share its batch.
    Speculative Rejection's memory schedule decides when the whole batch's cache is full, so there it would depend
    on when Ray delivers the next call: its calls decode one at a time, and a run is reproduced exactly."""
    m = config.method
    joins = config.models.engine == "vllm" or admits(config)
    return joins and not (m.name == "speculative_rejection" and m.schedule == "memory")


def concurrent_calls(config: JobConfig) -> int:
    """Actor calls (Ray Data batches) one actor runs at once: two where their prompts feed one decoding loop, else
    one."""
    return CONCURRENT_CALLS if feeds_across_calls(config) else 1
