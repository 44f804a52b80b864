"""The engine at a realistic scale against `generate()`, for Best-of-N: `python -m bench.engine_scale`.

Builds random-init checkpoints at run time in a temporary folder (never committed; no network): a Llama-style
target with GQA and a 32k vocabulary, a Qwen2-style one with a ~152k vocabulary, a 2-layer draft of the Llama
target (built and loaded as a check; Best-of-N does not use it), and a reward model of each target's shape
(``LlamaForSequenceClassification``, num_labels = 1). Each tokenizer is a byte-level BPE (`tokenizers`) of exactly the
model's vocabulary, whose words (" a" .. " zzzz") are one token each, wrapped as ``PreTrainedTokenizerFast`` with
EOS and pad tokens; prompts are random words, so a prompt of P words encodes to P tokens (checked).

For each case (model, N, prompt tokens P, new tokens T), one prompt per call, the two sides alternate
(``--repeats`` times each, figures of the run with the least CPU time):

- **engine**: ``Runner(config).run(items)`` with method best_of_n and the reward model: the job's own path
  (prefill once, cache repeated over the N candidates, final scoring with the shared-prefix reward model);
- **generate**: ``model.generate(do_sample=True, top_k=0, num_return_sequences=N, max_new_tokens=T,
  min_new_tokens=T)`` on the same target; no scoring.

Figures: generated tokens, CPU seconds of the process (``time.process_time``, every thread: robust to the load of
other processes, unlike wall-clock, which is also shown), tokens per CPU-second and per wall-second, the peak RSS
above the RSS at the call's start (``/proc/self/statm`` polled every 5 ms, so a peak shorter than that can be
missed), and the ratio engine / generate of tokens per CPU-second (> 1: the engine is cheaper). ``engine excl.
scoring`` removes the reward model's CPU time, for a like-for-like decoding comparison.

**Roofline.** The CPU's float32 matmul throughput is measured in the same run: [1024, h] @ [h, 4h] (the MLP's
shape at hidden size h), best of several, in FLOP per CPU-second and per wall-second. The fraction reached is an
approximation: 2 x (parameters without the input embedding, the LM head included) x tokens fed to the target
(prefill tokens + decoded tokens; attention's own FLOPs and the reward model are left out) / CPU seconds of the
side's decoding, against the matmul's FLOP per CPU-second.

**Phases** of the engine side: CPU time (``time.process_time``) of manual timers wrapped around the engine's
functions by this bench (exclusive of nested timers): ``forward`` (the model, `workers.decoding.batch.forward`, without
the cache update), ``cache update`` (writing a step's keys and values: the engine's in-place
``GrowingLayer.update``; transformers' ``DynamicLayer.update``, a concatenation, under generate and in the reward
session's caches), ``cache select`` (``batch_repeat_interleave``, ``Batch.select``/``compact``), ``sampling``
(``uniforms`` + ``next_tokens``: warp, softmax over the vocabulary, inverse-CDF draw), ``scoring`` (the reward
model's call or its session's, tokenization included) and ``other`` (the rest: bookkeeping, ``tolist``, decoding
the candidates' text). "Sampling of a step" is sampling / (forward + cache update + cache select + sampling).

**Steps**: the CPU time of each ``TargetSampler.step`` call (forward, cache, sampling of one token per sequence); the
median of the first and of the last quarter of a case's steps, and their ratio, show how a step grows with the
response length (the attention reads one more column per step; nothing else should grow).

**Speculative Rejection**: one prompt with alpha 0.5 and a decision every 16 tokens against Best-of-N on the same
prompt: reward tokens (everything the reward model was fed, prompt included) per generated token.

**Random weights rarely emit EOS**: with random init the EOS token has probability about 1/V per step, so almost
every row decodes to the length limit and the engine's early exit of finished rows never plays. The *mixed lengths*
case makes rows finish at a length drawn uniformly in [1, T] per row (the same lengths on both sides): generate
gets a ``LogitsProcessor`` that forces EOS at the row's length (generate keeps finished rows in its batch, padded);
the engine has no logits hook, so the bench sets each sequence's length limit (``Batch.limit``, after the prefill)
to the row's length, which the engine handles as it handles an EOS (`TargetSampler.done`, then the finished rows leave
the cache in bulk): the finish reason is "length" rather than "eos", the decoding work is the same.

``--quick`` (the default) takes about 15 minutes per repeat on 2 CPU cores; ``--full`` runs the issue's grid (N = 16, 64,
256; prompts of 32 and 512 tokens; 128 and 512 new tokens; hidden 768 x 12 layers), which takes hours on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.common import table
from pipeline.preflight import resolved
from schemas.config import validate_config

SPECIALS = ["<unk>", "<pad>", "</s>"]  # ids 0, 1, 2
PAD, EOS = 1, 2


def bpe_vocab(vocab: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE of exactly `vocab` entries: the specials, the 256 byte-level characters, then the words
    " a" .. " zz" .. " zzz" and as many 4-letter words as fit, each built by merging its last letter onto its
    prefix, so that " abcd" is one token."""
    import itertools
    import string

    from tokenizers.pre_tokenizers import ByteLevel

    words = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(ByteLevel.alphabet()):
        words[ch] = len(words)
    merges = []
    for k in range(1, 5):
        for combo in itertools.product(string.ascii_lowercase, repeat=k):
            if len(words) >= vocab:
                return words, merges
            w = "\u0120" + "".join(combo)  # Ġ: byte-level's space
            words[w] = len(words)
            merges.append((w[:-1], w[-1]))
    raise ValueError(f"vocabulary {vocab} is larger than this builder's words")


