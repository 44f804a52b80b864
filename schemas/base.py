"""Shared pydantic base and the error type that reports every problem of a config at once."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError


class Strict(BaseModel):
    """A config section: unknown keys are refused, defaults are validated, values are immutable."""

    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True)


class ConfigError(ValueError):
    """Every problem found in a config, one per line, each naming its dotted field and the rule it broke."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s){where}:\n{lines}")


def _loc(loc: tuple) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            # Pydantic names union members by their tag or class in the location; they are not user keys.
            if parts and item in _UNION_TAGS:
                continue
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or "(config)"


_UNION_TAGS: set[str] = set()


def register_union_tags(tags) -> None:
    """Names pydantic inserts into error locations for discriminated unions (hidden from messages)."""
    _UNION_TAGS.update(tags)


def describe_validation_error(err: ValidationError) -> list[str]:
    """One message per error: ``field.path: rule (got value)``."""
    out = []
    for e in err.errors(include_url=False):
        loc = _loc(tuple(e["loc"]))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (not a field of this section; check its spelling)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif e["type"] == "union_tag_invalid":
            ctx = e.get("ctx", {})
            msg = f"unknown value {ctx.get('tag')!r}; expected one of {ctx.get('expected_tags')}"
        elif e["type"] == "union_tag_not_found":
            msg = f"field {e.get('ctx', {}).get('discriminator', 'name')} is required to pick the variant"
        got = e.get("input")
        if e["type"] not in ("missing", "extra_forbidden", "union_tag_not_found") and not isinstance(got, dict):
            msg = f"{msg} (got {got!r})"
        out.append(f"{loc}: {msg}")
    return out


class InputError(Exception):
    """Bad config, arguments or input files. The message names each offending field or path; nothing was written.

    `problems` holds one line per problem so that every problem can be reported at once.
    """

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))
