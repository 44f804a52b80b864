"""The recipe config of `winnow rounds` (YAML, validated by pydantic, unknown keys refused, every problem at once).

A recipe names round 0's model, a reward, the prompts (generated concept sets or two sources), one or more data
sources (`sources`: a generation method each, one chain of rounds per source), the SFT selection, the training and
the evaluation; `job` holds whatever else every `winnow generate` run of the recipe should get (generation,
resources, cost, models.engine, ...). docs/expert-iteration.md has an annotated example.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from schemas.base import ConfigError, InputError, Strict, describe_validation_error
from schemas.compat import deprecated
from schemas.config import Reward, apply_overrides, read_yaml_mapping
from schemas.methods import Method
from sftdata.select import parse_select

NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
# keys of a run config the recipe sets itself: `job` may not set them
RECIPE_KEYS = {"name", "seed", "data", "method", "output"}
RECIPE_MODEL_KEYS = {"target", "reward"}


class PromptsConfig(Strict):
    vocabulary: Literal["everyday", "tiny-world"] | None = Field(
        "everyday",
        description="Generate concept-sentence prompts (assets.concept_sets): 'everyday' words for a real instruct "
        "model, or 'tiny-world' for the bundled tiny trio; the training and held-out splits are disjoint in concept "
        "sets. Null: read train_source and heldout_source instead.",
    )
    train: int = Field(200, ge=1, description="Training prompts (generated, or the first N rows of train_source).")
    heldout: int = Field(96, ge=1, description="Held-out prompts (generated, or the first N rows of heldout_source).")
    seed: int = Field(0, ge=0, description="Seed of the generated concept sets.")
    train_source: str | None = Field(
        None, description="With vocabulary null: the training prompts, any data.source of a job config.")
    heldout_source: str | None = Field(
        None, description="With vocabulary null: the held-out prompts; keep them apart from the training prompts.")
    id_column: str | None = Field("id", description="The sources' prompt-id column (generated prompts have `id`).")
    prompt_column: str = Field("prompt", min_length=1, description="The sources' prompt column.")

    @model_validator(mode="after")
    def _one_kind(self) -> PromptsConfig:
        sources = [self.train_source, self.heldout_source]
        if self.vocabulary is not None and any(sources):
            raise ValueError("give either vocabulary (generated prompts) or train_source and heldout_source, not "
                             "both; set vocabulary: null to read sources")
        if self.vocabulary is None and not all(sources):
            raise ValueError("vocabulary is null, so train_source and heldout_source are both required")
        return self


class SftConfig(Strict):
    select: str = Field("best", description="'best' or 'top-k=K': candidates kept per prompt (winnow build-sft).")
    min_reward: float | None = Field(None, description="Keep only candidates with a reward >= this.")
    include_rejected: bool = Field(False, description="Keep Speculative Rejection's rejected candidates that have a "
                                   "reward (none do by default: their final reward is null).")
    include_truncated: bool = Field(False, description="Keep candidates that hit max_new_tokens.")
    include_unverified: bool = Field(False, description="With a verifier in the job: keep candidates that did not "
                                     "verify too, ranked after every verified one (by default only verified answers "
                                     "are kept).")

    @field_validator("select")
    @classmethod
    def _select(cls, v: str) -> str:
        try:
            parse_select(v)
        except InputError as err:
            raise ValueError(err.problems[0].replace("--select ", "")) from None
        return v


class LoraConfig(Strict):
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA scaling numerator (lora_alpha).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout.")
    target_modules: str | list[str] = Field(
        "all-linear", description="Modules that get adapters (peft's target_modules; 'all-linear': every linear "
        "layer but the output layer).")


class TrainConfig(Strict):
    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters (peft), merged into the weights after training; null: a full "
        "fine-tune.")
    epochs: float = Field(2.0, gt=0, description="Passes over the round's SFT set.")
    learning_rate: float = Field(1e-4, gt=0, description="Peak learning rate.")
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "linear", description="Learning-rate schedule (transformers' lr_scheduler_type).")
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="Fraction of the steps spent warming up.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    batch_size: int = Field(8, ge=1, description="Examples per device step.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Steps whose gradients add up to one update.")
    max_length: int = Field(512, ge=8, description="Tokens of prompt and completion kept per example.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where to train: 'auto' is cuda when torch sees a GPU, else cpu (float32, no bf16).")
    cpu_threads: int | None = Field(
        None, ge=1, description="Threads of a training on CPU (torch.set_num_threads); null: torch's default, one "
        "per core. On a machine shared with other work, fewer threads than cores avoid threads that wait on each "
        "other (docs/expert-iteration.md: 1 thread trained 30 times faster than 2 on a busy 2-core machine).")


class EvaluationConfig(Strict):
    sample: Method = Field(
        default_factory=lambda: {"name": "best_of_n", "n": 1},
        description="The one-sample evaluation: best_of_n with n: 1 (a sample at job.generation's settings) or "
        "nucleus.")
    greedy: bool = Field(True, description="Also evaluate greedy decoding.")

    @field_validator("sample")
    @classmethod
    def _one_sample(cls, v):
        if not (v.name == "nucleus" or (v.name == "best_of_n" and v.n == 1)):
            raise ValueError(f"must draw one sample per prompt: best_of_n with n: 1, or nucleus (got {v.name}"
                             + (f" with n: {v.n})" if hasattr(v, "n") else ")"))
        return v


class RecipeConfig(Strict):
    name: str = Field(pattern=NAME, description="The recipe's name: runs are named NAME-round-K-SOURCE-STEP.")
    out: str = Field(description="The recipe's folder (local): prompts, runs, SFT sets, models and recipe.json.")
    rounds: int = Field(1, ge=0, le=100, description="Rounds of generate, build-sft, fine-tune and evaluate per "
                        "source. Raise it to continue a finished recipe: its rounds are reused.")
    seed: int = Field(0, ge=0, le=2**32 - 1,
                      description="Seed of every run and of training (below 2^32: training seeds numpy with it).")
    model: str = Field(description="Round 0's model: a Hugging Face folder, s3:// prefix or builtin:NAME.")
    reward: Reward = Field(description="How candidates are scored (models.reward of every run).")
    prompts: PromptsConfig = Field(default_factory=PromptsConfig)
    sources: dict[str, Method] = Field(
        description="The data sources, by name (letters, digits, _ . -): the method that generates each round's "
        "data, e.g. {bon: {name: best_of_n, n: 8}, sr: {name: speculative_rejection, n: 8}}. Each is a chain of "
        "rounds of its own, from the same round 0.", min_length=1)
    job: dict = Field(
        default_factory=dict,
        description="More keys of every run's job config (generation, resources, cost, models.engine, ...); the "
        "recipe sets name, seed, data, method, output, models.target and models.reward itself.")
    sft: SftConfig = Field(default_factory=SftConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)

    @field_validator("sources")
    @classmethod
    def _source_names(cls, v: dict) -> dict:
        bad = [k for k in v if not re.fullmatch(NAME, k)]
        if bad:
            raise ValueError(f"source names must be letters, digits, _ . - (got {bad})")
        return v

    @field_validator("job")
    @classmethod
    def _job_keys(cls, v: dict) -> dict:
        taken = sorted(RECIPE_KEYS & set(v))
        models = v.get("models") or {}
        taken += [f"models.{k}" for k in sorted(RECIPE_MODEL_KEYS & set(models if isinstance(models, dict) else {}))]
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by the recipe (name, seed, data, method, output, model, "
                             "reward are the recipe's own keys)")
        return v

    def identity(self) -> str:
        """The config as one string, without `rounds` (a recipe continues when only its rounds grow)."""
        dump = self.model_dump(mode="json")
        dump.pop("rounds")
        return json.dumps(dump, sort_keys=True)


# What a required section that breaks a rule is replaced by, so that the rest of the recipe is still checked (its
# problems are said with the section's own); the checks of `rounds.recipe.Recipe.check` leave such a section out.
STAND_INS = {"name": "recipe", "out": "recipe", "model": "builtin:tiny-target", "reward": {"kind": "logprob"},
             "sources": {"source": {"name": "greedy"}}}


@dataclass(frozen=True)
class CheckedRecipe:
    """A recipe checked section by section: `config` with every top-level section that broke a rule replaced by
    its default (or its stand-in, `STAND_INS`), the `problems` found, by field, and the sections replaced
    (`broken`), which the later checks leave out."""

    config: RecipeConfig
    problems: list[str]
    broken: frozenset[str]
    deprecated: tuple[str, ...] = ()  # a warning line per old name of a setting its `job` keys use


def check_recipe(data, source: str | None = None) -> CheckedRecipe:
    """Validate a recipe, keeping on past its broken sections (`CheckedRecipe`), so that the recipe's later checks
    (`rounds.recipe.Recipe.check`: every job config it makes, the models, the prompts) run too and every problem is
    said at once. ConfigError only when `data` is not a mapping of sections."""
    if not isinstance(data, dict):
        raise ConfigError([f"(recipe): expected a mapping of sections, got {type(data).__name__}"], source)
    try:
        return CheckedRecipe(RecipeConfig.model_validate(data), [], frozenset())
    except ValidationError as err:
        problems = describe_validation_error(err, RecipeConfig)
        broken = frozenset(str(e["loc"][0]) for e in err.errors() if e["loc"])
    kept = {key: value for key, value in data.items() if key not in broken}
    kept.update({key: STAND_INS[key] for key in broken if key in STAND_INS})
    try:
        config = RecipeConfig.model_validate(kept)
    except ValidationError:  # a rule across sections: nothing more can be checked than the sections' own problems
        raise ConfigError(problems, source) from None
    return CheckedRecipe(config, problems, broken)


def validate_recipe(data, source: str | None = None) -> RecipeConfig:
    """The recipe config; ConfigError naming every problem of its sections otherwise."""
    checked = check_recipe(data, source)
    if checked.problems:
        raise ConfigError(checked.problems, source)
    return checked.config


def read_recipe(path: str | Path, overrides: list[str] | None = None) -> CheckedRecipe:
    """Read a recipe YAML, apply ``--set`` overrides and check it section by section (`check_recipe`); ConfigError
    when the file cannot be read as a mapping."""
    data = apply_overrides(read_yaml_mapping(path, "recipe", "recipe config"), overrides or [])
    job = data.get("job")
    old_names = tuple(deprecated(job, "job.")) if isinstance(job, dict) else ()
    return replace(check_recipe(data, str(path)), deprecated=old_names)


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> RecipeConfig:
    """Read a recipe YAML, apply ``--set`` overrides, validate; ConfigError naming every problem otherwise."""
    raw = read_yaml_mapping(path, "recipe", "recipe config")
    return validate_recipe(apply_overrides(raw, overrides or []), str(path))
