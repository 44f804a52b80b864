"""Per-method parameters: a discriminated union on ``method.name``, and what each method can do.

Parameter names follow the papers: ``n`` and ``alpha`` (Speculative Rejection, paper 001); ``gamma``,
``num_beams`` and ``tau`` (MJSD, paper 002); ``lookahead`` (d), ``top_k`` (k), ``accept_threshold`` (a_t),
``reward_threshold`` (r_t) and ``b`` (CDSL, paper 000).

A method's abilities live on its class (`MethodParams`): whether it is a candidate pool, which engines run it,
whether it needs a reward or a draft, how many sequences a prompt starts, whether its KV cache grows to full
length, whether calls can feed one decoding loop, and how it samples. Validation (`schemas.config`), the actor's
choice of concurrency and `workers/` read them there and nowhere else.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, NamedTuple, Union

from pydantic import Field

from schemas.compat import Renamed


class Sampling(NamedTuple):
    """How a method samples, from `generation` and its own parameters: the warp (temperature 0 is greedy; top_p 1
    and top_k 0 disable them) and the sampler ('target' token by token, or 'speculative': the draft proposes
    `gamma` tokens, the target verifies them)."""

    temperature: float
    top_p: float
    top_k: int
    sampler: str
    gamma: int

    @classmethod
    def of(cls, generation) -> "Sampling":
        """The job's sampling, from its `generation` section (schemas.config.GenerationConfig)."""
        g = generation
        return cls(g.temperature, g.top_p, g.top_k, g.sampler, g.gamma)


class MethodParams(Renamed):
    """What every method's parameters say about it. Class attributes are fixed per method; methods depend on the
    parameters."""

    section: ClassVar[str] = "method"

    pool: ClassVar[bool] = False  # decodes a candidate pool per prompt (workers.pool), on any engine it runs on
    engines: ClassVar[frozenset[str]] = frozenset({"hf"})  # models.engine values that run it
    ranks_by_reward: ClassVar[bool] = False  # ranks or steers by a reward, so it cannot run without one
    needs_draft: ClassVar[bool] = False  # needs models.draft whatever the sampler

    def candidates(self) -> int:
        """Sequences a prompt decodes at once at the start (candidates, or beams)."""
        return 1

    def decides(self) -> bool:
        """Whether the pool has decision tokens (scores running candidates while they decode)."""
        return False

    def kv_grows(self) -> bool:
        """Whether a prompt's sequences may hold their KV cache at full length (else decisions bound it)."""
        return True

    def feeds_across_calls(self) -> bool:
        """Whether the method decides for each prompt whatever prompts share its decoding loop, so that an actor's
        calls may feed one loop (continuous batching across calls, resources.feed_calls; workers.pool.loop)."""
        return self.pool

    def alpha_(self) -> float:
        """The rejection rate of its decisions (Speculative Rejection's alpha; 0: it rejects no one)."""
        return 0.0

    def scores_partials(self) -> bool:
        """Whether it scores partial responses with the reward (decisions, or lookaheads), which a verifier cannot."""
        return self.decides() or (self.ranks_by_reward and not self.pool)

    def scoring_clock(self) -> int:
        """Steps between the ticks of a candidate pool's scoring clock: Speculative Rejection's
        `method.scoring_steps`; for Best-of-N, whose rows never depend on it (it only scores prompts that ended),
        BEST_OF_N_SCORING_STEPS; 1 (every step) for the pools of one candidate."""
        return getattr(self, "scoring_steps", 1)

    def stop_rule(self) -> tuple[int, int] | None:
        """(k, lag): stop a prompt once k of its candidates verified, counting a verdict `lag` decoding steps after
        its candidate ended (method.stop_after_verified, verdict_lag_steps); None: no stopping."""
        k = getattr(self, "stop_after_verified", None)
        return None if k is None else (k, self.verdict_lag_steps)

    def sampling(self, job: Sampling) -> Sampling:
        """How its candidates are sampled, from the job's sampling (`Sampling.of(generation)`)."""
        return job if self.pool else job._replace(sampler="target")


def stop_after_verified_field():
    return Field(
        None, ge=1,
        description="Stop a prompt once this many of its candidates have verified: its running candidates are cut "
        "(finish_reason 'rejected') and their places go to waiting prompts. When one answer per prompt is wanted, "
        "samples after a verified one buy nothing. Needs a verifier (models.verifier, or a math or code reward). "
        "Null: every candidate runs to its end.",
    )


# Best-of-N's scoring clock: the prompts that ended are scored together every this many steps, in one reward call
BEST_OF_N_SCORING_STEPS = 4


def scoring_steps_field(default: int):
    return Field(
        default, ge=1, le=4096,
        description="Steps between the ticks of the actor's scoring clock. The reward model scores only on a tick: "
        "Speculative Rejection's decisions, the prompts it starts, and the final rewards of prompts that ended. "
        "So many prompts share one reward-model forward, where a forward costs about the same at any width (a GPU "
        "at small sizes). A prompt's decisions still depend on its own candidates only: it starts on a tick, and "
        "decides on the ticks of its own clock. A longer clock shares more forwards, but a decision comes before "
        "its prompt's KV space is full, and a freed place may wait for a tick. 1: every step.",
    )


