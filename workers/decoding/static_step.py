"""The target's decoding step in static shapes, which a GPU replays from a CUDA graph (`models.decode_step`).

At the sizes one device runs (135M-1B parameters, tens to hundreds of sequences), a GPU finishes a decoding step's
arithmetic long before the host has launched its kernels: some 15 a layer. A CUDA graph records a step's kernels
once and replays them in one launch, but only where every shape and every address repeats. The dynamic step
(`workers.decoding.batch.forward` on a growing cache) repeats neither: the mask grows a column a step, compaction and
joins change the rows, the cache moves its storage as it grows.

A `StaticCache` holds the batch's keys and values in fixed storage, and the step's inputs in fixed buffers:

- a step of r sequences over c columns runs at its *bucket* (row_bucket(r), column_bucket(c)): the spare rows are
  *padding rows* (their outputs are dropped; a row's computation never reads another row's), the spare columns are
  holes of the mask (never attended to);
- the *storage*: per layer keys and values [R, H, C, D] (R rows and C columns of capacity, both buckets), zeros where
  nothing was written, so that a hole's value is finite (attention multiplies it by a probability of exactly 0);
- the *inputs*: token ids and positions [R, 1], the mask [R, C] (bool) and the column the step writes [1], copied in
  before each step;
- a *graph* (CUDA): one bucket's step, captured at its second step (a bucket met once, as rows leave and join, is not
  worth a capture) and replayed at every later step of that bucket. The storage moves only when the batch outgrows
  it (`_fit`: more rows joined, or longer responses), and then the graphs over it are dropped.

The batch's operations keep their meaning: `batch_select_indices` moves the kept rows down in place, `join` appends
freshly prefilled prompts right-aligned (as `kvcache.join_caches` does), `drop_left` drops leading hole columns once
there are COLUMN_STEP of them (a shift of the storage, where the dynamic cache takes a view). The prefill, the
shared-prefix cache (`workers.decoding.shared_prefix`) and the speculative sampler keep the dynamic step.

`steps_exactly(model)` checks once per model that the static step gives the dynamic step's logits (sdpa attention,
plain full-attention layers, a model that takes a prepared 4D mask); a model that fails keeps the dynamic step.
"""

from __future__ import annotations

import logging
import weakref

import torch
from transformers import DynamicCache

from workers.decoding.kvcache import cache_kw, layers_of, new_cache, plain_columns

log = logging.getLogger(__name__)

COLUMN_STEP = 64  # columns of a column bucket's step (and the leading holes worth a shift, `drop_left`)


