"""Per-method parameters: a discriminated union on ``method.name``.

Parameter names follow the papers: ``n`` and ``alpha`` (Speculative Rejection, paper 001); ``gamma``,
``num_beams`` and ``tau`` (MJSD, paper 002); ``lookahead`` (d), ``top_k`` (k), ``accept_threshold`` (a_t),
``reward_threshold`` (r_t) and ``b`` (CDSL, paper 000).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from schemas.base import Strict

# Methods that rank candidates by a reward, so they cannot run without one.
REWARD_METHODS = frozenset({"best_of_n", "speculative_rejection", "cdlh", "cdlh_appx", "cdsl"})
# Methods that decode a pool of candidates per prompt, with the sampler of `generation.sampler`.
POOL_METHODS = frozenset({"best_of_n", "speculative_rejection"})
# Methods that need a draft model beside the target (a pool method also needs one with the speculative sampler:
# `schemas.config.JobConfig.draft_needed_by` is the rule).
DRAFT_METHODS = frozenset({"speculative_decoding", "mjsd", "cdlh_appx", "cdsl"})


class BestOfN(Strict):
    """N i.i.d. samples per prompt, scored by the reward; the argmax is returned."""

    name: Literal["best_of_n"] = Field(description="Best-of-N sampling.")
    n: int = Field(16, ge=1, le=65536, description="Samples per prompt (N).")


class SpeculativeRejection(Strict):
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
        description="How decision tokens are chosen. 'memory': when the KV cache of the running candidates "
        "(2 x layers x kv_heads x head_dim x dtype bytes per token) would exceed the memory budget. 'fixed': every "
        "`every_k_tokens` generated tokens, for reproducible experiments.",
    )
    every_k_tokens: int = Field(16, ge=1, description="Tokens between decisions when schedule is 'fixed'.")
    memory_budget_mb: float | None = Field(
        None, gt=0,
        description="KV-cache budget in MiB for schedule 'memory'. Null: free device memory "
        "(torch.cuda.mem_get_info) x memory_fraction on GPU, the host's available memory (MemAvailable) x "
        "memory_fraction on CPU; a number caps that. The budget used is recorded in stats.memory_budget_bytes.",
    )
    memory_fraction: float = Field(
        0.8, gt=0.0, le=1.0,
        description="Fraction of free device memory (GPU) or available host memory (CPU) the KV cache may fill.",
    )


class Greedy(Strict):
    """The target's own greedy decoding: one response per prompt."""

    name: Literal["greedy"] = Field(description="Greedy decoding with the target.")


class Nucleus(Strict):
    """Nucleus (top-p) sampling with the target: one response per prompt."""

    name: Literal["nucleus"] = Field(description="Nucleus sampling with the target.")
    top_p: float = Field(0.9, gt=0.0, le=1.0, description="Nucleus mass p; overrides generation.top_p.")


class Beam(Strict):
    """Beam search with the target: the highest-likelihood beam is returned."""

    name: Literal["beam"] = Field(description="Beam search with the target.")
    num_beams: int = Field(3, ge=1, le=64, description="Beams kept at each step.")
    length_penalty: float = Field(
        1.0, description="Exponent on length when ranking finished beams (score / length**length_penalty)."
    )


class SpeculativeDecoding(Strict):
    """Leviathan et al.: the draft proposes gamma tokens, the target verifies them in one forward."""

    name: Literal["speculative_decoding"] = Field(description="Speculative decoding with the draft model.")
    gamma: int = Field(4, ge=1, le=64, description="Draft tokens proposed per target call.")


class MJSD(Strict):
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


class _Lookahead(Strict):
    lookahead: int = Field(3, ge=1, le=64, description="Lookahead length d: greedy tokens rolled out per candidate.")
    top_k: int = Field(
        3, ge=1, le=1024, description="Candidate next tokens k scored by their lookaheads (the paper's 3)."
    )


class CDLH(_Lookahead):
    """Paper 000, Algorithm 2: top-k candidates, each with d greedy lookahead tokens from the target."""

    name: Literal["cdlh"] = Field(description="Constrained decoding with lookahead heuristic (target lookaheads).")


class CDLHAppx(_Lookahead):
    """Paper 000, section 3.1: CDLH with the lookaheads drafted by the draft model."""

    name: Literal["cdlh_appx"] = Field(description="CDLH with approximate (draft) lookaheads.")


class CDSL(_Lookahead):
    """Paper 000, Algorithm 1: speculative lookaheads, verified by the target and scored by the reward."""

    name: Literal["cdsl"] = Field(description="Constrained decoding with speculative lookaheads (paper 000).")
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


Method = Annotated[
    Union[BestOfN, SpeculativeRejection, Greedy, Nucleus, Beam, SpeculativeDecoding, MJSD, CDLH, CDLHAppx, CDSL],
    Field(discriminator="name"),
]

METHOD_NAMES = (
    "best_of_n", "speculative_rejection", "greedy", "speculative_decoding", "mjsd",
    "cdlh", "cdlh_appx", "cdsl", "beam", "nucleus",
)
