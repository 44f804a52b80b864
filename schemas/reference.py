"""The two generated references of docs/config.md: the job config (from the pydantic models' fields and
descriptions) and the output columns (from `schemas.rows`).

`python -m schemas.reference` prints them; `python -m schemas.reference --write docs/config.md` replaces the text
between that file's ``<!-- config-reference:start -->`` / ``<!-- config-reference:end -->`` and
``<!-- output-columns:start -->`` / ``<!-- output-columns:end -->`` markers (a test checks that docs/config.md holds
exactly what this renders, so neither reference can drift from the schema).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path

import pyarrow as pa
from annotated_types import Ge, Gt, Le, Lt, MinLen
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from schemas import compat
from schemas import config as C
from schemas import methods as M
from schemas import rows as R

SECTIONS = ("config-reference", "output-columns")

REWARDS = list(typing.get_args(typing.get_args(C.Reward)[0]))
METHODS = list(typing.get_args(typing.get_args(M.Method)[0]))


def type_name(t) -> str:
    origin = typing.get_origin(t)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(t))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(t)
        if all(isinstance(a, type) and issubclass(a, BaseModel) for a in args if a is not type(None)):
            return "section (see below)" + (" or `null`" if type(None) in args else "")
        return " \\| ".join("`null`" if a is type(None) else type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(typing.get_args(t)[0])
    if isinstance(t, type) and issubclass(t, BaseModel):
        return "section"
    return {str: "string", int: "int", float: "float", bool: "bool"}.get(t, getattr(t, "__name__", str(t)))


def bounds(field) -> str:
    parts = []
    for m in field.metadata:
        if isinstance(m, Ge):
            parts.append(f">= {m.ge}")
        elif isinstance(m, Gt):
            parts.append(f"> {m.gt}")
        elif isinstance(m, Le):
            parts.append(f"<= {m.le}")
        elif isinstance(m, Lt):
            parts.append(f"< {m.lt}")
        elif isinstance(m, MinLen):
            parts.append(f"length >= {m.min_length}")
        elif getattr(m, "pattern", None):
            parts.append(f"matches `{m.pattern}`")
    return ", ".join(parts)


def default(field) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        return "(defaults)"
    value = field.default
    if value is None:
        return "`null`"
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str) and not value.isprintable():
        return f"`{json.dumps(value)}`"  # as YAML writes it in double quotes: "\n\n"
    return f"`{value}`"


def table(model: type[BaseModel], prefix: str, skip: tuple[str, ...] = ()) -> list[str]:
    lines = ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        old = compat.old_names(prefix + name)
        if old:
            desc += " Deprecated old name" + ("s" if len(old) > 1 else "") + ": " + ", ".join(f"`{o}`" for o in old) \
                + " (still read, with a warning)."
        lines.append(f"| `{prefix}{name}` | {type_name(field.annotation)} | {default(field)} | {bounds(field)} | "
                     f"{desc} |")
    return lines


def render() -> str:
    out = [
        "Every key, its type, default and rule, generated from the pydantic models in `schemas/` by "
        "`python -m schemas.reference`. Unknown keys are refused; `winnow validate CONFIG` lists every problem at "
        "once.",
        "",
        "### Top level",
        "",
        *table(C.JobConfig, "", skip=("data", "models", "method", "generation", "output", "resources", "cost")),
    ]
    sections = [("data", C.DataConfig), ("models", C.ModelsConfig), ("generation", C.GenerationConfig),
                ("output", C.OutputConfig), ("resources", C.ResourcesConfig), ("cost", C.CostConfig)]
    for name, model in sections:
        out += ["", f"### `{name}`", "", *table(model, f"{name}.")]
        if name == "models":
            out += ["", "#### `models.reward`, by `kind`", ""]
            for reward in REWARDS:
                kind = typing.get_args(reward.model_fields["kind"].annotation)[0]
                out += [f"`kind: {kind}`: {reward.model_fields['kind'].description}", ""]
                rest = [n for n in reward.model_fields if n != "kind"]
                if rest:
                    out += [*table(reward, "models.reward.", skip=("kind",)), ""]
            out.pop()
    out += ["", "### `method`, by `name`", ""]
    for method in METHODS:
        mname = typing.get_args(method.model_fields["name"].annotation)[0]
        doc = " ".join((method.__doc__ or "").split())
        out += [f"#### `name: {mname}`", "", doc, ""]
        if [n for n in method.model_fields if n != "name"]:
            out += [*table(method, "method.", skip=("name",)), ""]
    out += ["### Names in more than one section", "",
            "The same key name in two sections names two settings; each applies where it is written:", "",
            "| name | key | there |", "|---|---|---|"]
    for name, places in shared_names().items():
        for key, desc in places:
            out.append(f"| `{name}` | `{key}` | {first_sentence(desc)} |")
    return "\n".join(out).rstrip() + "\n"


def first_sentence(text: str) -> str:
    text = " ".join((text or "").split()).replace("|", "\\|")
    return text.split(". ")[0].rstrip(".") + "."


def shared_names() -> dict[str, list[tuple[str, str]]]:
    """Key names that more than one section uses (`name` and `kind`, which pick a variant, aside): name -> (dotted
    key, description) of each section's field, the method variants' fields gathered under `method.`."""
    places: dict[str, dict[str, str]] = {}

    def add(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            if name in ("name", "kind") or typing.get_origin(field.annotation) is None and isinstance(
                    field.annotation, type) and issubclass(field.annotation, BaseModel):
                continue
            places.setdefault(name, {}).setdefault(prefix + name, field.description or "")

    for prefix, model in (("data.", C.DataConfig), ("models.", C.ModelsConfig), ("generation.", C.GenerationConfig),
                          ("output.", C.OutputConfig), ("resources.", C.ResourcesConfig), ("cost.", C.CostConfig)):
        add(model, prefix)
    for reward in REWARDS:
        add(reward, "models.reward.")
    for method in METHODS:
        add(method, "method.")
    return {n: sorted(keys.items()) for n, keys in sorted(places.items())
            if len({k.rsplit(".", 1)[0] for k in keys}) > 1}


def render_columns() -> str:
    """The output columns of candidates/*.parquet, nested fields and `stats` included, with their Arrow types."""

    def short(dtype) -> str:
        if pa.types.is_list(dtype):
            return f"list<{short(dtype.value_type)}>"
        return "struct" if pa.types.is_struct(dtype) else str(dtype)

    def walk(name: str, dtype, out: list[str]) -> None:
        if name in R.COLUMN_MEANINGS:
            out.append(f"| `{name}` | `{short(dtype)}` | {R.COLUMN_MEANINGS[name]} |")
        inner = dtype.value_type if pa.types.is_list(dtype) else dtype
        if name != "stats" and pa.types.is_struct(inner):
            suffix = "[]" if inner is not dtype else ""
            for i in range(inner.num_fields):
                walk(f"{name}{suffix}.{inner.field(i).name}", inner.field(i).type, out)

    lines = ["One row per prompt, generated from `schemas/rows.py` by `python -m schemas.reference`. Readers should "
             "ignore columns they do not know: new ones may be added.", "",
             "| column | type | meaning |", "|---|---|---|"]
    for f in R.ROW_SCHEMA:
        walk(f.name, f.type, lines)
    lines += ["", "`stats`, by field:", "", "| field | type | meaning |", "|---|---|---|"]
    lines += [f"| `stats.{name}` | `{short(dtype)}` | {meaning} |" for name, (dtype, meaning) in R.STATS_FIELDS.items()]
    return "\n".join(lines) + "\n"


RENDER = {"config-reference": render, "output-columns": render_columns}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def section_of(readme: str, name: str = "config-reference") -> str:
    """The text between a document's markers of section `name` (without the marker lines)."""
    start, end = _markers(name)
    if start not in readme or end not in readme:
        raise ValueError(f"no {start} ... {end} section")
    return readme.split(start, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def replace_section(readme: str, text: str, name: str = "config-reference") -> str:
    start, end = _markers(name)
    head, rest = readme.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{text}{end}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m schemas.reference", description=__doc__.splitlines()[0])
    p.add_argument("--write", metavar="FILE",
                   help="replace both generated sections of this file (docs/config.md)")
    args = p.parse_args(argv)
    if args.write:
        path = Path(args.write)
        text = path.read_text()
        for name in SECTIONS:
            text = replace_section(text, RENDER[name](), name)
        path.write_text(text)
    else:
        print("\n".join(RENDER[name]() for name in SECTIONS), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
