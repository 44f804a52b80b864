"""Build the bundled assets: `python -m assets.build [--out DIR]` (default: this folder).

Deterministic: every random draw comes from fixed seeds (Python `random.Random`, `torch.manual_seed`), torch runs
with `use_deterministic_algorithms(True)` on 2 threads, so the same machine and library versions give the same
weights. About 4-6 minutes on 2 CPU cores. Writes:

- tiny-target/, tiny-draft/   LlamaForCausalLM + the shared LM tokenizer + generation_config.json
- tiny-reward/                LlamaForSequenceClassification (num_labels=1) + its own tokenizer (prompt first)
- demo-prompts/prompts.jsonl  held-out prompts: id, prompt, concepts
- train_concept_sets.txt.gz   every concept set used in any training set (one sorted, space-joined set a line)
- build_meta.json             seeds, sizes, configs, timings, library versions

Training:
1. target: next-token cross-entropy on response tokens of world examples (prompt rendered with the chat template);
2. draft: distilled from the target (KL(target || draft) on the same sequences), so its greedy choices agree;
3. reward: regression on (prompt, text) rendered with the reward chat template (prompt first), where text is a
   whole response, a prefix of one, or a disfluent corruption; label = lexical.concept_coverage(text) minus
   DISFLUENCY_PENALTY for corrupted text. Prefixes are labelled with their own coverage, so partial rewards mean
   "concepts covered so far"; every response token is also labelled with the coverage so far (`rm_sequences`).

`python -m assets.build --only reward` rebuilds tiny-reward alone from the same data and seeds (the other assets
are left as they are and must be those this code draws) and updates build_meta.json for it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import pathlib
import random
import re
import shutil
import sys
import time

# OpenMP threads that wait by sleeping rather than spinning: on a shared machine (more runnable threads than cores)
# spinning threads waiting for a descheduled partner made training up to 100x slower. No effect on the numbers;
# set before torch is imported (OpenMP reads it when it loads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from assets import ASSETS_DIR, tokenization, world
from lexical import concept_coverage, inflections

SEED = 1234
DEMO_SEED = 7
N_DEMO = 32
N_LM_TRAIN = 32_000  # 1000 steps of 32
N_RM_TRAIN = 46_000  # 1375 steps of 32 (after 2000 held out for validation)
DISFLUENCY_PENALTY = 0.5
THREADS = 2

TARGET_ARCH = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=384)
DRAFT_ARCH = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=192)
REWARD_ARCH = dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                   intermediate_size=256)

REWARD_ROPE_THETA = 1e6  # slow rotary frequencies: the matching head compares words far apart

# the loss on concept words is weighted concept_weight for the first weight_until of the steps (a curriculum)
TARGET_TRAIN = dict(epochs=1, batch=32, lr=3e-3, concept_weight=6.0, weight_until=0.6)
DRAFT_TRAIN = dict(epochs=2, batch=32, lr=3e-3, concept_weight=3.0, weight_until=0.5)
REWARD_TRAIN = dict(epochs=2, batch=32, lr=2e-3)  # 2 epochs: 1 left prefix RMSE 0.151 and all 0.182 (see README)


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# data
def lm_sequences(tok, examples: list[world.Example]) -> list[tuple[list[int], int, list[int]]]:
    """(token ids of prompt + response + EOS, number of prompt tokens, positions of concept words) per example."""
    convs = [[{"role": "user", "content": e.prompt}] for e in examples]
    prompts = tok.apply_chat_template(convs, add_generation_prompt=True, tokenize=False)
    backend = tok.backend_tokenizer
    p_ids = [enc.ids for enc in backend.encode_batch(prompts, add_special_tokens=False)]
    r_ids = [enc.ids for enc in backend.encode_batch([e.response for e in examples], add_special_tokens=False)]
    vocab = tok.get_vocab()
    out = []
    for e, p, r in zip(examples, p_ids, r_ids):
        assert tok.unk_token_id not in p and tok.unk_token_id not in r
        forms = {vocab[f] for c in e.concepts for f in world.surface_forms(c)}
        forms |= {vocab[f.capitalize()] for c in e.concepts for f in world.surface_forms(c) if f.capitalize() in vocab}
        out.append((p + r + [tok.eos_token_id], len(p), [len(p) + j for j, t in enumerate(r) if t in forms]))
    return out


def batches_by_length(lengths: list[int], batch: int, gen: torch.Generator) -> list[list[int]]:
    """Shuffled batches of similar-length sequences (less padding), in a seeded order."""
    order = torch.randperm(len(lengths), generator=gen).tolist()
    chunk = batch * 32
    out: list[list[int]] = []
    for i in range(0, len(order), chunk):
        part = sorted(order[i : i + chunk], key=lambda j: lengths[j])
        out += [part[k : k + batch] for k in range(0, len(part), batch)]
    perm = torch.randperm(len(out), generator=gen).tolist()
    return [out[i] for i in perm]


def pad_right(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def lr_at(step: int, total: int, peak: float) -> float:
    warm = max(1, int(0.05 * total))
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.98), eps=1e-8)


# ---------------------------------------------------------------------------------------------------------------
# training
def train_lm(model, seqs, pad_id: int, *, epochs: int, batch: int, lr: float, seed: int, teacher=None,
             name: str, concept_weight: float = 1.0, weight_until: float = 0.0) -> dict:
    """Cross-entropy on response tokens, or (teacher given) KL(teacher || model) on them.

    For the first `weight_until` fraction of the steps, the loss on concept words is weighted `concept_weight`
    (a curriculum that speeds up learning to copy concepts from the prompt); plain loss afterwards."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [len(s[0]) for s in seqs]
    plan = [b for _ in range(epochs) for b in batches_by_length(lengths, batch, gen)]
    opt = make_optimizer(model, lr)
    model.train()
    t0 = time.time()
    ema = None
    n_tok = 0
    for step, idx in enumerate(plan):
        ids, mask = pad_right([seqs[i][0] for i in idx], pad_id)
        # position t predicts token t+1; only response tokens (and the final EOS) are targets
        tgt_mask = torch.zeros_like(mask, dtype=torch.bool)
        wmat = torch.ones(mask.shape)
        weighted = step < weight_until * len(plan) and concept_weight != 1.0
        for row, i in enumerate(idx):
            s, p, cpos = seqs[i]
            tgt_mask[row, p - 1 : len(s) - 1] = True
            if weighted:
                wmat[row, [j - 1 for j in cpos]] = concept_weight
        for g in opt.param_groups:
            g["lr"] = lr_at(step, len(plan), lr)
        logits = model(input_ids=ids, attention_mask=mask).logits[tgt_mask]
        labels = ids[:, 1:][tgt_mask[:, :-1]]
        if teacher is None:
            if weighted:
                w = wmat[tgt_mask]
                loss = (F.cross_entropy(logits, labels, reduction="none") * w).sum() / w.sum()
            else:
                loss = F.cross_entropy(logits, labels)
        else:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits[tgt_mask], -1)
            kl = (t_logp.exp() * (t_logp - F.log_softmax(logits, -1))).sum(-1)
            w = wmat[tgt_mask]
            loss = (kl * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        n_tok += int(mask.sum())
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 200 == 0 or step == len(plan) - 1:
            log(f"  {name} step {step + 1}/{len(plan)} loss {ema:.4f} ({time.time() - t0:.0f}s)")
    model.eval()
    dt = time.time() - t0
    return {"steps": len(plan), "final_loss_ema": round(ema, 4), "seconds": round(dt, 1),
            "tokens_per_second": round(n_tok / dt)}


def detok(words: list[str]) -> str:
    return " ".join(words).replace(" .", ".").replace(" ,", ",")


def reward_examples(rng: random.Random, examples: list[world.Example]) -> list[tuple[str, str, float, str]]:
    """(prompt, text, label, kind) for reward-model training."""
    out = []
    vocab = [w for w in world.all_words() if w.isalpha() and w.islower()]
    for e in examples:
        words = e.response.replace(".", " .").split()
        r = rng.random()
        if r < 0.45:
            text, kind, pen = e.response, "full", 0.0
        elif r < 0.80:
            k = rng.randint(0, len(words) - 1)
            text, kind, pen = detok(words[:k]), "prefix", 0.0
        elif r < 0.87:
            w = words[:]
            rng.shuffle(w)
            text, kind, pen = detok(w), "shuffled", DISFLUENCY_PENALTY
        elif r < 0.94:
            k = rng.randint(1, len(words) - 1)
            span = rng.randint(1, 3)
            start = max(0, k - span)
            w = words[:k] + words[start:k] * rng.randint(2, 5) + words[k:][: rng.randint(0, 4)]
            text, kind, pen = detok(w), "repeated", DISFLUENCY_PENALTY
        else:
            w = [rng.choice(vocab) for _ in range(rng.randint(3, 20))]
            w += [c for c in e.concepts if rng.random() < 0.5]
            rng.shuffle(w)
            text, kind, pen = detok(w), "salad", DISFLUENCY_PENALTY
        label = concept_coverage(text, e.concepts) - pen
        out.append((e.prompt, text, label, kind))
    return out


def rm_sequences(tok, rows) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
    """Token ids of (prompt, text) rendered with the reward chat template, dense per-token labels, and per-token
    first-occurrence flags.

    The template renders the request first and the response after it, then [EOS]. Dense labels (NaN where there is
    none), on the score itself: every token of the response is labelled with the fraction of the request's concepts
    that the response covers up to and including this token's word (what a partial reward means; no disfluency
    penalty), and the last token ([EOS]) with the row's label. Flags (NaN outside the response), the target of a
    training-only head on layer AUX_LAYER: 1.0 on the first token of a word that covers a concept no earlier word
    covered ("dog" in "the dog ... the dogs" once), else 0.0; the mechanism "a response word looks back at the
    request" and counts each concept once.
    """
    convs = [[{"role": "user", "content": p}, {"role": "assistant", "content": t}] for p, t, _, _ in rows]
    texts = tok.apply_chat_template(convs, tokenize=False)
    encs = tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    ids, dense, firsts = [], [], []
    for (prompt, text, label, _), rendered, enc in zip(rows, texts, encs):
        concepts = [c.strip() for c in prompt.split(":", 1)[1].rstrip(".").split(",")]
        forms = [inflections(c) for c in concepts]
        start = rendered.index(ASSISTANT_MARK) + len(ASSISTANT_MARK)
        # the words of the response (as lexical reads them: the template lower-cases it) and the concepts they cover
        words = [(start + m.start(), {i for i, f in enumerate(forms) if m.group() in f})
                 for m in WORD.finditer(rendered[start:start + len(text)])]
        lab = [float("nan")] * len(enc.ids)
        first = [float("nan")] * len(enc.ids)
        seen: set[int] = set()
        w = 0
        for j, (s0, e0) in enumerate(enc.offsets):
            if s0 < start or enc.ids[j] == tok.eos_token_id:
                continue
            new = False
            while w < len(words) and words[w][0] < e0:  # the words that begin before this token ends
                new |= bool(words[w][1] - seen) and words[w][0] == s0
                seen |= words[w][1]
                w += 1
            lab[j] = len(seen) / len(concepts)
            first[j] = float(new)
        eos_pos = max(i for i, t in enumerate(enc.ids) if t == tok.eos_token_id)
        lab[eos_pos] = label
        ids.append(enc.ids[: eos_pos + 1])
        dense.append(lab[: eos_pos + 1])
        firsts.append(first[: eos_pos + 1])
    return ids, dense, firsts


ASSISTANT_MARK = "### Assistant: "
WORD = re.compile(r"[a-z]+")  # a word as lexical reads it (the template lower-cases the response)
DENSE_WEIGHT = 0.5
# the first-occurrence flags, on a training-only linear head reading layer AUX_LAYER's output (discarded after
# training): without it the score never learned coverage in one epoch (validation RMSE 0.30, as good as a constant)
AUX_WEIGHT = 0.5
AUX_LAYER = 0


def train_reward(model, seqs, dense, labels, pad_id: int, *, epochs: int, batch: int, lr: float,
                 seed: int, firsts=None) -> dict:
    """MSE of the pooled score (last token) against the label, plus DENSE_WEIGHT x MSE of the per-token scores
    against the dense labels (coverage so far), plus (`firsts` given, AUX_WEIGHT > 0) AUX_WEIGHT x MSE of a
    training-only linear head on the output of layer AUX_LAYER against the first-occurrence flags (the head is
    discarded after training; the saved model is a plain LlamaForSequenceClassification)."""
    gen = torch.Generator().manual_seed(seed)
    plan = [b for _ in range(epochs) for b in batches_by_length([len(s) for s in seqs], batch, gen)]
    aux = None
    captured: dict[str, torch.Tensor] = {}
    hook = None
    if AUX_WEIGHT > 0 and firsts is not None:
        aux = torch.nn.Linear(model.config.hidden_size, 1)
        with torch.no_grad():
            aux.weight.copy_(torch.randn(aux.weight.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.02)
            aux.bias.zero_()

        def grab(_module, _inputs, output):
            captured["h"] = output[0] if isinstance(output, tuple) else output

        hook = model.model.layers[AUX_LAYER].register_forward_hook(grab)
    opt = make_optimizer(model if aux is None else torch.nn.ModuleList([model, aux]), lr)
    model.train()
    t0 = time.time()
    ema = None
    n_tok = 0
    for step, idx in enumerate(plan):
        ids, mask = pad_right([seqs[i] for i in idx], pad_id)
        width = ids.shape[1]
        d = torch.tensor([dense[i] + [float("nan")] * (width - len(dense[i])) for i in idx])
        y = torch.tensor([labels[i] for i in idx], dtype=torch.float32)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, len(plan), lr)
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        per_tok = model.score(hidden)[..., 0]
        last = mask.sum(1) - 1  # right padding: the last real token, [EOS]
        pred = per_tok[torch.arange(len(idx)), last]
        has = ~torch.isnan(d)
        loss = F.mse_loss(pred, y) + DENSE_WEIGHT * F.mse_loss(per_tok[has], d[has])
        if aux is not None:
            f = torch.tensor([firsts[i] + [float("nan")] * (width - len(firsts[i])) for i in idx])
            has_f = ~torch.isnan(f)
            loss = loss + AUX_WEIGHT * F.mse_loss(aux(captured["h"])[..., 0][has_f], f[has_f])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        n_tok += int(mask.sum())
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 200 == 0 or step == len(plan) - 1:
            log(f"  reward step {step + 1}/{len(plan)} loss {ema:.4f} ({time.time() - t0:.0f}s)")
    if hook is not None:
        hook.remove()
    model.eval()
    dt = time.time() - t0
    return {"steps": len(plan), "final_loss_ema": round(ema, 5), "seconds": round(dt, 1),
            "tokens_per_second": round(n_tok / dt)}


@torch.no_grad()
def eval_reward(model, seqs, labels, kinds, pad_id: int) -> dict:
    preds = []
    for i in range(0, len(seqs), 256):
        ids, mask = pad_right(seqs[i : i + 256], pad_id)
        preds += model(input_ids=ids, attention_mask=mask).logits[:, 0].tolist()
    out = {}
    for kind in sorted(set(kinds)) + ["all"]:
        sel = [j for j, k in enumerate(kinds) if kind in ("all", k)]
        err = [(preds[j] - labels[j]) ** 2 for j in sel]
        out[kind] = {"n": len(sel), "rmse": round(math.sqrt(sum(err) / len(err)), 4)}
    return out


# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_coverage(model, tok, concept_sets: list[list[str]], max_new: int = 96) -> float:
    """Mean lexical coverage of the model's greedy responses (a training diagnostic)."""
    covs = []
    for c in concept_sets:
        ids = tok.apply_chat_template([{"role": "user", "content": world.make_prompt(c)}],
                                      add_generation_prompt=True)["input_ids"]
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        covs.append(concept_coverage(tok.decode(out[0, len(ids):], skip_special_tokens=True), c))
    return sum(covs) / len(covs)


def lm_config(tok, arch: dict) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tok), max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=True, hidden_act="silu", attention_bias=False, mlp_bias=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        initializer_range=0.02, use_cache=True, **arch,
    )


