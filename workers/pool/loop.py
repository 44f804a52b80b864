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

The loop takes nothing from above: the actor's wiring (`workers.actor.runner.Runner`) submits a call (`submit`), and
when no thread serves the loop it opens a fresh pool and has its engine run `serve(pool)` in the thread that may
step it (a thread of its own on the hf engine, the vLLM engine's own thread on the vllm engine). Whenever the loop
runs dry, its pool (the decoder's sequences, the reward session) is dropped and the thread is given back. If
decoding raises, every call submitted fails with that error, those decoding and those waiting (Ray Data retries or
fails those batches), the pool is dropped, and the next call opens a fresh one.

One step of the loop (`_turn`), shaped as schedule, execute, update from the outputs:
1. the pool turns once (`Pool.step`): it schedules (admission, rejection rounds) and has its decoder and reward
   session execute; it hands back what ran (a `workers.accounting.work.Work`);
2. the loop charges that work to its one meter (`Meter.charge`) and closes the stretch of time (`Meter.tick`);
3. the prompts whose candidates have all ended get their final rewards (`Pool.ended`), charged the same way;
4. each call whose prompts are all done gets its outcomes: results, the cost struct, the steps' stats.
Each stretch of the loop's time is charged to the prompts that caused its tokens, so device seconds add up to the
loop's busy time however the calls overlapped; a call's `wall_seconds` is its own wall time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

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
    """One actor call: its prompts, their groups in the pool once accepted, those not done yet, and its outcomes.
    `opens`: no thread served the loop when it came, so its caller opens a pool and serves the loop (`Loop.serve`)."""

    prompts: list[PromptInput]
    started: float = field(default_factory=time.perf_counter)
    groups: list[int] = field(default_factory=list)
    pending: set[int] = field(default_factory=set)  # groups whose candidates have not all ended
    outcomes: dict[int, Outcome] = field(default_factory=dict)  # by group
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    opens: bool = False


class Loop:
    """Calls from any thread of the actor (`submit`, then `wait`) get each prompt's `Outcome`, decoded in the one
    pool that every call in flight feeds (`feeds`: more than one call at once). A call that finds no thread serving
    the loop `opens` it: its caller hands a fresh pool to `serve`, in the thread that may step the pool's decoder.
    `devices`: GPUs the actor holds (1 on CPU), what its busy time is multiplied by."""

    def __init__(self, feeds: bool, devices: float = 1.0):
        self.feeds, self.devices = feeds, devices
        self.lock = threading.Lock()  # the calls coming in, and whether a thread serves the loop
        self.incoming: list[Call] = []
        self.serving = False
        self._idle()

    def _idle(self) -> None:
        self.calls: list[Call] = []
        self.pool: Pool | None = None
        self.meter: Meter | None = None

    def submit(self, prompts: list[PromptInput]) -> Call:
        """A call of `prompts`, queued for the loop; it `opens` the loop when no thread serves it (the caller then
        serves it, `serve`, or fails it, `fail`)."""
        call = Call(list(prompts))
        with self.lock:
            self.incoming.append(call)
            if not self.serving:
                self.serving = call.opens = True
        return call

    def wait(self, call: Call) -> list[Outcome]:
        """The call's outcomes, in its prompts' order, once its prompts are all done (its error, if decoding
        failed)."""
        call.done.wait()
        if call.error is not None:
            raise call.error
        return [call.outcomes[g] for g in call.groups]

    def fail(self, err: BaseException, calls: Sequence[Call] = ()) -> None:
        """Every call submitted fails with `err` (`calls`, those the loop decodes, and those waiting), and the next
        call opens the loop again: no pool could be opened or served, or decoding raised."""
        with self.lock:
            calls, self.incoming = list(calls) + self.incoming, []
            self.serving = False
        for call in calls:
            call.error = err
            call.done.set()

    # -- the loop's thread ---------------------------------------------------------------------------------------
    def serve(self, pool: Pool) -> None:
        """Decode every call in flight on `pool` (fresh: nothing added yet) until none is left, then drop it; run in
        the thread that may step its decoder."""
        self.pool, self.meter = pool, Meter(0)
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
                except BaseException as err:  # noqa: BLE001 - the calls submitted fail with it, in their threads
                    failed = self.calls + [c for c in new if c not in self.calls]
                    self._close()
                    self.fail(err, failed)
                    return

    def _close(self) -> None:
        pool = self.pool
        self._idle()
        if pool is not None:
            pool.close()

    def _accept(self, call: Call) -> None:
        call.groups = self.pool.add(call.prompts)
        self.meter.grow(call.groups[-1] + 1 - self.meter.base)
        call.pending = set(call.groups)
        self.calls.append(call)

    def _turn(self) -> None:
        """One step of the loop: the pool schedules and executes a turn, the loop charges what it ran (the one place
        the meter is charged), then the outcomes of every call whose prompts are all done."""
        pool, meter = self.pool, self.meter
        turn = pool.step()
        meter.charge(turn.work)
        meter.tick()
        ended, scored = pool.ended(sorted(set().union(*(c.pending for c in self.calls))))
        meter.charge(scored)
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
