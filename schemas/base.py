"""Shared pydantic base and the error type that reports every problem of a config at once."""

from __future__ import annotations

import difflib
import typing

from pydantic import BaseModel, ConfigDict, ValidationError


class Strict(BaseModel):
    """A config section: unknown keys are refused, defaults are validated, values are immutable, and every float is
    a finite number (nan, inf and -inf are refused: a threshold of nan passes or fails every comparison silently). A
    field that means something by infinity says so with its own ``Field(allow_inf_nan=True)``."""

    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True, allow_inf_nan=False)


# Begins a validator's message that is whole lines of its own, each naming its field (a rule across fields, or two
# names of one setting): `describe_validation_error` gives those lines as they are, without pydantic's location.
CROSS_MARK = "@@cross@@"


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


def describe_validation_error(err: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    """One message per error: ``field.path: rule (got value)``. Given the validated `model`, an unknown key is
    answered with the section's close spellings ("did you mean 'alpha'?", difflib) or, when it is a field of another
    variant of a discriminated union (``path`` under a ``logprob`` reward), with the variants it belongs to."""
    out = []
    for e in err.errors(include_url=False):
        loc = _loc(tuple(e["loc"]))
        msg = e["msg"]
        if CROSS_MARK in msg:
            out.extend(msg.split(CROSS_MARK, 1)[1].splitlines())
            continue
        if e["type"] == "extra_forbidden":
            msg = unknown_key_message(model, tuple(e["loc"])) if model is not None else None
            msg = msg or "unknown key (not a field of this section; check its spelling)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif e["type"] == "union_tag_invalid":
            ctx = e.get("ctx", {})
            msg = f"unknown value {ctx.get('tag')!r}; expected one of {ctx.get('expected_tags')}"
            close = difflib.get_close_matches(str(ctx.get("tag")), _tags_of(ctx.get("expected_tags")), n=1)
            if close:
                msg += f" (did you mean {close[0]!r}?)"
        elif e["type"] == "finite_number":
            msg = "must be a finite number, not nan or inf"
        elif e["type"] == "union_tag_not_found":
            msg = f"field {e.get('ctx', {}).get('discriminator', 'name')} is required to pick the variant"
        got = e.get("input")
        if e["type"] not in ("missing", "extra_forbidden", "union_tag_not_found") and not isinstance(got, dict):
            msg = f"{msg} (got {got!r})"
        out.append(f"{loc}: {msg}")
    return out


def _tags_of(expected) -> list[str]:
    """The tags of pydantic's ``expected_tags`` context ("'a', 'b'")."""
    return [t.strip().strip("'\"") for t in str(expected or "").split(",") if t.strip()]


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, Union, Annotated and lists)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out += [m for m in _models_in(arg) if m not in out]
    return out


def _tag_of(model: type[BaseModel], tag: str) -> str | None:
    """The field of a union variant whose Literal type holds `tag` (its discriminator: kind, name), or None."""
    for name, info in model.model_fields.items():
        if typing.get_origin(info.annotation) is typing.Literal and tag in typing.get_args(info.annotation):
            return name
    return None


def unknown_key_message(model: type[BaseModel], loc: tuple) -> str | None:
    """Why the key at `loc` is not a field of its section, with a hint: a close spelling of one of the section's
    fields, or the other variants of a discriminated union that have it; None when `loc` cannot be followed."""
    *parents, key = loc
    current: list[type[BaseModel]] = [model]
    variants: list[type[BaseModel]] = []  # the union the section is a variant of
    tag = section = None
    for item in parents:
        if isinstance(item, int):
            continue
        if len(current) > 1:  # a discriminated union: pydantic puts the variant's tag in the location
            variants, current = current, [m for m in current if _tag_of(m, item)]
            tag = item
            if len(current) != 1:
                return None
            continue
        info = current[0].model_fields.get(item)
        if info is None:
            return None
        section, tag, variants = item, None, []
        current = _models_in(info.annotation)
    if len(current) != 1:
        return None
    disc = _tag_of(current[0], tag) if tag is not None else None
    holders = [t for m in variants if disc and str(key) in m.model_fields
               for t in typing.get_args(m.model_fields[disc].annotation)]
    what = f"{section} {disc}" if disc != "name" else section
    if not holders:  # spelled as no variant spells it: perhaps misspelt
        close = difflib.get_close_matches(str(key), list(current[0].model_fields), n=3, cutoff=0.6)
        if close:
            return "unknown key; did you mean " + " or ".join(repr(c) for c in close) + "?"
        others = {f: t for m in variants for t in typing.get_args(m.model_fields[disc].annotation)
                  for f in m.model_fields if f != disc} if disc else {}
        close = difflib.get_close_matches(str(key), list(others), n=1, cutoff=0.6)
        if close:
            return f"unknown key; did you mean {close[0]!r} (a field of {what} {others[close[0]]!r})?"
        return None
    names = ", ".join(repr(t) for t in holders[:-1]) + (" and " if holders[1:] else "") + repr(holders[-1])
    use = holders[0] if len(holders) == 1 else "one of them"
    plural = "s" if len(holders) > 1 else ""
    return (f"{key!r} is a field of {what}{plural} {names}, not {tag!r} (set {_loc(tuple(parents))}.{disc}: {use} to "
            "use it, or remove the key)")


class InputError(Exception):
    """Bad config, arguments or input files. The message names each offending field or path; nothing was written.

    `problems` holds one line per problem so that every problem can be reported at once.
    """

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))