def row_bucket(rows: int) -> int:
    """The rows a step of `rows` sequences runs at: `rows` itself up to 16, then rounded up to a step of an eighth of
    the largest power of two below it (18, 20, ..., 32, then 36, 40, ..., 64, then 72, ...), so that padding rows are
    fewer than an eighth of the rows and a doubling of the rows passes through eight buckets."""
    if rows <= 16:
        return max(rows, 1)
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def column_bucket(columns: int) -> int:
    """The columns a step over `columns` columns attends to: rounded up to a multiple of COLUMN_STEP."""
    return -(-max(columns, 1) // COLUMN_STEP) * COLUMN_STEP


class StaticCache(DynamicCache):
    """A batch's keys and values in fixed storage, and its decoding step in static shapes (module docstring).

    `rows` and `columns` are those in use (every row holds `columns` columns, its holes masked by the batch);
    `horizon` the columns the rows in use need to finish (their columns now and their tokens left); `capture`:
    whether steps are captured in CUDA graphs (a CUDA device only)."""

    def __init__(self, model: torch.nn.Module, capture: bool = False):
        super().__init__()
        self.model = model
        self.device = next(model.parameters()).device
        self.capture = capture and self.device.type == "cuda"
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self.keys_: list[torch.Tensor] = []  # per layer [R, H, C, D]
        self.values_: list[torch.Tensor] = []
        self.rows = self.columns = self.horizon = 0
        self.view = (0, 0)  # the bucket of the forward running now (read by `update`)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.seen: set[tuple[int, int]] = set()  # the buckets stepped over this storage
        self.pool = None  # the memory pool of the graphs over this storage (CUDA)
        self.out: torch.Tensor | None = None  # [R, V] float32: where a replayed graph leaves its logits
        self.captures = 0  # graphs captured so far (tests, benches)

    # -- capacity ----------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> tuple[int, int]:
        """(R, C): rows and columns the storage holds."""
        return (self.keys_[0].shape[0], self.keys_[0].shape[2]) if self.keys_ else (0, 0)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys_ + self.values_)

    def _fit(self, rows: int, columns: int, like: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Storage for `rows` rows of `columns` columns (both rounded up to buckets), the rows and columns in use
        copied; new storage drops the graphs over the old. `like`: each layer's (keys, values) of another cache,
        whose heads, head size and dtype the first storage takes."""
        cap_rows, cap_cols = self.capacity
        if rows <= cap_rows and columns <= cap_cols:
            return
        new_rows, new_cols = max(cap_rows, row_bucket(rows)), max(cap_cols, column_bucket(columns))
        ref = like if not self.keys_ else list(zip(self.keys_, self.values_))
        keys, values = [], []
        for li, (k, v) in enumerate(ref):
            nk = k.new_zeros((new_rows, k.shape[1], new_cols, k.shape[-1]))
            nv = v.new_zeros((new_rows, v.shape[1], new_cols, v.shape[-1]))
            if self.keys_ and self.rows and self.columns:
                nk[: self.rows, :, : self.columns] = k[: self.rows, :, : self.columns]
                nv[: self.rows, :, : self.columns] = v[: self.rows, :, : self.columns]
            keys.append(nk)
            values.append(nv)
        self.keys_, self.values_ = keys, values
        dev = self.device
        self.ids = torch.zeros((new_rows, 1), dtype=torch.long, device=dev)  # [R, 1]
        self.pos = torch.zeros((new_rows, 1), dtype=torch.long, device=dev)  # [R, 1]
        self.mask = torch.zeros((new_rows, new_cols), dtype=torch.bool, device=dev)  # [R, C]
        self.col = torch.zeros(1, dtype=torch.long, device=dev)  # the column this step writes
        self.graphs.clear()
        self.seen.clear()
        self.out = None
        if self.capture:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(dev)
            self.out = torch.empty((new_rows, self.vocab), dtype=torch.float32, device=dev)

    # -- the batch's operations ------------------------------------------------------------------------------
    def load(self, cache: DynamicCache, rows: int, columns: int, horizon: int) -> "StaticCache":
        """Take a freshly started batch's cache (`rows` rows of `columns` columns, plain layers) into the storage,
        room made for `horizon` columns. Returns self."""
        layers = layers_of(cache)
        self.rows = self.columns = 0
        self._fit(rows, horizon, like=layers)
        for li, (k, v) in enumerate(layers):
            self.keys_[li][:rows, :, :columns] = k
            self.values_[li][:rows, :, :columns] = v
        self.rows, self.columns, self.horizon = rows, columns, horizon
        return self

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.columns

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (in that order), moved to the first rows of the storage."""
        idx = indices.to(self.device)
        r, n = self.rows, self.columns
        if n:
            for t in self.keys_ + self.values_:
                t[: idx.numel(), :, :n] = t[:r, :, :n].index_select(0, idx)
        self.rows = int(idx.numel())

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a static cache's rows are selected or joined, not repeated")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a static cache is not cropped")

    def join(self, other: DynamicCache, rows: int, columns: int, horizon: int) -> None:
        """Append `other`'s `rows` rows of `columns` columns (freshly prefilled prompts needing `horizon` columns)
        below the rows in use, both right-aligned to the wider one's columns, as `kvcache.join_caches` does; the
        narrower side's leading columns become holes (the caller masks them)."""
        n = self.columns
        width = max(n, columns)
        shift = width - n
        self._fit(self.rows + rows, max(self.horizon + shift, horizon + width - columns))
        for li, (k, v) in enumerate(layers_of(other)):
            for store, new in ((self.keys_[li], k), (self.values_[li], v)):
                if shift and n:
                    store[: self.rows, :, shift:width] = store[: self.rows, :, :n].clone()
                store[self.rows: self.rows + rows, :, width - columns: width] = new
        self.rows += rows
        self.columns = width
        self.horizon = max(self.horizon + shift, horizon + width - columns)

    def drop_left(self, columns: int) -> int:
        """Drop the first `columns` columns (holes in every row) once they are COLUMN_STEP or more, by shifting
        the columns in use to the storage's start; returns how many were dropped (0 below COLUMN_STEP: holes cost
        a static step only the columns of its bucket)."""
        if columns < COLUMN_STEP:
            return 0
        r, n = self.rows, self.columns
        for t in self.keys_ + self.values_:
            t[:r, :, : n - columns] = t[:r, :, columns:n].clone()
        self.columns -= columns
        self.horizon = max(self.horizon - columns, self.columns)
        return columns

    # -- the step --------------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's keys and values [rb, H, 1, D] at the step's column; return the bucket's keys and values
        [rb, H, cb, D] (views of the storage: their addresses repeat from step to step)."""
        rb, cb = self.view
        k = self.keys_[layer_idx][:rb, :, :cb]
        v = self.values_[layer_idx][:rb, :, :cb]
        k.index_copy_(2, self.col, key_states)
        v.index_copy_(2, self.col, value_states)
        return k, v

    def step(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One decoding step: `input_ids` [r, 1] fed at column c - 1 under `mask` [r, c] (the cache's columns and
        the new one). Returns the logits [r, 1, V] float32."""
        r, c = mask.shape
        if r != self.rows or c != self.columns + 1:
            raise RuntimeError(f"StaticCache: a step of {r} rows over {c} columns on a cache of {self.rows} rows "
                               f"and {self.columns} columns")
        self._fit(r, c)
        rb, cb = row_bucket(r), column_bucket(c)
        self.ids[:r].copy_(input_ids)
        self.pos[:r, 0] = mask.sum(-1) - 1  # position ids count only real columns
        m = self.mask[:rb, :cb]
        m.zero_()
        m[:r, :c] = mask.bool()
        m[r:, c - 1] = True  # a padding row attends to its own new column: a finite row, dropped
        self.col.fill_(c - 1)
        self.columns = c
        graph = self.graphs.get((rb, cb))
        if graph is None and self.capture and (rb, cb) in self.seen:
            graph = self._capture(rb, cb)
        if graph is None:  # no capture, or the bucket's first step (a bucket met once is not worth a capture)
            self.seen.add((rb, cb))
            return self._forward(rb, cb)[:r, None]
        graph.replay()
        return self.out[:r, None].clone()

    def _forward(self, rb: int, cb: int) -> torch.Tensor:
        """The model's forward over the bucket's buffers: logits [rb, V] float32."""
        self.view = (rb, cb)
        with torch.inference_mode():
            out = self.model(input_ids=self.ids[:rb], attention_mask=self.mask[:rb, :cb][:, None, None, :],
                             position_ids=self.pos[:rb], **cache_kw(self.model, self), use_cache=True,
                             logits_to_keep=1)
        return out.logits[:, -1].float()

    def _capture(self, rb: int, cb: int) -> torch.cuda.CUDAGraph:
        """Capture the bucket's step on a side stream, after a warm-up forward there (which writes the keys and
        values the step will write), its logits copied into `out`. `CUDAGraph.capture_begin` rather than
        `torch.cuda.graph`, which empties the allocator's cache at every capture."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            self._forward(rb, cb)
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                self.out[:rb].copy_(self._forward(rb, cb))
            finally:
                graph.capture_end()
        current.wait_stream(self.stream)
        self.graphs[(rb, cb)] = graph
        self.captures += 1
        return graph


# ---------------------------------------------------------------------------------------------------------------
# Whether a model's step may run static

_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def steps_exactly(model: torch.nn.Module) -> bool:
    """Whether the static step gives the model's dynamic-step logits (checked once per model): two prompts of
    unequal lengths (left padding), two rows each, three steps."""
    if model not in _VERDICTS:
        _VERDICTS[model] = _probe(model)
        log.info("target %s its decoding step in static shapes", "runs" if _VERDICTS[model] else "cannot run")
    return _VERDICTS[model]


@torch.inference_mode()
def _probe(model: torch.nn.Module) -> bool:
    from workers.decoding.shared_prefix import agrees, probe_inputs

    if model.config._attn_implementation != "sdpa" or not plain_columns(new_cache(model.config)):
        return False
    ids, mask, steps = probe_inputs(model, 3)
    try:
        outs = []
        for static in (False, True):
            cache = new_cache(model.config)
            model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                  **cache_kw(model, cache), use_cache=True)
            cache.batch_repeat_interleave(2)
            m = mask.repeat_interleave(2, 0)
            if static:
                cache = StaticCache(model).load(cache, 4, m.shape[1], m.shape[1] + 3)
            logits = []
            for t in range(3):
                m = torch.cat([m, m.new_ones(4, 1)], 1)
                tok = steps[:, t:t + 1]
                if static:
                    logits.append(cache.step(tok, m)[:, -1])
                else:
                    out = model(input_ids=tok, attention_mask=m, position_ids=(m.cumsum(-1) - 1)[:, -1:],
                                **cache_kw(model, cache), use_cache=True)
                    logits.append(out.logits[:, -1].float())
            outs.append(torch.stack(logits))
    except (NotImplementedError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as err:
        log.info("target cannot run its decoding step in static shapes: %s", err)
        return False
    return agrees(outs[0], outs[1], next(model.parameters()).dtype)
