"""The hf engine (models.engine: hf): Winnow's own engine on transformers.

`HfEngine` loads the target (and the draft, where the method or its sampler needs one) on the actor's device, reads
the memory a batch may take (`kv_space`) and resolves how the target's decoding step runs (`decode_step`: static
shapes, captured in CUDA graphs on a GPU, or dynamic). `MemoryModel` says what a prompt's sequences may take at their
peak: one rule, which a decoder holds as its own and the engine uses to chunk prompts. `HfDecoder` is a candidate
pool's decoder on the loaded models (`workers.pool.decoder.Decoder`): one `Batch` decoded by the target sampler or
the speculative sampler (`workers.decoding`), prompts joining it as memory frees, rejected sequences dropped by
selection; built from a context alone (`HfDecoder(ctx, params)`), the same way by the actor's engine and by
`workers.methods.run_method`. The draft/target methods that are not candidate pools (beam, MJSD, CDSL, CDLH) run on
the same loaded models (`workers.methods`), in chunks of prompts that fit in memory (`memory_chunks`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from schemas.config import JobConfig
from schemas.methods import MethodParams
from workers.accounting.memory import device_free_bytes, free_memory_bytes, share_bytes
from workers.accounting.work import Work
from workers.loading import load_causal_lm, pick_device
from workers.candidates import PromptInput
from workers.context import Context
from workers.decoding.batch import Batch, Prefilled
from workers.decoding.kvcache import context_length, model_kv_bytes, storage_columns
from workers.decoding.shared_prefix import shares_exactly, worth_sharing
from workers.decoding.speculative import SpeculativeSampler
from workers.decoding.static_step import steps_exactly
from workers.decoding.target import TargetSampler
from workers.pool.decoder import Key, Seq, StepOutput
from workers.scoring.protocol import Scorer

log = logging.getLogger(__name__)

# Ended sequences leave the batch once they are at least 1/COMPACT_FRACTION of it (a selection copies the cache).
COMPACT_FRACTION = 8
MEMORY_FRACTION = 0.8  # of the device's free memory at the start of a batch, for its sequences


class BatchTooLarge(RuntimeError):
    """One prompt's sequences cannot fit in the worker's memory (the job fails with this message)."""


def batch_memory_need(rows: int, prompt_tokens: int, new_tokens: int, kv_bytes_per_token: int, vocab: int,
                      shared_prompt: bool = False) -> int:
    """Peak bytes of `rows` sequences of one prompt, an upper estimate: their KV cache at full length in the
    in-place storage of `workers.decoding.kvcache` (a quarter of headroom, at least MIN_HEADROOM columns; the
    prompt's columns held once when `shared_prompt`, `workers.decoding.shared_prefix`, else in every sequence), their
    token buffer (int64), and three float32 [rows, vocab] tensors per step (logits, warped logits, probabilities)."""
    length = prompt_tokens + new_tokens
    if shared_prompt:
        kv_columns = prompt_tokens + rows * storage_columns(new_tokens)
    else:
        kv_columns = rows * storage_columns(length)
    return kv_columns * kv_bytes_per_token + rows * (8 * length + 3 * 4 * vocab)


def eos_token_ids(generation_config, tokenizer) -> list[int]:
    """The tokenizer's EOS and every stop token of the model's generation config."""
    ids = set()
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError("models.target: neither the tokenizer nor the generation config defines an EOS token")
    return sorted(ids)


def pad_token_id(tokenizer, eos_ids: list[int]) -> int:
    """The tokenizer's pad token, else its first stop token."""
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else eos_ids[0])


