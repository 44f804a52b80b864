"""Measured figures that cannot drift: the docs' tables of figures, rendered from the files the benches write.

A bench run with ``--json docs/figures/NAME.json`` writes its figures there; a table in README.md or docs/*.md that
shows them sits between ``<!-- figures:TABLE -->`` and ``<!-- /figures:TABLE -->`` and is rendered from its file by
`RENDER[TABLE]`. `python -m bench.figures --write` renders every such table in place (after a bench run); `python -m
bench.figures` prints the tables that differ from their render; `tests/test_figures.py` fails on any, so a figure
in the docs is always the one its file holds, and a file is always what a named bench wrote (its command is in the
text beside the table).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!-- figures:(?P<name>[a-z0-9-]+) -->\n(?P<body>.*?)<!-- /figures:(?P=name) -->", re.S)


def load(name: str) -> dict:
    return json.loads((FIGURES / f"{name}.json").read_text())


def fmt(v, digits: int = 2) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def md(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def quickstart_summary() -> str:
    """The summary the quickstart printed (README: the first run's output)."""
    return "```\n" + "\n".join(load("quickstart")["quickstart_summary"]) + "\n```\n"


def quickstart_bill() -> str:
    """The quickstart against Best-of-32: what each cost and the ratio (bench.quickstart)."""
    f = load("quickstart")
    sr, bon, r = f["sr"], f["bon"], f["sr_over_bon"]
    rows = []
    for label, key, digits in (("mean best reward", "mean_best_reward", 4), ("generated tokens", "generated_tokens", 0),
                               ("reward-model tokens", "reward_tokens", 0),
                               ("reward tokens per generated token", "reward_per_generated", 2),
                               ("GFLOP per prompt (target and reward)", "gflop_per_prompt", 2),
                               ("decoding steps", "decoding_steps", 0),
                               ("device-seconds (interleaved pairs)", "device_s", 2)):
        ratio = r.get(key)
        if key == "mean_best_reward":
            low, high = r["reward_difference_95"]
            shown = f"{ratio:+.4f} [{low:+.4f}, {high:+.4f}]"
        else:
            shown = "" if ratio is None else f"**{ratio:.2f}x**"
        rows.append([label, fmt(bon[key], digits), fmt(sr[key], digits), shown])
    return md(["", "Best-of-32", "SR n = 32 (quickstart)", "SR / Best-of-32 (reward: difference [95%])"], rows)


def bill_cases(case: str) -> Iterator[tuple[str, str, dict]]:
    """(engine, "n=N", figures) of each run of `case` in bench.bill's file (its keys: "CASE ENGINE n=N")."""
    for key, got in load("bill")["cases"].items():
        name, engine, n = key.split(" ")
        if name == case:
            yield engine, n, got


def scoring_steps(setup: dict) -> str:
    """The scoring clock SR ran on (method.scoring_steps): a run filed without the setting scored at every step."""
    if "scoring_steps" not in setup:
        return "1"
    from schemas.methods import SpeculativeRejection

    default = SpeculativeRejection.model_fields["scoring_steps"].default
    return str(setup["scoring_steps"] if setup["scoring_steps"] is not None else default)


def bill(case: str) -> Callable[[], str]:
    """One case of bench.bill: each side's figures and SR against Best-of-N at n and at the same reward."""

    def render() -> str:
        rows = []
        for engine, n, got in bill_cases(case):
            same, at_n = got["SR / BoN at the same reward"], got["SR / BoN-n"]
            sr = got[f"SR-{n[2:]}"]
            setup = got["setup"]
            rows.append([engine, n[2:], f"{setup['prompts']} x {setup['new_tokens']}", str(setup["width"]),
                         fmt(sr["mean_best_reward"], 4), f"BoN-{same['matched_n']:.0f}",
                         f"**{same['decoding_steps']:.2f}x**", f"{at_n['decoding_steps']:.2f}x",
                         f"{same['gflop']:.2f}x", f"{at_n['gflop']:.2f}x", fmt(sr["reward_per_generated"], 2),
                         fmt(sr["reward_beyond_prompts_per_generated"], 2), f"{same['cpu_s']:.2f}x",
                         fmt(sr["mean_width"], 0), scoring_steps(setup)])
        return md(["engine", "n", "prompts x new tokens", "width", "SR reward", "matches", "steps vs same reward",
                   "steps vs BoN-n", "FLOPs vs same reward", "FLOPs vs BoN-n", "reward tok / gen tok",
                   "beyond the prompts", "CPU s vs same reward", "SR mean width", "SR scoring steps"], rows)

    return render


def reward_tokens(*cases: str) -> Callable[[], str]:
    """Cases of bench.bill, their reward-model tokens only: each side's generated tokens, the tokens its reward
    model was fed, and the two over each other (for a case whose sides are too few prompts to fill the width, so its
    steps say nothing, or whose reward's scores mean nothing)."""

    def render() -> str:
        rows = []
        for engine, _, got in (run for case in cases for run in bill_cases(case)):
            setup = got["setup"]
            sides = sorted((k for k in got if k.startswith(("BoN-", "SR-"))),
                           key=lambda k: (k[:2], int(k.split("-")[1])))
            for side in sides:
                fig = got[side]
                fed = fig["reward_per_generated"] * fig["generated_tokens"]
                rows.append([engine, f"{setup['prompts']} x {setup['new_tokens']}", side,
                             f"{fig['generated_tokens']:,}", f"{fed:,.0f}", f"{fig['reward_prompt_tokens']:,}",
                             fmt(fig["reward_per_generated"], 2), fmt(fig["reward_beyond_prompts_per_generated"], 2)])
        return md(["engine", "prompts x new tokens", "side", "generated tokens", "reward-model tokens",
                   "of which the prompts, at least", "reward tok / gen tok", "beyond the prompts"], rows)

    return render


def sessions(*cases: str) -> Callable[[], str]:
    """Cases of bench.bill run with the reward sessions (``CASE``) and scored whole at every call (``CASE@whole``):
    each side's reward-model tokens and FLOPs (target and reward) both ways, and whether the two runs made the same
    rows (the same generated tokens, the mean best reward within 1e-6); then the interleaved A/B of Speculative
    Rejection's CPU seconds both ways (``CASE@ab``)."""

    def render() -> str:
        rows = []
        for case in cases:
            whole = {(engine, n): got for engine, n, got in bill_cases(f"{case}@whole")}
            for engine, n, got in bill_cases(case):
                before = whole[(engine, n)]
                setup = got["setup"]
                for side in sorted((k for k in got if k.startswith(("BoN-", "SR-"))),
                                   key=lambda k: (k[:2], int(k.split("-")[1]))):
                    a, b = before[side], got[side]
                    same = abs(a["mean_best_reward"] - b["mean_best_reward"]) <= 1e-6 and a["generated_tokens"] == \
                        b["generated_tokens"]  # the scores' float noise aside
                    rows.append([case, engine, f"{setup['prompts']} x {setup['new_tokens']}", side,
                                 f"{b['generated_tokens']:,}", fmt(a["reward_per_generated"], 2),
                                 f"**{fmt(b['reward_per_generated'], 2)}**",
                                 fmt(b["reward_beyond_prompts_per_generated"], 2), fmt(a["gflop"], 1),
                                 fmt(b["gflop"], 1), "yes" if same else "NO"])
        table = md(["case", "engine", "prompts x new tokens", "side", "generated tokens",
                    "reward tok / gen tok, whole", "with sessions", "beyond the prompts", "GFLOP, whole",
                    "with sessions", "same rows"], rows)
        rows = []
        for case in cases:
            for engine, n, got in bill_cases(f"{case}@ab"):
                setup, ratio = got["setup"], got["cached / whole"]
                rows.append([case, engine, f"SR-{n[2:]}", f"{setup['prompts']} x {setup['new_tokens']}",
                             str(setup["repeats"]), fmt(got["whole"]["cpu_s"], 1), fmt(got["cached"]["cpu_s"], 1),
                             f"**{ratio['cpu_s']:.2f}x**", f"{ratio['gflop']:.2f}x",
                             "yes" if got["same_rows"] else "NO"])
        return table + "\n" + md(["case", "engine", "side", "prompts x new tokens", "pairs", "CPU s, whole",
                                   "with sessions", "CPU s ratio", "GFLOP ratio", "same rows"], rows)

    return render


def bill_gpu() -> str:
    """bench.bill on a GPU (`--gpus 1`): SR against Best-of-N in decoding steps, in steps and reward forwards (what
    a launch-bound device bills) and in wall seconds, the device's."""
    rows = []
    for key, got in load("bill-gpu")["cases"].items():
        case, engine, n = key.split(" ")
        same, at_n, setup = got["SR / BoN at the same reward"], got["SR / BoN-n"], got["setup"]
        sr, bon = got[f"SR-{n[2:]}"], got[f"BoN-{n[2:]}"]
        forwards = [f["decoding_steps"] + f["reward_forwards"] for f in (sr, bon)]
        per_step = [1000 * f["wall_s"] / f["decoding_steps"] for f in (sr, bon)]
        rows.append([f"{case}, {engine}", n[2:], f"{setup['prompts']} x {setup['new_tokens']}", str(setup["width"]),
                     f"BoN-{same['matched_n']:.0f}", f"**{same['decoding_steps']:.2f}x**",
                     f"{at_n['decoding_steps']:.2f}x", f"**{forwards[0] / forwards[1]:.2f}x**",
                     f"{same['wall_s']:.2f}x", f"{at_n['wall_s']:.2f}x", f"{per_step[0]:.0f} / {per_step[1]:.0f}",
                     fmt(sr["reward_per_generated"], 2)])
    return md(["case", "n", "prompts x new tokens", "width", "SR matches", "steps vs same reward", "steps vs BoN-n",
               "steps + reward forwards vs BoN-n", "wall vs same reward", "wall vs BoN-n", "ms a step, SR / BoN-n",
               "reward tok / gen tok"], rows)


def bill_clock() -> str:
    """bench.bill on the scoring clock, with the reward session as an accelerator runs it (`--reward-levels 0`): each
    side's decoding steps and reward-model forwards, what a device bills where a forward costs about the same at any
    width, SR against Best-of-n and against Best-of-N at the same reward, and the forwards per prompt scoring."""
    f = load("bill-clock")
    rows = []
    for key, got in f["cases"].items():
        case, engine, n = key.split(" ")
        same, setup = got["SR / BoN at the same reward"], got["setup"]
        sr, bon = got[f"SR-{n[2:]}"], got[f"BoN-{n[2:]}"]
        both = [s["decoding_steps"] + s["reward_forwards"] for s in (sr, bon)]
        # Best-of-N at SR's reward: its steps and forwards, from the ratios at the same reward
        matched = sr["decoding_steps"] / same["decoding_steps"] + sr["reward_forwards"] / same["reward_forwards"]
        rows.append([f"{case}, {engine}", n[2:], f"{setup['prompts']} x {setup['new_tokens']}",
                     f"{sr['decoding_steps']:.0f} + {sr['reward_forwards']}",
                     f"{bon['decoding_steps']:.0f} + {bon['reward_forwards']}", f"**{both[0] / both[1]:.2f}x**",
                     f"BoN-{same['matched_n']:.0f}", f"**{both[0] / matched:.2f}x**",
                     f"{sr['reward_forwards_per_scoring']:.2f} / {bon['reward_forwards_per_scoring']:.2f}",
                     f"{sr['mean_best_reward']:.4f} / {bon['mean_best_reward']:.4f}"])
    return (md(["case", "n", "prompts x new tokens", "SR: steps + reward forwards", "BoN-n: steps + reward forwards",
                "SR / BoN-n", "SR's reward matches", "SR / BoN at the same reward",
                "reward forwards per scoring, SR / BoN-n", "mean best reward, SR / BoN-n"], rows)
            + f"\nWidth {f['width']}, {f['threads']} torch thread(s), CPU; the counts are the same on any device. "
            f"Load average {f['load_before'][0]:.1f} before, {f['load_after'][0]:.1f} after.\n")


def gpu_forwards() -> str:
    """bench.bill on a GPU at n = 32 with the reward session's tree at its default depth and cut to 1 and 0 levels:
    each side's target steps and reward forwards, what a launch-bound device bills, against reward tokens."""
    rows = []
    for name, levels in (("bill-gpu", "4 (default)"), ("bill-gpu-levels1", "1"), ("bill-gpu-levels0", "0")):
        got = load(name)["cases"]["tiny hf n=32"]
        sr, bon = got["SR-32"], got["BoN-32"]
        both = [f["decoding_steps"] + f["reward_forwards"] for f in (sr, bon)]
        rows.append([levels, f"{bon['decoding_steps']:.0f} + {bon['reward_forwards']}",
                     f"{sr['decoding_steps']:.0f} + {sr['reward_forwards']}", f"**{both[0] / both[1]:.2f}x**",
                     f"{bon['reward_per_generated']:.2f} / {sr['reward_per_generated']:.2f}",
                     f"{sr['wall_s']:.2f} / {bon['wall_s']:.2f}"])
    return md(["tree levels", "BoN-32: steps + reward forwards", "SR-32: steps + reward forwards",
               "SR / BoN, steps + reward forwards", "reward tok / gen tok, BoN / SR", "wall s, SR / BoN"], rows)


def gpu() -> str:
    """bench.gpu: the hf engine against generate() at one prompt per call, and SR against Best-of-N there."""
    f = load("gpu")
    rows = [[str(r["n"]), fmt(r["engine"]["tok_per_s"], 0), fmt(r["generate"]["tok_per_s"], 0),
             f"**{r['speedup']:.2f}**", fmt(r["engine"]["peak_mib"], 0), fmt(r["generate"]["peak_mib"], 0),
             f"{r['sr']['tokens']:,} / {r['bon']['tokens']:,}", f"{r['sr']['wall_s']:.2f} / {r['bon']['wall_s']:.2f}"]
            for r in (dict(v, **{k: w for k, w in s.items() if k in ("sr", "bon")})
                      for v, s in zip(f["versus_generate"], f["rejection"]))]
    return (f"{f['device']}, {f['dtype']}, {f['parameters']:,} parameters, torch {f['torch']}, transformers "
            f"{f['transformers']}; one prompt of {f['prompt_tokens']} tokens, {f['new_tokens']} new tokens\n\n"
            + md(["N", "engine tok/s", "generate() tok/s", "engine / generate", "engine peak MiB",
                  "generate peak MiB", "SR / BoN tokens", "SR / BoN wall s"], rows))


def gpu_check() -> str:
    """bench.gpu_check: the hf engine (static and dynamic step) against generate(), and SR against Best-of-n, on one
    device, with the device, versions and anything the budget skipped."""
    f = load("gpu-check")
    if f["mode"] != "gpu":  # the script's own check at tiny sizes: it ran, and its figures are no GPU's
        return (f"No GPU figures yet: the JSON holds the `--cpu` check ({f['device']}, {f['dtype']}, torch "
                f"{f['torch']}), which shows only that the script runs.\n")
    where = f["device"]
    rows = []
    for e in f["versus_generate"]:
        for r in e["runs"]:
            g = r["generate"]
            for step in ("static", "dynamic"):
                a = r[step]
                rows.append([e["shape"], f"N = {r['n']}", f"engine, {step} step", "generate()",
                             f"{a['wall_s']:.2f} / {g['wall_s']:.2f}", f"{a['tok_per_s']:,.0f} / {g['tok_per_s']:,.0f}",
                             f"{a['decoding_steps']:,.0f} / {g['decoding_steps']:,.0f}", "",
                             f"**{a['tok_per_s'] / g['tok_per_s']:.2f}x** tokens/s"])
    for e in f["rejection"]:
        for r in e["runs"]:
            a, b = r["SR"], r["BoN"]
            rows.append([e["case"], f"n = {r['n']}", "SR, alpha 0.5", "Best-of-n",
                         f"{a['wall_s']:.2f} / {b['wall_s']:.2f}",
                         f"{a['generated_tokens'] / a['wall_s']:,.0f} / {b['generated_tokens'] / b['wall_s']:,.0f}",
                         f"{a['decoding_steps']:,.0f} / {b['decoding_steps']:,.0f}",
                         f"{a['reward_forwards']:,} / {b['reward_forwards']:,}",
                         f"**{r['SR / BoN']['wall_s']:.2f}x** wall"])
    head = (f"{where}, {f['dtype']}, torch {f['torch']}, transformers {f['transformers']}; {f['elapsed_s']:.0f} s in "
            "all" + (f"; skipped for the budget: {'; '.join(f['skipped'])}" if f["skipped"] else "") + "\n\n")
    return head + md(["case", "N", "side A", "side B", "wall s, A / B", "tokens/s, A / B", "decoding steps, A / B",
                      "reward forwards, A / B", "A / B"], rows)


def static_step() -> str:
    """bench.static_step: the static step against the dynamic one on the CPU, in CPU seconds, with the load."""
    f = load("static-step")
    names = {"tiny-bon": "tiny trio, Best-of-16, 32 prompts", "tiny-sr": "tiny trio, SR n = 16, 32 prompts",
             "smollm2-shape": "SmolLM2-135M shape, Best-of-16, 2 prompts"}
    rows = [[names.get(name, name), f"{c['dynamic']['cpu_s']:.2f}", f"{c['static']['cpu_s']:.2f}",
             f"**{c['static / dynamic']['cpu_s']:.2f}x**", "yes" if c["same_rows"] else "no"]
            for name, c in f["cases"].items()]
    return (md(["case", "dynamic CPU s", "static CPU s", "static / dynamic", "same rows"], rows)
            + f"\nLeast of {f['repeats']} alternating runs a side, {f['threads']} torch thread, torch {f['torch']}; "
            f"load average {f['load_before'][0]:.1f} before, {f['load_after'][0]:.1f} after.\n")


def verified_word_problems() -> str:
    """What a verified answer costs on SmolLM2's word problems, per method (bench.verified), with its command and
    machine."""
    f = load("verified")
    labels = {"greedy": "greedy", "best-of-n": f"Best-of-{f['n']}",
              "stop-after-1": f"Best-of-{f['n']}, stop after 1 verified",
              "speculative-rejection": f"Speculative Rejection, n = {f['n']}"}
    runs = f["methods"]

    def interval(value, ci, digits):
        if value is None:
            return "no verified prompt"
        hi = "unbounded" if ci is None or ci[1] is None else fmt(ci[1], digits)
        return f"{fmt(value, digits)} [{'' if ci is None else fmt(ci[0], digits)}, {hi}]"

    rows = []
    for key, label in labels.items():
        m = runs[key]
        c = m["cost_of_a_pass"]
        flops = c.get("flops")
        rows.append([label, f"{m['verified_prompts']} / {m['prompts']}",
                     interval(m["verified_rate"], m["verified_rate_interval"], 3), fmt(m["pass_at_1"], 3),
                     fmt(m["generated_tokens"]), fmt(m["decoding_steps"], 0), fmt(m["gflop_per_prompt"], 1),
                     fmt(m["device_seconds"], 1),
                     interval(None if flops is None else flops / 1e9, None if c.get("flops_interval") is None else
                              [None if v is None else v / 1e9 for v in c["flops_interval"]], 1),
                     interval(c["usd"], c.get("usd_interval"), 6)])
    head = ["method", "verified prompts", "verified rate [95%]", "mean pass@1", "generated tokens", "decoding steps",
            "GFLOP per prompt", "device-seconds", "GFLOP per verified prompt [95%]", "USD per verified prompt [95%]"]
    return (md(head, rows) + f"\nMade by `{f['command']}`: each method is run by `winnow generate` as "
            f"`{runs['best-of-n']['command']}`, with its own `method`. Machine: {f['machine']}.\n")


RENDER: dict[str, Callable[[], str]] = {
    "verified-word-problems": verified_word_problems,
    "bill-gpu": bill_gpu,
    "gpu": gpu,
    "gpu-check": gpu_check,
    "static-step": static_step,
    "gpu-forwards": gpu_forwards,
    "bill-clock": bill_clock,
    "quickstart-summary": quickstart_summary,
    "quickstart-bill": quickstart_bill,
    **{f"bill-{case}": bill(case) for case in ("tiny", "smollm2", "smollm2-concepts")},
    "bill-smollm2-rm": reward_tokens("smollm2-rm"),
    "bill-smollm2-rm-long": reward_tokens("smollm2-rm-long", "smollm2-rm-long-answers"),
    "bill-prm": sessions("tiny-prm", "smollm2-prm"),
}


def tables() -> list[tuple[Path, str, str]]:
    """(file, table name, its text now) of every marked table of the docs."""
    return [(path, m["name"], m["body"]) for path in DOCS for m in MARK.finditer(path.read_text())]


def stale() -> list[str]:
    """One line per marked table that differs from its render, or that names no renderer or file."""
    out = []
    for path, name, body in tables():
        if name not in RENDER:
            out.append(f"{path.relative_to(ROOT)}: table {name!r} has no renderer in bench.figures.RENDER")
            continue
        try:
            want = RENDER[name]()
        except (OSError, KeyError, ValueError) as err:
            out.append(f"{path.relative_to(ROOT)}: table {name!r} cannot be rendered ({type(err).__name__}: {err})")
            continue
        if body != want:
            out.append(f"{path.relative_to(ROOT)}: table {name!r} differs from its render; run python -m "
                       "bench.figures --write")
    return out


def write() -> list[str]:
    """Render every marked table in place; the names of those that changed."""
    changed = []
    for path in DOCS:
        text = path.read_text()

        def sub(m: re.Match) -> str:
            try:
                body = RENDER[m["name"]]()
            except (OSError, KeyError, ValueError) as err:  # no file yet: the table is left as it is, and said
                changed.append(f"{path.relative_to(ROOT)}: {m['name']} NOT rendered ({type(err).__name__}: {err})")
                return m.group(0)
            if body != m["body"]:
                changed.append(f"{path.relative_to(ROOT)}: {m['name']}")
            return f"<!-- figures:{m['name']} -->\n{body}<!-- /figures:{m['name']} -->"

        new = MARK.sub(sub, text)
        if new != text:
            path.write_text(new)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.figures", description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="render every marked table in place")
    args = ap.parse_args(argv)
    if args.write:
        for line in write():
            print(f"rendered {line}")
        return 0
    problems = stale()
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