def build_tokenizer(vocab: int, folder: Path) -> None:
    """A byte-level BPE tokenizer (as Qwen2Tokenizer expects: transformers 5 loads the model type's own tokenizer
    class for qwen2 whatever tokenizer_config.json names) of exactly `vocab` entries, with EOS and pad tokens."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    words, merges = bpe_vocab(vocab)
    tok = Tokenizer(models.BPE(words, merges, unk_token="<unk>"))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>",
                                   padding_side="left", model_max_length=1 << 20)
    assert len(fast) == vocab, (len(fast), vocab)
    fast.save_pretrained(folder)


SHAPES = {  # name: (family, vocab, hidden, layers, heads, kv_heads, intermediate)
    "quick": {"llama-32k": ("llama", 32000, 512, 8, 8, 2, 1408), "qwen2-152k": ("qwen2", 151936, 512, 8, 8, 2, 1408)},
    "full": {"llama-32k": ("llama", 32000, 768, 12, 12, 4, 2048), "qwen2-152k": ("qwen2", 151936, 768, 12, 12, 4, 2048)},
}


def model_config(family: str, vocab: int, hidden: int, layers: int, heads: int, kv: int, inter: int, **over):
    from transformers import LlamaConfig, Qwen2Config

    cls = LlamaConfig if family == "llama" else Qwen2Config
    kw = {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
          "num_key_value_heads": kv, "intermediate_size": inter, "max_position_embeddings": 4096,
          "tie_word_embeddings": False, "eos_token_id": EOS, "pad_token_id": PAD, "bos_token_id": None}
    kw.update(over)
    return cls(**kw)


def build_checkpoints(root: Path, name: str, shape: tuple, draft: bool) -> dict[str, Path]:
    """target (and reward, and optionally a 2-layer draft) folders for one shape, random init, seed 0."""
    from transformers import (
        GenerationConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
        Qwen2ForCausalLM,
    )

    family, vocab, hidden, layers, heads, kv, inter = shape
    torch.manual_seed(0)
    out = {}
    cfg = model_config(*shape)
    lm = (LlamaForCausalLM if family == "llama" else Qwen2ForCausalLM)(cfg)
    lm.generation_config = GenerationConfig(eos_token_id=EOS, pad_token_id=PAD)
    out["target"] = root / f"{name}-target"
    lm.save_pretrained(out["target"])
    del lm
    # the reward model: the target's shape with a scalar head (Llama's class for both families)
    rm = LlamaForSequenceClassification(model_config("llama", vocab, hidden, layers, heads, kv, inter, num_labels=1))
    out["reward"] = root / f"{name}-reward"
    rm.save_pretrained(out["reward"])
    del rm
    if draft:
        d = (LlamaForCausalLM if family == "llama" else Qwen2ForCausalLM)(model_config(family, vocab, hidden, 2, heads,
                                                                                         kv, inter))
        out["draft"] = root / f"{name}-draft"
        d.save_pretrained(out["draft"])
        del d
    for folder in out.values():
        build_tokenizer(vocab, folder)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Measurement helpers


class Phases:
    """Exclusive CPU time (time.process_time) of named functions, wrapped in place; nested timers subtract."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.stack: list[float] = []  # child time accumulated by each open frame
        self.undo: list[tuple] = []

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)
        phases = self

        def timed(*a, **kw):
            phases.stack.append(0.0)
            t0 = time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.process_time() - t0
                child = phases.stack.pop()
                phases.totals[name] = phases.totals.get(name, 0.0) + dt - child
                if phases.stack:
                    phases.stack[-1] += dt

        self.undo.append((owner, attr, fn))
        setattr(owner, attr, timed)

    def take(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out


class StepTimes:
    """CPU seconds of each call of the engine's decoding step (`TargetSampler.step`: forward, cache, sampling), in
    order."""

    def __init__(self):
        self.times: list[float] = []

    def install(self) -> None:
        from workers.decoding.target import TargetSampler

        step, times = TargetSampler.step, self.times

        def timed(engine, batch):
            t0 = time.process_time()
            try:
                return step(engine, batch)
            finally:
                times.append(time.process_time() - t0)

        TargetSampler.step = timed

    def take(self) -> dict:
        """The median step of the first and of the last quarter of the steps, and their ratio (> 1: steps grow
        with the response length)."""
        t, self.times[:] = list(self.times), []
        if len(t) < 8:
            return {}
        q = len(t) // 4
        first, last = sorted(t[:q])[q // 2], sorted(t[-q:])[q // 2]
        return {"step_first_ms": 1e3 * first, "step_last_ms": 1e3 * last, "step_growth": last / first}


class PeakRSS:
    """Peak RSS above the RSS at entry, polled from /proc/self/statm every `every` seconds."""

    def __init__(self, every: float = 0.005):
        self.every, self.peak, self.base = every, 0, 0
        self.page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _poll(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.every)

    def __enter__(self):
        self.base = self.peak = self.rss()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.rss())
        return False

    @property
    def above_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def matmul_roofline(hidden: int, repeats: int = 5) -> dict:
    """float32 [1024, h] @ [h, 4h]: best FLOP per CPU-second and per wall-second over `repeats` timings."""
    a, b = torch.randn(1024, hidden), torch.randn(hidden, 4 * hidden)
    flop = 2 * 1024 * hidden * 4 * hidden
    for _ in range(3):
        a @ b
    best_cpu = best_wall = float("inf")
    inner = 8
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(inner):
            a @ b
        best_cpu = min(best_cpu, (time.process_time() - c0) / inner)
        best_wall = min(best_wall, (time.perf_counter() - w0) / inner)
    return {"shape": f"[1024,{hidden}]@[{hidden},{4 * hidden}]", "gflop_per_cpu_s": flop / best_cpu / 1e9,
            "gflop_per_wall_s": flop / best_wall / 1e9}


def matmul_params(model) -> int:
    """Parameters that take part in a token's matmuls: all but the input embedding (the LM head included)."""
    emb = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not emb)


