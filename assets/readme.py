"""Render assets/README.md from build_meta.json and the figures assets.measure produced (called by measure)."""

from __future__ import annotations

import json
import pathlib

from assets import BUILTINS, tokenization


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _ok(flag: bool) -> str:
    return "met" if flag else "NOT MET"


def _rebuild(meta: dict) -> str:
    r = meta.get("reward_rebuild")
    if not r:
        return ""
    t = r["timings_seconds"]
    versions = "" if r["versions"] == meta["versions"] else (
        f", with torch {r['versions']['torch']} and transformers {r['versions']['transformers']}")
    return (f"\ntiny-reward was then rebuilt alone (`{r['command']}`) in {t['total']:.0f} s "
            f"(data {t['data']:.0f} s, reward {t['reward']:.0f} s{versions}), with a load average of "
            f"{r['load_average_1min']['start']} at the start and {r['load_average_1min']['end']} at the end; the "
            "reward's time above is that one.")


def render(assets: pathlib.Path, f: dict) -> str:
    meta = json.loads((assets / "build_meta.json").read_text())
    cfg = {n: json.loads((assets / BUILTINS[n] / "config.json").read_text())
           for n in ("tiny-target", "tiny-draft", "tiny-reward")}
    lm_vocab = json.loads((assets / "tiny-target" / "tokenizer.json").read_text())["model"]["vocab"]
    rm_vocab = json.loads((assets / "tiny-reward" / "tokenizer.json").read_text())["model"]["vocab"]
    sp, pr, bon, sm, gr = f["speculative_greedy"], f["partial_reward"], f["best_of_n"], f["samples"], f["greedy"]
    speed = f["speed"]
    size = f["bytes_on_disk"]
    par = f["parameters"]
    t = meta["timings_seconds"]
    tcfg = cfg["tiny-target"]
    head_dim = tcfg.get("head_dim") or tcfg["hidden_size"] // tcfg["num_attention_heads"]
    kv = {"layers": tcfg["num_hidden_layers"], "kv_heads": tcfg["num_key_value_heads"], "head_dim": head_dim,
          "bytes": 2 * tcfg["num_hidden_layers"] * tcfg["num_key_value_heads"] * head_dim * 4}
    rm_val = ", ".join(f"{k} {v['rmse']}" for k, v in meta["training"]["tiny-reward"]["validation"].items())
    first_row = (assets / BUILTINS["demo-prompts"] / "prompts.jsonl").read_text().splitlines()[0]

    def arch_row(name: str) -> str:
        c = cfg[name]
        return (f"| `{name}` | {c['architectures'][0]} | {c['num_hidden_layers']} | {c['hidden_size']} | "
                f"{c['num_attention_heads']} | {c['num_key_value_heads']} | {c['intermediate_size']} | "
                f"{c['vocab_size']} | {par[name]:,} | {_mb(size[name])} |")

    def specials(vocab: dict, names: list[str]) -> str:
        return ", ".join(f"`{s}` = {vocab[s]}" for s in names)

    ex = "\n".join(f"- prompt: {e['prompt']}\n  greedy response of tiny-target: {e['greedy']}"
                   for e in f["examples"][:3])
    return f"""# Bundled assets: a tiny CommonGen-like world and three models trained on it

Everything here is committed, so a fresh clone runs offline: no download, no build (all but SmolLM2, the last row,
which is built from an optional package). Job configs name these assets as `builtin:NAME`;
`assets.builtin_path(NAME)` gives the folder (or file) and `winnow assets` lists them.

| name | folder | what |
|---|---|---|
| `builtin:tiny-target` | `tiny-target/` | `LlamaForCausalLM`, {par['tiny-target']:,} parameters, GQA |
| `builtin:tiny-draft` | `tiny-draft/` | `LlamaForCausalLM`, {par['tiny-draft']:,} parameters, the same tokenizer as the target |
| `builtin:tiny-reward` | `tiny-reward/` | `LlamaForSequenceClassification` (1 label: the reward), its own tokenizer |
| `builtin:demo-prompts` | `demo-prompts/` | `prompts.jsonl`: {f['n_prompts']} held-out prompts |
| `builtin:real-prompts` | `real-prompts/` | 112 real instructions written for this project (below) |
| `builtin:real-concepts` | `real-prompts/concepts.jsonl` | their 48 concept sentences alone, for the `lexical` reward |
| `builtin:smollm2-135m-instruct` | a cache folder, built on first use | SmolLM2-135M-Instruct, a real instruct model: needs the `real` extra ([docs/real-model.md](../docs/real-model.md)) |

The tiny models are toys for tests, demos and CPU benchmarks of the engine (speculative decoding, Best-of-N,
Speculative Rejection, CDSL, MJSD), not language models: they know about {len(lm_vocab)} words.

## Real prompts (`real-prompts/`)
112 short instructions written for this project (not taken from a dataset), in the demo prompts' JSONL shape, for
runs and benches on a real model (`builtin:smollm2-135m-instruct`): `concepts.jsonl` holds 48 CommonGen-style concept
sentences ("Write one sentence that uses all of these words: dog, frisbee, park.", `concepts` 3-4 plain everyday
words with regular inflections, as `lexical` counts them), `instructions.jsonl` 64 explanations, advice and short
writing tasks (ids `explain-*`, `advice-*`, `write-*`, interleaved; no `concepts`). A job reads the folder's files
in name order, so `builtin:real-prompts` with `data.limit` keeps concept sentences first; with the `lexical` reward
the instructions become error rows (no concepts): use `builtin:real-concepts` there. The instructions ask for short
answers ("in one or two sentences") because SmolLM2-135M rambles and loops otherwise: its greedy answers (hf engine,
at most 128 new tokens) are a median 36 tokens long for the instructions (59 of 64 end at `<|im_end|>`) and 16 for
the concept sentences (44 of 48 within 192 tokens; they cover 0.807 of their concepts).

## The world (`assets/world.py`)
A task is CommonGen's (paper 000, section 4.1): "Write a sentence using these concepts: c1, c2, c3." with 3-5
concept lemmas drawn from {len(__import__('assets.world', fromlist=['x']).ROLE_OF)} nouns, places and verbs. A
response is 1-3 sentences from a small grammar (subject, verb, object, place, adjectives, adverbs, filler sentences
like "It is a sunny day."), about 6-50 words. Inflections are regular and are exactly those `lexical`
accepts (dog -> dogs, kick -> kicks/kicking/kicked, dance -> dancing, carry -> carries/carried); no word of the world
counts as a concept it does not come from (`world.check_world()`).

Coverage is imperfect on purpose. Each training response draws a latent diligence q ~ U(0.1, 1) and keeps each
concept with probability q, otherwise it uses a random substitute of the same class; kept concepts are placed
first. So sampled responses vary in coverage (Best-of-N has something to choose from), and the first part of a
response shows how the rest will go (partial rewards predict final rewards, which Speculative Rejection relies
on). The reward is trained to approximate `lexical.concept_coverage` minus {meta['disfluency_penalty']}
for disfluent text, so it lies in about [-0.5, 1].

Demo prompts (`demo-prompts/prompts.jsonl`) are JSON lines with `id` (string), `prompt` (string) and `concepts`
(list of 3-5 lemmas), e.g.
`{first_row}`.
Their concept sets are held out: none of them occurs in any training set (`train_concept_sets.txt.gz` lists every
training concept set, sorted and space-joined, one a line; `tests/test_assets.py` checks).

{ex}

## Models
| name | class | layers | hidden | heads | KV heads | MLP | vocab | parameters | on disk |
|---|---|---|---|---|---|---|---|---|---|
{arch_row('tiny-target')}
{arch_row('tiny-draft')}
{arch_row('tiny-reward')}

All float32 safetensors, `max_position_embeddings` 256, RoPE, tied input/output embeddings for the two LMs.
FLOPs per token (2 x weights multiplied, output projection included, attention scores excluded): target
{f['flops_per_token']['tiny-target']:,}, draft {f['flops_per_token']['tiny-draft']:,} ({speed['flops_ratio']}x fewer).
KV cache of the target per token: 2 x {kv['layers']} layers x {kv['kv_heads']} KV heads x {kv['head_dim']} head_dim x
4 bytes = {kv['bytes']} bytes in float32 (`head_dim` is in config.json).

Training (`assets/build.py`): the target learns next-token cross-entropy on the response tokens of
{meta['n_lm_examples']:,} world examples (the loss on concept words is up-weighted during the first 60% of the
steps, a curriculum that makes copying concepts from the prompt emerge within the CPU budget); the draft is
distilled from the target (KL(target || draft), 2 epochs over the same sequences), so its choices agree with the
target's; the reward model regresses ({meta['training']['tiny-reward']['epochs']} epochs) on
{meta['n_reward_examples']:,} (prompt, text) pairs where the text is a
whole response, a prefix of one (labelled with the prefix's own coverage), or a disfluent corruption (shuffled,
looped or word salad: coverage minus {meta['disfluency_penalty']}), scored at `[EOS]`; every token of the
response is also labelled with the coverage of the response so far (so the score means "covered so far" at every
length), and a training-only linear head on the first layer's output (discarded after training) learns to flag
the first occurrence of each requested concept in the response. Initialisation hints (only initial values, all
trained afterwards): inflected forms start from their lemma's embedding plus a shared suffix vector, words of one
class share a class vector, and head 0 of the reward model's first layer starts as a "same word" matching head
(W_Q = W_K on the slowly rotating RoPE dimensions, `rope_theta` 1e6), through which a word of the response finds
the same word in the request. Without these hints the models did not learn to copy or to match concepts within the
time budget. Reward validation RMSE (held-out world rows): {rm_val}.

## Tokenizers
**tiny-target / tiny-draft** (identical files): word level (`tokenizers` WordLevel; whitespace + punctuation
pre-tokenizer; case-sensitive), {len(lm_vocab)} tokens, special tokens first:
{specials(lm_vocab, tokenization.LM_SPECIALS)}. EOS is `<|im_end|>`, pad is `<|pad|>`, no BOS,
`padding_side` left. Chat template (ChatML-like; the assistant turn ends with EOS):
```jinja
{tokenization.LM_CHAT_TEMPLATE}
```
Decoding uses the WordPiece decoder with cleanup, so `decode(ids, skip_special_tokens=True)` gives
"The dog kicks the ball." (words joined by spaces, "." and "," attached; ":" stays detached, which only prompts
contain). Words outside the world become `<|unk|>`.

**tiny-reward**: WordPiece (a lemma plus `##s`/`##es`/`##d`/`##ed`/`##ing` where the inflection splits cleanly:
"kicks" -> `kick ##s`; whole words otherwise: "dancing"), case-sensitive, {len(rm_vocab)} tokens: lower-case words in
alphabetical order, then the upper-case words of requests ("DOG", "WRITE"), the suffix pieces, and the special
tokens last: {specials(rm_vocab, tokenization.RM_SPECIALS)}; pad `[PAD]`, EOS `[EOS]`, `padding_side` right.
Its chat template renders the turns in order, the prompt first: the request upper-cased, then the response
lower-cased, then `[EOS]`, where the score is read (the newline before it is whitespace, not a token). Winnow
scores partial responses again and again as they grow (Speculative Rejection's decisions) and keeps each
candidate's reward-model cache between scores: with the prompt first, a prompt is encoded once for all its
candidates and a decision feeds only the response's new tokens and `[EOS]`. (The first version rendered the
response first and the request after it, so that each concept of the request could look back at the response;
the whole request then sat in the end-of-turn tail and was fed again at every decision for every candidate, and
Speculative Rejection fed more reward tokens than Best-of-N.) Now a causal model lets each word of the response
("dog ##s") look back at the request, where a concept is a token of its own ("DOG": the casing tells the request's
copy from the response's), and count the concepts covered so far:
```jinja
{tokenization.RM_CHAT_TEMPLATE}
```
Ids, special tokens, casing, segmentation and template all differ from the target's: scoring must decode the
target's tokens to text and re-tokenise with this tokenizer.

## Measured figures (`python -m assets.measure`, {f['n_prompts']} demo prompts, CPU, float32)
| figure | value | target |
|---|---|---|
| greedy acceptance rate of the draft, gamma = {sp['gamma']} (accepted / proposed) | **{sp['acceptance_rate']}** | >= 0.5: {_ok(sp['acceptance_rate'] >= 0.5)} |
| mean accepted draft tokens per iteration; tokens per target forward | {sp['mean_accepted_per_iteration']}; {sp['tokens_per_target_forward']} | |
| speculative greedy output identical to the target's greedy output | {sp['matches_target_greedy']} | |
| Pearson(reward of first half, reward of whole), per prompt, mean ({sm['per_prompt']} samples, T = 1) | **{pr['pearson_half_vs_full_mean']}** | >= 0.3: {_ok(pr['pearson_half_vs_full_mean'] >= 0.3)} |
| Kendall tau of the same | {pr['kendall_half_vs_full_mean']} | |
| mean reward of one sample | {bon['mean_single_reward']} | |
| mean best reward of Best-of-{bon['n']} | **{bon['mean_best_reward']}** | clearly above one sample |
| gap, in within-prompt reward standard deviations ({bon['mean_within_prompt_reward_sd']}) | {bon['gap_in_sd']} | |
| lexical coverage: greedy / one sample / BoN-{bon['n']} pick / best of 16 by coverage itself | {gr['mean_lexical_coverage']} / {bon['mean_single_lexical_coverage']} / {bon['mean_best_lexical_coverage']} / {bon['oracle_best_lexical_coverage']} | |
| Pearson(reward, lexical coverage) over all samples | {sm['reward_vs_lexical_pearson_pooled']} | |
| greedy responses ending with EOS; mean greedy length (tokens) | {gr['ended_with_eos']}; {gr['mean_tokens']} | |
| fraction of samples ending with EOS within 96 tokens; mean sample length (tokens) | {sm['ended_with_eos']}; {sm['mean_tokens']} | |

Forward throughput on this machine (tokens/s; 80-token sequences; decode = one token per step with a KV cache;
{speed.get('threads', 1)} thread(s); the machine was shared, so take ratios rather than absolute values):

| model | prefill, batch 1 | decode, batch 1 | prefill, batch 16 | decode, batch 16 |
|---|---|---|---|---|
| tiny-target | {speed['tiny-target']['batch1']['prefill_tokens_per_s']:,} | {speed['tiny-target']['batch1']['decode_tokens_per_s']:,} | {speed['tiny-target']['batch16']['prefill_tokens_per_s']:,} | {speed['tiny-target']['batch16']['decode_tokens_per_s']:,} |
| tiny-draft | {speed['tiny-draft']['batch1']['prefill_tokens_per_s']:,} | {speed['tiny-draft']['batch1']['decode_tokens_per_s']:,} | {speed['tiny-draft']['batch16']['prefill_tokens_per_s']:,} | {speed['tiny-draft']['batch16']['decode_tokens_per_s']:,} |

Draft / target cost ratio c (CDSL's section 4.3): {speed['draft_over_target_cost_decode_batch1']} for batch-1
decoding, {speed['draft_over_target_cost_prefill_batch16']} for a batch-16 prefill; the FLOPs ratio is
{round(1 / speed['flops_ratio'], 3)}. At these sizes a CPU forward is dominated by per-call overhead, so the
wall-clock ratio is much closer to 1 than the FLOPs ratio; measure c on the machine you benchmark.

## Notes for the engine and reward code
- `apply_chat_template(..., add_generation_prompt=True)` returns a `BatchEncoding` (use `["input_ids"]`) in
  transformers 5; pass `tokenize=False` for the string. The LM prompt ends with `<|im_start|>assistant\\n`; the
  model answers and stops with `<|im_end|>` (EOS, id {lm_vocab['<|im_end|>']}); `generation_config.json` has
  `eos_token_id` {lm_vocab['<|im_end|>']} and `pad_token_id` {lm_vocab['<|pad|>']}. The LM tokenizers pad on the left.
- Llama uses RoPE only, so left padding with an attention mask gives the same logits as no padding (up to float
  error) even without explicit `position_ids`; pass them anyway if the engine needs exactness across batch shapes.
- Reward: render `[{{"role": "user", ...}}, {{"role": "assistant", "content": text}}]` with the REWARD tokenizer's
  template and tokenise with `add_special_tokens=False` (the template already has `[BOS]`/`[EOS]`; the tokenizer adds
  nothing anyway). `LlamaForSequenceClassification` reads the score at the rightmost token that is not `[PAD]`
  (id {rm_vocab['[PAD]']}, set as `pad_token_id` in its config), which is `[EOS]`; left or right padding both work.
  The score is `logits[:, 0]`. Partial responses are scored the same way (decode, then render).
- The reward template lower-cases the response and upper-cases the request itself; do not tokenise raw text with
  the reward tokenizer (capitalised words would become `[UNK]`). Unknown words become `[UNK]`; any text still scores.
- No stop strings besides EOS; responses never contain special tokens as text.

## Rebuild
```
python -m assets.build      # writes the folders, build_meta.json, train_concept_sets.txt.gz
python -m assets.build --only reward  # tiny-reward alone (same data and seeds), build_meta.json updated for it
python -m assets.measure    # rewrites this README and measurements.json; --readme-only re-renders from the json
```
The last build took {t['total']:.0f} s on {meta.get('cpu_count', '?')} cores with {meta['threads']} torch threads
({', '.join(f'{k} {v:.0f} s' for k, v in t.items() if k != 'total')}), with a 1-minute load average of
{meta.get('load_average_1min', {}).get('start', '?')} at the start and {meta.get('load_average_1min', {}).get('end', '?')} at
the end (the machine is shared; a busier machine takes proportionally longer).{_rebuild(meta)} The measurement took
{f.get('measure_seconds', '?')} s.
Deterministic: fixed seeds (`assets/build.py`: world {meta['seeds']['world']}, demo prompts
{meta['seeds']['demo']}), `torch.use_deterministic_algorithms(True)`, {meta['threads']} threads; the same machine and
library versions give the same weights (built with torch {meta['versions']['torch']}, transformers
{meta['versions']['transformers']}). Total size of `assets/`: {_mb(size['assets_total'])}.
"""