def save_lm(model, tok, path: pathlib.Path) -> None:
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               bos_token_id=None, do_sample=False)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)


@torch.no_grad()
def init_shared_forms(model, tok, seed: int) -> torch.Tensor:
    """Initialise the embedding of every inflected form as its lemma's embedding plus a per-suffix vector (and
    capitalised words as their lower-case form plus a capitalisation vector), after adding a shared vector per word
    class (agent, object, place, verb_i, verb_t, adjective, adverb, preposition). Only an initialisation: it gives
    the models the hints that "dog" and "dogs" name the same thing and that "dog" and "cat" play the same role,
    which makes copying concepts learnable in the few minutes of CPU training we can afford.
    Returns the shared vectors used (suffix, case and class vectors), one a row."""
    g = torch.Generator().manual_seed(seed)
    emb = model.get_input_embeddings().weight
    std = model.config.initializer_range
    vocab = tok.get_vocab()
    extra = torch.randn(6, emb.shape[1], generator=g) * std
    classes = {**{w: r for w, r in world.ROLE_OF.items()}, **{w: "adj" for w in world.ADJECTIVES},
               **{w: "adv" for w in world.ADVERBS}, **{w: "prep" for w in world.PREPOSITIONS}}
    names = sorted(set(classes.values()))
    class_vec = dict(zip(names, torch.randn(len(names), emb.shape[1], generator=g) * std))
    for w, c in classes.items():
        if w in vocab:
            emb[vocab[w]] += class_vec[c]
    for lemma in world.ROLE_OF:
        if lemma not in vocab:
            continue
        for k, form in enumerate(world.surface_forms(lemma)[1:], start=1):
            if form in vocab:
                emb[vocab[form]] = emb[vocab[lemma]] + extra[k]
    for w, i in vocab.items():
        if w[:1].isupper() and w.lower() in vocab and w.lower() != w:
            emb[i] = emb[vocab[w.lower()]] + extra[5]
    out = model.get_output_embeddings()
    if out is not None and out.weight is not emb and out.weight.shape == emb.shape:
        out.weight.copy_(emb)
    return torch.cat([extra, torch.stack([class_vec[n] for n in names])])