# ----------------------------------------------------------------------------------------------------------------
# The two sides


def prompt_text(length: int, vocab: int, rng: random.Random) -> str:
    """`length` random words of the vocabulary, each one token (a leading space on each, the first included)."""
    words = [w[1:] for w in bpe_vocab(vocab)[0] if w.startswith("\u0120") and len(w) > 1]
    return "".join(" " + rng.choice(words) for _ in range(length))


class ForceEOS:
    """A generate LogitsProcessor: row r emits EOS as its lengths[r]-th new token (the rest of the row is padding)."""

    def __init__(self, lengths: list[int], prompt_len: int):
        self.lengths = torch.tensor(lengths)
        self.prompt_len = prompt_len

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_len  # new tokens so far
        rows = self.lengths == step + 1
        if bool(rows.any()):
            scores[rows] = float("-inf")
            scores[rows, EOS] = 0.0
        return scores


class Side:
    """Both sides on one loaded target: the engine through a Runner, generate on the Runner's target."""

    def __init__(self, folders: dict[str, Path], phases: Phases, steps: StepTimes):
        from workers.actor.runner import Runner

        self.folders = folders
        self.runner = Runner(self.config(16, 16))
        self.phases, self.steps = phases, steps
        self.limits: list[int] | None = None  # per-row length limits for the mixed case

    def config(self, n: int, new_tokens: int, every_k_tokens: int | None = None):
        method = {"name": "best_of_n", "n": n} if every_k_tokens is None else {
            "name": "speculative_rejection", "n": n, "alpha": 0.5, "schedule": "fixed",
            "every_k_tokens": every_k_tokens}
        raw = {
            "name": "bench-scale", "seed": 0,
            "data": {"source": "builtin:demo-prompts", "prompt_column": "prompt", "id_column": "id"},
            "models": {"target": str(self.folders["target"]),
                       "reward": {"kind": "model", "path": str(self.folders["reward"])}},
            "method": method,
            "generation": {"max_new_tokens": new_tokens, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
            "output": {"path": "runs/bench-scale"},
        }
        return resolved(validate_config(raw))

    def engine(self, text: str, n: int, new_tokens: int, every_k_tokens: int | None = None) -> dict:
        from workers.actor.runner import Runner

        runner = Runner(self.config(n, new_tokens, every_k_tokens), share=self.runner)  # on the loaded models
        items = [{"prompt_id": "p0", "prompt": [{"role": "user", "content": text}]}]
        self.phases.take()
        self.steps.take()
        with PeakRSS() as mem:
            c0, w0 = time.process_time(), time.perf_counter()
            rows = runner.run(items)
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        assert rows[0]["error"] is None, rows[0]["error"]
        return {"tokens": rows[0]["stats"]["generated_tokens"], "cpu_s": cpu, "wall_s": wall,
                "peak_rss_mb": mem.above_mb, "phases": self.phases.take(), **self.steps.take(),
                "reward_tokens": rows[0]["cost"]["reward_tokens"], "best_reward": rows[0]["best_reward"],
                "rejection_rounds": rows[0]["stats"].get("rejection_rounds", 0)}

    def generate(self, ids: list[int], n: int, new_tokens: int, lengths: list[int] | None = None) -> dict:
        from transformers import LogitsProcessorList

        model = self.runner.engine.target
        inp = torch.tensor([ids])
        procs = LogitsProcessorList([ForceEOS(lengths, len(ids))]) if lengths else None
        self.phases.take()
        with PeakRSS() as mem, torch.inference_mode():
            c0, w0 = time.process_time(), time.perf_counter()
            out = model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, num_return_sequences=n, max_new_tokens=new_tokens,
                                 min_new_tokens=0 if lengths else new_tokens, pad_token_id=PAD,
                                 eos_token_id=EOS, logits_processor=procs)
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        new = out[:, len(ids):]
        is_eos = new == EOS
        tokens = int(torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, new.shape[1]).sum())
        return {"tokens": tokens, "cpu_s": cpu, "wall_s": wall, "peak_rss_mb": mem.above_mb,
                "phases": self.phases.take(), "decoded_width": int(new.shape[1])}


