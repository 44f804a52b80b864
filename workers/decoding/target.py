"""The target sampler: a candidate pool's sequences sampled from the target alone, one token per sequence per step.

A *sampler* (here and in `workers.decoding.speculative`) is how the hf engine turns a pool's sequences into tokens:
`prefill` starts prompts (each prefilled once, its first token sampled for every candidate), `step` samples the next
token of every sequence, `done` says which have finished. Draws are counter-based (`workers.decoding.sampling`), so
a sequence's tokens do not depend on the sequences batched with it. A sampler records the forwards it runs in its
own `Work`, which its decoder takes after each call (`take_work`) and hands up with the step's output.

The target sampler's step is dynamic (the cache and the width exactly as the sequences need) or static
(`workers.decoding.static_step`: fixed storage and widths in buckets, each bucket's step captured in a CUDA graph on a
GPU). A static sampler moves a batch's repeated cache into its storage at the batch's first step; a batch whose
prompts share their cache keeps the dynamic step.
"""

from __future__ import annotations

import torch

from workers.accounting.work import Work
from workers.decoding.batch import Batch, Prefilled, forward, left_pad
from workers.decoding.kvcache import model_kv_bytes, new_cache
from workers.decoding.sampling import STREAM_TOKEN, Warp, next_tokens_and_logprobs, uniforms
from workers.decoding.shared_prefix import SharedPrefixCache, share
from workers.decoding.static_step import StaticCache, steps_exactly


