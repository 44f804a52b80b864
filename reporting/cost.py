"""The report's two cost bases: **compute**, a model of the work from tokens and parameter counts, and **measured
USD**, from device-seconds.

- **compute** of a prompt (FLOPs): ``2 x (N_target x target_tokens + N_draft x draft_tokens + N_reward x
  reward_tokens)``, the usual 2 FLOPs per parameter per token processed by a forward pass, with each row's
  `cost.*_tokens` (prefill and decoding, every candidate, rejected ones included) and N the parameters of the model
  that processed them: the reward model's for a `model` reward, the target's for `logprob` (its reward is the target's
  own log-probability), none for `lexical` and `python` rewards (no model: 0 FLOPs). Attention over the context and
  the embedding lookup are left out; an embedding tied to the output layer is counted once. Parameter counts and the
  tokens of a config repeat from run to run, whatever the machine's load, so the same runs get the same verdict
  every time. (One caveat: where two actor calls feed one decoding loop, a finished sequence is fed, and charged,
  until its batch compacts, which depends on what else is in the batch: three repeats of Best-of-N moved its target
  tokens by up to 0.23%, while device-seconds moved up to 2.5-fold.) It is the default ranking basis.
- **measured USD** of a prompt: ``device_seconds / 3600 x cost.usd_per_device_hour`` of the run's own manifest. What
  the run cost on its machine, which on a shared machine varies several-fold between repeats. Always reported; the
  ranking basis with ``winnow report --basis usd``.

Parameter counts come from the run's manifest (`parameters`, recorded at run start from the safetensors headers:
`runfolder.parameters`). A run written before they were recorded is counted from the model folders named in its
config, where they exist here; a run whose needed count is found neither way has no compute, and the report ranks
its reward group by measured USD, naming the run and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runfolder.parameters import counts_of
from runfolder.runs import Run, reward_definition

COMPUTE, USD = "compute", "usd"
BASES = (COMPUTE, USD)
FLOPS_PER_PARAMETER_TOKEN = 2
ROLES = ("target", "draft", "reward")


def usd(device_seconds: float, usd_per_device_hour: float) -> float:
    """What device_seconds cost at a price per device-hour."""
    return device_seconds / 3600.0 * usd_per_device_hour


@dataclass
class RunCost:
    """How one run's rows are costed: parameters per token role (target, draft, reward; the reward role's are those
    of whatever model scored: 0 for lexical and python rewards), where they came from, and the price of its
    device-hours."""

    parameters: dict[str, int | None]
    source: str  # "manifest", "model folders", or "" when nothing was counted
    usd_per_device_hour: float
    not_counted: dict[str, str] = field(default_factory=dict)  # role -> why it has no count
    problem: str | None = None  # why this run has no compute (a needed count is missing); None when it has

    def flops(self, row: dict) -> float | None:
        """Compute of one row (FLOPs); None when the run has no compute."""
        if self.problem is not None:
            return None
        c = row["cost"]
        total = sum((self.parameters[r] or 0) * c[f"{r}_tokens"] for r in ROLES)
        return float(FLOPS_PER_PARAMETER_TOKEN * total)

    def usd(self, row: dict) -> float:
        """Measured USD of one row."""
        return usd(row["cost"]["device_seconds"], self.usd_per_device_hour)

    def value(self, row: dict, basis: str) -> float | None:
        """The row's cost on `basis` (FLOPs for compute, USD for usd)."""
        return self.flops(row) if basis == COMPUTE else self.usd(row)


def run_cost(run: Run, resolve=lambda spec: spec) -> RunCost:
    """The run's `RunCost`: parameter counts from its manifest, else from the model folders its config names (each
    location through `resolve`, e.g. `assets.resolve` for `builtin:` names). A role whose rows processed tokens
    without a count leaves the run without compute (`problem` says which and why)."""
    recorded = run.manifest.parameters
    counts = recorded if recorded is not None else counts_of(run.manifest.config.get("models") or {}, resolve)
    source = "manifest" if recorded is not None else "model folders"
    kind = reward_definition(run).kind
    reward = {"model": counts.reward, "process": counts.reward, "logprob": counts.target}.get(kind, 0)
    if kind == "unrecorded":
        reward = None
    params = {"target": counts.target, "draft": counts.draft, "reward": reward}
    why = dict(counts.not_counted)
    if kind == "logprob" and "target" in why:
        why["reward"] = f"the logprob reward is scored by the target: {why['target']}"
    rows = [r for r in run.rows if r["error"] is None]
    problems = []
    for role in ROLES:
        if params[role] is None and any(r["cost"][f"{role}_tokens"] for r in rows):
            reason = why.get(role) or ("the manifest records no count for it" if recorded is not None
                                       else "its config names no model for it")
            problems.append(f"its {role} processed tokens but has no parameter count ({reason})")
    counted = any(v is not None for v in (counts.target, counts.draft, counts.reward))
    return RunCost(params, source if counted else "", run.usd_per_device_hour, why,
                   "; ".join(problems) or None)