def install_timers(phases: Phases) -> None:
    from transformers.cache_utils import DynamicCache, DynamicLayer

    import workers.decoding.batch as batch_module
    import workers.decoding.target as target_module
    from workers.decoding.kvcache import GrowingLayer
    from workers.scoring.reward_model import RewardModelScorer
    from workers.scoring.reward_session import CachedScoring

    phases.wrap(target_module, "forward", "forward")
    phases.wrap(DynamicLayer, "update", "cache update")  # generate's cache
    phases.wrap(GrowingLayer, "update", "cache update")  # the engine's
    phases.wrap(DynamicCache, "batch_repeat_interleave", "cache select")
    phases.wrap(batch_module.Batch, "select", "cache select")
    phases.wrap(target_module, "uniforms", "sampling")
    phases.wrap(target_module, "next_tokens", "sampling")
    phases.wrap(RewardModelScorer, "__call__", "scoring")
    phases.wrap(CachedScoring, "score", "scoring")  # a pool's reward session (nested calls count once)
    phases.wrap(CachedScoring, "release", "scoring")


def set_row_limits(sides: list[Side]) -> None:
    """TargetSampler.prefill, then each sequence's limit set to the current side's per-row length (the mixed case)."""
    from workers.decoding.target import TargetSampler

    prefill = TargetSampler.prefill

    def limited(self, *a, **kw):
        batch = prefill(self, *a, **kw)
        for side in sides:
            if side.limits is not None:
                assert batch.size == len(side.limits)
                batch.limit = torch.minimum(batch.limit, torch.tensor(side.limits, device=batch.limit.device))
        return batch

    TargetSampler.prefill = limited


# ----------------------------------------------------------------------------------------------------------------


