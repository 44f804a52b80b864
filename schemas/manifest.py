"""`manifest.json` of a run folder: what ran, with what, when, and what it cost."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas.compat import current


class CostTotals(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target_tokens: int = 0
    draft_tokens: int = 0
    reward_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    reward_forwards: int = 0
    wall_seconds: float = Field(0.0, description="summed over prompts (each prompt's call's wall time)")
    device_seconds: float = 0.0
    usd: float = Field(0.0, description="device_seconds / 3600 x cost.usd_per_device_hour")
    rows_without_cost: int = Field(
        0, description="rows whose cost (or a field of it) is null, as in files Winnow did not write; they are "
        "left out of these totals rather than counted as free"
    )


class ParameterCounts(BaseModel):
    """Parameters of the run's models, counted from their safetensors headers at run start
    (`runfolder.parameters`); the report's compute basis is 2 x parameters x tokens processed, per model."""

    model_config = ConfigDict(extra="allow")

    target: int | None = Field(None, description="parameters of models.target")
    draft: int | None = Field(None, description="parameters of models.draft; null without a draft")
    reward: int | None = Field(None, description="parameters of the reward model (models.reward.path, kind model "
                               "or process); null for the other kinds (logprob is scored by the target)")
    not_counted: dict[str, str] = Field(
        default_factory=dict, description="role (target, draft, reward) -> why its model could not be counted "
        "(e.g. only pytorch_model.bin weights)"
    )


class Manifest(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    config: dict[str, Any] = Field(description="the resolved job config, read under the settings' new names (a run "
                                   "written before a rename holds the old ones: `schemas.compat.current`)")
    config_hash: str
    winnow_version: str
    packages: dict[str, str] = Field(default_factory=dict, description="versions of torch, transformers, ray, ...")
    git_commit: str | None = None
    status: Literal["running", "succeeded", "failed"] = "running"
    started_at: str = Field(description="ISO-8601 UTC time the (latest) run started")
    finished_at: str | None = None
    rows: int = Field(0, description="rows in candidates/, errored ones included")
    generated_tokens: int = Field(0, description="stats.generated_tokens summed over the rows")
    candidates: int = Field(0, description="candidates started, over the rows")
    rejected: int = Field(0, description="candidates stopped by a Speculative Rejection cut")
    no_cut: bool | None = Field(
        None, description="method speculative_rejection only: true when it rejected no candidate at all (the run was "
        "Best-of-N at Speculative Rejection's price)"
    )
    decoding_steps: float = Field(
        0.0, description="the decoding steps the run's actors took (stats.decoding_steps summed): what a device bills "
        "when a step costs about the same at any width; 0 for methods that are not candidate pools"
    )
    reward_steps: float = Field(
        0.0, description="the reward model's forwards over the run (stats.reward_steps summed): billed like "
        "decoding steps where a forward costs about the same at any width; 0 for methods that are not candidate "
        "pools or without a reward model's forward"
    )
    mean_width: float | None = Field(
        None, description="sequences per decoding step over the run (stats.sequence_steps / stats.decoding_steps, "
        "summed over rows); null without steps"
    )
    reward_forwards_per_scoring: float | None = Field(
        None, description="the reward model's forwards (reward_steps) per prompt scoring: each decision of a "
        "prompt, and the scoring of its candidates at their end. Below 1 where prompts' scorings share forwards (the "
        "scoring clock, method.scoring_steps); above 1 where one scoring takes several forwards. Null without a "
        "reward model's forward"
    )
    errors: int = Field(0, description="rows whose `error` is not null")
    cost: CostTotals = Field(default_factory=CostTotals)
    reward_inputs_truncated: int = Field(
        0, description="reward inputs longer than the reward model's context, scored on their last tokens "
        "(stats.reward_inputs_truncated summed over rows)"
    )
    parameters: ParameterCounts | None = Field(
        None, description="parameter counts of the run's models; null in runs written before they were recorded"
    )

    @field_validator("config")
    @classmethod
    def _current_names(cls, v: dict[str, Any]) -> dict[str, Any]:
        return current(v)
