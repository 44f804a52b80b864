"""Turns a batch of prompts into output rows: what one Ray actor does with each call.

Where the worker side begins: the Ray actor is `pipeline.job.GenerateBatch`, the callable Ray Data's
`map_batches` runs on an actor pool; it builds one `Runner` when the actor starts and calls `Runner.run` with each
batch's prompts. Everything below it is here and in the rooms of `workers/`, with no Ray in it.

`Runner(config)` is the wiring of one actor: the engine of `models.engine` (`workers.engines`: hf loads the target
and draft with transformers, vllm builds one vLLM engine), the reward, and the method with its own parameters.
`Runner.run(items)` takes prompts as dicts with `prompt_id`, `prompt` (chat messages) and optionally `concepts`, and
returns one output row per prompt in the shape of `schemas.rows.ROW_SCHEMA` (docs/config.md: Output columns), in
order. A prompt that cannot run (empty, or longer than the target's context) becomes a row with `error` set; a
failure of the engine itself raises, so the job fails loudly.

The candidate-pool methods (best_of_n, speculative_rejection, greedy, nucleus, speculative_decoding: the `pool`
ability of schemas.methods) decode in one loop per actor (`workers.pool.loop`) on either engine, which the calls in
flight feed where the method allows it: a call that finds the loop idle opens a fresh pool and has the engine serve
the loop on it. The other methods (beam, MJSD, CDSL, CDLH) run on the hf engine's models, a call at a time, in
groups of prompts that fit in memory (`workers.methods`), each group's work charged here to a meter of its own.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time

import torch

from schemas.config import MODEL_REWARDS, VERIFIER_REWARDS, JobConfig
from schemas.methods import Sampling
from schemas.rows import error_row, prompt_problem
from workers.accounting.cost import Meter
from workers.candidates import PromptInput, settle_verdicts
from workers.context import Context
from workers.decoding.sampling import prompt_key
from workers.engines.hf import HfEngine
from workers.engines.protocol import Engine
from workers.loading import load_process_reward_model, load_reward_model
from workers.methods import run_method
from workers.methods.measures import add_perplexities, constraint_stats
from workers.pool.loop import Loop, Outcome
from workers.pool.pool import Pool
from workers.scoring.items import Scored, render
from workers.scoring.process_reward import ProcessRewardScorer, Steps
from workers.scoring.protocol import Scorer
from workers.scoring.reward_model import RewardModelScorer
from workers.scoring.scorers import LexicalScorer, LogprobScorer, PythonScorer
from workers.verifiers.user_function import PythonVerifier
from workers.verifiers.verdict import Verifier

log = logging.getLogger(__name__)


def new_engine(config: JobConfig) -> Engine:
    """The engine of `models.engine` (vLLM is imported only where it runs)."""
    if config.models.engine == "vllm":
        from workers.engines.vllm import VllmEngine

        return VllmEngine(config)
    return HfEngine(config)


def load_reward(config: JobConfig, engine: Engine, **switches) -> Scorer | None:
    """The scorer of `models.reward` on the engine's device (None without a reward). `switches`: the sessions'
    switches of a reward model on transformers (`RewardModelScorer`: incremental_sessions, levels, share_prompts),
    which benches set to measure a session against its absence."""
    r = config.models.reward
    if r is None:
        return None
    if r.kind in MODEL_REWARDS:
        m = config.models
        steps = Steps.of(r) if r.kind == "process" else None
        if r.engine == "vllm":
            from workers.scoring.vllm_reward import VllmRewardScorer

            return VllmRewardScorer(r.path, "models.reward.path", engine.device, m.dtype, m.trust_remote_code,
                                    r.kv_cache_mb, config.seed, steps=steps)
        if steps is not None:
            loaded = load_process_reward_model(r.path, "models.reward.path", engine.device, m.dtype,
                                               m.trust_remote_code)
            return ProcessRewardScorer(loaded.model, loaded.tokenizer, steps, r.batch_tokens, **switches)
        loaded = load_reward_model(r.path, "models.reward.path", engine.device, m.dtype, m.trust_remote_code)
        return RewardModelScorer(loaded.model, loaded.tokenizer, r.batch_tokens, **switches)
    if r.kind == "logprob":
        return LogprobScorer(engine.target, engine.pad_id, r.batch_tokens)
    if r.kind == "lexical":
        return LexicalScorer()
    if r.kind == "python":
        return PythonScorer(r.function, r.timeout_s, r.columns)
    return None  # a math or code reward: the verifier is the reward (`load_verifier`)


def load_verifier(config: JobConfig) -> Verifier | None:
    """The verifier of the job (`JobConfig.verifier`: models.verifier, or a math or code reward), judging with as
    many workers as the actor has CPUs unless its `workers` says otherwise; None without one."""
    v = config.verifier
    if v is None:
        return None
    workers = v.workers if getattr(v, "workers", None) is not None else max(1, int(config.resources.cpus_per_worker))
    if v.kind == "math":
        from workers.verifiers.math_verifier import MathVerifier

        return MathVerifier(v.answer_column, v.timeout_s, workers)
    if v.kind == "code":
        from workers.verifiers.code_verifier import CodeVerifier
        from workers.verifiers.sandbox import Limits

        limits = Limits(wall_s=v.timeout_s, cpu_s=v.cpu_s, memory_mb=v.memory_mb, processes=v.processes,
                        output_bytes=v.output_kb * 1024)
        return CodeVerifier(v.tests_column, v.sandbox, limits, workers, v.python)
    return PythonVerifier(v.function, v.timeout_s, v.columns)


class Runner:
    def __init__(self, config: JobConfig, share: "Runner | None" = None, engine: Engine | None = None,
                 reward_switches: dict | None = None):
        """`share`: a Runner of the same models and resources whose engine and reward this one uses (a test or a
        bench running several methods or settings on one loaded engine; two runners' calls decode one after the
        other). `engine`: an engine built for `config` by the caller (bench/vllm_engine.py builds its vLLM engine
        through `vllm.LLM`). `reward_switches`: the reward model's session switches (`load_reward`), for a reward
        loaded here (not shared)."""
        if share is not None and (share.config.models != config.models or share.config.resources != config.resources):
            raise ValueError("models and resources: a runner sharing an engine needs the same models and resources")
        if share is not None and config.draft_needed_by and share.engine.draft is None:
            raise ValueError(f"models.draft: {config.draft_needed_by} needs the draft, which the shared engine has not "
                             "loaded")
        self.config = config
        self.params = config.method
        self.engine: Engine = share.engine if share is not None else engine if engine is not None else \
            new_engine(config)
        e = self.engine
        self.tokenizer, self.eos_ids, self.pad_id, self.context_length = e.tokenizer, e.eos_ids, e.pad_id, \
            e.context_length
        # A fast tokenizer may not be used from two threads at once: the calls encode their prompts with this one,
        # one call at a time, and the method decodes its responses with a copy (in the decoding loop's thread).
        self.encoding = threading.Lock()
        self.decoding_tokenizer = copy.deepcopy(self.tokenizer)
        if self.context_length is None:
            log.warning("models.target %s: its config has no max_position_embeddings, so prompts are not checked "
                        "against a context length (each response may still take generation.max_new_tokens)",
                        config.models.target)
        self.reward: Scorer | None = share.reward if share is not None else \
            load_reward(config, self.engine, **(reward_switches or {}))
        self.verifier: Verifier | None = share.verifier if share is not None else load_verifier(config)
        self.verdict_reward = getattr(config.models.reward, "kind", None) in VERIFIER_REWARDS
        self.engine.start()  # vLLM's engine, after the reward model: its CPU worker pins this process's threads
        self.devices = config.resources.gpus_per_worker or 1.0  # what an actor's busy time is multiplied by
        self.loop = Loop(config.concurrent_calls > 1, self.devices) if self.params.pool else None
        self.lock = threading.Lock()  # the other methods: one call at a time

    # -- prompts -------------------------------------------------------------------------------------------------
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
        name = self.params.name
        if max_new_tokens is None:
            max_new_tokens = self.config.generation.max_new_tokens
        ready: list[tuple[int, PromptInput]] = []
        errors: dict[int, dict] = {}
        for i, item in enumerate(items):
            problem = prompt_problem(item["prompt"])
            if problem is None:
                ids = self.encode_prompt(item["prompt"])
                if self.context_length is not None and len(ids) >= self.context_length:
                    problem = (f"prompt is {len(ids)} tokens; the target's context is {self.context_length} "
                               "tokens")
            if problem is not None:
                errors[i] = error_row(item["prompt_id"], item["prompt"], name, problem)
                continue
            concepts = item.get("concepts")
            room = None if self.context_length is None else self.context_length - len(ids)
            limit = max_new_tokens if room is None else min(max_new_tokens, room)
            prompt = PromptInput(item["prompt_id"], item["prompt"], ids, prompt_key(item["prompt_id"]), limit,
                                 list(concepts) if concepts is not None else None, item.get("columns"))
            ready.append((i, prompt))
        return ready, errors

    def context_for(self) -> Context:
        """What the method and its pool share for a batch: the tokenizer and stop tokens, the reward, the method's
        sampling (`Context.for_method`) and the seed, the hf engine's models, and what a pool's decoder may take:
        the engine's KV space read now, and models.max_num_seqs."""
        e = self.engine
        ctx = Context(self.decoding_tokenizer, self.eos_ids, self.pad_id, self.reward,
                      Sampling.of(self.config.generation), self.config.seed, target=e.target, draft=e.draft,
                      verifier=self.verifier, verdict_reward=self.verdict_reward, kv_space=e.kv_space(),
                      width=self.config.models.width(self.params.candidates()))
        return ctx.for_method(self.params)

    def open_pool(self) -> Pool:
        """A fresh candidate pool for the method on the engine."""
        ctx = self.context_for()
        return Pool.for_method(ctx, self.engine.decoder(ctx, self.params), self.params)

    # -- a call --------------------------------------------------------------------------------------------------
    def run(self, items: list[dict]) -> list[dict]:
        """One output row per input prompt, in order (error rows for prompts that cannot run). Safe to call from
        several threads at once: the calls of a pool method feed its loop, the others take turns."""
        with self.encoding:
            ready, errors = self.prepare(items)
        out: list[dict | None] = [errors.get(i) for i in range(len(items))]
        if not ready:
            return out
        prompts = [p for _, p in ready]
        self.engine.check(prompts, self.params, self.reward)  # a prompt too large for the memory fails here
        if self.loop is not None:
            outcomes = self._feed(prompts)
        else:
            with self.lock:
                outcomes = self._run_chunks(prompts)
        for (i, p), o in zip(ready, outcomes):
            out[i] = self.row(p, o)
        return out

    def _feed(self, prompts: list[PromptInput]) -> list[Outcome]:
        """A call of a pool method through the actor's decoding loop. The call that finds the loop idle opens it: a
        fresh pool, served by the engine in the thread that steps it; if that fails, every call waiting fails."""
        call = self.loop.submit(prompts)
        if call.opens:
            try:
                self.engine.serve(functools.partial(self.loop.serve, self.open_pool()))
            except BaseException as err:  # noqa: BLE001 - not swallowed: each waiting call (this one too) raises it
                self.loop.fail(err)
        return self.loop.wait(call)

    @torch.inference_mode()
    def _run_chunks(self, prompts: list[PromptInput]) -> list[Outcome]:
        """A method that is not a candidate pool, on the hf engine: the prompts in chunks that fit in memory, each
        chunk's costs taken before its quality measures run (they are not billed): what the method ran, charged
        to the chunk's meter."""
        started = time.perf_counter()
        out: list[Outcome] = []
        for chunk in self.engine.memory_chunks(prompts, self.params, self.reward):
            ps = [prompts[i] for i in chunk]
            ctx = self.context_for()
            results, work = run_method(ctx, self.params, ps)
            self.engine.synchronize()
            if self.verifier is not None:  # judged before the cost window closes: the actor waits for it
                self._judge(ps, results)
            meter = Meter(len(ps))
            meter.started = started
            meter.charge(work)
            costs = meter.per_prompt(self.devices)  # the cost window closes here
            add_perplexities(ctx, ps, results)
            out += [Outcome(r, c, int(t)) for r, c, t in zip(results, costs, meter.reward_inputs_truncated.tolist())]
            started = time.perf_counter()
        return out

    def _judge(self, prompts: list[PromptInput], results: list) -> None:
        """The verifier's verdicts on the finished candidates of a method with a loop of its own, all submitted at
        once (judged in parallel), then settled as a pool settles them (`settle_verdicts`)."""
        futures = []
        for p, res in zip(prompts, results):
            futures.append({i: self.verifier.submit(c.text, p.columns or {}, p.messages)
                            for i, c in enumerate(res.candidates) if c.finish_reason != "rejected"})
        for res, judged in zip(results, futures):
            verdicts = {i: f.result() for i, f in judged.items()}
            res.best_index, checked = settle_verdicts(res.candidates, verdicts, self.verdict_reward, res.best_index,
                                                      ranks=self.params.ranks_by_reward)
            res.stats.update(checked)

    # -- responses given, not generated (`winnow score`) -----------------------------------------------------------
    @torch.inference_mode()
    def score_responses(self, items: list[dict], responses: list[str]) -> list[dict]:
        """Each given response scored by the job's reward and judged by its verifier, as a finished candidate of a
        run would be: {score, verified, reason, answer} per item, in order. `items` are input prompts (as `run`
        takes them, with `columns`); an item whose prompt cannot run gets its problem as `reason` and no score."""
        ready, errors = self.prepare(items)
        out = [{"score": None, "verified": None, "reason": errors[i]["error"], "answer": None} if i in errors else None
               for i in range(len(items))]
        if not ready:
            return out
        tok = self.tokenizer
        scored = [Scored(k, p.messages, responses[i], p.ids, tok(responses[i], add_special_tokens=False)["input_ids"],
                         p.concepts, None, p.columns) for k, (i, p) in enumerate(ready)]
        scores = self.reward(scored).values if self.reward is not None else [None] * len(scored)
        futures = [self.verifier.submit(it.text, it.row or {}, it.prompt) if self.verifier is not None else None
                   for it in scored]
        for (i, _), score, future in zip(ready, scores, futures):
            v = future.result() if future is not None else None
            if v is not None and self.verdict_reward:
                score = 1.0 if v.verified else 0.0
            out[i] = {"score": score, "verified": None if v is None else v.verified,
                      "reason": None if v is None else v.reason, "answer": None if v is None else v.answer}
        return out

    def row(self, p: PromptInput, o: Outcome) -> dict:
        """Prompt p's output row (schemas.rows.ROW_SCHEMA) from its outcome: the method's result, its cost struct,
        and its reward inputs cut to the reward model's context (a stat only where a reward model has a context)."""
        res = o.result
        best = res.best_index
        cand = res.candidates[best] if best is not None else None
        if cand is not None:
            res.stats.update(constraint_stats(cand.text, p.concepts))
        with_truncated = self.reward is not None and self.reward.cuts_inputs
        return {
            "prompt_id": p.prompt_id,
            "prompt": p.messages,
            "method": self.params.name,
            "candidates": [c.struct() for c in res.candidates],
            "best_index": best,
            "best_text": cand.text if cand else None,
            "best_reward": cand.reward if cand else None,
            "cost": o.cost,
            "stats": {"prompt_tokens": len(p.ids), **res.stats, **o.steps,
                      **({"reward_inputs_truncated": o.truncated} if with_truncated else {})},
            "error": None,
        }
