"""The GPU check of issue 46, in one command that fits the minutes a GPU is lent: `python -m bench.gpu_check`.

It runs in this process, on one CUDA device, in bfloat16, in under 8 minutes of an H200 (`--budget-s`: a part that
would start past it is skipped and said so), and writes every figure to one JSON file (`--json`) after each
measurement, so that a run cut short keeps what it measured. `python -m bench.figures --write` renders its table
into docs/benchmarks.md. The models are built at run time (random init, `bench.engine_scale`'s builders; nothing
downloaded, nothing committed) but for the bundled tiny trio. Parts, most wanted first:

1. **engine vs generate()** at SmolLM2-135M's shape (`bench.gpu.SMOLLM2`) and, last, at Llama-3.2-1B's shape
   (`LLAMA_1B`): Best-of-N through the job's own `Runner` with the `logprob` reward (no reward model: decoding
   alone), its target's step static (CUDA graphs) and dynamic, against ``model.generate(do_sample=True,
   num_return_sequences=N, min_new_tokens=T)`` on the same loaded target, N = 16 and 64; one prompt of 128 random
   words, 128 new tokens (random weights emit no EOS: every row runs to the limit). The three sides alternate twice;
   the fastest run of each is kept. Figures: generated tokens per wall-second (the device synchronised around each
   run), decoding steps, graphs captured.
2. **Speculative Rejection vs Best-of-n** at n = 32 and 128, on a full actor (every prompt in one call, width 256,
   prompts starting as the width frees), the target's step as models.decode_step says (the default, dynamic): the tiny trio with
   its reward model on 128 held-out concept prompts (`bench.bill`'s `tiny` case, 48 new tokens), and SmolLM2's shape
   with a reward model of the same backbone's shape (random init: its scores mean nothing, its cost is a 135M
   model's) on 32 prompts of 64 random words, 64 new tokens.
   Figures: wall seconds, decoding steps, reward-model forwards, mean best reward, per side and SR / BoN.

`--cpu` runs the same code on the CPU at tiny sizes in seconds (float32, a 2-layer shape for both model shapes, a
few prompts, n = 4 and 8): a check of the script, not a figure (tests/test_gpu_check.py runs it).

On the device machine the `run` tool runs it with the wheels it lacks carried in `.whl` (docs/benchmarks.md, "The
GPU check", holds the command and how to fetch the wheels).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import table, write_json
from bench.engine_scale import EOS, PAD, build_tokenizer, model_config, prompt_text
from bench.gpu import SMALL, SMOLLM2

# Llama-3.2-1B's config (its published config.json): vocabulary, hidden, layers, heads, KV heads, MLP; tied
# embeddings, llama3 rope scaling
LLAMA_1B = ("llama", 128256, 2048, 16, 32, 8, 8192)
LLAMA_1B_OVER = {"tie_word_embeddings": True, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "head_dim": 64,
                 "max_position_embeddings": 131072,
                 "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                                  "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}}
SMALL_1B = ("llama", 4096, 128, 2, 4, 2, 256)  # --cpu: the 1B part's code at a tiny size
BUDGET_S = 330.0  # on a GPU, no part starts later than this (the longest part takes about two minutes)


class Clock:
    """The check's budget: whether a part may start, and the JSON written after each measurement."""

    def __init__(self, budget_s: float | None, out: dict, path: str | None):
        self.start, self.budget, self.out, self.path = time.perf_counter(), budget_s, out, path

    def may_start(self, part: str) -> bool:
        """Whether `part` may start (the budget is not spent); a part that may not is recorded as skipped."""
        if self.budget is None or time.perf_counter() - self.start < self.budget:
            return True
        self.out["skipped"].append(part)
        print(f"skipped (out of the {self.budget:.0f} s budget): {part}", flush=True)
        self.save()
        return False

    def save(self) -> None:
        self.out["elapsed_s"] = time.perf_counter() - self.start
        if self.path:
            write_json(self.path, self.out)