def summarise(label: str, runs: list[dict], flop_per_token: float, prefill_tokens: int, roof: dict) -> dict:
    best = min(runs, key=lambda r: r["cpu_s"])
    work = best["cpu_s"] - best["phases"].get("scoring", 0.0)
    fed = prefill_tokens + best["tokens"]
    return {"tokens": best["tokens"], "cpu_s": best["cpu_s"], "wall_s": best["wall_s"],
            "tok_per_cpu_s": best["tokens"] / best["cpu_s"], "tok_per_wall_s": best["tokens"] / best["wall_s"],
            "decode_cpu_s": work, "tok_per_decode_cpu_s": best["tokens"] / work,
            "peak_rss_mb": best["peak_rss_mb"],
            "roofline_frac": flop_per_token * fed / work / (roof["gflop_per_cpu_s"] * 1e9),
            "phases": best["phases"], "all_cpu_s": [r["cpu_s"] for r in runs],
            **{k: best[k] for k in ("step_first_ms", "step_last_ms", "step_growth") if k in best}}


def run_case(side: Side, name: str, n: int, prompt_len: int, new_tokens: int, repeats: int, roof: dict,
             mixed: bool, rng: random.Random) -> dict:
    text = prompt_text(prompt_len, side.runner.engine.target.config.vocab_size, rng)
    ids = side.runner.tokenizer(text)["input_ids"]
    assert len(ids) == prompt_len, (len(ids), prompt_len)
    assert side.runner.encode_prompt([{"role": "user", "content": text}]) == ids
    lengths = [rng.randint(1, new_tokens) for _ in range(n)] if mixed else None
    flop_per_token = 2 * matmul_params(side.runner.engine.target)
    eng_runs, gen_runs = [], []
    for _ in range(repeats):  # alternate, so that other processes' load falls on both sides alike
        side.limits = lengths
        eng_runs.append(side.engine(text, n, new_tokens))
        side.limits = None
        gen_runs.append(side.generate(ids, n, new_tokens, lengths))
    e = summarise("engine", eng_runs, flop_per_token, prompt_len, roof)
    # generate prefills the prompt once per returned sequence (num_return_sequences expands the input first)
    g = summarise("generate", gen_runs, flop_per_token, n * prompt_len, roof)
    return {"model": name, "n": n, "prompt_tokens": prompt_len, "new_tokens": new_tokens, "mixed_lengths": mixed,
            "row_lengths": lengths, "engine": e, "generate": g,
            "ratio_tok_per_cpu_s": e["tok_per_cpu_s"] / g["tok_per_cpu_s"],
            "ratio_decode_only": e["tok_per_decode_cpu_s"] / g["tok_per_decode_cpu_s"],
            "peak_rss_ratio": e["peak_rss_mb"] / g["peak_rss_mb"] if g["peak_rss_mb"] > 0 else None}


def run_rejection(side: Side, name: str, n: int, prompt_len: int, new_tokens: int, every: int, repeats: int,
                  rng: random.Random) -> dict:
    """Speculative Rejection (alpha 0.5, a decision every `every` tokens) against Best-of-N on one prompt: reward
    tokens per generated token (what the reward model was fed, the prompt included, over the tokens generated),
    CPU seconds and the scoring share."""
    text = prompt_text(prompt_len, side.runner.engine.target.config.vocab_size, rng)
    runs: dict[str, list[dict]] = {"sr": [], "bon": []}
    for _ in range(repeats):
        runs["sr"].append(side.engine(text, n, new_tokens, every_k_tokens=every))
        runs["bon"].append(side.engine(text, n, new_tokens))
    out = {"model": name, "n": n, "prompt_tokens": prompt_len, "new_tokens": new_tokens, "every_k_tokens": every}
    for key, rs in runs.items():
        best = min(rs, key=lambda r: r["cpu_s"])
        out[key] = {"tokens": best["tokens"], "reward_tokens": best["reward_tokens"],
                    "reward_tokens_per_token": best["reward_tokens"] / best["tokens"], "cpu_s": best["cpu_s"],
                    "scoring_share": best["phases"].get("scoring", 0.0) / best["cpu_s"],
                    "rounds": best["rejection_rounds"], "best_reward": best["best_reward"]}
    return out


