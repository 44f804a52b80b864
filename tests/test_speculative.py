"""Oracles of batched speculative decoding and of the speculative sampler inside Best-of-N and SR (CPU, float32).

Small random Llama pairs stand in for the trio: a target, and a draft that is a perturbed copy of it (so that
acceptance is partial and differs between sequences). The helpers at the top are shared by tests/test_mjsd.py,
tests/test_cdsl.py and tests/test_beam.py.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM

from schemas.config import GenerationConfig
from schemas.methods import Sampling
from tests.metered import MeteredContext, run_method
from tests.replay_decoder import ScriptedScorer
from tests.trio_helpers import params_of
from workers.accounting.cost import Meter
from workers.accounting.work import Work
from workers.candidates import PromptInput
from workers.decoding.kvcache import cache_kw, fork_cache, pack
from workers.decoding.sampling import Warp, prompt_key, warp_probs
from workers.decoding.speculative import SpeculativeSampler, Side, emit, ragged_cat, right_align, take

EOS = 1
PAD = 0


# ---------------------------------------------------------------------------------------------------------------
# Shared helpers


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and far faster than on two when the machine's cores are busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_lm(vocab: int = 48, seed: int = 0, sharpness: float = 8.0, layers: int = 2) -> LlamaForCausalLM:
    """A random Llama; `sharpness` scales the output layer (large: peaked, few greedy ties; small: flat)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=PAD, eos_token_id=EOS, pad_token_id=PAD)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


def perturbed(model: LlamaForCausalLM, scale: float, seed: int = 1) -> LlamaForCausalLM:
    """A copy of `model` with Gaussian noise of `scale` x each tensor's std: a draft that agrees only in part."""
    torch.manual_seed(seed)
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn_like(p) * scale * p.std())
    return out


@functools.lru_cache(maxsize=None)
def pair(vocab: int = 48, sharpness: float = 8.0, noise: float = 0.5):
    target = tiny_lm(vocab, 0, sharpness)
    return target, perturbed(target, noise)


class ToyTokenizer:
    """Token i decodes to the word 'w<i>'; EOS is special."""

    def decode(self, tokens, skip_special_tokens=True):
        return " ".join(f"w{t}" for t in tokens if not (skip_special_tokens and t == EOS))


def coverage_reward(wanted: list[set[int]]):
    """A scripted reward: the fraction of prompt g's wanted token ids that its response contains."""

    def reward(items, meter):
        return [len(wanted[it.group] & set(it.response_ids)) / len(wanted[it.group]) for it in items]

    return ScriptedScorer(reward)


def toy_context(target, draft, generation: dict | None = None, reward=None, num_prompts: int = 1,
                seed: int = 0) -> MeteredContext:
    """A Context on a toy pair: `generation` as the config's section (sampling warp and pool sampler), with the meter
    that `run` charges (`tests.metered`)."""
    g = GenerationConfig(**(generation or {}))
    return MeteredContext(ToyTokenizer(), [EOS], PAD, reward,
                          Sampling(g.temperature, g.top_p, g.top_k, g.sampler, g.gamma), seed, target=target,
                          draft=draft, meter=Meter(num_prompts))


def toy_prompts(count: int, vocab: int, limit: int, seed: int = 0, lo: int = 3, hi: int = 12) -> list[PromptInput]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = int(torch.randint(lo, hi, (1,), generator=gen))
        ids = torch.randint(2, vocab, (n,), generator=gen).tolist()
        out.append(PromptInput(f"p{seed}-{i}", [{"role": "user", "content": str(ids)}], ids, prompt_key(f"p{seed}-{i}"),
                               limit))
    return out


def run(method: dict, ctx: MeteredContext, prompts: list[PromptInput]):
    """Run a method from its own parameters (a dict such as {"name": "mjsd", "tau": 1.0}), its work charged to the
    context's meter."""
    with torch.inference_mode():
        return run_method(ctx, params_of(method), prompts)


def greedy_reference(model, prompt: list[int], limit: int) -> list[int]:
    """The model's greedy continuation, recomputed from scratch (no cache) at every token."""
    seq: list[int] = []
    with torch.inference_mode():
        while len(seq) < limit and not (seq and seq[-1] == EOS):
            seq.append(int(model(torch.tensor([prompt + seq])).logits[0, -1].argmax()))
    return seq


