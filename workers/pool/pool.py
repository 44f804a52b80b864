"""Best-of-N and Speculative Rejection (paper 001, Algorithm 1; docs/references.md) on one candidate pool per
prompt, on either engine.

A `Pool` holds every prompt in flight: its n candidates (running on a decoder, `workers.pool.decoder`, or ended),
their partial rewards and its decisions. It is the scheduler of the actor's loop: it decides what runs, the decoder
and the reward session run it and hand back what happened. One turn (`Pool.step`):
1. takes the sequences that ended in the last step (the decoder's `StepOutput`): each becomes a candidate;
2. holds a rejection round where the schedule calls one (`workers.pool.schedules`), scoring through the session;
3. starts the waiting prompts that fit (admission: the decoder's memory model, `Decoder.need`);
4. steps the decoder, and returns what the turn ran (`Turn`: a `Work` of every forward, step and scoring call).
`Pool.ended` gives the prompts whose candidates have all ended their final rewards (and what scoring them ran), and
`Pool.result` makes a prompt's answer (eq. 6: the finished candidate with the highest final reward) and stats. The
caller charges the work (`workers.pool.loop`): the pool counts nothing itself. Best-of-N is the same pool with no
decision tokens; greedy, nucleus and speculative decoding are pools of one candidate, whose answer is that
candidate.

Scoring goes through one reward session per pool (`Context.reward_session`): with a causal reward model it keeps
each running candidate's reward-model cache from one decision to the next, so a decision feeds the reward model
the tokens generated since the last one, not every response whole. Rejected sequences leave the decoder at once
(dropped from the hf engine's batch by selection, aborted on vLLM), so a round costs the scoring and nothing more.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from schemas.methods import MethodParams
from workers.accounting.work import Work
from workers.candidates import Candidate, MethodResult, PromptInput, best_of, reward_stats, settle_verdicts
from workers.context import Context
from workers.pool.decoder import Decoder, Key, Seq, StepOutput
from workers.pool.schedules import NoDecisions, pool_space, rejection_cut, schedule_for


@dataclass
class PromptState:
    """One prompt's candidates while its pool decodes them."""

    prompt: PromptInput
    candidates: list[Candidate | None]  # None while the candidate runs (or waits to start)
    partials: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))  # cand -> partial rewards
    decisions: list[int] = field(default_factory=list)  # its longest running response at each decision
    unscored: list[int] = field(default_factory=list)  # candidates ended since its last decision, no reward yet
    started: bool = False
    steps: int = 0  # decoding steps it has run in since it started
    verdicts: dict = field(default_factory=dict)  # cand -> the verifier's future verdict, for its finished candidates
    counting: list[tuple[int, int]] = field(default_factory=list)  # (step, cand): verdicts the stop rule counts then
    verified: int = 0  # candidates the stop rule has counted as verified
    tick: int = 0  # its own clock: its longest running response // the pool's `every`, at its last tick
    ended_at: int = 0  # the pool's clock when its last candidate ended

    @property
    def ended(self) -> bool:
        return all(c is not None for c in self.candidates)

    @property
    def running(self) -> int:
        """Its candidates not ended yet: its running sequences once it has started."""
        return sum(c is None for c in self.candidates)


class Turn(NamedTuple):
    """What one turn of a pool did: whether anything still runs or waits, and what it ran (forwards, tokens and steps
    per prompt, scoring included)."""

    busy: bool
    work: Work


