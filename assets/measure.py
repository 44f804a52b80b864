"""Measure the bundled models and write the figures into assets/README.md: `python -m assets.measure`.

Plain torch/transformers code, independent of the project's engine:
- greedy speculative acceptance of the draft under the target (gamma = 4, greedy verification);
- 64 samples per demo prompt at temperature 1 from the target: the reward of the first half of each response
  (in target tokens) against the reward of the whole response (Pearson and Kendall per prompt, averaged);
- Best-of-16 against a single sample (reward and lexical coverage);
- lexical coverage (lexical) of greedy and sampled responses; reward against lexical coverage;
- parameters, bytes on disk, forward throughput of target and draft.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import numpy as np
import torch
from scipy import stats
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from assets import ASSETS_DIR, BUILTINS
from lexical import concept_coverage

GAMMA = 4
N_SAMPLES = 64
BON = 16
MAX_NEW_TOKENS = 96
SEED = 0


def log(msg: str) -> None:
    print(msg, flush=True)


def folder_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def load(assets: pathlib.Path):
    target_path, draft_path, reward_path = (assets / BUILTINS[n] for n in ("tiny-target", "tiny-draft",
                                                                            "tiny-reward"))
    tok = AutoTokenizer.from_pretrained(target_path)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.float32).eval()
    rtok = AutoTokenizer.from_pretrained(reward_path)
    reward = AutoModelForSequenceClassification.from_pretrained(reward_path, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in (assets / BUILTINS["demo-prompts"] / "prompts.jsonl").open()]
    return tok, target, draft, rtok, reward, rows


def prompt_ids(tok, prompt: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)["input_ids"]


@torch.no_grad()
def greedy(model, ids: list[int], eos: int, max_new: int = MAX_NEW_TOKENS) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(ids):].tolist()


@torch.no_grad()
def speculative_greedy(target, draft, ids: list[int], eos: int, gamma: int = GAMMA,
                       max_new: int = MAX_NEW_TOKENS) -> tuple[list[int], list[tuple[int, int]]]:
    """Greedy speculative decoding: the draft proposes up to gamma greedy tokens (stopping after EOS), the target
    keeps the longest prefix that matches its own greedy choices and adds one token of its own.
    Returns the response and (accepted, proposed) per iteration."""
    out: list[int] = []
    log_ = []
    while len(out) < max_new and (not out or out[-1] != eos):
        ctx = ids + out
        k = min(gamma, max_new - len(out))
        prop: list[int] = []
        for _ in range(k):
            t = int(draft(input_ids=torch.tensor([ctx + prop])).logits[0, -1].argmax())
            prop.append(t)
            if t == eos:
                break
        logits = target(input_ids=torch.tensor([ctx + prop])).logits[0, len(ctx) - 1 :]
        choice = logits.argmax(-1).tolist()  # target's greedy token after ctx, ctx+prop[:1], ...
        acc = 0
        while acc < len(prop) and prop[acc] == choice[acc]:
            acc += 1
        log_.append((acc, len(prop)))
        new = prop[:acc]
        if not (new and new[-1] == eos):
            new.append(choice[acc])
        out += new[: max_new - len(out)]
    return out, log_


@torch.no_grad()
def sample(model, ids: list[int], n: int, eos: int, pad: int, gen: torch.Generator,
           max_new: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """n samples at temperature 1 (no top-k/top-p), each cut after its EOS."""
    x = torch.tensor([ids] * n)
    out = model(input_ids=x, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    done = torch.zeros(n, dtype=torch.bool)
    toks = []
    for _ in range(max_new):
        nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        toks.append(nxt)
        done |= nxt == eos
        if bool(done.all()):
            break
        out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    mat = torch.stack(toks, 1).tolist()
    res = []
    for row in mat:
        res.append(row[: row.index(eos) + 1] if eos in row else row)
    return res


@torch.no_grad()
def score(reward, rtok, prompt: str, texts: list[str], batch: int = 128) -> list[float]:
    convs = [[{"role": "user", "content": prompt}, {"role": "assistant", "content": t}] for t in texts]
    rendered = rtok.apply_chat_template(convs, tokenize=False)
    out: list[float] = []
    for i in range(0, len(rendered), batch):
        enc = rtok(rendered[i : i + batch], padding=True, add_special_tokens=False, return_tensors="pt")
        out += reward(**enc).logits[:, 0].tolist()
    return out


@torch.no_grad()
def _time_prefill(model, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(input_ids=x)
    return time.perf_counter() - t0


@torch.no_grad()
def _time_decode(model, x: torch.Tensor, steps: int) -> float:
    """Seconds for `steps` single-token forwards with a KV cache, after a 16-token prefill."""
    past = model(input_ids=x[:, :16], use_cache=True).past_key_values
    t0 = time.perf_counter()
    for s in range(steps):
        past = model(input_ids=x[:, 16 + s : 17 + s], past_key_values=past, use_cache=True).past_key_values
    return time.perf_counter() - t0


def throughput(models: dict, vocab: int, *, batch: int, length: int = 80, rounds: int = 7) -> dict:
    """Forward tokens per second of each model: a prefill of batch x length tokens, and single-token decoding
    steps with a KV cache. The models are timed in turn, round after round, and the best round counts (the
    machine may be shared: the fastest run is the least disturbed one)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(4, vocab, (batch, length), generator=g)
    steps = length - 16
    best = {n: [float("inf"), float("inf")] for n in models}
    for m in models.values():  # warm up
        _time_prefill(m, x)
        _time_decode(m, x, 4)
    for _ in range(rounds):
        for n, m in models.items():
            best[n][0] = min(best[n][0], _time_prefill(m, x))
            best[n][1] = min(best[n][1], _time_decode(m, x, steps))
    return {n: {"prefill_tokens_per_s": round(batch * length / p), "decode_tokens_per_s": round(batch * steps / d)}
            for n, (p, d) in best.items()}