def chisquare_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of counts against probabilities; cells expected below `min_expected` pooled."""
    n = float(observed.sum())
    exp = expected_probs.double().flatten() * n
    obs = observed.double().flatten()
    big = exp >= min_expected
    o, e = obs[big], exp[big]
    if float(exp[~big].sum()) > 0:
        o = torch.cat([o, obs[~big].sum()[None]])
        e = torch.cat([e, exp[~big].sum()[None]])
    return float(stats.chisquare(o.numpy(), e.numpy() * float(o.sum()) / float(e.sum())).pvalue)


def token_law(model, prompt: list[int], warp: Warp) -> torch.Tensor:
    """[V, V, V] the model's exact (warped) probability of the first three response tokens; EOS is absorbing (a
    sequence that ended is continued by EOS with probability 1, as `padded_triples` reads samples)."""
    with torch.inference_mode():
        v = model.config.vocab_size
        eos_row = torch.zeros(v)
        eos_row[EOS] = 1.0

        def nxt(prefixes: list[list[int]]) -> torch.Tensor:
            probs = warp_probs(model(torch.tensor([prompt + q for q in prefixes])).logits[:, -1], warp)  # [N, V]
            ended = torch.tensor([EOS in q for q in prefixes])
            return torch.where(ended[:, None], eos_row, probs)

        p1 = nxt([[]])[0]  # [V]
        p2 = nxt([[a] for a in range(v)])  # [V, V]
        p3 = nxt([[a, b] for a in range(v) for b in range(v)]).view(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


def padded_triples(tokens: list[list[int]], v: int) -> torch.Tensor:
    """Counts [V, V, V] of the first three tokens of each sequence, continued by EOS after an EOS."""
    flat = []
    for t in tokens:
        t = list(t[:3])
        while len(t) < 3:
            assert t and t[-1] == EOS, "a sequence shorter than 3 tokens must end with EOS"
            t.append(EOS)
        flat.append((t[0] * v + t[1]) * v + t[2])
    return torch.bincount(torch.tensor(flat), minlength=v ** 3).view(v, v, v)


# ---------------------------------------------------------------------------------------------------------------
# Greedy: token-identical to the target


def test_greedy_speculative_decoding_is_the_targets_greedy_decoding_with_ragged_acceptance():
    target, draft = pair()
    prompts = toy_prompts(10, 48, 24)
    ctx = toy_context(target, draft, {"temperature": 0}, num_prompts=len(prompts))
    results = run({"name": "speculative_decoding", "gamma": 4}, ctx, prompts)
    greedy = run({"name": "greedy"}, toy_context(target, draft, {"temperature": 0}, num_prompts=len(prompts)),
                 prompts)
    rates = [r.stats["acceptance_rate"] for r in results]
    assert len(set(rates)) >= 4 and max(rates) - min(rates) > 0.15, f"acceptance was not ragged: {rates}"
    for p, res, ref in zip(prompts, results, greedy):
        assert res.candidates[0].tokens == ref.candidates[0].tokens
    for p, res in list(zip(prompts, results))[:3]:
        assert res.candidates[0].tokens == greedy_reference(target, p.ids, 24)
    # fewer target calls than tokens: the drafts were used
    assert sum(int(f) for f in ctx.meter.forwards["target"]) < sum(len(r.candidates[0].tokens) for r in results)
    for r in results:
        assert r.stats["target_calls_per_token"] < 1.0
        assert r.stats["mean_accepted_tokens"] > 1.0


@pytest.mark.parametrize("gamma", [1, 7])
def test_greedy_equality_holds_for_short_and_long_drafts(gamma):
    target, draft = pair()
    prompts = toy_prompts(6, 48, 17, seed=3)
    res = run({"name": "speculative_decoding", "gamma": gamma},
              toy_context(target, draft, {"temperature": 0}, num_prompts=6), prompts)
    for p, r in zip(prompts, res):
        assert r.candidates[0].tokens == greedy_reference(target, p.ids, 17)
        assert len(r.candidates[0].tokens) <= 17


# ---------------------------------------------------------------------------------------------------------------
# Sampling: the target's distribution


def sample_batch(target, draft, prompt, n, warp, gamma, limit, seed=0):
    with torch.inference_mode():
        engine = SpeculativeSampler(target, draft, gamma, PAD, [EOS], warp, seed)
        batch = engine.prefill([prompt], n, [prompt_key("chi")], [limit])
        while not bool(engine.finished(batch).all()):
            engine.step(batch)
    return batch, engine


@pytest.mark.parametrize("warp", [Warp(1.0), Warp(0.7, top_k=5), Warp(1.0, top_p=0.8)])
def test_sampled_speculative_decoding_reproduces_the_targets_distribution(warp):
    """Tokens 2 and 3 come from drafts (accepted or recovered); their joint law must be the target's."""
    target, draft = pair(vocab=12, sharpness=2.0, noise=1.5)
    prompt = [3, 7, 5, 9]
    batch, engine = sample_batch(target, draft, prompt, 3000, warp, gamma=3, limit=4)
    v = target.config.vocab_size
    observed = padded_triples([batch.tokens[i, : int(batch.length[i])].tolist() for i in range(batch.size)], v)
    assert chisquare_pvalue(observed.sum(0), token_law(target, prompt, warp).sum(0)) > 1e-3
    rate = engine.stats(0)["acceptance_rate"]
    assert 0.05 < rate < 0.95, rate  # both accepted drafts and recovered tokens were exercised
    # the test has power: the draft's own law is rejected on the same samples
    assert chisquare_pvalue(observed.sum(0), token_law(draft, prompt, warp).sum(0)) < 1e-6