class TargetSampler:
    """Target-only batched sampling: prefill once per prompt, one token per sequence per step."""

    role = "target"
    columns_per_step = 1  # KV columns a step adds to every sequence
    admits = True  # prompts may join a batch while it decodes (`Batch.extend`)

    def __init__(
        self,
        model: torch.nn.Module,
        pad_id: int,
        eos_ids: list[int],
        warp: Warp,
        seed: int,
        step: str = "dynamic",
        capture: bool = True,
    ):
        """`step`: 'dynamic' or 'static' (kept dynamic for a model whose static step would not give its own logits,
        `steps_exactly`); `capture`: whether a static step is captured in CUDA graphs on a CUDA device."""
        if step not in ("dynamic", "static"):
            raise ValueError(f"TargetSampler: step must be 'dynamic' or 'static', not {step!r}")
        self.model = model
        self.device = next(model.parameters()).device
        self.pad_id = pad_id
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=self.device)
        self.warp = warp
        self.seed = seed
        self.work = Work()  # the forwards run since the decoder last took them
        self.kv_bytes_per_column = model_kv_bytes(model)
        self.static = step == "static" and steps_exactly(model)
        self.capture = capture
        self.store: StaticCache | None = None  # the static step's storage, reused by the next batch once empty

    def take_work(self) -> Work:
        """The forwards run since the last call, handed to the decoder (a fresh record starts)."""
        work, self.work = self.work, Work()
        return work

    def stats(self, group: int) -> dict:
        """Method-specific measurements of one prompt (none for plain sampling)."""
        return {}

    # -- prefill -----------------------------------------------------------------------------------------------
    def prefill(
        self, prompts: list[list[int]], n: int, rng_keys: list[int], limits: list[int], first_group: int = 0
    ) -> Batch:
        """Prefill each prompt once, share (or repeat) its cache across its n candidates, and sample every
        sequence's first token. The prompts are groups first_group, first_group + 1, ... of the batch."""
        groups = list(range(first_group, first_group + len(prompts)))
        return self.begin(self.encode(prompts, groups), n, rng_keys, limits)

    def encode(self, prompts: list[list[int]], groups: list[int]) -> Prefilled:
        """The prompts' prefill, one forward (left-padded), counted for prompts `groups`: their caches and the
        logits of their first tokens, for `begin` now or later."""
        ids, mask = left_pad(prompts, self.pad_id, self.device)  # [P, L]
        cache = new_cache(self.model.config)
        group = torch.tensor(groups, dtype=torch.long, device=self.device)
        logits = forward(self.model, self.role, ids, mask, cache, group, self.work)[:, -1]  # [P, V]
        return Prefilled(cache, mask, logits, list(groups))

    def begin(self, pre: Prefilled, n: int, rng_keys: list[int], limits: list[int]) -> Batch:
        """Start n candidates of each prefilled prompt (rng_keys and limits in its order): the prompt's cache held
        once for its candidates where that is exact and worth it (else repeated), every sequence's first token
        sampled from the prompt's logits. Takes `pre`'s cache."""
        dev, p = self.device, len(pre.groups)
        shared = share(self.model, pre.cache, torch.arange(p, device=dev).repeat_interleave(n), self.kv_bytes_per_column)
        if shared is None:
            pre.cache.batch_repeat_interleave(n)
        batch = Batch(
            cache=shared if shared is not None else pre.cache,
            mask=pre.mask.repeat_interleave(n, 0),
            pending=torch.zeros(p * n, dtype=torch.long, device=dev),
            group=torch.tensor(pre.groups, dtype=torch.long, device=dev).repeat_interleave(n),
            cand=torch.arange(n, device=dev).repeat(p),
            rng_key=torch.tensor(rng_keys, dtype=torch.long, device=dev).repeat_interleave(n),
            length=torch.zeros(p * n, dtype=torch.long, device=dev),
            limit=torch.tensor(limits, dtype=torch.long, device=dev).repeat_interleave(n),
            tokens=torch.full((p * n, max(limits)), self.pad_id, dtype=torch.long, device=dev),
            alive=torch.ones(p * n, dtype=torch.bool, device=dev),
            logprob=torch.zeros(p * n, dtype=torch.float64, device=dev),
        )
        self._sample_into(batch, pre.logits.repeat_interleave(n, 0))
        return batch

    # -- decode --------------------------------------------------------------------------------------------------
    def step(self, batch: Batch) -> None:
        """Feed every sequence's pending token and sample its next one."""
        if self.static and not isinstance(batch.cache, (StaticCache, SharedPrefixCache)):
            batch.cache = self._into_store(batch)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(batch.size, 1)], dim=1)  # [B, L+1]
        logits = forward(self.model, self.role, batch.pending[:, None], batch.mask, batch.cache, batch.group,
                         self.work, counted=batch.alive)
        self._sample_into(batch, logits[:, -1])

    def _into_store(self, batch: Batch) -> StaticCache:
        """The batch's cache moved into the static storage: this sampler's, once no batch holds rows in it (else a
        store of its own), room made for the tokens its sequences may still take."""
        if self.store is None or self.store.rows:
            self.store = StaticCache(self.model, self.capture)
        columns = batch.kv_columns()
        left = int((batch.limit - batch.length).max()) if batch.size else 0
        return self.store.load(batch.cache, batch.size, columns, columns + left + 1)

    def release(self) -> None:
        """Drop the static storage and its graphs (the decoder is closed)."""
        self.store = None

    def _sample_into(self, batch: Batch, logits: torch.Tensor) -> None:
        """Sample each sequence's next token from `logits` [B, V] (warped), and record its log-probability under the
        unwarped logits (temperature 1): the `logprob` reward and the perplexity read it, no forward needed."""
        u = uniforms(self.seed, batch.rng_key, batch.cand, batch.length, STREAM_TOKEN)
        tok, logp = next_tokens_and_logprobs(logits, self.warp, u)  # [B], [B]
        batch.append_pending(tok, logp)

    def finished(self, batch: Batch) -> torch.Tensor:
        """[B] bool: alive sequences whose last token is EOS or that reached their limit."""
        return batch.alive & (torch.isin(batch.pending, self.eos) | (batch.length >= batch.limit))

    def is_eos(self, tok: torch.Tensor) -> torch.Tensor:
        return torch.isin(tok, self.eos)
