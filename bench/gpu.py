"""The hf engine on a CUDA device at SmolLM2-135M's shape: `python -m bench.gpu` (a machine with an NVIDIA GPU).

Builds random-init checkpoints at run time in a temporary folder (`bench.engine_scale`'s builders; no network, nothing
committed): a Llama target of SmolLM2-135M-Instruct's shape (hidden 576, 30 layers, 9 heads, 3 KV heads, MLP 1536,
a 49,152-word vocabulary; 135M parameters with untied embeddings) and a reward model of the same shape with a scalar
head. The real SmolLM2 (a 98 MB GGUF file) is not used: the bench must run where only this repository travels.
Everything runs in this process, on the GPU, in `--dtype` (bfloat16 by default), one prompt of `--prompt-tokens`
random words per call, `--new-tokens` new tokens (random weights almost never emit EOS, so every candidate runs to
the limit on both sides):

1. **engine vs generate()**: Best-of-N through the job's own `Runner` (prefill once, the prompt's KV shared by the N
   candidates, the in-place cache, the final scoring with the reward model) against
   ``model.generate(do_sample=True, top_k=0, num_return_sequences=N, min_new_tokens=T)`` on the same loaded target
   (no scoring), for each N of `--ns`. Both sides run without PyTorch's cuDNN attention, which the engine turns off
   when it loads on a GPU (`workers.loading.without_cudnn_attention`; `--cudnn-ab` measures generate() with it on
   and off). Figures: generated tokens per wall-second (the device synchronised before
   each clock read) and the peak CUDA memory allocated above what was allocated before the call (the models), from
   ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. The sides alternate, `--repeats` runs
   each; the fastest run of each side is shown.
2. **Speculative Rejection vs Best-of-N**: the minimal config (`n`, `alpha` 0.5: the memory schedule, each prompt
   given the KV space of n / 8 candidates at full length) against Best-of-N at the same N, both through the Runner:
   generated tokens, wall seconds, peak CUDA memory, rejection rounds. With random weights the rewards mean nothing;
   the work and the memory are what SR saves.

`--profile` first profiles one call of each side at the first N: where its time goes (cProfile of the thread that
decodes, sorted by own time) and, on CUDA, the operations that made the host wait for the device
(``torch.cuda.set_sync_debug_mode``), counted by source line.

`--device cpu` runs the same code on the CPU (peak memory is then not measured), with `--small` for a shape that a
laptop runs in a minute: a check of the bench itself, not a figure.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import table
from bench.engine_scale import EOS, PAD, build_checkpoints, prompt_text
from pipeline.preflight import resolved
from schemas.config import validate_config

SMOLLM2 = ("llama", 49152, 576, 30, 9, 3, 1536)  # family, vocab, hidden, layers, heads, kv heads, MLP
SMALL = ("llama", 4096, 128, 2, 4, 2, 256)


class Bench:
    def __init__(self, folders: dict[str, Path], device: str, dtype: str, new_tokens: int):
        from workers.actor.runner import Runner

        self.folders, self.device, self.dtype, self.new_tokens = folders, device, dtype, new_tokens
        self.cuda = device == "cuda"
        self.base = Runner(self.config(8))
        assert self.base.engine.device.type == device, self.base.engine.device

    def config(self, n: int, rejection: bool = False):
        method = {"name": "speculative_rejection", "n": n, "alpha": 0.5} if rejection else {"name": "best_of_n", "n": n}
        raw = {
            "name": "bench-gpu", "seed": 0,
            "data": {"source": "builtin:demo-prompts", "prompt_column": "prompt", "id_column": "id"},
            "models": {"target": str(self.folders["target"]), "dtype": self.dtype,
                       "reward": {"kind": "model", "path": str(self.folders["reward"])}},
            "method": method,
            "generation": {"max_new_tokens": self.new_tokens, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
            "resources": {"gpus_per_actor": 1 if self.cuda else 0},
            "output": {"path": "runs/bench-gpu"},
        }
        return resolved(validate_config(raw))

    def timed(self, fn) -> tuple[object, float, float | None]:
        """fn(), its wall seconds (the device synchronised around it) and its peak CUDA memory in MiB above what
        was allocated before it (None on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20 if self.cuda else None
        return out, wall, peak

    def engine(self, text: str, n: int, rejection: bool = False) -> dict:
        from workers.actor.runner import Runner

        runner = Runner(self.config(n, rejection), share=self.base)  # on the loaded models
        items = [{"prompt_id": "p0", "prompt": [{"role": "user", "content": text}]}]
        rows, wall, peak = self.timed(lambda: runner.run(items))
        row = rows[0]
        assert row["error"] is None, row["error"]
        return {"tokens": row["stats"]["generated_tokens"], "wall_s": wall, "peak_mib": peak,
                "rounds": row["stats"].get("rejection_rounds", 0), "best_reward": row["best_reward"]}

    def generate(self, ids: list[int], n: int) -> dict:
        model = self.base.engine.target
        inp = torch.tensor([ids], device=self.base.engine.device)

        def call():
            with torch.inference_mode():
                return model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), do_sample=True,
                                      temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n,
                                      max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                                      pad_token_id=PAD, eos_token_id=EOS)

        out, wall, peak = self.timed(call)
        return {"tokens": int(out[:, len(ids):].numel()), "wall_s": wall, "peak_mib": peak}


