"""Continuous batching across actor calls: one decoding loop per actor that every call feeds.

Ray Data hands an actor a batch of prompts per call (`resources.prompts_per_batch`). Decoding each call on its own
leaves the batch to drain: its last rows run alone while the next call's prompts wait in Ray's queue. Instead, the
actor takes up to two calls at once (`workers.calls`, Ray Data's `max_concurrent_calls_per_actor`), and both
feed one candidate pool (`workers.methods.rejection`) that a single thread decodes: a call's prompts wait in the
pool, start as memory frees (`Admission`, the same budget and per-prompt need as within one call), and leave it as
soon as each has every candidate ended and scored. A call returns its rows when its last prompt is done, so Ray
Data's commit per batch (and with it exactly-once) is unchanged; what changes is that the next batch's prompts
take the places of rows that finish early.

Sampled tokens do not depend on which prompts share a step (draws are keyed per prompt and candidate,
`workers.sampling`), and the fixed schedule keeps a clock per prompt, so a prompt's candidates are the same as when
its call decodes alone; rewards agree to float noise (scoring batches differ). The cost meter charges each stretch
of the loop's time to the prompts that caused its tokens (`workers.cost.Meter.tick`), so device seconds add up to
the loop's busy time however the calls overlapped; `wall_seconds` is the call's own wall time.

The loop's thread exists only while a call is in flight, and the pool (its KV cache, the reward session) is dropped
whenever the loop runs dry. If decoding raises, every call in flight fails with that error (Ray Data retries or
fails those batches) and the loop starts afresh with the next call.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from workers.cost import Meter
from workers.methods import POOL_PLANS
from workers.methods.common import PromptInput
from workers.methods.rejection import Admission, add_prompts, complete_prompts, open_pool, pool_step


@dataclass
class Call:
    """One actor call: its input items, its rows as they are made, its prompts in the pool (number -> (position,
    prompt)) and those not done yet."""

    items: list[dict]
    started: float = field(default_factory=time.perf_counter)
    out: list[dict | None] = field(default_factory=list)
    prompts: dict[int, tuple[int, PromptInput]] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class DecodeLoop:
    """`run(items)` from any thread of the actor returns `runner`'s rows for `items` (`workers.runner.Runner.run`'s
    contract), decoding them in the one pool that every call in flight feeds."""

    def __init__(self, runner):
        self.runner = runner
        self.lock = threading.Lock()
        self.incoming: list[Call] = []
        self.thread: threading.Thread | None = None
        self._idle()

    def _idle(self) -> None:
        self.calls: list[Call] = []
        self.plan = self.pool = self.meter = None

    def run(self, items: list[dict]) -> list[dict]:
        call = Call(items)
        with self.lock:
            self.incoming.append(call)
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, name="winnow-decode-loop", daemon=True)
                self.thread.start()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.out

    # -- the loop's thread ---------------------------------------------------------------------------------------
    def _serve(self) -> None:
        with torch.inference_mode():
            while True:
                with self.lock:
                    new, self.incoming = self.incoming, []
                    if not new and not self.calls:
                        self.thread = None
                        self._idle()  # the pool's cache and reward session go with it
                        return
                for call in new:
                    self._accept(call)
                if self.calls:
                    try:
                        self._turn()
                    except BaseException as err:  # noqa: BLE001 - the calls in flight fail with it, in their threads
                        for call in self.calls:
                            call.error = err
                            call.done.set()
                        self._idle()

    def _open(self) -> None:
        """A fresh pool, with the memory budget read now."""
        runner = self.runner
        self.meter = Meter(0)
        ctx = runner.context_for(self.meter)
        ctx.admission = Admission(runner.budget(), runner.memory_need)
        self.plan = POOL_PLANS[runner.config.method.name](ctx, runner.config.method)
        self.pool = open_pool([], self.plan.n, self.plan.sampler)

    def _accept(self, call: Call) -> None:
        """Put a call's runnable prompts in the pool; its error rows are made at once. A call that cannot run (a
        prompt too large for the memory alone) fails alone."""
        try:
            ready, errors = self.runner.prepare(call.items)
            call.out = [errors.get(i) for i in range(len(call.items))]
            if not ready:
                call.done.set()
                return
            if self.pool is None:
                self._open()
            self.runner.memory_groups(ready, self.plan.ctx.admission.budget)  # raises BatchTooLarge
        except BaseException as err:  # noqa: BLE001 - this call fails, in its own thread
            call.error = err
            call.done.set()
            return
        groups = add_prompts(self.pool, [p for _, p in ready])
        self.meter.grow(groups[-1] + 1 - self.meter.base)
        call.prompts = dict(zip(groups, ready))
        call.pending = set(groups)
        self.calls.append(call)

    def _turn(self) -> None:
        """One step of the pool, then the rows of every call whose prompts are all done."""
        pool_step(self.pool, self.plan)
        self.meter.tick()
        pending = set().union(*(c.pending for c in self.calls))
        ended = complete_prompts(self.plan.ctx, self.pool, pending)
        if not ended:
            return
        self.meter.tick()  # their final scoring is theirs
        for g in ended:
            for call in self.calls:
                call.pending.discard(g)
        for call in [c for c in self.calls if not c.pending]:
            self._finish(call)

    def _finish(self, call: Call) -> None:
        groups = sorted(call.prompts)
        results = [self.plan.result(self.pool, g) for g in groups]
        runner, meter = self.runner, self.meter
        runner.synchronize()
        costs = meter.per_prompt(runner.devices, groups, time.perf_counter() - call.started)
        truncated = [int(meter.reward_inputs_truncated[g - meter.base]) for g in groups]
        runner.fill_rows(self.plan.ctx, [call.prompts[g] for g in groups], results, costs, truncated, call.out)
        meter.pause()  # the quality measures' time is nobody's
        for g in groups:
            self.plan.forget(self.pool, g)
        self.calls.remove(call)
        meter.retire(min((g for c in self.calls for g in c.prompts), default=len(self.pool.prompts)))
        call.done.set()