GRIDS = {  # model: list of (N, prompt tokens, new tokens, mixed lengths)
    "quick": {"llama-32k": [(16, 32, 128, False), (64, 32, 128, False), (64, 512, 64, False),
                            (64, 32, 128, True)],
              "qwen2-152k": [(64, 32, 64, False), (64, 512, 64, False)]},
    "full": {m: [(n, p, t, False) for n in (16, 64, 256) for p in (32, 512) for t in (128, 512)]
             + [(64, 32, 512, True), (256, 32, 512, True)] for m in ("llama-32k", "qwen2-152k")},
}

REJECTION = {  # (N, prompt tokens, new tokens, a decision every k tokens), for each model
    "quick": [(64, 32, 128, 16)],
    "full": [(64, 32, 512, 16), (256, 32, 512, 16)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the reduced grid (default), about 10 minutes on 2 cores")
    mode.add_argument("--full", action="store_true", help="the issue's grid (hours on a CPU)")
    ap.add_argument("--models", nargs="*", help="only these models (llama-32k, qwen2-152k)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per side (default: 1 quick, 2 full)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--no-draft", action="store_true", help="do not build the 2-layer draft")
    ap.add_argument("--json", help="write every figure to this path")
    args = ap.parse_args()
    grid = "full" if args.full else "quick"
    repeats = args.repeats or (2 if args.full else 1)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"load average at start: {os.getloadavg()}; torch threads {torch.get_num_threads()}; cpus "
          f"{os.cpu_count()}; grid {grid}; repeats {repeats}")
    phases, steps = Phases(), StepTimes()
    install_timers(phases)
    steps.install()
    sides: list[Side] = []
    set_row_limits(sides)
    rng = random.Random(0)
    report: dict = {"grid": grid, "repeats": repeats, "threads": torch.get_num_threads(), "models": {}, "cases": []}
    tables = []
    with tempfile.TemporaryDirectory(prefix="winnow-engine-scale-") as tmp:
        for name, shape in SHAPES[grid].items():
            if args.models and name not in args.models:
                continue
            t0 = time.perf_counter()
            folders = build_checkpoints(Path(tmp), name, shape, draft=name == "llama-32k" and not args.no_draft)
            if "draft" in folders:  # a check that the draft loads as the Runner would load it
                from workers.loading import load_causal_lm

                d = load_causal_lm(str(folders["draft"]), "models.draft", torch.device("cpu"), "auto", False)
                draft_params = sum(p.numel() for p in d.model.parameters())
                del d
            side = Side(folders, phases, steps)
            sides[:] = [side]
            target = side.runner.engine.target
            roof = matmul_roofline(shape[2])
            info = {"family": shape[0], "vocab": shape[1], "hidden": shape[2], "layers": shape[3],
                    "heads": shape[4], "kv_heads": shape[5], "intermediate": shape[6],
                    "params_m": sum(p.numel() for p in target.parameters()) / 1e6,
                    "matmul_params_m": matmul_params(target) / 1e6, "build_and_load_s": time.perf_counter() - t0,
                    "matmul": roof["shape"], "matmul_gflop_per_cpu_s": roof["gflop_per_cpu_s"],
                    "matmul_gflop_per_wall_s": roof["gflop_per_wall_s"]}
            if "draft" in folders:
                info["draft_params_m"] = draft_params / 1e6
            report["models"][name] = info
            warm = prompt_text(8, shape[1], rng)  # first calls pay one-off costs (allocator, kernels): not counted
            side.engine(warm, 4, 4)
            side.generate(side.runner.tokenizer(warm)["input_ids"], 4, 4)
            print(f"{name}: built and loaded in {info['build_and_load_s']:.1f} s; load {os.getloadavg()}")
            for n, p, t, mixed in GRIDS[grid][name]:
                case = run_case(side, name, n, p, t, repeats, roof, mixed, rng)
                case["load_avg"] = os.getloadavg()
                report["cases"].append(case)
                print(f"  N={n} P={p} T={t}{' mixed' if mixed else ''}: engine {case['engine']['cpu_s']:.1f} CPU-s, "
                      f"generate {case['generate']['cpu_s']:.1f} CPU-s; load {case['load_avg'][0]:.2f}", flush=True)
            for n, p, t, every in REJECTION[grid]:
                rej = run_rejection(side, name, n, p, t, every, repeats, rng)
                rej["load_avg"] = os.getloadavg()
                report.setdefault("rejection", []).append(rej)
                print(f"  SR N={n} P={p} T={t} every {every}: {rej['sr']['reward_tokens_per_token']:.2f} reward "
                      f"tokens per token (Best-of-N {rej['bon']['reward_tokens_per_token']:.2f}); load "
                      f"{rej['load_avg'][0]:.2f}", flush=True)
            del side, target
            sides.clear()
    report["load_avg_end"] = os.getloadavg()
    report["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    tables.append(table("Checkpoints (random init) and this CPU's float32 matmul", report["models"],
                        ["vocab", "hidden", "layers", "heads", "kv_heads", "params_m", "matmul_params_m",
                         "matmul_gflop_per_cpu_s", "matmul_gflop_per_wall_s"], first="model"))

    def label(c):
        return f"{c['model']} N={c['n']} P={c['prompt_tokens']} T={c['new_tokens']}" + (
            " mixed" if c["mixed_lengths"] else "")

    rows = {}
    for c in report["cases"]:
        e, g = c["engine"], c["generate"]
        rows[label(c)] = {"eng tokens": e["tokens"], "gen tokens": g["tokens"], "eng CPU s": e["cpu_s"],
                          "gen CPU s": g["cpu_s"], "eng tok/CPU-s": e["tok_per_cpu_s"],
                          "gen tok/CPU-s": g["tok_per_cpu_s"], "ratio": c["ratio_tok_per_cpu_s"],
                          "ratio excl. scoring": c["ratio_decode_only"], "eng tok/wall-s": e["tok_per_wall_s"],
                          "gen tok/wall-s": g["tok_per_wall_s"], "eng peak MB": e["peak_rss_mb"],
                          "gen peak MB": g["peak_rss_mb"], "eng roofline": e["roofline_frac"],
                          "gen roofline": g["roofline_frac"]}
    tables.append(table("Best-of-N, one prompt per call: engine (Runner, reward model included) against generate "
                        "(ratio: engine / generate tokens per CPU-second; peak MB: RSS above the call's start; "
                        "roofline: fraction of the matmul's FLOP per CPU-second, scoring excluded)", rows,
                        list(next(iter(rows.values())).keys()), first="case"))
    steps = {label(c): {"first ms": c["engine"]["step_first_ms"], "last ms": c["engine"]["step_last_ms"],
                        "growth": c["engine"]["step_growth"], "columns first": c["prompt_tokens"] + 1,
                        "columns last": c["prompt_tokens"] + c["new_tokens"]}
             for c in report["cases"] if not c["mixed_lengths"] and "step_growth" in c["engine"]}
    if steps:
        tables.append(table("Engine decoding step (CPU ms, median of the first and of the last quarter of the steps; "
                            "growth: last / first; the attention reads the KV columns shown)", steps,
                            list(next(iter(steps.values())).keys()), first="case"))
    names = ["forward", "cache update", "cache select", "sampling", "scoring", "other"]
    shares = {}
    for c in report["cases"]:
        e = c["engine"]
        ph = dict(e["phases"])
        ph["other"] = e["cpu_s"] - sum(ph.values())
        e["phases"] = ph
        shares[label(c)] = {k: ph.get(k, 0.0) / e["cpu_s"] for k in names}
        shares[label(c)]["gen: cache update"] = c["generate"]["phases"].get("cache update", 0.0) / c["generate"]["cpu_s"]
        step = sum(ph.get(k, 0.0) for k in ("forward", "cache update", "cache select", "sampling"))
        shares[label(c)]["sampling of a step"] = ph.get("sampling", 0.0) / step if step else 0.0
    tables.append(table("Engine CPU time by phase (share of the engine's CPU seconds; gen: generate's share in its KV "
                        "cache update; sampling of a step: sampling / (forward + cache + sampling))", shares,
                        names + ["gen: cache update", "sampling of a step"], first="case"))
    rej = {}
    for r in report.get("rejection", []):
        for key, what in (("sr", "SR"), ("bon", "Best-of-N")):
            rej[f"{r['model']} {what} N={r['n']} P={r['prompt_tokens']} T={r['new_tokens']}"] = {
                "every k": r["every_k_tokens"] if key == "sr" else None, **r[key]}
    if rej:
        tables.append(table("Speculative Rejection (alpha 0.5, fixed schedule) against Best-of-N: reward tokens per "
                            "generated token, CPU seconds, scoring's share of them", rej,
                            list(next(iter(rej.values())).keys()), first="run"))
    for t in tables:
        print(t)
    print(f"\nload average at end: {report['load_avg_end']}; process max RSS {report['max_rss_mb']:.0f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
