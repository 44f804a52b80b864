"""The job config reference, rendered as Markdown from the pydantic models' fields and descriptions.

`python -m schemas.reference` prints it; `python -m schemas.reference --write README.md` replaces the text between the
README's ``<!-- config-reference:start -->`` and ``<!-- config-reference:end -->`` markers (a test checks that the
README holds exactly what this renders, so the reference cannot drift from the schema).
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path

from annotated_types import Ge, Gt, Le, Lt, MinLen
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from schemas import config as C
from schemas import methods as M

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"

REWARDS = [C.ModelReward, C.LogprobReward, C.LexicalReward, C.PythonReward]
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
    return f"`{value}`"


def table(model: type[BaseModel], prefix: str, skip: tuple[str, ...] = ()) -> list[str]:
    lines = ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{prefix}{name}` | {type_name(field.annotation)} | {default(field)} | {bounds(field)} | "
                     f"{desc} |")
    return lines


def render() -> str:
    out = [
        "Every key, its type, default and rule, generated from the pydantic models in `schemas/` by "
        "`python -m schemas.reference`. Unknown keys are refused; `winnow validate CONFIG` lists every problem at once.",
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
    return "\n".join(out).rstrip() + "\n"


def section_of(readme: str) -> str:
    """The text between the README's markers (without the marker lines)."""
    if START not in readme or END not in readme:
        raise ValueError(f"README has no {START} ... {END} section")
    return readme.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def replace_section(readme: str, text: str) -> str:
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{text}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m schemas.reference", description=__doc__.splitlines()[0])
    p.add_argument("--write", metavar="README", help="replace the reference section of this file")
    args = p.parse_args(argv)
    text = render()
    if args.write:
        path = Path(args.write)
        path.write_text(replace_section(path.read_text(), text))
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
