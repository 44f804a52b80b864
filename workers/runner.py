"""Turns a batch of prompts into output rows: what one Ray actor does with each batch.

`Runner(config)` loads the trio once (it is the wiring of one actor: the config's models, its generation settings,
its method and that method's own parameters); `Runner.run(items)` takes prompts as dicts with `prompt_id`, `prompt`
(chat messages) and optionally `concepts`, and returns one output row per prompt in the shape of
`schemas.rows.ROW_SCHEMA` (README: Output columns), in order. A prompt that cannot run (empty, or longer than the
target's context) becomes a row with `error` set; a failure of the engine itself raises, so the job fails loudly.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from schemas.config import JobConfig
from schemas.rows import error_row, prompt_problem
from workers.calls import admits, feeds_across_calls
from workers.cost import Meter
from workers.engine import kv_bytes_per_token
from workers.feed import DecodeLoop
from workers.kvcache import storage_columns
from workers.loading import context_length, load_causal_lm, load_reward_model, pick_device
from workers.memory import free_memory_bytes
from workers.methods import get_method
from workers.methods.common import Context, PoolSampler, PromptInput
from workers.methods.measures import add_measures
from workers.methods.rejection import Admission
from workers.rewards import LexicalScorer, LogprobScorer, PythonScorer, RewardModelScorer, render
from workers.sampling import Warp, prompt_key
from workers.shared_prefix import shares_exactly, worth_sharing

log = logging.getLogger(__name__)


def eos_token_ids(model, tokenizer) -> list[int]:
    """The tokenizer's EOS and every stop token of the model's generation config."""
    ids = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError("models.target: neither the tokenizer nor the generation config defines an EOS token")
    return sorted(ids)


MEMORY_FRACTION = 0.8  # of the device's free memory at the start of a batch, for its sequences


class BatchTooLarge(RuntimeError):
    """One prompt's sequences cannot fit in the worker's memory (the job fails with this message)."""


def batch_memory_need(rows: int, prompt_tokens: int, new_tokens: int, kv_bytes_per_token: int, vocab: int,
                      shared_prompt: bool = False) -> int:
    """Peak bytes of `rows` sequences of one prompt, an upper estimate: their KV cache at full length in the
    in-place storage of `workers.kvcache` (a quarter of headroom, at least MIN_HEADROOM columns; the prompt's
    columns held once when `shared_prompt`, `workers.shared_prefix`, else in every sequence), their token buffer
    (int64), and three float32 [rows, vocab] tensors per step (logits, warped logits, probabilities)."""
    length = prompt_tokens + new_tokens
    if shared_prompt:
        kv_columns = prompt_tokens + rows * storage_columns(new_tokens)
    else:
        kv_columns = rows * storage_columns(length)
    return kv_columns * kv_bytes_per_token + rows * (8 * length + 3 * 4 * vocab)


class Runner:
    memory_budget: int | None = None  # bytes for a batch's sequences; None: MEMORY_FRACTION of the free memory

    def __init__(self, config: JobConfig):
        self.config = config
        m = config.models
        self.device = pick_device(config.resources.gpus_per_worker)
        target = load_causal_lm(m.target, "models.target", self.device, m.dtype, m.trust_remote_code)
        self.target, self.tokenizer = target.model, target.tokenizer
        self.draft = None
        if config.draft_needed_by:
            draft = load_causal_lm(m.draft, "models.draft", self.device, m.dtype, m.trust_remote_code)
            self.draft = draft.model
        self.eos_ids = eos_token_ids(self.target, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos_ids[0])
        self.reward = self._reward()
        self.context = context_length(self.target)
        if self.context is None:
            log.warning("models.target %s: its config has no max_position_embeddings, so prompts are not checked "
                        "against a context length (each response may still take generation.max_new_tokens)",
                        m.target)
        g = config.generation
        self.warp = Warp(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)
        self.method = get_method(config.method.name)
        self._loop: DecodeLoop | None = None
        self._loop_lock = threading.Lock()
        self._call_lock = threading.Lock()

    def _reward(self):
        r = self.config.models.reward
        if r is None:
            return None
        if r.kind == "model":
            m = self.config.models
            loaded = load_reward_model(r.path, "models.reward.path", self.device, m.dtype, m.trust_remote_code)
            return RewardModelScorer(loaded.model, loaded.tokenizer, r.batch_tokens)
        if r.kind == "logprob":
            return LogprobScorer(self.target, self.pad_id, r.batch_tokens)
        if r.kind == "lexical":
            return LexicalScorer()
        return PythonScorer(r.function)

    def encode_prompt(self, messages: list[dict]) -> list[int]:
        """The prompt rendered with the target's chat template (generation prompt added), as token ids."""
        if getattr(self.tokenizer, "chat_template", None):
            text = render(self.tokenizer, messages, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(render(self.tokenizer, messages, False))["input_ids"]

    def prepare(self, items: list[dict], max_new_tokens: int | None = None
                ) -> tuple[list[tuple[int, PromptInput]], dict[int, dict]]:
        """Split input prompts (dicts) into runnable prompts (with their position) and error rows (by position).
        `max_new_tokens`: the most new tokens per response (default generation.max_new_tokens)."""
        name = self.config.method.name
        if max_new_tokens is None:
            max_new_tokens = self.config.generation.max_new_tokens
        ready: list[tuple[int, PromptInput]] = []
        errors: dict[int, dict] = {}
        for i, item in enumerate(items):
            problem = prompt_problem(item["prompt"])
            if problem is None:
                ids = self.encode_prompt(item["prompt"])
                if self.context is not None and len(ids) >= self.context:
                    problem = f"prompt is {len(ids)} tokens; the target's context is {self.context} tokens"
            if problem is not None:
                errors[i] = error_row(item["prompt_id"], item["prompt"], name, problem)
                continue
            concepts = item.get("concepts")
            limit = max_new_tokens if self.context is None else min(max_new_tokens, self.context - len(ids))
            prompt = PromptInput(item["prompt_id"], item["prompt"], ids, prompt_key(item["prompt_id"]), limit,
                                 list(concepts) if concepts is not None else None)
            ready.append((i, prompt))
        return ready, errors

    def context_for(self, meter: Meter) -> Context:
        """What the methods share for one batch: the loaded models, the config's sampling settings and seed."""
        g = self.config.generation
        return Context(self.target, self.tokenizer, self.draft, self.reward, meter, self.warp, self.config.seed,
                       self.eos_ids, self.pad_id, PoolSampler(g.sampler, g.gamma))

    def memory_need(self, prompt: PromptInput) -> int:
        """Bytes one prompt's sequences may take at their peak (`batch_memory_need`)."""
        params = self.config.method
        rows = getattr(params, "n", None) or getattr(params, "num_beams", None) or 1
        # Speculative Rejection's memory schedule rejects candidates once their cache reaches its own budget: only
        # the start (prompt + one token per candidate) must fit whole.
        grows = not (self.config.method.name == "speculative_rejection" and params.schedule == "memory")
        kv = kv_bytes_per_token(self.target) + (kv_bytes_per_token(self.draft) if self.draft is not None else 0)
        vocab = self.target.get_output_embeddings().weight.shape[0]
        # the target-only engine shares a prompt's cache across its candidates where that is exact
        shared = self.draft is None and self.config.method.name in ("best_of_n", "speculative_rejection") \
            and worth_sharing(len(prompt.ids), rows, kv) and shares_exactly(self.target)
        new = prompt.limit if grows else 1
        need = batch_memory_need(rows, len(prompt.ids), new, kv, vocab, shared)
        if self.config.method.name == "speculative_rejection" and getattr(self.reward, "incremental", False):
            # the reward session keeps each running candidate's reward-model cache from one decision to the next
            need += rows * storage_columns(len(prompt.ids) + new) * self.reward.kv_bytes_per_token
        return need

    def budget(self) -> int:
        """Bytes a batch's sequences may take: `memory_budget`, else MEMORY_FRACTION of the memory free now."""
        return self.memory_budget if self.memory_budget is not None else int(
            free_memory_bytes(self.device) * MEMORY_FRACTION)

    def admits(self) -> bool:
        """Whether the method's prompts join one decoding batch as room frees, over actor calls (`workers.feed`):
        the candidate-pool methods on the target-only engine. The others decode in `memory_groups`."""
        return admits(self.config)

    def memory_groups(self, ready: list[tuple[int, PromptInput]], budget: int | None = None
                      ) -> list[list[tuple[int, PromptInput]]]:
        """The batch's prompts in consecutive groups that each fit in `budget` (default `self.budget()`); the
        whole batch when it fits. A prompt that cannot fit alone raises `BatchTooLarge` before anything is
        allocated for it. Splitting changes no sampled token (draws are keyed per prompt and candidate,
        `workers.sampling`), only how the batch is timed."""
        budget = self.budget() if budget is None else budget
        groups: list[list[tuple[int, PromptInput]]] = []
        used = budget + 1
        for item in ready:
            need = self.memory_need(item[1])
            if need > budget:
                raise BatchTooLarge(
                    f"prompt {item[1].prompt_id!r}: {self.config.method.name} would hold about {need / 2**30:.1f} GiB "
                    f"(its sequences' KV cache and logits, {len(item[1].ids)} prompt tokens + up to "
                    f"{item[1].limit} new) but this worker has {budget / 2**30:.1f} GiB to give "
                    f"({MEMORY_FRACTION:.0%} of the free {self.device.type} memory); lower method.n (or num_beams) or "
                    "generation.max_new_tokens, or run on a device with more memory"
                )
            if used + need > budget:
                groups.append([])
                used = 0
            groups[-1].append(item)
            used += need
        return groups

    @property
    def devices(self) -> float:
        """GPUs this worker holds (1 for a CPU worker): what its wall time is multiplied by for device seconds."""
        return self.config.resources.gpus_per_worker or 1.0

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(self, items: list[dict]) -> list[dict]:
        """One output row per input prompt, in order (error rows for prompts that cannot run). Safe to call from
        several threads at once. Where `feeds_across_calls`, every call feeds one decoding loop whose batch the
        prompts join as memory frees (`workers.feed`); else a call's prompts decode on their own: in one batch
        that they join as memory frees (`admits`), or in as many groups as memory requires (`memory_groups`)."""
        if feeds_across_calls(self.config):
            with self._loop_lock:
                if self._loop is None:
                    self._loop = DecodeLoop(self)
            return self._loop.run(items)
        with self._call_lock:
            return self._run_groups(items)

    def _run_groups(self, items: list[dict]) -> list[dict]:
        started = time.perf_counter()
        ready, errors = self.prepare(items)
        out: list[dict | None] = [errors.get(i) for i in range(len(items))]
        if not ready:
            return out
        budget = self.budget()
        groups = self.memory_groups(ready, budget)  # a prompt that cannot fit alone fails here
        if self.admits():  # one batch that the prompts join as memory frees
            self._run_group(ready, out, started, Admission(budget, self.memory_need))
            return out
        for group in groups:
            self._run_group(group, out, started)
            started = time.perf_counter()
        return out

    def _run_group(self, ready: list[tuple[int, PromptInput]], out: list[dict | None], started: float,
                   admission: Admission | None = None) -> None:
        meter = Meter(len(ready))
        meter.started = started
        ctx = self.context_for(meter)
        ctx.admission = admission
        prompts = [p for _, p in ready]
        results = self.method(ctx, self.config.method, prompts)
        self.synchronize()
        costs = meter.per_prompt(self.devices)  # the cost window closes here
        self.fill_rows(ctx, ready, results, costs, meter.reward_inputs_truncated.tolist(), out)

    def fill_rows(self, ctx: Context, ready: list[tuple[int, PromptInput]], results: list, costs: list[dict],
                  truncated: list[int], out: list[dict | None]) -> None:
        """Each prompt's output row into its position of `out`, with its quality measures (`add_measures`, run
        after the costs were taken: not billed) and `truncated`, its reward inputs cut to the reward model's
        context."""
        add_measures(ctx, [p for _, p in ready], results)
        for (i, p), res, cost, cut in zip(ready, results, costs, truncated):
            out[i] = self.row(p, res, cost, cut)

    def row(self, p: PromptInput, res, cost: dict, truncated: int) -> dict:
        """Prompt p's output row (schemas.rows.ROW_SCHEMA) from its method result and its cost struct; `truncated`:
        its reward inputs cut to the reward model's context (a stat only where a reward model has a context)."""
        best = res.best_index
        cand = res.candidates[best] if best is not None else None
        with_truncated = isinstance(self.reward, RewardModelScorer)
        return {
            "prompt_id": p.prompt_id,
            "prompt": p.messages,
            "method": self.config.method.name,
            "candidates": [c.struct() for c in res.candidates],
            "best_index": best,
            "best_text": cand.text if cand else None,
            "best_reward": cand.reward if cand else None,
            "cost": cost,
            "stats": {"prompt_tokens": len(p.ids), **res.stats,
                      **({"reward_inputs_truncated": truncated} if with_truncated else {})},
            "error": None,
        }