def flops_per_token(model) -> int:
    """2 x the weights one token's forward multiplies by: every matrix except the input embedding lookup, plus the
    output projection even when it is tied to the input embedding (attention scores excluded)."""
    emb = model.get_input_embeddings().weight
    n = sum(p.numel() for p in model.parameters() if p is not emb)
    out = model.get_output_embeddings()
    if out is not None and out.weight is emb:
        n += emb.numel()
    return 2 * n


def measure(assets: pathlib.Path) -> dict:
    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    tok, target, draft, rtok, reward, rows = load(assets)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    figs: dict = {"n_prompts": len(rows)}

    # ---- sizes
    figs["parameters"] = {n: sum(p.numel() for p in m.parameters())
                          for n, m in (("tiny-target", target), ("tiny-draft", draft), ("tiny-reward", reward))}
    figs["bytes_on_disk"] = {n: folder_bytes(assets / BUILTINS[n]) for n in BUILTINS}
    figs["bytes_on_disk"]["assets_total"] = folder_bytes(assets)
    figs["flops_per_token"] = {"tiny-target": flops_per_token(target), "tiny-draft": flops_per_token(draft)}

    # ---- greedy responses and speculative acceptance
    t0 = time.time()
    acc_log, greedy_cov, greedy_len, same, ended = [], [], [], 0, 0
    examples = []
    for r in rows:
        ids = prompt_ids(tok, r["prompt"])
        g = greedy(target, ids, eos)
        s, lg = speculative_greedy(target, draft, ids, eos)
        same += int(s == g)
        acc_log += lg
        text = tok.decode(g, skip_special_tokens=True)
        greedy_cov.append(concept_coverage(text, r["concepts"]))
        greedy_len.append(len(g))
        ended += int(bool(g) and g[-1] == eos)
        if len(examples) < 4:
            examples.append({"prompt": r["prompt"], "greedy": text})
    accepted = sum(a for a, _ in acc_log)
    proposed = sum(p for _, p in acc_log)
    figs["greedy"] = {
        "mean_lexical_coverage": round(float(np.mean(greedy_cov)), 4),
        "mean_tokens": round(float(np.mean(greedy_len)), 1),
        "ended_with_eos": f"{ended}/{len(rows)}",
    }
    figs["speculative_greedy"] = {
        "gamma": GAMMA,
        "acceptance_rate": round(accepted / proposed, 4),
        "mean_accepted_per_iteration": round(accepted / len(acc_log), 3),
        "tokens_per_target_forward": round(sum(greedy_len) / len(acc_log), 3),
        "iterations": len(acc_log),
        "matches_target_greedy": f"{same}/{len(rows)}",
    }
    log(f"greedy: {json.dumps(figs['greedy'])}; speculative: {json.dumps(figs['speculative_greedy'])} "
        f"({time.time() - t0:.1f}s)")

    # ---- sampling, partial rewards, Best-of-N
    t0 = time.time()
    gen = torch.Generator().manual_seed(SEED)
    pear, kend, degenerate = [], [], 0
    single_r, best_r, single_c, best_c, oracle_c, within_sd = [], [], [], [], [], []
    all_r, all_c, eos_frac, lens = [], [], [], []
    for r in rows:
        ids = prompt_ids(tok, r["prompt"])
        samples = sample(target, ids, N_SAMPLES, eos, pad, gen)
        resp = [s[:-1] if s and s[-1] == eos else s for s in samples]
        eos_frac += [bool(s) and s[-1] == eos for s in samples]
        lens += [len(x) for x in resp]
        full_t = [tok.decode(x, skip_special_tokens=True) for x in resp]
        half_t = [tok.decode(x[: len(x) // 2], skip_special_tokens=True) for x in resp]
        rw = score(reward, rtok, r["prompt"], full_t + half_t)
        full_r, half_r = np.array(rw[:N_SAMPLES]), np.array(rw[N_SAMPLES:])
        cov = np.array([concept_coverage(t, r["concepts"]) for t in full_t])
        all_r += full_r.tolist()
        all_c += cov.tolist()
        if full_r.std() == 0 or half_r.std() == 0:
            degenerate += 1
        else:
            pear.append(float(np.corrcoef(half_r, full_r)[0, 1]))
            kend.append(float(stats.kendalltau(half_r, full_r).statistic))
        within_sd.append(float(full_r.std()))
        single_r.append(float(full_r.mean()))
        single_c.append(float(cov.mean()))
        groups = np.arange(N_SAMPLES).reshape(-1, BON)  # 4 disjoint Best-of-16 draws per prompt
        picks = [int(gr[np.argmax(full_r[gr])]) for gr in groups]
        best_r.append(float(np.mean([full_r[i] for i in picks])))
        best_c.append(float(np.mean([cov[i] for i in picks])))
        oracle_c.append(float(np.mean([cov[gr].max() for gr in groups])))
    sd = float(np.mean(within_sd))
    figs["samples"] = {
        "per_prompt": N_SAMPLES,
        "temperature": 1.0,
        "mean_tokens": round(float(np.mean(lens)), 1),
        "ended_with_eos": round(float(np.mean(eos_frac)), 4),
        "mean_lexical_coverage": round(float(np.mean(single_c)), 4),
        "reward_vs_lexical_pearson_pooled": round(float(np.corrcoef(all_r, all_c)[0, 1]), 4),
    }
    figs["partial_reward"] = {
        "pearson_half_vs_full_mean": round(float(np.mean(pear)), 4),
        "kendall_half_vs_full_mean": round(float(np.mean(kend)), 4),
        "prompts_used": len(pear),
        "prompts_degenerate": degenerate,
    }
    figs["best_of_n"] = {
        "n": BON,
        "mean_single_reward": round(float(np.mean(single_r)), 4),
        "mean_best_reward": round(float(np.mean(best_r)), 4),
        "mean_within_prompt_reward_sd": round(sd, 4),
        "gap_in_sd": round((float(np.mean(best_r)) - float(np.mean(single_r))) / sd, 3),
        "mean_single_lexical_coverage": round(float(np.mean(single_c)), 4),
        "mean_best_lexical_coverage": round(float(np.mean(best_c)), 4),
        "oracle_best_lexical_coverage": round(float(np.mean(oracle_c)), 4),
    }
    log(f"samples: {json.dumps(figs['samples'])}")
    log(f"partial reward: {json.dumps(figs['partial_reward'])}")
    log(f"best-of-{BON}: {json.dumps(figs['best_of_n'])} ({time.time() - t0:.1f}s)")

    # ---- speed
    t0 = time.time()
    sp = {"tiny-target": {}, "tiny-draft": {}}
    for b in (1, 16):
        res = throughput({"tiny-target": target, "tiny-draft": draft}, len(tok), batch=b)
        for n in sp:
            sp[n][f"batch{b}"] = res[n]
    # c of the CDSL paper: time of a draft call over time of a target call
    sp["draft_over_target_cost_decode_batch1"] = round(sp["tiny-target"]["batch1"]["decode_tokens_per_s"]
                                           / sp["tiny-draft"]["batch1"]["decode_tokens_per_s"], 3)
    sp["draft_over_target_cost_prefill_batch16"] = round(sp["tiny-target"]["batch16"]["prefill_tokens_per_s"]
                                             / sp["tiny-draft"]["batch16"]["prefill_tokens_per_s"], 3)
    sp["threads"] = torch.get_num_threads()
    sp["load_average_1min"] = round(os.getloadavg()[0], 2)
    sp["flops_ratio"] = round(figs["flops_per_token"]["tiny-target"] / figs["flops_per_token"]["tiny-draft"], 2)
    figs["speed"] = sp
    log(f"speed: {json.dumps(sp)} ({time.time() - t0:.1f}s)")
    figs["examples"] = examples
    return figs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--assets", type=pathlib.Path, default=ASSETS_DIR, help="folder holding the built assets")
    ap.add_argument("--no-readme", action="store_true", help="print the figures only")
    ap.add_argument("--readme-only", action="store_true",
                    help="re-render README.md from the saved measurements.json without measuring again")
    args = ap.parse_args(argv)
    if args.readme_only:
        from assets.readme import render

        figs = json.loads((args.assets / "measurements.json").read_text())
        (args.assets / "README.md").write_text(render(args.assets, figs))
        log(f"wrote {args.assets / 'README.md'} from measurements.json")
        return 0
    t0 = time.time()
    figs = measure(args.assets)
    figs["measure_seconds"] = round(time.time() - t0, 1)
    (args.assets / "measurements.json").write_text(json.dumps(figs, indent=2) + "\n")
    print(json.dumps(figs, indent=2))
    if not args.no_readme:
        from assets.readme import render

        (args.assets / "README.md").write_text(render(args.assets, figs))
        log(f"wrote {args.assets / 'README.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
