"""One decoding loop per actor, fed by every actor call in flight (continuous batching across calls).

Ray Data hands an actor a batch of prompts per call (`resources.prompts_per_batch`). Decoding each call on its own
leaves the batch to drain: its last sequences run alone while the next call's prompts wait in Ray's queue. Instead,
where the method allows it (`JobConfig.concurrent_calls`), the actor takes up to two calls at once and both feed one
candidate pool (`workers.pool.pool.Pool`) that a single thread decodes: a call's prompts wait in the pool, start as
the decoder has room (`Decoder.admit`), and leave it as soon as each has every candidate ended and scored. A call
returns when its last prompt is done, so Ray Data's commit per batch (and with it exactly-once) is unchanged; what
changes is that the next batch's prompts take the places of sequences that finish early. Where the method does not
allow it (Speculative Rejection's memory schedule, whose decisions depend on which prompts share the cache), the
loop takes one call at a time.

The loop serves both engines the same way; what differs is the thread it runs in (`serve`): a thread started for
each run of calls on the hf engine, the vLLM engine's own thread on the vllm engine (a vLLM engine is stepped by the
thread that built it). Whenever the loop runs dry, its pool (the decoder's sequences, the reward session) is dropped
and the thread is given back. If decoding raises, every call in flight fails with that error (Ray Data retries or
fails those batches) and the next call gets a fresh pool.

Costs: the pool's meter charges each stretch of the loop's time to the prompts that caused its tokens
(`workers.accounting.cost.Meter.tick`), so device seconds add up to the loop's busy time however the calls
overlapped; a call's `wall_seconds` is its own wall time. A call's prompts' costs are taken when their candidates
have all ended.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from workers.accounting.cost import Meter
from workers.candidates import MethodResult, PromptInput
from workers.pool.pool import Pool


@dataclass
class Outcome:
    """What a call gets back per prompt: the method's result, its cost struct, how many of its reward inputs were
    cut to the reward model's context, and its share of the decoding steps (`Meter.step_stats`; empty for a method
    that is not a candidate pool)."""

    result: MethodResult
    cost: dict
    truncated: int
    steps: dict = field(default_factory=dict)


@dataclass
class Call:
    """One actor call: its prompts, their groups in the pool once accepted, those not done yet, and its outcomes."""

    prompts: list[PromptInput]
    started: float = field(default_factory=time.perf_counter)
    groups: list[int] = field(default_factory=list)
    pending: set[int] = field(default_factory=set)  # groups whose candidates have not all ended
    outcomes: dict[int, Outcome] = field(default_factory=dict)  # by group
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


def start_thread(fn: Callable[[], None]) -> None:
    """Serve the loop in a thread of its own (the hf engine)."""
    threading.Thread(target=fn, name="winnow-decode-loop", daemon=True).start()


class Loop:
    """`run(prompts)` from any thread of the actor returns each prompt's `Outcome`, decoding them in the one pool
    that every call in flight feeds (`feeds`: more than one call at once). `open_pool(meter)` makes a fresh pool
    whose context counts into `meter`; `serve(fn)` runs the loop's function in the thread that decodes; `devices`:
    GPUs the actor holds (1 on CPU), what its busy time is multiplied by."""

    def __init__(self, open_pool: Callable[[Meter], Pool], feeds: bool, serve: Callable = start_thread,
                 devices: float = 1.0):
        self.open_pool, self.feeds, self.serve, self.devices = open_pool, feeds, serve, devices
        self.lock = threading.Lock()  # the calls coming in, and whether a thread serves the loop
        self.incoming: list[Call] = []
        self.serving = False
        self._idle()

    def _idle(self) -> None:
        self.calls: list[Call] = []
        self.pool: Pool | None = None
        self.meter: Meter | None = None

    def run(self, prompts: list[PromptInput]) -> list[Outcome]:
        call = Call(list(prompts))
        with self.lock:
            self.incoming.append(call)
            if not self.serving:
                self.serving = True
                self.serve(self._serve)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return [call.outcomes[g] for g in call.groups]

    # -- the loop's thread ---------------------------------------------------------------------------------------
    def _serve(self) -> None:
        with torch.inference_mode():
            while True:
                with self.lock:
                    take = len(self.incoming) if self.feeds else min(len(self.incoming), int(not self.calls))
                    new, self.incoming = self.incoming[:take], self.incoming[take:]
                    if not new and not self.calls:
                        self.serving = False
                        self._close()  # the pool's sequences and reward session go with it
                        return
                try:
                    for call in new:
                        self._accept(call)
                    self._turn()
                except BaseException as err:  # noqa: BLE001 - the calls in flight fail with it, in their threads
                    for call in self.calls + new:
                        call.error = err
                        call.done.set()
                    self._close()

    def _close(self) -> None:
        pool = self.pool
        self._idle()
        if pool is not None:
            pool.close()

    def _accept(self, call: Call) -> None:
        if self.pool is None:
            self.meter = Meter(0)
            self.pool = self.open_pool(self.meter)
        call.groups = self.pool.add(call.prompts)
        self.meter.grow(call.groups[-1] + 1 - self.meter.base)
        call.pending = set(call.groups)
        self.calls.append(call)

    def _turn(self) -> None:
        """One step of the pool, then the outcomes of every call whose prompts are all done."""
        pool, meter = self.pool, self.meter
        pool.step()
        meter.tick()
        ended = pool.ended(sorted(set().union(*(c.pending for c in self.calls))))
        if not ended:
            return
        meter.tick()  # their final scoring is theirs
        for call in self.calls:
            call.pending.difference_update(ended)
        for call in [c for c in self.calls if not c.pending]:
            self._finish(call)

    def _finish(self, call: Call) -> None:
        """A call whose prompts have all ended: its results and costs (the cost window closes here), its prompts
        forgotten by the pool."""
        pool, meter = self.pool, self.meter
        pool.decoder.synchronize()
        costs = meter.per_prompt(self.devices, call.groups, time.perf_counter() - call.started)
        for g, cost, steps in zip(call.groups, costs, meter.step_stats(call.groups)):
            call.outcomes[g] = Outcome(pool.result(g), cost, int(meter.reward_inputs_truncated[g - meter.base]),
                                       steps)
            pool.forget(g)
        meter.pause()  # decoding the results' texts is nobody's
        self.calls.remove(call)
        meter.retire(min((g for c in self.calls for g in c.groups), default=pool.next_group))
        call.done.set()