def test_best_of_n_with_the_speculative_sampler_keeps_the_targets_distribution():
    target, draft = pair(vocab=12, sharpness=2.0, noise=1.5)
    prompt = PromptInput("bon", [], [4, 2, 8], prompt_key("bon"), 4)
    ctx = toy_context(target, draft, {"sampler": "speculative", "gamma": 2, "temperature": 1.0},
                      reward=ScriptedScorer(lambda items, m: [0.0] * len(items)))
    (res,) = run({"name": "best_of_n", "n": 3000}, ctx, [prompt])
    v = target.config.vocab_size
    observed = padded_triples([c.tokens for c in res.candidates], v)
    law = token_law(target, prompt.ids, Warp(1.0))
    assert chisquare_pvalue(observed, law) > 1e-3
    assert chisquare_pvalue(observed.sum(0), law.sum(0)) > 1e-3  # tokens 2-3, where drafts were used
    assert chisquare_pvalue(observed, token_law(draft, prompt.ids, Warp(1.0))) < 1e-6
    assert 0.05 < res.stats["acceptance_rate"] < 0.95 and res.stats["target_calls_per_token"] < 1.0


def test_sampled_sequences_do_not_depend_on_the_batch():
    target, draft = pair()
    prompts = toy_prompts(4, 48, 20, seed=5)
    gen = {"sampler": "speculative", "gamma": 3, "temperature": 1.0}
    bon = {"name": "best_of_n", "n": 3}
    zero = ScriptedScorer(lambda items, m: [0.0] * len(items))
    together = run(bon, toy_context(target, draft, gen, reward=zero, num_prompts=4),
                   prompts)
    for i, p in enumerate(prompts):
        (alone,) = run(bon, toy_context(target, draft, gen, reward=zero), [p])
        assert [c.tokens for c in alone.candidates] == [c.tokens for c in together[i].candidates]


# ---------------------------------------------------------------------------------------------------------------
# Inside Speculative Rejection


def test_speculative_rejection_with_the_speculative_sampler_runs_and_rejects():
    target, draft = pair()
    prompts = toy_prompts(3, 48, 24, seed=7)
    wanted = [set(range(2 + g, 48, 5)) for g in range(3)]
    gen = {"sampler": "speculative", "gamma": 3, "temperature": 1.0}
    method = {"name": "speculative_rejection", "n": 12, "alpha": 0.5, "schedule": "fixed", "every_k_tokens": 6}
    ctx = toy_context(target, draft, gen, coverage_reward(wanted), num_prompts=3)
    results = run(method, ctx, prompts)
    for res in results:
        rejected = [c for c in res.candidates if c.finish_reason == "rejected"]
        assert rejected and res.stats["rejection_rounds"] > 0
        assert res.candidates[res.best_index].finish_reason in ("eos", "length")
        assert res.stats["acceptance_rate"] is not None and res.stats["draft_calls_per_token"] > 0
    assert int(ctx.meter.forwards["draft"].sum()) > 0