def verdict_lag_steps_field():
    return Field(
        8, ge=0, le=4096,
        description="With stop_after_verified: decoding steps between a candidate's end and the step at which its "
        "verdict counts; the actor waits for the verdict there if it is not in yet. A longer lag lets code run while "
        "decoding goes on, and may cost that many steps of the prompt's other candidates. When verdicts arrive "
        "never changes the rows.",
    )


class BestOfN(MethodParams):
    """N i.i.d. samples per prompt, scored by the reward; the argmax is returned."""

    pool: ClassVar[bool] = True
    engines: ClassVar[frozenset[str]] = frozenset({"hf", "vllm"})
    ranks_by_reward: ClassVar[bool] = True

    name: Literal["best_of_n"] = Field(description="Best-of-N sampling.")
    n: int = Field(16, ge=1, le=65536, description="Samples per prompt (N).")
    stop_after_verified: int | None = stop_after_verified_field()
    verdict_lag_steps: int = verdict_lag_steps_field()

    def scoring_clock(self) -> int:
        return BEST_OF_N_SCORING_STEPS

    def candidates(self) -> int:
        return self.n


class SpeculativeRejection(MethodParams):
    """Paper 001, Algorithm 1: start with n candidates, cut the lowest alpha fraction at each decision token."""

    name: Literal["speculative_rejection"] = Field(description="Speculative Rejection (paper 001).")
    n: int = Field(64, ge=1, le=65536, description="Initial candidates per prompt (b_init).")
    alpha: float = Field(
        0.5, ge=0.0, lt=1.0,
        description="Rejection rate: at each decision token the candidates below the alpha-quantile of partial "
        "rewards stop (equations 4-5). 0 keeps every candidate, which is Best-of-n.",
    )
    schedule: Literal["memory", "fixed"] = Field(
        "memory",
        description="How decision tokens are chosen. 'memory' (paper 001's rule): each prompt is given a KV space "
        "(memory_candidates) and decides when its running candidates' KV cache (the prompt once, each response's "
        "tokens; 2 x layers x kv_heads x head_dim x dtype bytes per token) would pass it with the next token. "
        "'fixed': every `every_k_tokens` generated tokens.",
    )
    every_k_tokens: int = Field(16, ge=1, description="Tokens between decisions when schedule is 'fixed'.")
    memory_candidates: int | None = Field(
        None, ge=1,
        description="Schedule 'memory': each prompt's KV space is what this many of its candidates hold at full "
        "length (its prompt once, each response at the token limit): Speculative Rejection starts n candidates in "
        "the memory of Best-of-memory_candidates, as paper 001 starts a batch larger than Best-of-N could finish. "
        "Null: n / 8 (at least 1). Bounded by the pool's share of the KV cache (models.kv_cache_mb x "
        "memory_fraction, or pool_kv_cache_mb); the KV space used is recorded in stats.kv_space_bytes.",
    )
    pool_kv_cache_mb: float | None = Field(
        None, gt=0,
        description="Schedule 'memory': a cap in MiB on the pool's share of the actor's KV cache, which the prompts' "
        "KV spaces share (a prompt starts when its KV space fits beside the running prompts'). Null: no cap beyond "
        "models.kv_cache_mb x memory_fraction.",
    )
    memory_fraction: float = Field(
        0.8, gt=0.0, le=1.0,
        description="Schedule 'memory': the fraction of the actor's KV cache (models.kv_cache_mb, or the device's "
        "free memory) that the prompts' KV spaces may fill.",
    )
    scoring_steps: int = scoring_steps_field(4)
    stop_after_verified: int | None = stop_after_verified_field()
    verdict_lag_steps: int = verdict_lag_steps_field()

    pool: ClassVar[bool] = True
    engines: ClassVar[frozenset[str]] = frozenset({"hf", "vllm"})
    ranks_by_reward: ClassVar[bool] = True

    def candidates(self) -> int:
        return self.n

    def decides(self) -> bool:
        return True

    def kv_grows(self) -> bool:
        # the memory schedule rejects candidates once their cache reaches their prompt's KV space
        return self.schedule != "memory"

    def alpha_(self) -> float:
        return self.alpha

    def kv_space_candidates(self) -> int:
        """Schedule 'memory': the candidates at full length whose KV cache makes up a prompt's KV space."""
        return self.memory_candidates if self.memory_candidates is not None else max(1, self.n // 8)


class Greedy(MethodParams):
    """The target's own greedy decoding: one response per prompt."""

    pool: ClassVar[bool] = True
    engines: ClassVar[frozenset[str]] = frozenset({"hf", "vllm"})

    name: Literal["greedy"] = Field(description="Greedy decoding with the target.")

    def sampling(self, job: Sampling) -> Sampling:
        return Sampling(0.0, 1.0, 0, "target", job.gamma)


class Nucleus(MethodParams):
    """Nucleus (top-p) sampling with the target: one response per prompt."""

    pool: ClassVar[bool] = True
    engines: ClassVar[frozenset[str]] = frozenset({"hf", "vllm"})

    name: Literal["nucleus"] = Field(description="Nucleus sampling with the target.")
    top_p: float = Field(0.9, gt=0.0, le=1.0, description="Nucleus mass p; overrides generation.top_p.")

    def sampling(self, job: Sampling) -> Sampling:
        return job._replace(top_p=self.top_p, sampler="target")


class Beam(MethodParams):
    """Beam search with the target: the highest-likelihood beam is returned."""

    name: Literal["beam"] = Field(description="Beam search with the target.")
    num_beams: int = Field(3, ge=1, le=64, description="Beams kept at each step.")
    length_penalty: float = Field(
        1.0, description="Exponent on length when ranking finished beams (score / length**length_penalty)."
    )

    def candidates(self) -> int:
        return self.num_beams


class SpeculativeDecoding(MethodParams):
    """Leviathan et al.: the draft proposes gamma tokens, the target verifies them in one forward."""

    pool: ClassVar[bool] = True  # a pool of one candidate per prompt, sampled by the speculative sampler
    needs_draft: ClassVar[bool] = True

    name: Literal["speculative_decoding"] = Field(description="Speculative decoding with the draft model.")
    gamma: int = Field(4, ge=1, le=64, description="Draft tokens proposed per target call.")

    def sampling(self, job: Sampling) -> Sampling:
        return job._replace(sampler="speculative", gamma=self.gamma)


class MJSD(MethodParams):
    """Paper 002, Algorithm 1: beam-sampled drafts verified by joint likelihood."""

    name: Literal["mjsd"] = Field(description="Multi-token joint speculative decoding (paper 002).")
    gamma: int = Field(
        12, ge=1, le=64,
        description="Draft tokens per iteration. The paper uses 4; 12 is tuned on the bundled trio "
        "(bench/draft_target.py --sections tune).",
    )
    num_beams: int = Field(
        4, ge=1, le=64,
        description="Beams of the draft's beam sampling. The paper uses 8; 4 is tuned on the bundled trio.",
    )
    tau: float = Field(
        0.1, ge=0.0, le=1.0,
        description="Acceptance threshold: the longest draft prefix with min(1, p/q) > tau is kept. "
        "tau = 1 rejects every draft, which is the target's own decoding. The paper's 0.1.",
    )

    needs_draft: ClassVar[bool] = True


class _Lookahead(MethodParams):
    lookahead: int = Field(3, ge=1, le=64, description="Lookahead length d: greedy tokens rolled out per candidate.")
    top_k: int = Field(
        3, ge=1, le=1024, description="Candidate next tokens k scored by their lookaheads (the paper's 3)."
    )


class CDLH(_Lookahead):
    """Paper 000, Algorithm 2: top-k candidates, each with d greedy lookahead tokens from the target."""

    name: Literal["cdlh"] = Field(description="Constrained decoding with lookahead heuristic (target lookaheads).")

    ranks_by_reward: ClassVar[bool] = True


class CDLHAppx(_Lookahead):
    """Paper 000, section 3.1: CDLH with the lookaheads drafted by the draft model."""

    name: Literal["cdlh_appx"] = Field(description="CDLH with approximate (draft) lookaheads.")

    ranks_by_reward: ClassVar[bool] = True
    needs_draft: ClassVar[bool] = True


class CDSL(_Lookahead):
    """Paper 000, Algorithm 1: speculative lookaheads, verified by the target and scored by the reward."""

    name: Literal["cdsl"] = Field(description="Constrained decoding with speculative lookaheads (paper 000).")

    ranks_by_reward: ClassVar[bool] = True
    needs_draft: ClassVar[bool] = True
    accept_threshold: float = Field(
        0.9, ge=0.0, le=1.0,
        description="a_t: an acceptance a = accepted/d at or above it counts as high. Defaults a_t, r_t and b are "
        "the pick of the paper's own tuning rule (Appendix C) on the bundled trio (bench/draft_target.py).",
    )
    reward_threshold: float = Field(
        0.6, description="r_t: a reward of the accepted prefix at or above it counts as high."
    )
    b: int = Field(1, ge=0, le=64, description="Target tokens tried greedily in step 1 of states S2/S3.")
    validation: Literal["hard", "sampling"] = Field(
        "hard",
        description="How the target validates drafted lookaheads: 'hard' (argmax match) or 'sampling' "
        "(speculative sampling, min(1, p/q)).",
    )


METHOD_CLASSES = (BestOfN, SpeculativeRejection, Greedy, Nucleus, Beam, SpeculativeDecoding, MJSD, CDLH, CDLHAppx,
                  CDSL)

Method = Annotated[Union[METHOD_CLASSES], Field(discriminator="name")]


def method_name(cls: type[MethodParams]) -> str:
    """The `method.name` a parameters class answers to."""
    return cls.model_fields["name"].annotation.__args__[0]


METHOD_NAMES = tuple(method_name(c) for c in METHOD_CLASSES)


def methods_that(ability) -> list[str]:
    """The names of the methods whose class has `ability(cls)`, in METHOD_CLASSES' order (for messages)."""
    return [method_name(c) for c in METHOD_CLASSES if ability(c)]