class Pool:
    """The candidate pools of every prompt in flight on one decoder: prompts join (`add`) and leave (`forget`)
    while it decodes. `n` candidates per prompt, rejection quantile `alpha`, decision schedule `schedule`."""

    def __init__(self, ctx: Context, decoder: Decoder, n: int, alpha: float = 0.0, schedule: NoDecisions | None = None,
                 space: int | None = None, stop: tuple[int, int] | None = None, every: int = 1):
        """`space`: the bytes the running prompts may hold in all (default: the decoder's KV space). `stop`: (k, lag)
        of the stop rule (a prompt stops once k of its candidates verified, a verdict counting `lag` steps after its
        candidate ended: `MethodParams.stop_rule`), or None. `every`: the steps of the scoring clock (module
        docstring: a common clock)."""
        self.ctx, self.decoder, self.n, self.alpha, self.stop = ctx, decoder, n, alpha, stop
        self.every = every
        self.clock = 0  # decoding steps the pool has run
        self.schedule = schedule if schedule is not None else NoDecisions()
        self.space = space if space is not None else decoder.kv_space()
        self.prompts: dict[int, PromptState] = {}  # by group
        self.waiting: list[int] = []  # groups not started yet, in order
        self.next_group = 0
        self.live = 0  # sequences running on the decoder
        self.ended_seqs: list[Seq] = []  # the sequences that ended in the last step, taken at the next turn
        self.scoring = None  # the reward session, made at the first scoring

    @classmethod
    def for_method(cls, ctx: Context, decoder: Decoder, params: MethodParams) -> "Pool":
        """The pool of a pool method's parameters (schemas.methods: n, alpha and the schedule of Speculative
        Rejection; one candidate for the single-response methods), with the KV space the method gives it."""
        return cls(ctx, decoder, params.candidates(), params.alpha_(), schedule_for(params, decoder),
                   pool_space(params, decoder.kv_space()), params.stop_rule(), params.scoring_clock())

    # -- prompts in and out ----------------------------------------------------------------------------------------
    def add(self, prompts: list[PromptInput]) -> list[int]:
        """Prompts join the pool, decoding or not; they wait to start. Returns their groups."""
        groups = list(range(self.next_group, self.next_group + len(prompts)))
        self.next_group += len(prompts)
        for g, p in zip(groups, prompts):
            self.prompts[g] = PromptState(p, [None] * self.n)
        self.waiting += groups
        self.decoder.wait(groups, list(prompts))
        return groups

    def forget(self, g: int) -> None:
        """Drop what the pool, its schedule and its decoder hold of prompt g once its row is made."""
        del self.prompts[g]
        self.schedule.forget(g)
        self.decoder.forget(g)

    def close(self) -> None:
        self.decoder.close()

    # -- one turn --------------------------------------------------------------------------------------------------
    def step(self) -> Turn:
        """One turn of the decoding loop: take the sequences that ended, a rejection round for the running prompts
        the schedule calls one for, start the waiting prompts that fit in what the ended and the rejected freed (a
        round for those the schedule calls one for at their first token), and one decoding step (recorded with its
        width). Not busy once nothing runs or waits. A prompt's round comes at the same point of its own decoding
        whether it started this turn or long before: admission only moves when prompts start."""
        work = Work()
        self._harvest(self.ended_seqs)
        self.ended_seqs = []
        if not self.live:  # nothing decodes, so the clock would not move: it moves to its next tick
            self.clock = -(-self.clock // self.every) * self.every
        on_clock = self.clock % self.every == 0
        self._round({g: s.prompt for g, s in self.prompts.items() if s.started}, work, on_clock)
        self._stop_verified(work)
        # prompts that decide start on the clock, so that they all tick in the same steps (`_round`)
        started, out = self._admit() if on_clock or not self.schedule.decides else ([], StepOutput([], Work()))
        work.add(out.work)
        if started:
            self._harvest(out.finished)  # a fresh candidate's first token may already end it
            self._round({g: self.prompts[g].prompt for g in started}, work)
            self._stop_verified(work)
        if not self.live:
            return Turn(bool(self.waiting), work)
        running = [(g, s.running) for g, s in self.prompts.items() if s.started and s.running]
        work.step(torch.tensor([g for g, _ in running]), torch.tensor([r for _, r in running]))
        out = self.decoder.step()
        work.add(out.work)
        self.ended_seqs = out.finished
        self.clock += 1
        for g, _ in running:
            self.prompts[g].steps += 1
        return Turn(True, work)

    def _round(self, prompts: dict[int, PromptInput], work: Work, on_clock: bool = True) -> None:
        """A rejection round for the prompts among `prompts` that tick (`_ticking`) and that the schedule calls one
        for. Its scoring call also gives the final rewards of the prompts among `prompts` whose every candidate has
        ended (`ended` would otherwise score them in a call of their own): one reward forward for both where a
        forward costs the same at any width. On a clock (`every` > 1) those final rewards wait for a decision to
        ride on, or, after `every` steps (at once for a pool that never decides), for the pool's tick
        (`on_clock`)."""
        due = self.schedule.due(self.decoder, self._ticking(prompts), self.every) if self.live else set()
        done = {g for g in prompts if g not in due and self.prompts[g].ended and self.prompts[g].unscored}
        if not due and self.every > 1:  # on a clock: the ended prompts wait for a decision to ride on, or a tick
            waited = lambda g: not self.schedule.decides or self.clock - self.prompts[g].ended_at >= self.every
            done = {g for g in done if on_clock and waited(g)}
        if due or done:
            self.schedule.rejected(self._decide(due | done, work))

    def _ticking(self, prompts: dict[int, PromptInput]) -> dict[int, PromptInput]:
        """The prompts among `prompts` whose own clock ticks now: their longest running response has reached a new
        multiple of `every` tokens. A prompt's ticks are a function of its own tokens, whatever prompts share the
        decoder; prompts that start on the pool's clock tick in the same steps, so their decisions share forwards."""
        if self.every == 1:
            return prompts
        out = {}
        for g, lengths in self.decoder.lengths().items():
            if g in prompts:
                tick = max(lengths) // self.every
                if tick > self.prompts[g].tick:
                    self.prompts[g].tick = tick
                    out[g] = prompts[g]
        return out

    def _hold(self, state: PromptState, rows: int) -> int:
        """The bytes a prompt's `rows` running sequences may take (`Decoder.need`), within its schedule's KV space."""
        return self.decoder.need(state.prompt, rows, self.schedule.kv_tokens(state.prompt))

    def _admit(self) -> tuple[list[int], StepOutput]:
        """Start waiting prompts, in order, while the decoder has the places (`Decoder.width`) and the pool the KV
        space (`space`) for all their candidates beside what the running prompts hold now: their running
        candidates, each prompt within its own KV space (a cut or a finished candidate frees its place at once),
        and the prompts the decoder holds prefilled ahead (`Decoder.waiting_bytes`). A prompt always starts when
        nothing runs. One rule on both engines; a function of the prompts' own decoding, so where and when a prompt
        starts is the same however the calls were timed. Returns the groups started and the decoder's output of
        their start."""
        nothing = StepOutput([], Work())
        if not self.waiting:
            return [], nothing
        running = [s for s in self.prompts.values() if s.started and s.running]
        if running and not self.decoder.joins:
            return [], nothing
        seqs = sum(s.running for s in running)
        used = sum(self._hold(s, s.running) for s in running) + self.decoder.waiting_bytes()
        space = math.inf if self.space is None else self.space
        take = 0
        for g in self.waiting:
            need = self._hold(self.prompts[g], self.n)
            if (seqs or take) and (used + need > space or seqs + self.n > self.decoder.width):
                break
            take += 1
            seqs += self.n
            used += need
        groups, self.waiting = self.waiting[:take], self.waiting[take:]
        if not groups:
            return [], nothing
        for g in groups:
            self.prompts[g].started = True
        out = self.decoder.start(groups, [self.prompts[g].prompt for g in groups])
        self.live += take * self.n
        return groups, out

    def _harvest(self, ended: list[Seq]) -> None:
        """Take the sequences that ended (a decoder's output): each becomes its prompt's candidate, to be scored, and
        goes to the verifier at once, which judges it beside decoding."""
        verifier = self.ctx.verifier
        for (g, c), tokens, logprob in ended:
            state = self.prompts[g]
            cand = state.candidates[c] = Candidate(tokens, self.ctx.finish_reason(tokens), logprob=logprob)
            state.unscored.append(c)
            self.live -= 1
            state.ended_at = self.clock
            if verifier is not None:
                cand.text = self.ctx.decode(tokens)
                state.verdicts[c] = verifier.submit(cand.text, state.prompt.columns or {}, state.prompt.messages)
                if self.stop is not None:
                    state.counting.append((state.steps + self.stop[1], c))

    def _stop_verified(self, work: Work) -> None:
        """The stop rule (`stop`): each verdict counts at its step (its candidate's end, plus the lag), the actor
        waiting for it there if it is not in yet, so that the rows do not depend on when verdicts arrive. A prompt
        with k verified candidates is stopped: its running candidates are cut."""
        if self.stop is None:
            return
        k, _ = self.stop
        stopping = set()
        for g, state in self.prompts.items():
            due = [c for step, c in state.counting if step <= state.steps]
            if not due:
                continue
            state.counting = [(step, c) for step, c in state.counting if step > state.steps]
            state.verified += sum(state.verdicts[c].result().verified for c in due)
            if state.verified >= k and state.running:
                stopping.add(g)
        if stopping:
            cut = [s for s in self.decoder.running() if s.key[0] in stopping]
            self._cut(cut, work)
            if self.scoring is not None:
                self.scoring.release([s.key for s in cut])
    def _session(self):
        if self.scoring is None:
            self.scoring = self.ctx.reward_session()
        return self.scoring

    def _score(self, live: Sequence[Seq], done: list[Key], work: Work) -> list[float | None]:
        """Partial rewards of the running candidates `live`, scored in one call with the final rewards of the ended
        candidates `done` (set on them); what scoring ran goes to `work`."""
        ctx = self.ctx
        items = [ctx.scored(s.key[0], self.prompts[s.key[0]].prompt, s.tokens, s.logprob) for s in live]
        ended = [self.prompts[g].candidates[c] for g, c in done]
        items += [ctx.scored(g, self.prompts[g].prompt, cand.tokens, cand.logprob) for (g, _), cand in zip(done, ended)]
        scores, ran = self._session().score([s.key for s in live] + done, items,
                                            [False] * len(live) + [True] * len(done))
        work.add(ran)
        for (g, c), s in zip(done, scores[len(live):]):
            self.prompts[g].candidates[c].reward = s
        return scores[: len(live)]

    def _decide(self, groups: set[int], work: Work) -> dict[int, int]:
        """One rejection round for prompts `groups`: partial rewards of their running candidates, final rewards of
        their candidates ended since their last round, `rejection_cut` per prompt, and the rejected candidates
        dropped from the decoder. The rejected and the ended candidates leave the reward session together. Returns
        the number of candidates rejected per prompt."""
        live = [s for s in self.decoder.running() if s.key[0] in groups]
        done = [(g, c) for g in sorted(groups) for c in self.prompts[g].unscored]
        for g in groups:
            self.prompts[g].unscored = []
        scores = self._score(live, done, work)
        finished: dict[int, list[float]] = defaultdict(list)
        for g, c in done:
            finished[g].append(self.prompts[g].candidates[c].reward)
        of_group: dict[int, list[int]] = defaultdict(list)  # group -> its running candidates' indices in `live`
        for i, (seq, score) in enumerate(zip(live, scores)):
            g, c = seq.key
            self.prompts[g].partials[c].append(score)
            of_group[g].append(i)
        kept: set[int] = set()
        for g, idx in of_group.items():
            self.prompts[g].decisions.append(max(len(live[i].tokens) for i in idx))
            kept.update(idx[k] for k in rejection_cut([scores[i] for i in idx], finished[g], self.alpha))
        rejected = [live[i] for i in range(len(live)) if i not in kept]
        counts = dict.fromkeys(of_group, 0)
        for (g, _), _, _ in rejected:
            counts[g] += 1
        self._cut(rejected, work)
        self._session().release(done + [s.key for s in rejected])
        return counts

    def _cut(self, seqs: Sequence[Seq], work: Work) -> None:
        """Running sequences stopped before they finished (a rejection round's, or the stop rule's): each becomes a
        rejected candidate and leaves the decoder (the counts it settles for them go to `work`)."""
        for (g, c), tokens, logprob in seqs:
            self.prompts[g].candidates[c] = Candidate(tokens, "rejected", logprob=logprob)
            self.prompts[g].ended_at = self.clock
        work.add(self.decoder.drop([s.key for s in seqs]))
        self.live -= len(seqs)

    # -- prompts whose candidates have all ended -------------------------------------------------------------------
    def ended(self, groups: Sequence[int]) -> tuple[list[int], Work]:
        """The prompts among `groups` whose every candidate has ended and been judged by the verifier, with their final
        rewards given (one scoring call for all of them; their candidates leave the reward session), and what that
        scoring ran. Verdicts not in yet are waited for only when nothing else runs or waits; a prompt leaves the pool
        when its last one is in, which changes nothing of the others' decoding."""
        work = Work()
        idle = not self.live and not self.waiting
        ended = [g for g in sorted(groups) if self.prompts[g].ended]
        if self.every > 1 and not idle:  # their final scoring rides on the clock's next tick (`_round`)
            ended = [g for g in ended if not self.prompts[g].unscored]
        if self.ctx.verifier is not None:
            for g in ended:
                if idle:
                    for v in self.prompts[g].verdicts.values():
                        v.result()
            ended = [g for g in ended if all(v.done() for v in self.prompts[g].verdicts.values())]
        done = [(g, c) for g in ended for c in self.prompts[g].unscored]
        for g in ended:
            self.prompts[g].unscored = []
        if done:
            self._score((), done, work)
            self._session().release(done)
        return ended, work

    def result(self, g: int) -> MethodResult:
        """Prompt g's candidates (decoded), its answer and its stats (the answer's perplexity under the target among
        them, from the log-probabilities its decoder kept). The answer is the finished candidate with the highest
        final reward (eq. 6); a pool of one candidate answers with it."""
        state = self.prompts[g]
        cands = state.candidates
        for c, cand in enumerate(cands):
            if c not in state.verdicts:  # a judged candidate's text was decoded for its verifier
                cand.text = self.ctx.decode(cand.tokens)
            cand.partial_rewards = state.partials.get(c, [])
        stats = {
            "generated_tokens": sum(len(c.tokens) for c in cands),
            "finished_candidates": sum(c.finish_reason != "rejected" for c in cands),
            "rejection_rounds": len(state.decisions),
            "decision_tokens": list(state.decisions),
            **reward_stats(cands),
            **self.decoder.stats(g),
            **self.schedule.stats(state.prompt),
        }
        best = 0 if self.n == 1 else best_of(cands)  # eq. 6
        if self.ctx.verifier is not None:  # the best-ranked verified candidate
            verdicts = {c: v.result() for c, v in state.verdicts.items()}
            best, checked = settle_verdicts(cands, verdicts, self.ctx.verdict_reward, best, self.n > 1)
            stats.update(checked, **reward_stats(cands))
        if best is not None:
            stats["perplexity"] = cands[best].perplexity()
        return MethodResult(cands, best, stats)


def decode(pool: Pool, prompts: list[PromptInput]) -> tuple[list[MethodResult], Work]:
    """Every prompt through `pool` to its result, in this thread, and what decoding them ran (one batch on its own;
    `workers.pool.loop` turns the same steps for prompts of many actor calls, and charges each turn's work)."""
    work = Work()
    groups = pool.add(prompts)
    while True:
        turn = pool.step()
        work.add(turn.work)
        if not turn.busy:
            break
    _, scored = pool.ended(groups)
    work.add(scored)
    return [pool.result(g) for g in groups], work