def test_speculative_rejection_with_alpha_zero_is_best_of_n_with_the_speculative_sampler():
    """Selecting sequences (SR's rounds) keeps both caches exact: no rejection gives exactly Best-of-N's candidates."""
    target, draft = pair()
    prompts = toy_prompts(3, 48, 24, seed=8)
    wanted = [set(range(3 + g, 48, 4)) for g in range(3)]
    gen = {"sampler": "speculative", "gamma": 3, "temperature": 1.0}
    bon = run({"name": "best_of_n", "n": 6}, toy_context(target, draft, gen, coverage_reward(wanted), 3), prompts)
    method = {"name": "speculative_rejection", "n": 6, "alpha": 0.0, "schedule": "memory", "pool_kv_cache_mb": 0.05}
    sr = run(method, toy_context(target, draft, gen, coverage_reward(wanted), 3), prompts)
    assert any(r.stats["rejection_rounds"] > 0 for r in sr)
    for s, b in zip(sr, bon):
        assert [c.tokens for c in s.candidates] == [c.tokens for c in b.candidates]
        assert s.best_index == b.best_index


# ---------------------------------------------------------------------------------------------------------------
# The bookkeeping: holes, commits, selection


def test_both_caches_stay_exact_after_steps_and_sequence_selection():
    target, draft = pair()
    prompts = toy_prompts(4, 48, 30, seed=9)
    with torch.inference_mode():
        engine = SpeculativeSampler(target, draft, 4, PAD, [EOS], Warp(1.0), 0)
        batch = engine.prefill([p.ids for p in prompts], 3, [p.rng_key for p in prompts], [30] * 4)
        for _ in range(4):
            engine.step(batch)
        batch.select(torch.tensor([0, 2, 5, 7, 10, 11]))
        t, d = batch.sides(target, draft)
        assert bool((t.n_in == batch.length - 1).all())
        for side, model in ((t, target), (d, draft)):
            seq, seq_len = side.backlog(batch.tokens, batch.length)
            got = side.extend_to(seq, seq_len, torch.ones_like(seq_len, dtype=torch.bool), batch.group, Work(),
                                 None)[:, -1]
            for r in range(batch.size):
                full = prompts[int(batch.group[r])].ids + batch.tokens[r, : int(batch.length[r])].tolist()
                ref = model(torch.tensor([full])).logits[0, -1].float()
                torch.testing.assert_close(got[r], ref, atol=1e-4, rtol=1e-4)


def test_pack_moves_real_columns_together_exactly():
    target, _ = pair()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    mask = torch.tensor([[1, 0, 1, 1, 0, 1], [0, 0, 1, 0, 1, 1]])
    from transformers import DynamicCache
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        side = Side(target, "target", cache, mask.new_zeros(2, 0), torch.zeros(2, dtype=torch.long))
        side.feed(ids, mask.bool(), torch.tensor([0, 0]), Work(), None)
        packed = pack(cache, side.mask)
        assert packed.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
        nxt = torch.tensor([[20], [21]])
        out = target(input_ids=nxt, attention_mask=torch.cat([packed, torch.ones(2, 1, dtype=torch.long)], 1),
                     position_ids=torch.tensor([[4], [3]]), **cache_kw(target, cache), use_cache=True).logits[:, -1]
        for r, real in enumerate(([5, 7, 8, 10], [13, 15, 16])):
            ref = target(torch.tensor([real + [int(nxt[r])]])).logits[0, -1]
            torch.testing.assert_close(out[r], ref, atol=1e-4, rtol=1e-4)


def test_commit_keeps_the_longest_agreeing_run_and_crops_common_holes():
    target, _ = pair()
    from transformers import DynamicCache
    with torch.inference_mode():
        side = Side(target, "target", DynamicCache(config=target.config), torch.zeros(2, 0, dtype=torch.long),
                    torch.zeros(2, dtype=torch.long))
        side.feed(torch.tensor([[4, 5], [6, 7]]), torch.ones(2, 2, dtype=torch.bool), torch.tensor([0, 1]), Work(),
                  None)
        side.commit(torch.tensor([[4, 5, 9], [6, 7, 9]]), torch.tensor([3, 3]))
        assert side.n_in.tolist() == [2, 2] and side.mask.shape[1] == 2
        side.feed(torch.tensor([[9, 20, 21], [9, 22, 23]]), torch.ones(2, 3, dtype=torch.bool), torch.tensor([0, 1]),
                  Work(), None)
        tokens = torch.tensor([[4, 5, 9, 20, 30, 0], [6, 7, 9, 31, 0, 0]])
        side.commit(tokens, torch.tensor([5, 4]))  # sequence 0: 9, 20 agree (30 pending); sequence 1: only 9 agrees
        assert side.n_in.tolist() == [4, 3]
        assert side.mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]  # the column of 21 / 23 was cropped
        assert side.cache.get_seq_length() == 4