@torch.no_grad()
def init_matching_head(model, shared: torch.Tensor, seed: int, target_logit: float = 8.0) -> None:
    """Initialise head 0 of layer 0 of the reward model as a "same word" matching head: W_Q = W_K = W, restricted
    to the slowly rotating RoPE dimensions (so the score barely depends on distance) and blind to the shared
    suffix/case/class vectors (so "dog" and "dogs" in the response match "DOG" in the request, but not "CAT").
    The match is symmetric, so it serves the prompt-first template as it served the old response-first one: a word
    of the response attends to its occurrences in the request (and, as much, to itself and its earlier occurrences
    in the response), and what it reads there (upper case: a requested concept) says whether it covers one.
    Training sharpens it towards the request's copy. Only an initialisation, trained like every other weight;
    learning this match by gradient descent alone takes far longer than the CPU budget of the build."""
    g = torch.Generator().manual_seed(seed)
    attn = model.model.layers[0].self_attn
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    w = torch.randn(d, cfg.hidden_size, generator=g)
    basis, _ = torch.linalg.qr(shared.T)  # orthonormal basis of the shared directions
    w = w - (w @ basis) @ basis.T
    fast = d // 2 // 3  # the fastest third of the rotary pairs carries position, not content
    w[:fast] = 0
    w[d // 2 : d // 2 + fast] = 0
    # scale so that a word's score against itself (inputs normalised to unit RMS) is about target_logit
    scale = (target_logit * math.sqrt(d) / (w.pow(2).sum() * 1.0)).sqrt()
    w = w * scale
    attn.q_proj.weight[:d] = w
    attn.k_proj.weight[:d] = w


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def build_reward(rm_tok, rm_seqs, rm_dense, rm_firsts, rm_rows) -> tuple[LlamaForSequenceClassification, dict]:
    """The reward model, initialised (init_shared_forms, init_matching_head) and trained on all but the first
    n_val rows, then validated on those; its training stats with the validation RMSE per kind."""
    torch.manual_seed(SEED + 20)
    rcfg = LlamaConfig(
        vocab_size=len(rm_tok), max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=REWARD_ROPE_THETA,
        tie_word_embeddings=False, num_labels=1, problem_type="regression",
        pad_token_id=rm_tok.pad_token_id, bos_token_id=rm_tok.bos_token_id, eos_token_id=rm_tok.eos_token_id,
        initializer_range=0.02, use_cache=False, **REWARD_ARCH,
    )
    reward = LlamaForSequenceClassification(rcfg)
    init_matching_head(reward, init_shared_forms(reward, rm_tok, SEED + 20), SEED + 21)
    log(f"reward: {n_params(reward):,} parameters")
    n_val = min(2000, len(rm_seqs) // 10)
    labels = [r[2] for r in rm_rows]
    stats = train_reward(reward, rm_seqs[n_val:], rm_dense[n_val:], labels[n_val:], rm_tok.pad_token_id,
                         seed=SEED + 20, firsts=rm_firsts[n_val:], **REWARD_TRAIN)
    stats["dense_labels"] = "coverage so far on every response token"
    stats["dense_weight"] = DENSE_WEIGHT
    stats["aux"] = {"labels": "first occurrence of a concept", "layer": AUX_LAYER, "weight": AUX_WEIGHT}
    stats["validation"] = eval_reward(reward, rm_seqs[:n_val], labels[:n_val], [r[3] for r in rm_rows[:n_val]],
                                      rm_tok.pad_token_id)
    log(f"  reward validation rmse: {json.dumps(stats['validation'])}")
    return reward, stats


def save_reward(reward, rm_tok, path: pathlib.Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    reward.save_pretrained(path, safe_serialization=True)
    rm_tok.save_pretrained(path)


def write_train_keys(path: pathlib.Path, train_keys: list[str]) -> None:
    with open(path, "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
            gz.write(("\n".join(train_keys) + "\n").encode())


def demo_lines(demo_sets: list[list[str]]) -> str:
    return "".join(json.dumps({"id": f"demo-{i:03d}", "prompt": world.make_prompt(c), "concepts": c}) + "\n"
                   for i, c in enumerate(demo_sets))


def check_same_data(out: pathlib.Path, demo_sets: list[list[str]], train_keys: list[str]) -> None:
    """A reward rebuilt alone must come from the data a full build makes: the demo prompts and the training concept
    sets this code draws must be those already written in `out` (else the world or the seeds have changed, and a
    full build is due)."""
    demo = (out / "demo-prompts" / "prompts.jsonl").read_text()
    with gzip.open(out / "train_concept_sets.txt.gz", "rt") as f:
        keys = f.read().splitlines()
    if demo != demo_lines(demo_sets) or keys != train_keys:
        raise SystemExit(f"{out}: its demo prompts or training concept sets are not those this code draws: "
                         "rebuild everything (python -m assets.build)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=ASSETS_DIR, help="where to write the asset folders")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the training data (for quick trials)")
    ap.add_argument("--only", choices=["reward"], default=None,
                    help="rebuild tiny-reward alone (the same data and seeds; the other assets in --out are kept "
                         "and must be those this code draws; build_meta.json is updated for the reward)")
    args = ap.parse_args(argv)
    out: pathlib.Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    only_reward = args.only == "reward"

    t_start = time.time()
    load_start = os.getloadavg()
    timings: dict[str, float] = {}
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    world.check_world()

    # ---- world, prompts, data
    t0 = time.time()
    demo_sets = world.sample_demo_sets(DEMO_SEED, N_DEMO)
    held_out = {world.concept_key(c) for c in demo_sets}
    n_lm = int(N_LM_TRAIN * args.scale)
    n_rm = int(N_RM_TRAIN * args.scale)
    lm_examples = world.sample_training(SEED, n_lm, held_out)
    rm_examples = world.sample_training(SEED + 1, n_rm, held_out)
    rm_rows = reward_examples(random.Random(SEED + 2), rm_examples)
    train_keys = sorted({world.concept_key(e.concepts) for e in lm_examples + rm_examples})
    assert not held_out & set(train_keys)
    if only_reward and args.scale == 1.0:
        check_same_data(out, demo_sets, train_keys)
    lm_tok = tokenization.build_lm_tokenizer()
    rm_tok = tokenization.build_reward_tokenizer()
    lm_seqs = [] if only_reward else lm_sequences(lm_tok, lm_examples)
    rm_seqs, rm_dense, rm_firsts = rm_sequences(rm_tok, rm_rows)
    assert all(rm_tok.unk_token_id not in s for s in rm_seqs)
    timings["data"] = time.time() - t0
    log(f"data: {len(lm_examples)} LM examples, {len(rm_rows)} reward examples, LM vocab {len(lm_tok)}, "
        f"reward vocab {len(rm_tok)} ({timings['data']:.1f}s)")

    if only_reward:
        t0 = time.time()
        reward, reward_stats = build_reward(rm_tok, rm_seqs, rm_dense, rm_firsts, rm_rows)
        timings["reward"] = time.time() - t0
        t0 = time.time()
        save_reward(reward, rm_tok, out / "tiny-reward")
        timings["write"] = time.time() - t0
        timings["total"] = time.time() - t_start
        meta_path = out / "build_meta.json"
        meta = json.loads(meta_path.read_text())
        meta["parameters"]["tiny-reward"] = n_params(reward)
        meta["architectures"]["tiny-reward"] = REWARD_ARCH
        meta["training"]["tiny-reward"] = {**REWARD_TRAIN, **reward_stats}
        # the build's step timings with the reward's replaced (the total is their sum); the rebuild's own record
        steps = {**meta["timings_seconds"], "reward": round(timings["reward"], 1)}
        steps["total"] = round(sum(v for k, v in steps.items() if k != "total"), 1)
        meta["timings_seconds"] = steps
        meta["reward_rebuild"] = {
            "command": "python -m assets.build --only reward",
            "timings_seconds": {k: round(v, 1) for k, v in timings.items()},
            "load_average_1min": {"start": round(load_start[0], 2), "end": round(os.getloadavg()[0], 2)},
            "threads": THREADS,
            "cpu_count": os.cpu_count(),
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                         "transformers": transformers.__version__},
        }
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        log("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
        return 0

    # ---- target
    t0 = time.time()
    torch.manual_seed(SEED)
    target = LlamaForCausalLM(lm_config(lm_tok, TARGET_ARCH))
    init_shared_forms(target, lm_tok, SEED)
    log(f"target: {n_params(target):,} parameters")
    target_stats = train_lm(target, lm_seqs, lm_tok.pad_token_id, seed=SEED, name="target", **TARGET_TRAIN)
    target_stats["greedy_coverage_demo"] = round(greedy_coverage(target, lm_tok, demo_sets), 4)
    log(f"  target greedy coverage on the demo prompts: {target_stats['greedy_coverage_demo']}")
    timings["target"] = time.time() - t0

    # ---- draft (distilled from the target)
    t0 = time.time()
    torch.manual_seed(SEED + 10)
    draft = LlamaForCausalLM(lm_config(lm_tok, DRAFT_ARCH))
    init_shared_forms(draft, lm_tok, SEED + 10)
    log(f"draft: {n_params(draft):,} parameters")
    draft_stats = train_lm(draft, lm_seqs, lm_tok.pad_token_id, seed=SEED + 10, teacher=target, name="draft",
                           **DRAFT_TRAIN)
    draft_stats["greedy_coverage_demo"] = round(greedy_coverage(draft, lm_tok, demo_sets), 4)
    log(f"  draft greedy coverage on the demo prompts: {draft_stats['greedy_coverage_demo']}")
    timings["draft"] = time.time() - t0

    # ---- reward
    t0 = time.time()
    reward, reward_stats = build_reward(rm_tok, rm_seqs, rm_dense, rm_firsts, rm_rows)
    timings["reward"] = time.time() - t0

    # ---- write
    t0 = time.time()
    for name, model, tok in (("tiny-target", target, lm_tok), ("tiny-draft", draft, lm_tok)):
        path = out / name
        shutil.rmtree(path, ignore_errors=True)
        save_lm(model, tok, path)
    save_reward(reward, rm_tok, out / "tiny-reward")
    demo_dir = out / "demo-prompts"
    demo_dir.mkdir(exist_ok=True)
    (demo_dir / "prompts.jsonl").write_text(demo_lines(demo_sets))
    write_train_keys(out / "train_concept_sets.txt.gz", train_keys)
    timings["write"] = time.time() - t0
    timings["total"] = time.time() - t_start
    meta = {
        "seeds": {"world": SEED, "demo": DEMO_SEED, "reward_rows": SEED + 2, "target": SEED, "draft": SEED + 10,
                  "reward": SEED + 20},
        "n_demo_prompts": N_DEMO,
        "n_lm_examples": len(lm_examples),
        "n_reward_examples": len(rm_rows),
        "n_train_concept_sets": len(train_keys),
        "disfluency_penalty": DISFLUENCY_PENALTY,
        "parameters": {"tiny-target": n_params(target), "tiny-draft": n_params(draft),
                       "tiny-reward": n_params(reward)},
        "architectures": {"tiny-target": TARGET_ARCH, "tiny-draft": DRAFT_ARCH, "tiny-reward": REWARD_ARCH},
        "training": {"tiny-target": {**TARGET_TRAIN, **target_stats}, "tiny-draft": {**DRAFT_TRAIN, **draft_stats},
                     "tiny-reward": {**REWARD_TRAIN, **reward_stats}},
        "timings_seconds": {k: round(v, 1) for k, v in timings.items()},
        "threads": THREADS,
        "load_average_1min": {"start": round(load_start[0], 2), "end": round(os.getloadavg()[0], 2)},
        "cpu_count": os.cpu_count(),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }
    (out / "build_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    log("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