def profiled(bench: Bench, text: str, ids: list[int], n: int, top: int = 18) -> None:
    """One call of each side under cProfile (the engine's in its decoding thread), and the host's waits for the
    device by source line (CUDA)."""
    import collections
    import cProfile
    import io
    import pstats
    import warnings

    from workers.pool.loop import Loop

    for side in ("engine", "generate"):
        prof = cProfile.Profile()
        serve = Loop.serve

        def serve_profiled(self, pool, serve=serve, prof=prof):
            prof.enable()
            try:
                serve(self, pool)
            finally:
                prof.disable()

        waits: collections.Counter = collections.Counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if bench.cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                if side == "engine":
                    Loop.serve = serve_profiled
                    r = bench.engine(text, n)
                else:
                    prof.enable()
                    r = bench.generate(ids, n)
                    prof.disable()
            finally:
                Loop.serve = serve
                if bench.cuda:
                    torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            if "synchroniz" in str(w.message):
                waits[f"{Path(w.filename).name}:{w.lineno}"] += 1
        steps = bench.new_tokens
        print(f"\n## profile: {side}, N={n}: {r['tokens']} tokens, {r['wall_s']:.2f} s, "
              f"{1000 * r['wall_s'] / steps:.1f} ms a step; host waits for the device: {sum(waits.values())} "
              f"({sum(waits.values()) / steps:.1f} a step)")
        for where, count in waits.most_common(12):
            print(f"    {count:6d}  {where}")
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])


def cudnn_ab(bench: Bench, vocab: int, n: int, rng: random.Random, repeats: int = 3) -> list[dict]:
    """generate() at N=n with PyTorch's cuDNN attention backend on and off (the engine turns it off when it loads,
    `workers.loading.without_cudnn_attention`), alternating; each run's prompt has a length no run had before, so
    no run reuses another's cuDNN plans."""
    runs = []
    for r in range(repeats):
        for on in (True, False):
            torch.backends.cuda.enable_cudnn_sdp(on)
            length = 100 + 13 * len(runs)
            ids = bench.base.encode_prompt([{"role": "user", "content": prompt_text(length, vocab, rng)}])
            g = bench.generate(ids, n)
            runs.append({"cudnn": on, "prompt_tokens": len(ids), **g,
                         "ms_per_step": 1000 * g["wall_s"] / bench.new_tokens})
            print(f"generate N={n}, cuDNN attention {'on ' if on else 'off'}: {runs[-1]['ms_per_step']:.1f} ms a step",
                  flush=True)
    torch.backends.cuda.enable_cudnn_sdp(False)
    return runs