def test_emit_cuts_after_eos_and_at_the_limit():
    from workers.decoding.batch import Batch

    batch = Batch(cache=None, mask=torch.zeros(3, 1), pending=torch.tensor([2, 2, 2]), group=torch.arange(3),
                cand=torch.zeros(3, dtype=torch.long), rng_key=torch.zeros(3, dtype=torch.long),
                length=torch.tensor([1, 1, 4]), limit=torch.tensor([9, 9, 6]),
                tokens=torch.zeros(3, 9, dtype=torch.long), alive=torch.ones(3, dtype=torch.bool),
                logprob=torch.zeros(3, dtype=torch.float64))
    block = torch.tensor([[5, EOS, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]])
    m = emit(batch, block, torch.tensor([4, 3, 4]), torch.tensor([8, 8, 2]), torch.tensor([EOS]))
    assert m.tolist() == [2, 3, 2]
    assert batch.pending.tolist() == [EOS, 7, 6]
    assert batch.length.tolist() == [3, 4, 6]
    assert batch.tokens[0, 1:3].tolist() == [5, EOS] and batch.tokens[2, 4:6].tolist() == [5, 6]


def test_ragged_helpers():
    a = torch.tensor([[1, 2, 3], [4, 0, 0]])
    b = torch.tensor([[7, 8], [9, 0]])
    out, n = ragged_cat(a, torch.tensor([3, 1]), b, torch.tensor([1, 1]))
    assert out.tolist() == [[1, 2, 3, 7], [4, 9, 0, 0]] and n.tolist() == [4, 2]
    ids, real = right_align(out, torch.tensor([1, 0]), n)
    assert ids.tolist() == [[2, 3, 7], [0, 4, 9]] and real.tolist() == [[True] * 3, [False, True, True]]
    got, cnt = take(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), torch.tensor([2, 0]), torch.tensor([2, 1]))
    assert got.tolist() == [[3, 4], [5, 0]] and cnt.tolist() == [2, 1]
    from transformers import DynamicCache
    target, _ = pair()
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        target(input_ids=torch.tensor([[3, 4], [5, 6]]), **cache_kw(target, cache), use_cache=True)
        twin = fork_cache(cache, torch.tensor([1, 1, 0]))
        assert twin.layers[0].keys.shape[0] == 3 and cache.layers[0].keys.shape[0] == 2
        torch.testing.assert_close(twin.layers[0].keys[2], cache.layers[0].keys[0])


# ---------------------------------------------------------------------------------------------------------------
# On the bundled trio, through the Runner (config -> sampler -> methods)


def test_trio_greedy_speculative_decoding_is_the_targets_greedy_decoding():
    from tests.trio_helpers import config, demo_items, run_method, run_trio, tokens_of
    from workers.actor.runner import Runner

    items = demo_items(8)
    gen = {"temperature": 0, "max_new_tokens": 40}
    # through a Runner built from a job config: config -> sampler -> method
    sd_runner = Runner(config(method={"name": "speculative_decoding", "gamma": 4}, generation=gen))
    prompts, sd, _ = run_method(sd_runner, items)
    _, greedy, _ = run_trio({"name": "greedy"}, items, gen)
    assert tokens_of(sd) == tokens_of(greedy)
    rates = [r.stats["acceptance_rate"] for r in sd]
    assert len(set(rates)) > 1 and all(r.stats["target_calls_per_token"] < 1.0 for r in sd), rates
    p, res = prompts[0], sd[0]
    ids = torch.tensor([p.ids])
    with torch.inference_mode():
        ref = sd_runner.engine.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                                               do_sample=False,
                                        eos_token_id=sd_runner.eos_ids, pad_token_id=sd_runner.pad_id)
    assert res.candidates[0].tokens == ref[0, len(p.ids):].tolist()


def test_trio_speculative_rejection_with_the_speculative_sampler():
    from tests.trio_helpers import config, demo_items, run_method
    from workers.actor.runner import Runner

    cfg = config(method={"name": "speculative_rejection", "n": 8, "alpha": 0.5, "schedule": "fixed",
                         "every_k_tokens": 6}, generation={"sampler": "speculative", "gamma": 3, "max_new_tokens": 32})
    runner = Runner(cfg)
    assert runner.engine.draft is not None
    _, results, meter = run_method(runner, demo_items(3))
    for res in results:
        assert any(c.finish_reason == "rejected" for c in res.candidates) and res.stats["rejection_rounds"] > 0
        assert res.stats["acceptance_rate"] > 0 and res.stats["mean_accepted_tokens"] > 1.0
    assert int(meter.forwards["draft"].sum()) > 0