@dataclass(frozen=True)
class MemoryModel:
    """What a prompt's running sequences may take on the hf engine at their peak (`need`): the rule of a pool's
    admission (its decoder's own) and of the chunks of the methods with a loop of their own (the engine's).

    `kv_bytes_per_token`: the KV cache of one token of one sequence, of every model that keeps one (the target, and
    the draft where it decodes beside it); `shares`: a prompt's cache may be held once for its candidates (a
    candidate pool's target sampler, where the target shares exactly and it is worth it); `reward_kv_bytes_per_token`:
    what a reward session keeps per token of a running candidate between decisions (Speculative Rejection's);
    `static`: the decoding step runs in static shapes, whose storage holds up to an eighth more rows than run
    (`workers.decoding.static_step.row_bucket`)."""

    target: torch.nn.Module
    kv_bytes_per_token: int
    vocab: int
    shares: bool
    reward_kv_bytes_per_token: int = 0
    static: bool = False

    @classmethod
    def of(cls, target: torch.nn.Module, draft: torch.nn.Module | None, params: MethodParams,
           reward: Scorer | None = None) -> "MemoryModel":
        """The model of a method's sequences on `target` (and `draft`, where it decodes beside it), with `reward`'s
        session caches where the method decides (a pool that scores its running candidates again)."""
        kv = model_kv_bytes(target) + (model_kv_bytes(draft) if draft is not None else 0)
        session = reward.session_kv_bytes_per_token if params.decides() and reward is not None else 0
        return cls(target, kv, target.get_output_embeddings().weight.shape[0], draft is None and params.pool,
                   session or 0)

    def need(self, prompt: PromptInput, rows: int, kv_tokens: int | None = None) -> int:
        """Bytes `rows` running sequences of a prompt may take at their peak (`batch_memory_need`), their KV cache
        within `kv_tokens` tokens when given (a Speculative Rejection prompt's KV space: the responses then share
        what is left after the prompt), with the reward session's caches."""
        new = prompt.limit
        if kv_tokens is not None:
            new = min(new, -(-max(0, kv_tokens - len(prompt.ids)) // rows) + 1)
        device = next(self.target.parameters()).device
        shared = self.shares and worth_sharing(len(prompt.ids), rows, self.kv_bytes_per_token, device) and \
            shares_exactly(self.target)
        need = batch_memory_need(rows, len(prompt.ids), new, self.kv_bytes_per_token, self.vocab, shared)
        if self.static:
            need += need // 8  # the bucket's padding rows
        if self.reward_kv_bytes_per_token:
            # the reward session keeps each running candidate's reward-model cache from one decision to the next
            need += rows * storage_columns(len(prompt.ids) + new) * self.reward_kv_bytes_per_token
        return need


def decode_step(setting: str, device: torch.device, target: torch.nn.Module | None = None) -> str:
    """How the target's decoding step runs (models.decode_step): 'static' (captured in CUDA graphs on a CUDA
    device) or 'dynamic'. With `target` given, a 'static' that the model cannot run (`steps_exactly`) raises
    ValueError."""
    if setting not in ("static", "dynamic"):
        raise ValueError(f"models.decode_step: {setting!r} is not one of static, dynamic")
    if setting == "static" and target is not None and not steps_exactly(target):
        raise ValueError("models.decode_step: 'static', but this target's step in static shapes does not give its "
                         "own logits (it needs sdpa attention and plain full-attention layers); use 'dynamic'")
    return setting


def start_thread(fn: Callable[[], None]) -> None:
    """Serve a decoding loop in a thread of its own (the hf engine's models may be stepped from any thread)."""
    threading.Thread(target=fn, name="winnow-decode-loop", daemon=True).start()


class HfEngine:
    """The target and draft of a job, loaded with transformers on the actor's device."""

    name = "hf"
    kv_space_bytes: int | None = None  # the pool's KV space, set by tests; None: MEMORY_FRACTION of the free memory

    def __init__(self, config: JobConfig):
        self.config = config
        m = config.models
        self.device = pick_device(config.resources.gpus_per_worker)
        target = load_causal_lm(m.target, "models.target", self.device, m.dtype, m.trust_remote_code)
        self.target, self.tokenizer = target.model, target.tokenizer
        self.draft = None
        if config.draft_needed_by:
            self.draft = load_causal_lm(m.draft, "models.draft", self.device, m.dtype, m.trust_remote_code).model
        self.eos_ids = eos_token_ids(getattr(self.target, "generation_config", None), self.tokenizer)
        self.pad_id = pad_token_id(self.tokenizer, self.eos_ids)
        self.context_length = context_length(self.target.config)
        self.decode_step = decode_step(m.decode_step, self.device, self.target)

    # -- memory ------------------------------------------------------------------------------------------------------
    def kv_space(self) -> int:
        """Bytes a batch's sequences may take (the pool's KV space): `kv_space_bytes` (tests), else
        models.kv_cache_mb, else MEMORY_FRACTION of the memory free now, or of this actor's share of its GPU where
        several actors share one (resources.gpus_per_worker below 1: `share_bytes`)."""
        if self.kv_space_bytes is not None:
            return self.kv_space_bytes
        mb = self.config.models.kv_space_mb
        if mb is not None:
            return int(mb * 2**20)
        share = self.config.resources.gpus_per_worker
        room = share_bytes(self.device, share)
        if room is not None and room <= 0:
            raise BatchTooLarge(
                f"resources.gpus_per_worker: {share:g} of this GPU ({torch.cuda.get_device_name(self.device)}, "
                f"{torch.cuda.get_device_properties(self.device).total_memory / 2**30:.1f} GiB) leaves nothing beside "
                f"the models this actor loaded ({torch.cuda.memory_reserved(self.device) / 2**30:.1f} GiB); give each "
                "actor a larger share")
        return int((free_memory_bytes(self.device) if room is None else room) * MEMORY_FRACTION)

    def memory_need(self, prompt: PromptInput, params: MethodParams, reward: Scorer | None = None) -> int:
        """Bytes one prompt's sequences may take at their peak, all its candidates running (`MemoryModel.need`, the
        rule its decoder admits it by): with the memory schedule, within the prompt's KV space."""
        kv_tokens = None if params.kv_grows() else len(prompt.ids) + params.kv_space_candidates() * prompt.limit
        return MemoryModel.of(self.target, self.draft, params, reward).need(prompt, params.candidates(), kv_tokens)

    def memory_chunks(self, prompts: list[PromptInput], params: MethodParams, reward: Scorer | None = None,
                      budget: int | None = None) -> list[list[int]]:
        """The prompts' indices in consecutive chunks that each fit in `budget` (default `self.kv_space()`); all of
        them when they fit (a *group* is one prompt's number in a pool; a chunk is several prompts). A prompt that cannot fit alone raises `BatchTooLarge` before anything is allocated for
        it. Splitting changes no sampled token (draws are keyed per prompt and candidate,
        `workers.decoding.sampling`), only how the batch is timed."""
        budget = self.kv_space() if budget is None else budget
        chunks: list[list[int]] = []
        used = budget + 1
        for i, prompt in enumerate(prompts):
            need = self.memory_need(prompt, params, reward)
            if need > budget:
                raise BatchTooLarge(
                    f"prompt {prompt.prompt_id!r}: {params.name} would hold about {need / 2**30:.1f} GiB (its "
                    f"sequences' KV cache and logits, {len(prompt.ids)} prompt tokens + up to {prompt.limit} new) but "
                    f"this worker has {budget / 2**30:.1f} GiB to give ({MEMORY_FRACTION:.0%} of the free "
                    f"{self.device.type} memory); lower method.n (or num_beams) or generation.max_new_tokens, or run "
                    "on a device with more memory"
                )
            if used + need > budget:
                chunks.append([])
                used = 0
            chunks[-1].append(i)
            used += need
        return chunks

    def check(self, prompts: list[PromptInput], params: MethodParams, reward: Scorer | None = None) -> None:
        """Raise `BatchTooLarge` when one of the prompts cannot fit in memory alone."""
        self.memory_chunks(prompts, params, reward)

    # -- decoding ----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to build: the models are loaded."""

    def serve(self, fn) -> None:
        """Run a decoding loop's function in a thread of its own (`workers.pool.loop`)."""
        start_thread(fn)

    def decoder(self, ctx: Context, params: MethodParams) -> "HfDecoder":
        """A candidate pool's decoder for a method's parameters, on the context's models, with the context's KV
        space and width (`Runner.context_for`: this engine's KV space read when the context was made, and
        models.max_num_seqs), its target's step as models.decode_step says: what `workers.methods.run_method` builds
        from the same context (with the device's default step)."""
        return HfDecoder(ctx, params, self.decode_step)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class HfDecoder:
    """A candidate pool's sequences (n candidates per prompt) in one `Batch` on the hf engine
    (`workers.pool.decoder.Decoder`), sampled by `ctx.sampling`'s sampler.

    What a prompt's running sequences may take is `need(prompt, rows, kv_tokens)` bytes, by the decoder's own
    memory model (`MemoryModel`, of its sampler's models and the context's reward); the pool starts prompts while
    the running ones' fit in the KV space (`ctx.kv_space`) and their sequences in the width (`ctx.width`). The target
    sampler lets prompts join the batch while it decodes (`Batch.extend`); the speculative sampler's prompts start
    together, as many as fit, and the next ones once the batch is empty (`joins`).

    A prefill here is a batched forward of its own, which a device bills about as a decoding step (and a start's
    output records as one, of one row per prompt). So the target sampler prefills the prompts that wait (`wait`)
    ahead of their start, many in one forward (those AHEAD_FRACTION of the KV space and AHEAD_TOKENS hold), and a start
    takes its prompts' caches and first logits from them with no forward of its own (`TargetSampler.begin`);
    the pool counts what they hold (`waiting_bytes`) in its KV space."""

    AHEAD_FRACTION = 1 / 16  # of the KV space, the most the prompts prefilled ahead hold
    AHEAD_TOKENS = 8192  # prompts x longest prompt, the most one prefill forward feeds beyond the prompts starting

    def __init__(self, ctx: Context, params: MethodParams, step: str = "dynamic"):
        """The decoder of a pool method's parameters (`params.candidates()` per prompt) on `ctx`'s models, its KV
        space `ctx.kv_space` (None: the device's free memory, read when asked) and its width `ctx.width` (None: no
        bound beyond the space); `step`: how the target sampler's step runs (`decode_step`; the speculative sampler's
        is dynamic)."""
        self.ctx, self.n, self.space = ctx, params.candidates(), ctx.kv_space
        self.width = ctx.width if ctx.width is not None else 2**62
        self.device = next(ctx.target.parameters()).device
        if ctx.sampling.sampler == "speculative":
            if ctx.draft is None:
                raise ValueError("models.draft: required by the speculative sampler")
            self.sampler = SpeculativeSampler(ctx.target, ctx.draft, ctx.sampling.gamma, ctx.pad_id, ctx.eos_ids,
                                              ctx.warp, ctx.seed)
            draft = ctx.draft
        else:
            self.sampler = TargetSampler(ctx.target, ctx.pad_id, ctx.eos_ids, ctx.warp, ctx.seed,
                                         decode_step(step, self.device))
            draft = None
        self.memory = MemoryModel.of(ctx.target, draft, params, ctx.reward)
        if isinstance(self.sampler, TargetSampler) and self.sampler.static:
            self.memory = replace(self.memory, static=True)
        self.joins = self.sampler.admits
        self.ahead = isinstance(self.sampler, TargetSampler)  # whether prompts are prefilled before they start
        self.queue: list[tuple[int, PromptInput]] = []  # the prompts that wait, in the order they will start
        self.ready: Prefilled | None = None  # the first of them, prefilled ahead: its rows from ready_from on
        self.ready_from = 0
        self.kv_bytes_per_token = self.sampler.kv_bytes_per_column
        self.vocab = ctx.target.get_output_embeddings().weight.shape[0]
        self.batch: Batch | None = None
        self.prompts: dict[int, PromptInput] = {}  # by group, while its sequences may run

    def _running(self) -> bool:
        """Whether the batch holds sequences: `finished` compacts a batch whose every row ended, and `drop` compacts
        at once, so a batch that holds rows has one alive (asked without waiting for the device)."""
        return self.batch is not None and self.batch.size > 0

    def need(self, prompt: PromptInput, rows: int, kv_tokens: int | None = None) -> int:
        return self.memory.need(prompt, rows, kv_tokens)

    def wait(self, groups: list[int], prompts: list[PromptInput]) -> None:
        self.queue += zip(groups, prompts)

    def waiting_bytes(self) -> int:
        """What the prefill ahead holds: its caches and logits, all of them until every prompt of it has started
        (a start copies its prompts' rows out)."""
        return self.ready.nbytes() if self.ready is not None else 0

    def start(self, groups: list[int], prompts: list[PromptInput]) -> StepOutput:
        work = Work()
        if not self.ahead:  # the speculative sampler: prefilled at their start, the draft too
            self.queue = [(g, p) for g, p in self.queue if g not in groups]
            self._prefilled(groups, work)
            new = self.sampler.prefill([p.ids for p in prompts], self.n, [p.rng_key for p in prompts],
                                       [p.limit for p in prompts], first_group=groups[0])
        else:
            new = self.sampler.begin(self._take(groups, work), self.n, [p.rng_key for p in prompts],
                                     [p.limit for p in prompts])
        self.prompts.update(zip(groups, prompts))
        b = self.batch
        if b is None or not b.size:
            self.batch = new
        else:
            b.extend(new, self.ctx.pad_id)
        return StepOutput(self._finished(), work.add(self.sampler.take_work()))

    @staticmethod
    def _prefilled(groups: list[int], work: Work) -> None:
        """A prefill of prompts `groups` was a batched forward of its own, one row per prompt: a step a device bills
        like any other."""
        work.step(torch.tensor(groups), torch.ones(len(groups), dtype=torch.long))

    def _take(self, groups: list[int], work: Work) -> Prefilled:
        """Prompts `groups` (the first that wait, in order) prefilled: taken from those prefilled ahead (copied out,
        the others left in place), the rest prefilled now in one forward with the prompts that wait after them, as
        many as AHEAD_FRACTION of the KV space and AHEAD_TOKENS hold (the ones that start now whatever they hold)."""
        if [g for g, _ in self.queue[: len(groups)]] != list(groups):
            raise RuntimeError(f"HfDecoder: prompts {groups} start out of their order {[g for g, _ in self.queue]}")
        if self._ready_rows() < len(groups):
            more = self._prefill_ahead(len(groups) - self._ready_rows(), work)
            if self._ready_rows():
                more = self.ready.take(list(range(self.ready_from, len(self.ready.groups)))).join(more)
            self.ready, self.ready_from = more, 0
        taken = self.ready.take(list(range(self.ready_from, self.ready_from + len(groups))))
        self.ready_from += len(groups)
        if self.ready_from == len(self.ready.groups):
            self.ready, self.ready_from = None, 0
        self.queue = self.queue[len(groups):]
        return taken

    def _ready_rows(self) -> int:
        return len(self.ready.groups) - self.ready_from if self.ready is not None else 0

    def _prefill_ahead(self, least: int, work: Work) -> Prefilled:
        """Prefill the first prompts that wait and are not prefilled yet: at least `least` of them, then more while
        their caches and logits stay within AHEAD_FRACTION of the KV space and the forward within AHEAD_TOKENS
        (prompts x the longest)."""
        todo = self.queue[self._ready_rows():]
        space = self.kv_space()
        left = self.waiting_bytes() * self._ready_rows() // len(self.ready.groups) if self.ready is not None else 0
        budget = (space or 0) * self.AHEAD_FRACTION - left  # the rows left join the new ones
        per_token = self.kv_bytes_per_token
        take, held, longest = 0, 0, 0
        for _, p in todo:
            bytes_ = len(p.ids) * per_token + 4 * self.vocab
            wider = max(longest, len(p.ids))
            if take >= least and (held + bytes_ > budget or (take + 1) * wider > self.AHEAD_TOKENS):
                break
            take, held, longest = take + 1, held + bytes_, wider
        groups = [g for g, _ in todo[:take]]
        self._prefilled(groups, work)
        return self.sampler.encode([p.ids for _, p in todo[:take]], groups)

    def step(self) -> StepOutput:
        if self._running():
            self.sampler.step(self.batch)
        return StepOutput(self._finished(), self.sampler.take_work())

    @staticmethod
    def _seqs(b: Batch, idx: torch.Tensor | None = None) -> list[Seq]:
        """The batch's sequences (rows `idx`, default all) as the pool sees them."""
        if idx is not None:
            group, cand, tokens, length, logprob = b.group[idx], b.cand[idx], b.tokens[idx], b.length[idx], \
                b.logprob[idx]
        else:
            group, cand, tokens, length, logprob = b.group, b.cand, b.tokens, b.length, b.logprob
        return [Seq(key, t[:k], lp) for key, t, k, lp in zip(zip(group.tolist(), cand.tolist()), tokens.tolist(),
                                                            length.tolist(), logprob.tolist())]

    def _finished(self) -> list[Seq]:
        """The sequences that finished since the last call (their rows marked dead: they leave at a compaction)."""
        b = self.batch
        if b is None:
            return []
        out = []
        done = self.sampler.finished(b)
        flags = torch.stack([done, b.alive]).cpu()  # the host's one wait for the device in a turn of the pool
        if bool(flags[0].any()):
            out = self._seqs(b, done.nonzero().flatten())
            b.alive &= ~done
        b.compact(min_dead=max(1, b.size // COMPACT_FRACTION), alive=flags[1] & ~flags[0])
        return out

    def running(self) -> list[Seq]:
        b = self.batch
        if b is None:
            return []
        b.compact()  # every row alive: rows and running sequences are one
        return self._seqs(b)

    def lengths(self) -> dict[int, list[int]]:
        b = self.batch
        out: dict[int, list[int]] = {}
        if b is not None:
            for g, length in zip(b.group[b.alive].tolist(), b.length[b.alive].tolist()):
                out.setdefault(g, []).append(length)
        return out

    def drop(self, keys: Sequence[Key]) -> Work:
        if not keys:
            return Work()
        b = self.batch
        gone = set(keys)
        rows = [r for r, key in enumerate(zip(b.group.tolist(), b.cand.tolist())) if key in gone]
        b.alive[torch.tensor(rows, dtype=torch.long, device=b.alive.device)] = False
        b.compact()
        return Work()

    def kv_space(self) -> int | None:
        """The pool's KV space: as given, else the device's free memory (the host's available memory on CPU)."""
        return self.space if self.space is not None else device_free_bytes(self.device)

    def stats(self, group: int) -> dict:
        return self.sampler.stats(group)

    def forget(self, group: int) -> None:
        self.prompts.pop(group, None)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.batch = self.ready = None
        if isinstance(self.sampler, TargetSampler):
            self.sampler.release()
        self.ready_from = 0
        self.prompts.clear()
        self.queue.clear()