def fastest(runs: list[dict]) -> dict:
    best = dict(min(runs, key=lambda r: r["wall_s"]))
    best["tok_per_s"] = best["tokens"] / best["wall_s"]
    best["all_wall_s"] = [r["wall_s"] for r in runs]
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--small", action="store_true", help="a tiny shape, to check the bench itself")
    ap.add_argument("--ns", default="16,64,256", help="N values, comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="first profile one call of each side at the first N")
    ap.add_argument("--cudnn-ab", action="store_true",
                    help="first time generate() with PyTorch's cuDNN attention on and off, alternating, a fresh prompt "
                         "length each run")
    ap.add_argument("--skip-figures", action="store_true", help="only --profile and --cudnn-ab")
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.gpu: no CUDA device here (use --device cpu --small to check the bench itself)")
    ns = [int(x) for x in args.ns.split(",")]
    shape = SMALL if args.small else SMOLLM2
    rng = random.Random(0)
    out: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "dtype": args.dtype,
                 "shape": shape, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                 "torch": torch.__version__}
    import transformers

    out["transformers"] = transformers.__version__
    with tempfile.TemporaryDirectory(prefix="winnow-bench-gpu-") as tmp:
        folders = build_checkpoints(Path(tmp), "smollm2-shape", shape, draft=False)
        bench = Bench(folders, args.device, args.dtype, args.new_tokens)
        out["parameters"] = sum(p.numel() for p in bench.base.engine.target.parameters())
        text = prompt_text(args.prompt_tokens, shape[1], rng)
        ids = bench.base.encode_prompt([{"role": "user", "content": text}])
        bench.engine(text, 4)  # warm-up: CUDA's context, kernels, allocator
        bench.generate(ids, 4)
        if args.cudnn_ab:
            out["cudnn_ab"] = cudnn_ab(bench, shape[1], ns[0], rng)
        if args.profile:
            profiled(bench, text, ids, ns[0])
        versus, rejection = [], []
        for n in ([] if args.skip_figures else ns):
            eng, gen = [], []
            for _ in range(args.repeats):  # alternate
                eng.append(bench.engine(text, n))
                gen.append(bench.generate(ids, n))
            e, g = fastest(eng), fastest(gen)
            versus.append({"n": n, "engine": e, "generate": g, "speedup": e["tok_per_s"] / g["tok_per_s"],
                           "memory_ratio": e["peak_mib"] / g["peak_mib"] if e["peak_mib"] else None})
            print(f"engine vs generate N={n}: {e['tok_per_s']:.0f} vs {g['tok_per_s']:.0f} tokens/s", flush=True)
        for n in ([] if args.skip_figures else ns):
            sr, bon = [], []
            for _ in range(args.repeats):
                sr.append(bench.engine(text, n, rejection=True))
                bon.append(bench.engine(text, n))
            s, b = fastest(sr), fastest(bon)
            rejection.append({"n": n, "sr": s, "bon": b, "tokens_ratio": s["tokens"] / b["tokens"],
                              "wall_ratio": s["wall_s"] / b["wall_s"],
                              "memory_ratio": s["peak_mib"] / b["peak_mib"] if s["peak_mib"] else None})
            print(f"SR vs Best-of-{n}: tokens {s['tokens']} vs {b['tokens']}, wall {s['wall_s']:.2f} vs "
                  f"{b['wall_s']:.2f} s", flush=True)
    out["versus_generate"], out["rejection"] = versus, rejection
    print(f"\n{out['device']}, {args.dtype}, {out['parameters']:,} parameters, torch {out['torch']}, transformers "
          f"{out['transformers']}; one prompt of {args.prompt_tokens} tokens, {args.new_tokens} new tokens per "
          f"candidate\n")
    print(table("engine vs generate() (Best-of-N)", {
        f"N={r['n']}": {"engine tok/s": r["engine"]["tok_per_s"], "generate tok/s": r["generate"]["tok_per_s"],
                        "speedup": r["speedup"], "engine MiB": r["engine"]["peak_mib"],
                        "generate MiB": r["generate"]["peak_mib"], "memory ratio": r["memory_ratio"]}
        for r in versus}, ["engine tok/s", "generate tok/s", "speedup", "engine MiB", "generate MiB", "memory ratio"],
        first="N"))
    print(table("Speculative Rejection (n, alpha 0.5) vs Best-of-N", {
        f"N={r['n']}": {"SR tokens": r["sr"]["tokens"], "BoN tokens": r["bon"]["tokens"],
                        "tokens ratio": r["tokens_ratio"], "SR s": r["sr"]["wall_s"], "BoN s": r["bon"]["wall_s"],
                        "wall ratio": r["wall_ratio"], "SR MiB": r["sr"]["peak_mib"], "BoN MiB": r["bon"]["peak_mib"],
                        "rounds": r["sr"]["rounds"]}
        for r in rejection}, ["SR tokens", "BoN tokens", "tokens ratio", "SR s", "BoN s", "wall ratio", "SR MiB",
                              "BoN MiB", "rounds"], first="N"))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