def synchronized(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Captures:
    """Counts the CUDA graphs the static step captures (`StaticCache._capture`, wrapped while the check runs)."""

    def __init__(self):
        from workers.decoding.static_step import StaticCache

        self.count, self.cls, self.original = 0, StaticCache, StaticCache._capture
        check = self

        def counted(cache, rb, cb):
            check.count += 1
            return check.original(cache, rb, cb)

        StaticCache._capture = counted

    def close(self) -> None:
        self.cls._capture = self.original


def build_target(root: Path, name: str, shape: tuple, over: dict, device: str, dtype: torch.dtype) -> Path:
    """A random-init causal LM of `shape` (seed 0), initialised on `device` in `dtype`, saved with its tokenizer."""
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = root / name
    with torch.device(device):
        lm = LlamaForCausalLM(model_config(*shape, **over)).to(dtype)
    lm.generation_config = GenerationConfig(eos_token_id=EOS, pad_token_id=PAD)
    lm.save_pretrained(folder)
    del lm
    build_tokenizer(shape[1], folder)
    return folder


def build_reward(root: Path, name: str, shape: tuple, device: str, dtype: torch.dtype) -> Path:
    """A random-init reward model of `shape` with a scalar head (seed 1), saved with its tokenizer."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(1)
    folder = root / name
    with torch.device(device):
        rm = LlamaForSequenceClassification(model_config(*shape, num_labels=1)).to(dtype)
    rm.save_pretrained(folder)
    del rm
    build_tokenizer(shape[1], folder)
    return folder


def job_config(models: dict, method: dict, new_tokens: int, device: str, dtype: str, prompts: int = 1,
               width: int | None = None):
    from pipeline.preflight import resolved
    from schemas.config import validate_config

    return resolved(validate_config({
        "name": "gpu-check", "seed": 0,
        "data": {"source": "builtin:demo-prompts", "prompt_column": "prompt", "id_column": "id"},
        "models": {**models, "dtype": dtype, "max_num_seqs": width},
        "method": method,
        "generation": {"max_new_tokens": new_tokens, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
        "resources": {"gpus_per_worker": 1 if device == "cuda" else 0, "prompts_per_batch": prompts},
        "output": {"path": "runs/gpu-check"},
    }))


def versus_generate(folder: Path, label: str, ns: list[int], args, clock: Clock, captures: Captures) -> None:
    """Part 1 at one shape: Best-of-N through the Runner, static and dynamic step, against generate()."""
    from workers.actor.runner import Runner

    models = {"target": str(folder), "reward": {"kind": "logprob"}}
    base = Runner(job_config(models, {"name": "best_of_n", "n": 4}, args.new_tokens, args.device, args.dtype))
    engine = base.engine
    rng = random.Random(0)
    vocab = engine.target.get_output_embeddings().weight.shape[0]
    text = prompt_text(args.prompt_tokens, vocab, rng)
    items = [{"prompt_id": "p0", "prompt": [{"role": "user", "content": text}]}]
    ids = base.encode_prompt(items[0]["prompt"])
    entry = {"shape": label, "parameters": sum(p.numel() for p in engine.target.parameters()),
             "prompt_tokens": len(ids), "new_tokens": args.new_tokens, "runs": []}
    clock.out["versus_generate"].append(entry)

    def run_engine(n: int, step: str) -> dict:
        engine.decode_step = step  # the engine's resolved models.decode_step, switched between the runs of one model
        runner = Runner(job_config(models, {"name": "best_of_n", "n": n}, args.new_tokens, args.device, args.dtype),
                        share=base)
        before = captures.count
        synchronized(args.device)
        t0 = time.perf_counter()
        rows = runner.run(items)
        synchronized(args.device)
        wall = time.perf_counter() - t0
        if rows[0]["error"] is not None:
            raise RuntimeError(rows[0]["error"])
        stats = rows[0]["stats"]
        return {"tokens": stats["generated_tokens"], "wall_s": wall, "decoding_steps": stats["decoding_steps"],
                "captures": captures.count - before}

    def run_generate(n: int) -> dict:
        inp = torch.tensor([ids], device=engine.device)
        synchronized(args.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = engine.target.generate(input_ids=inp, attention_mask=torch.ones_like(inp), do_sample=True,
                                         temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n,
                                         max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                         pad_token_id=PAD, eos_token_id=EOS)
        synchronized(args.device)
        return {"tokens": int(out[:, len(ids):].numel()), "wall_s": time.perf_counter() - t0,
                "decoding_steps": args.new_tokens}

    run_engine(4, "static"), run_engine(4, "dynamic"), run_generate(4)  # warm-up: kernels, allocator, cuBLAS
    for n in ns:
        if not clock.may_start(f"engine vs generate(), {label}, N = {n}"):
            break
        sides: dict[str, list[dict]] = {"static": [], "dynamic": [], "generate": []}
        for _ in range(args.repeats):
            sides["static"].append(run_engine(n, "static"))
            sides["dynamic"].append(run_engine(n, "dynamic"))
            sides["generate"].append(run_generate(n))
        best = {k: dict(min(v, key=lambda r: r["wall_s"]), all_wall_s=[r["wall_s"] for r in v])
                for k, v in sides.items()}
        for b in best.values():
            b["tok_per_s"] = b["tokens"] / b["wall_s"]
        run = {"n": n, **best, "static_over_generate": best["static"]["tok_per_s"] / best["generate"]["tok_per_s"],
               "dynamic_over_generate": best["dynamic"]["tok_per_s"] / best["generate"]["tok_per_s"]}
        entry["runs"].append(run)
        clock.save()
        print(f"{label} N={n}: static {best['static']['tok_per_s']:.0f}, dynamic {best['dynamic']['tok_per_s']:.0f}, "
              f"generate() {best['generate']['tok_per_s']:.0f} tokens/s; static / generate() "
              f"{run['static_over_generate']:.2f}", flush=True)
    del base, engine
    if args.device == "cuda":
        torch.cuda.empty_cache()


def rejection(case, label: str, ns: list[int], args, clock: Clock, captures: Captures) -> None:
    """Part 2 on one case (a `bench.bill.Case`): SR and Best-of-n at each n, alternating, on one loaded engine."""
    from bench.bill import run_side
    from workers.actor.runner import Runner

    entry = {"case": label, "prompts": len(case.items), "new_tokens": case.max_new_tokens, "width": args.width,
             "runs": []}
    clock.out["rejection"].append(entry)
    first = None
    for n in ns:
        if not clock.may_start(f"SR vs Best-of-n, {label}, n = {n}"):
            break
        width = max(args.width, n)
        sides = {"BoN": {"name": "best_of_n", "n": n}, "SR": {"name": "speculative_rejection", "n": n, "alpha": 0.5}}
        runners = {}
        for side, method in sides.items():
            config = case.config(method, "hf", width, "runs/gpu-check", None, 1 if args.device == "cuda" else 0,
                                 args.dtype)
            runners[side] = Runner(config, share=first) if first is not None else Runner(config)
            first = first if first is not None else runners[side]
        got: dict[str, dict] = {}
        for _ in range(args.sr_repeats):
            for side, runner in runners.items():
                before = captures.count
                synchronized(args.device)
                rows, _, wall = run_side(runner, case.items)
                synchronized(args.device)
                fig = case.figures(rows)
                keep = {k: fig[k] for k in ("mean_best_reward", "generated_tokens", "decoding_steps", "mean_width",
                                            "reward_forwards", "reward_tokens")}
                keep.update(wall_s=min(wall, got.get(side, {}).get("wall_s", wall)), captures=captures.count - before,
                            decode_step=runner.engine.decode_step)
                got[side] = keep
                print(f"  {label} n={n} {side}: {wall:.2f} s, {keep['decoding_steps']:.0f} steps, "
                      f"{keep['reward_forwards']} reward forwards, reward {keep['mean_best_reward']:.4f}", flush=True)
        sr, bon = got["SR"], got["BoN"]
        ratio = {k: sr[k] / bon[k] for k in ("wall_s", "decoding_steps", "reward_forwards") if bon[k]}
        ratio["steps_and_reward_forwards"] = (sr["decoding_steps"] + sr["reward_forwards"]) / \
            (bon["decoding_steps"] + bon["reward_forwards"])
        ratio["mean_best_reward"] = sr["mean_best_reward"] - bon["mean_best_reward"]
        entry["runs"].append({"n": n, "width": width, "SR": sr, "BoN": bon, "SR / BoN": ratio})
        clock.save()
        print(f"{label} n={n}: SR / BoN wall {ratio['wall_s']:.2f}, steps + reward forwards "
              f"{ratio['steps_and_reward_forwards']:.2f}", flush=True)
    if args.device == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU, in seconds: a check of the script")
    ap.add_argument("--json", default=None, help="write every figure to this file, after each measurement")
    ap.add_argument("--budget-s", type=float, default=None, help="no part starts past this many seconds "
                    f"(default: {BUDGET_S:.0f} on a GPU, so that the last part ends inside 8 minutes; none with --cpu)")
    ap.add_argument("--parts", default="smollm2,sr-tiny,sr-smollm2,1b",
                    help="comma-separated, in order: smollm2, 1b (engine vs generate()), sr-tiny, sr-smollm2")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.cpu else "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.gpu_check: no CUDA device here; --cpu runs the script's own check on the CPU", file=sys.stderr)
        return 2
    cpu = args.cpu
    if cpu:
        torch.set_num_threads(1)  # tiny shapes: threads would only contend with the machine's other work
    args.dtype = "float32" if cpu else "bfloat16"
    args.ns_generate = [4, 8] if cpu else [16, 64]
    args.ns = [4, 8] if cpu else [32, 128]
    args.prompt_tokens, args.new_tokens = (16, 8) if cpu else (128, 128)
    args.repeats, args.sr_repeats = (1, 1) if cpu else (2, 1)
    args.width = 16 if cpu else 256
    budget = args.budget_s if args.budget_s is not None or cpu else BUDGET_S
    import transformers

    out: dict = {"device": torch.cuda.get_device_name() if not cpu else "cpu", "mode": "cpu" if cpu else "gpu",
                 "dtype": args.dtype, "torch": torch.__version__, "transformers": transformers.__version__,
                 "load_before": os.getloadavg(), "budget_s": budget, "versus_generate": [], "rejection": [],
                 "skipped": []}
    clock = Clock(budget, out, args.json)
    captures = Captures()
    dtype = torch.float32 if cpu else torch.bfloat16
    kind = "part, a tiny shape" if cpu else "shape"  # --cpu runs each part's code at a 2-layer shape
    try:
        with tempfile.TemporaryDirectory(prefix="winnow-gpu-check-") as tmp:
            root = Path(tmp)
            for part in args.parts.split(","):
                if part == "smollm2":
                    if clock.may_start("engine vs generate(), SmolLM2-135M shape"):
                        shape = SMALL if cpu else SMOLLM2
                        folder = build_target(root, "smollm2-shape", shape, {}, args.device, dtype)
                        versus_generate(folder, f"SmolLM2-135M {kind}", args.ns_generate, args, clock, captures)
                elif part == "1b":
                    if clock.may_start("engine vs generate(), Llama-3.2-1B shape"):
                        shape, over = (SMALL_1B, {}) if cpu else (LLAMA_1B, LLAMA_1B_OVER)
                        folder = build_target(root, "llama-1b-shape", shape, over, args.device, dtype)
                        versus_generate(folder, f"Llama-3.2-1B {kind}", args.ns_generate, args, clock, captures)
                elif part == "sr-tiny":
                    rejection(tiny_case(4 if cpu else 128, 16 if cpu else None), "tiny trio", args.ns, args, clock,
                              captures)
                elif part == "sr-smollm2":
                    if clock.may_start("SR vs Best-of-n, SmolLM2-135M shape"):
                        rejection(smollm2_case(root, cpu, args.device, dtype), f"SmolLM2-135M {kind} + its "
                                  "reward model", args.ns, args, clock, captures)
                else:
                    raise SystemExit(f"--parts: unknown part {part!r}")
    finally:
        captures.close()
    out["load_after"] = os.getloadavg()
    clock.save()
    print(render(out))
    return 0


def tiny_case(prompts: int, new_tokens: int | None):
    """bench.bill's `tiny` case: the bundled trio on `prompts` held-out concept prompts, `new_tokens` new tokens
    (None: the case's 48)."""
    from bench.bill import make_cases

    return make_cases(["tiny"], prompts, tempfile.gettempdir(), new_tokens)[0]


def smollm2_case(root: Path, cpu: bool, device: str, dtype: torch.dtype):
    """SmolLM2's shape (random init) with a reward model of the same backbone's shape, on random-word prompts."""
    from bench.bill import Case
    from runfolder.parameters import count_parameters

    shape = SMALL if cpu else SMOLLM2
    target = build_target(root, "sr-smollm2-target", shape, {}, device, dtype)
    reward = build_reward(root, "sr-smollm2-reward", shape, device, dtype)
    rng = random.Random(1)
    prompts, words, new_tokens = (4, 16, 8) if cpu else (32, 64, 64)
    items = [{"prompt_id": f"p{i}", "prompt": [{"role": "user", "content": prompt_text(words, shape[1], rng)}]}
             for i in range(prompts)]
    return Case("smollm2-shape", {"target": str(target), "reward": {"kind": "model", "path": str(reward)}}, items,
                new_tokens, {"target": count_parameters(str(target)), "reward": count_parameters(str(reward))})


def render(out: dict) -> str:
    """The check's figures as Markdown tables (stdout; docs/benchmarks.md's table is bench.figures' `gpu_check`)."""
    rows = {}
    for e in out["versus_generate"]:
        for r in e["runs"]:
            rows[f"{e['shape']}, N={r['n']}"] = {
                "static tok/s": r["static"]["tok_per_s"], "dynamic tok/s": r["dynamic"]["tok_per_s"],
                "generate tok/s": r["generate"]["tok_per_s"], "static / generate": r["static_over_generate"],
                "dynamic / generate": r["dynamic_over_generate"], "graphs": r["static"]["captures"]}
    text = table(f"engine vs generate(), {out['device']}, {out['dtype']}", rows,
                 ["static tok/s", "dynamic tok/s", "generate tok/s", "static / generate", "dynamic / generate",
                  "graphs"], first="case")
    rows = {}
    for e in out["rejection"]:
        for r in e["runs"]:
            ratio = r["SR / BoN"]
            rows[f"{e['case']}, n={r['n']}"] = {
                "SR s": r["SR"]["wall_s"], "BoN s": r["BoN"]["wall_s"], "wall": ratio.get("wall_s"),
                "SR steps": r["SR"]["decoding_steps"], "BoN steps": r["BoN"]["decoding_steps"],
                "SR reward fwd": r["SR"]["reward_forwards"], "BoN reward fwd": r["BoN"]["reward_forwards"],
                "steps + fwd": ratio["steps_and_reward_forwards"], "reward diff": ratio["mean_best_reward"]}
    text += table("Speculative Rejection (alpha 0.5) vs Best-of-n", rows,
                  ["SR s", "BoN s", "wall", "SR steps", "BoN steps", "SR reward fwd", "BoN reward fwd",
                   "steps + fwd", "reward diff"], first="case")
    if out["skipped"]:
        text += "\n\nskipped (budget): " + "; ".join(out["skipped"])
    return text


if __name__ == "__main__":
    sys.exit(main())
