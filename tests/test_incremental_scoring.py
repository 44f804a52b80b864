"""Incremental reward scoring (workers.scoring.reward_session.CachedScoring): a session keeps each candidate's
reward-model cache
between calls and feeds only what it does not hold, with the scores of whole scoring from scratch."""

from __future__ import annotations

import copy
import os
import random
from dataclasses import replace

import pytest
import torch

from tests.metered import MeteredSession, run_method, scored
from tests.trio_helpers import demo_items, params_of, trio, trio_context, trio_prompts
from workers.accounting.cost import Meter
from workers.scoring.items import Scored
from workers.scoring.reward_model import RewardModelScorer
from workers.scoring.reward_session import CachedScoring
from workers.scoring.scorers import Rescoring

# Most reward models' templates render the prompt first, as the bundled one does (PROMPT_FIRST spells out one like
# it); a template that renders the response first (RESPONSE_FIRST, the bundled one's until issue 27) puts the whole
# prompt in its end-of-turn tail, fed again at every score, so both shapes are tried.
RESPONSE_FIRST = (
    "[BOS]{% for message in messages if message['role'] == 'assistant' %}### Assistant: {{ message['conte"
    "nt'] | lower }}\n{% endfor %}{% for message in messages if message['role'] != 'assistant' %}### {{ me"
    "ssage['role'] | capitalize }}: {{ message['content'] | upper }}\n{% endfor %}[EOS]"
)
PROMPT_FIRST = (
    "[BOS]{% for m in messages %}### {{ m['role'] | capitalize }}: {{ m['content'] | upper if m['role'] != "
    "'assistant' else m['content'] | lower }}\n{% endfor %}[EOS]"
)
WORDS = ["the", "dog", "cat", "field", "a", "student", "repair", "quietly", ".", ","]
GLUED = ["s", "d", "m", "ly"]  # appended without a space: WordPiece re-splits the last word ("cat" -> "cat ##s")
PROMPTS = ["Write a sentence using these concepts: dog, field.", "Write about a cat.", "Describe a student."]


def scorer_with(template: str | None = None, batch_tokens: int | None = 8192,
                share_prompts: bool | None = None) -> RewardModelScorer:
    """The bundled reward model with its own template, or `template` (`share_prompts`: its sessions' switch)."""
    base = trio().reward
    tok = base.tok
    if template is not None:
        tok = copy.deepcopy(tok)
        tok.chat_template = template
    return RewardModelScorer(base.model, tok, batch_tokens, share_prompts=share_prompts)


def whole_scorer(scorer: RewardModelScorer) -> RewardModelScorer:
    """The same model scoring every input whole, from scratch (no prefix sharing, no session cache)."""
    ref = RewardModelScorer(scorer.model, scorer.tok, None)
    ref.shares_prefix = ref.incremental = False
    ref.max_len = scorer.max_len
    return ref


def close(got, want):
    return all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(got, want)) and len(got) == len(want)


def test_the_bundled_reward_model_scores_incrementally():
    bundled = trio().reward
    assert bundled.shares_prefix and bundled.incremental
    assert isinstance(bundled.session(), CachedScoring)
    assert bundled.kv_bytes_per_token == 2 * 3 * 4 * 24 * 4  # measured on the probe's cache: 2 x layers x heads x dim


@pytest.mark.parametrize("template, batch_tokens, max_len, share", [
    (PROMPT_FIRST, 8192, None, False),
    (None, 8192, None, False),  # the bundled template: the prompt is in the tail that moves
    (PROMPT_FIRST, 64, 40, False),  # batches split and joined; inputs past 40 tokens cut to the context, scored whole
    (PROMPT_FIRST, 8192, None, True),  # each prompt's prefix held once, read by the shared-prefix attention
    (PROMPT_FIRST, 64, 40, True),
])
def test_incremental_scores_equal_whole_scores_over_rounds(template, batch_tokens, max_len, share, monkeypatch):
    """Candidates grow by random words over rounds (some by nothing, some by a glued piece that re-splits the last
    word); some finish and leave after their last score, some are rejected; one is rewritten so that its encoding
    does not extend the cached one; a prompt with a single candidate has no shared prefix. Every call's scores equal
    whole scoring from scratch, the session holds exactly the candidates still running, and it feeds fewer tokens.
    `share`: every prompt's prefix is held once for its candidates (`CachedScoring`'s share_prompts; by default only
    where the copies would be worth it), and the rewritten candidate's encoding changes inside it."""
    rng = random.Random(0)
    scorer = scorer_with(template, batch_tokens, share_prompts=True if share else None)
    if max_len is not None:
        scorer.max_len = max_len
    ref = whole_scorer(scorer)
    texts = {(g, c): rng.choice(WORDS) for g in range(len(PROMPTS)) for c in range(5 if g < 2 else 1)}
    meter, whole_meter = Meter(len(PROMPTS)), Meter(len(PROMPTS))
    session = MeteredSession(scorer.session(), meter)
    running = set(texts)
    for rnd in range(6):
        for key in sorted(running):
            for _ in range(rng.choice([0, 1, 2, 3])):
                texts[key] += rng.choice(GLUED) if rng.random() < 0.2 else " " + rng.choice(WORDS)
        if rnd == 3:
            texts[(0, 1)] = "quietly a cat ."  # not an extension of what the cache holds (nor of the prefix held)
        keys = sorted(running)
        final = [rng.random() < 0.15 for _ in keys]
        items = [Scored(g, [{"role": "user", "content": PROMPTS[g]}], texts[(g, c)], [1], [2]) for g, c in keys]
        got = session.score(keys, items, final)
        assert close(got, scored(ref, items, whole_meter)), (rnd, got)
        rejected = {k for k, f in zip(keys, final) if not f and rng.random() < 0.2}
        finished = {k for k, f in zip(keys, final) if f}
        session.release(sorted(rejected))  # the finished ones were marked final: they leave with this release
        running -= rejected | finished
        cut = {k for k, it in zip(keys, items) if max_len is not None and len(scorer.encode(it)) > max_len}
        assert sorted(session.held()) == sorted(running - cut)  # a cut input is scored whole and not kept
    assert meter.tokens["reward"].sum() < whole_meter.tokens["reward"].sum()


def test_an_encoding_that_does_not_extend_the_cached_one_is_fed_from_the_common_prefix():
    scorer = scorer_with(PROMPT_FIRST)
    ref = whole_scorer(scorer)
    prompt = [{"role": "user", "content": PROMPTS[0]}]
    session = MeteredSession(scorer.session(), Meter(1))
    first = Scored(0, prompt, "the dog repair the field .", [1], [2])
    session.score(["k"], [first])
    for text in ["the cat", "the cat", "the cats", "a student"]:  # shorter, unchanged, re-split, all different
        item = Scored(0, prompt, text, [1], [2])
        before = int(session.meter.tokens["reward"].sum())
        held = list(session.store.parts[0].ids[0])
        assert close(session.score(["k"], [item]), scored(ref, [item], Meter(1)))
        new = scorer.encode(item)
        common = len(os.path.commonprefix([held, new]))
        fed = int(session.meter.tokens["reward"].sum()) - before
        assert fed == (0 if held == new else len(new) - common)  # an unchanged encoding reuses its last score


def test_candidates_that_share_leading_tokens_feed_them_once():
    """Fresh candidates of one prompt feed the tokens they share once, as a radix tree (`branch_tree`): 'the dog'
    for four of them, 'repair' for three, 'the field .' for two identical ones, each candidate's last token (the
    one the head reads) in its own row. Tokens fed beyond the prompt: one per distinct leading run of tokens that
    is not a whole encoding, plus one per candidate; the scores are whole scoring's, also at the next call."""
    from workers.scoring.reward_session import branch_tree

    scorer = scorer_with(PROMPT_FIRST)
    ref = whole_scorer(scorer)
    prompt = [{"role": "user", "content": PROMPTS[0]}]
    texts = ["the dog repair the field .", "the dog repair a cat .", "the dog quietly .", "a student .",
             "the dog repair the field ."]
    items = [Scored(0, prompt, t, [1], [2]) for t in texts]
    encoded = [scorer.encode(it) for it in items]
    shared = len(os.path.commonprefix(encoded))
    branches, below = branch_tree(encoded, list(range(5)), shared, scorer.head_pad, 4)
    assert [len(encoded[b.item][b.start:b.end]) for b in branches][:1] == [2]  # 'the dog', then deeper branches
    assert max(b.level for b in branches) == 3 and below[3] == -1 and below[0] == below[4] != below[1]
    meter = Meter(1)
    session = MeteredSession(scorer.session(), meter)
    assert close(session.score(list("abcde"), items), scored(ref, items, Meter(1)))
    distinct = {tuple(e[:k]) for e in encoded for k in range(shared + 1, len(e))}
    head = len(scorer.template_head)  # encoded by the scorer, charged to no prompt
    # the two identical candidates are one input: fed once, the second a copy of the first's row
    assert int(meter.tokens["reward"].sum()) == shared - head + len(distinct) + len({tuple(e) for e in encoded})
    grown = [Scored(0, prompt, t + " a cat", [1], [2]) for t in texts]
    assert close(session.score(list("abcde"), grown), scored(ref, grown, Meter(1)))


def test_the_templates_head_is_encoded_once_by_the_scorer():
    """Every prompt's encoding starts with the template's head ('[BOS]### User:'): the scorer encodes it once, as
    it loads (charged to no prompt, so that what a prompt costs does not depend on the prompts that shared its
    session), and each prompt is fed from there, also a prompt of one candidate (no shared prefix of its own); a
    conversation whose encoding does not start with it (a system turn first) is encoded whole. The scores are whole
    scoring's."""
    scorer = scorer_with(PROMPT_FIRST)
    head = scorer.template_head
    assert scorer.tok.convert_ids_to_tokens(head) == ["[BOS]", "#", "#", "#", "User", ":"]
    ref = whole_scorer(scorer)
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[2]}]
    prompts = [[{"role": "user", "content": PROMPTS[0]}], [{"role": "user", "content": PROMPTS[1]}], system]
    items = [Scored(0, prompts[0], "the dog", [1], [2]), Scored(0, prompts[0], "a cat", [1], [2]),
             Scored(1, prompts[1], "the field", [1], [2]), Scored(2, system, "a student", [1], [2])]
    encoded = [scorer.encode(it) for it in items]
    assert encoded[3][: len(head)] != head
    meter = Meter(3)
    session = MeteredSession(scorer.session(), meter)
    assert close(session.score([0, 1, 2, 3], items), scored(ref, items, Meter(3)))
    shared = len(os.path.commonprefix(encoded[:2]))
    want = (shared - len(head)) + sum(len(e) - shared for e in encoded[:2])  # prompt 0
    want += len(encoded[2]) - len(head) + len(encoded[3])  # prompt 1 from the head, the system turn whole
    assert int(meter.tokens["reward"].sum()) == want


def test_the_prompts_of_a_call_are_seeded_in_one_forward(monkeypatch):
    """Fresh candidates of three prompts, one of which does not start with the template's head (a system turn): the
    three prompts' shared prefixes are fed in one forward (on a device where a forward costs about the same at any
    width, the forwards are what it bills), each prompt charged its own tokens, and the scores are whole scoring's."""
    scorer = scorer_with(PROMPT_FIRST)
    ref = whole_scorer(scorer)
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[2]}]
    prompts = [[{"role": "user", "content": PROMPTS[0]}], [{"role": "user", "content": PROMPTS[1]}], system]
    items = [Scored(g, prompts[g], text, [1], [2]) for g in range(3) for text in ("the dog", "a cat .")]
    sizes: list[int] = []
    forward = CachedScoring._forward
    monkeypatch.setattr(CachedScoring, "_forward", lambda self, p, enc, out, counts=None: (
        sizes.append(p.size), forward(self, p, enc, out, counts))[1])
    meter = Meter(3)
    assert close(MeteredSession(scorer.session(), meter).score(list(range(6)), items), scored(ref, items, Meter(3)))
    assert sizes[0] == 3 and 3 not in sizes[1:]  # the seeds: one row per prompt, one forward
    encoded = [scorer.encode(it) for it in items]
    head = len(scorer.template_head)
    for g in range(3):
        pair = encoded[2 * g: 2 * g + 2]
        shared = len(os.path.commonprefix(pair))
        want = shared - (head if g < 2 else 0) + sum(len(e) - shared for e in pair)
        assert int(meter.tokens["reward"][g]) == want


def test_a_bidirectional_reward_model_scores_whole():
    from transformers import BertConfig, BertForSequenceClassification

    tok = copy.deepcopy(trio().reward.tok)
    tok.chat_template = PROMPT_FIRST
    torch.manual_seed(0)
    bert = BertForSequenceClassification(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64, num_labels=1,
                                                    pad_token_id=tok.pad_token_id)).eval()
    scorer = RewardModelScorer(bert, tok, 8192)
    assert not scorer.shares_prefix and not scorer.incremental
    meter = Meter(1)
    session = MeteredSession(scorer.session(), meter)
    assert isinstance(session.session, Rescoring)
    prompt = [{"role": "user", "content": PROMPTS[0]}]
    texts = ["the dog", "the cat"]
    for _ in range(2):
        texts = [t + " a field ." for t in texts]
        items = [Scored(0, prompt, t, [1], [2]) for t in texts]
        encoded = [scorer.encode(it) for it in items]
        with torch.inference_mode():
            want = [bert(input_ids=torch.tensor([e])).logits[0, 0].item() for e in encoded]
        before = int(meter.tokens["reward"].sum())
        assert close(session.score([0, 1], items), want)
        assert int(meter.tokens["reward"].sum()) - before == sum(len(e) for e in encoded)  # whole, every call
        session.release([])


def run_sr(scorer, n: int = 16, k: int = 16, prompts: int = 8, alpha: float = 0.5):
    """Speculative Rejection on the tiny target with `scorer`: (results, reward tokens, generated tokens)."""
    method = {"name": "speculative_rejection", "n": n, "alpha": alpha, "schedule": "fixed", "every_k_tokens": k}
    ps = trio_prompts(demo_items(prompts))
    meter = Meter(len(ps))
    ctx = replace(trio_context(meter), reward=scorer)
    with torch.inference_mode():
        results = run_method(ctx, params_of(method), ps)
    generated = sum(len(c.tokens) for r in results for c in r.candidates)
    return results, int(meter.tokens["reward"].sum()), generated


def assert_same_rows(got, want):
    for a, b in zip(got, want):
        assert a.best_index == b.best_index
        assert [c.text for c in a.candidates] == [c.text for c in b.candidates]
        assert [c.finish_reason for c in a.candidates] == [c.finish_reason for c in b.candidates]
        for ca, cb in zip(a.candidates, b.candidates):
            assert (ca.reward is None) == (cb.reward is None)
            assert ca.reward is None or ca.reward == pytest.approx(cb.reward, abs=1e-4)
            assert ca.partial_rewards == pytest.approx(cb.partial_rewards, abs=1e-4)


def shared_tokenizer_reward() -> RewardModelScorer:
    """A tiny seeded reward model on the target's own tokenizer and chat template (prompt first, '<|im_end|>\\n'
    closing the turn), the common case of a reward model of the policy's family."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    runner = trio()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=runner.engine.target.config.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                      pad_token_id=runner.pad_id, max_position_embeddings=512)
    tok = copy.deepcopy(runner.tokenizer)
    if tok.pad_token_id is None:
        tok.pad_token_id = runner.pad_id
    return RewardModelScorer(LlamaForSequenceClassification(cfg).eval(), tok, 8192)


def test_sr_feeds_the_reward_model_under_1_2_tokens_per_generated_token():
    """Every 16 tokens, with a reward model on the target's tokenizer: under 1.2 reward tokens per generated token
    (each response once, plus its end-of-turn tail per score and its prompt once); whole scoring re-feeds every
    response at every decision. The rows are those of whole scoring."""
    scorer = shared_tokenizer_reward()
    assert scorer.incremental
    got, reward_tokens, generated = run_sr(scorer)
    want, whole_tokens, _ = run_sr(whole_scorer(scorer))
    assert_same_rows(got, want)
    assert reward_tokens / generated < 1.2
    assert whole_tokens / generated > 1.4


@pytest.mark.parametrize("template", [PROMPT_FIRST, None, RESPONSE_FIRST])
def test_sr_on_the_tiny_trio_gives_the_rows_of_whole_scoring_for_fewer_reward_tokens(template):
    """The bundled reward model splits words the target keeps whole (1.09 reward tokens per generated token for the
    responses alone): with a prompt-first template (its own, None) SR feeds it under 1.2 tokens per token of the
    responses as it tokenises them. A template that puts the prompt after the response feeds it again at every
    score, so the saving there is smaller. Either way the rows are those of whole scoring."""
    scorer = scorer_with(template)
    got, reward_tokens, generated = run_sr(scorer)
    want, whole_tokens, _ = run_sr(whole_scorer(scorer))
    assert_same_rows(got, want)
    assert reward_tokens < 0.9 * whole_tokens
    if template is not RESPONSE_FIRST:
        responses = sum(len(scorer.tok(c.text.lower(), add_special_tokens=False)["input_ids"])
                        for r in got for c in r.candidates)
        assert reward_tokens / responses < 1.2


def test_sr_with_alpha_zero_is_best_of_n_with_incremental_scoring():
    scorer = scorer_with(PROMPT_FIRST)
    sr, _, _ = run_sr(scorer, n=8, k=6, prompts=4, alpha=0.0)
    ps = trio_prompts(demo_items(4))
    ctx = replace(trio_context(Meter(len(ps))), reward=scorer)
    with torch.inference_mode():
        bon = run_method(ctx, params_of({"name": "best_of_n", "n": 8}), ps)
    assert any(r.stats["rejection_rounds"] > 0 for r in sr)
    for s, b in zip(sr, bon):
        assert s.best_index == b.best_index
        assert [c.tokens for c in s.candidates] == [c.tokens for c in b.candidates]
        assert [c.reward for c in s.candidates] == pytest.approx([c.reward for c in b.candidates], abs=1e-4)


def test_short_memory_splits_batches_and_keeps_caches_within_their_share_without_changing_scores(monkeypatch):
    """With no free memory no cache is kept: every call scores from the prompts (each forward one row).
    With free memory for a few candidates' caches, the caches kept stay within a quarter of it and of the session's
    own bytes, during a call as at a release: the others start from their prompt again. The scores never change."""
    import workers.scoring.reward_cache as caches
    import workers.scoring.reward_model as rewards
    import workers.scoring.reward_session as sessions

    scorer = scorer_with(PROMPT_FIRST)
    ref = whole_scorer(scorer)

    def rounds(session, after_call):
        texts = {(g, c): "the dog" for g in range(2) for c in range(4)}
        for rnd in range(3):
            texts = {k: t + " a field ." if k[1] % 2 else t + " a cat" for k, t in texts.items()}
            keys = sorted(texts)
            items = [Scored(g, [{"role": "user", "content": PROMPTS[g]}], texts[(g, c)], [1], [2]) for g, c in keys]
            assert close(session.score(keys, items), scored(ref, items, Meter(2)))
            after_call(session.cache_bytes())
            held = session.cache_bytes()
            session.release([])
            after_call(held)

    roomy = MeteredSession(scorer.session(), Meter(2))
    roomy.score([0], [Scored(0, [{"role": "user", "content": PROMPTS[0]}], "the dog a cat", [1], [2])])
    row = roomy.cache_bytes()
    for module in (rewards, sessions):  # the whole scorer's batches and the session's caches
        monkeypatch.setattr(module, "device_free_bytes", lambda device: 0)
    session = MeteredSession(scorer.session(), Meter(2))

    def nothing_kept(_):
        assert all(p.size == 1 for p in session.store.parts) and session.held() == []

    rounds(session, nothing_kept)
    free = 12 * row
    for module in (rewards, sessions):
        monkeypatch.setattr(module, "device_free_bytes", lambda device: free)
    session = MeteredSession(scorer.session(), Meter(2))

    def within_share(held):  # after a call (without its bound every candidate would be kept), then a release
        assert 0 < len(session.held()) < 8
        assert session.cache_bytes() <= (free + held) * caches.CACHE_MEMORY_FRACTION

    rounds(session, within_share)


def test_a_call_for_some_prompts_feeds_only_their_rows():
    """A decision for one prompt (continuous batching keeps a clock per prompt) takes that prompt's rows out of the
    cache they share with another's: the other rows are not fed, and both stay exact."""
    scorer = scorer_with(PROMPT_FIRST)
    ref = whole_scorer(scorer)
    meter = Meter(2)
    session = MeteredSession(scorer.session(), meter)
    texts = {(g, c): ["the dog", "a cat", "the field"][c] for g in range(2) for c in range(3)}

    def call(keys):
        items = [Scored(g, [{"role": "user", "content": PROMPTS[g]}], texts[(g, c)], [1], [2]) for g, c in keys]
        assert close(session.score(keys, items), scored(ref, items, Meter(2)))

    call(sorted(texts))
    assert len(session.store.parts) == 1
    held = {k: list(ids) for p in session.store.parts for k, ids in zip(p.keys, p.ids)}
    width = session.store.parts[0].width
    for _ in range(3):
        for c in range(3):
            texts[(0, c)] += " a field ."
        before = meter.tokens["reward"].clone()
        call([(0, c) for c in range(3)])
        assert int(meter.tokens["reward"][1]) == int(before[1])  # the other prompt fed nothing
        other = [p for p in session.store.parts if p.keys[0][0] == 1]
        assert len(other) == 1 and sorted(other[0].keys) == [(1, c) for c in range(3)]
        assert [held[k] for k in other[0].keys] == other[0].ids and other[0].width == width  # no column added
    texts[(1, 0)] += " cat"
    call(sorted(texts))


def test_one_input_one_score_whatever_cache_scored_it():
    scorer = scorer_with(PROMPT_FIRST)
    session = MeteredSession(scorer.session(), Meter(1))
    prompt = [{"role": "user", "content": PROMPTS[0]}]

    def item(text):
        return Scored(0, prompt, text, [], [])

    # key "a" holds a cache of a shorter response; "b" and "c" are new: the same text reaches all three by other
    # routes (fed on a held cache, or from the prompt's prefix in other rows)
    session.score(["a"], [item("the dog ran")])
    got = session.score(["a", "b", "c"], [item("the dog ran into the field")] * 2 + [item("a cat")])
    assert got[0] == got[1]  # exactly: a rejection cut keeps ties together
    assert close(got, scored(whole_scorer(scorer), [item("the dog ran into the field")] * 2 + [item("a cat")],
                             Meter(1)))


def test_a_long_prompt_is_held_once_for_its_candidates():
    """A prompt whose copies in its candidates' caches would pass `worth_sharing` (4 MiB: 32 candidates of a
    prompt of about 100 tokens on the bundled reward model) is held once by the session, its candidates' caches
    hold only their own columns, and the scores are whole scoring's; a candidate that comes back without a cache (its
    cache dropped) starts from the prefix held, so the prompt is not fed again; when no candidate of the prompt is
    held, neither is its prefix. A short prompt (the quickstart's) is copied, as before."""
    scorer = scorer_with(PROMPT_FIRST)
    assert scorer.shares_prompt  # the load-time probe: shared-prefix scoring gives the model's scores
    ref = whole_scorer(scorer)
    long_prompt = [{"role": "user", "content": " ".join(["write about the dog and the cat in the field ."] * 10)}]
    rng = random.Random(1)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) for _ in range(32)]
    items = [Scored(0, long_prompt, t, [1], [2]) for t in texts]
    prompt_tokens = len(os.path.commonprefix([scorer.encode(it) for it in items]))
    assert prompt_tokens >= 90
    meter = Meter(1)
    session = MeteredSession(scorer.session(), meter)
    assert close(session.score(list(range(32)), items), scored(ref, items, Meter(1)))
    assert len(session.store.prefixes) == 1 and len(next(iter(session.store.prefixes.values())).ids) == prompt_tokens
    assert all(p.width < 12 for p in session.store.parts)  # the candidates' own columns only
    fed = int(meter.tokens["reward"].sum())
    # candidate 0 comes back without its cache, candidate 1 grown: neither feeds the prompt again
    session.store.parts = [p.take([r for r, k in enumerate(p.keys) if k != 0]) for p in session.store.parts]
    grown = [Scored(0, long_prompt, texts[0] + " a cat", [1], [2]), Scored(0, long_prompt, texts[1] + " .", [1], [2])]
    assert close(session.score([0, 1], grown), scored(ref, grown, Meter(1)))
    enc0, enc1 = scorer.encode(grown[0]), scorer.encode(grown[1])
    assert int(meter.tokens["reward"].sum()) - fed == (len(enc0) - prompt_tokens) + (
        len(enc1) - len(os.path.commonprefix([enc1, scorer.encode(items[1])])))
    session.release(list(range(32)))
    assert not session.store.prefixes and not session.store.parts
    short = [Scored(0, [{"role": "user", "content": PROMPTS[0]}], t, [1], [2]) for t in texts]
    session.score(list(range(32)), short)
    assert not session.store.prefixes


def test_held_and_fresh_rows_of_a_call_share_a_forward(monkeypatch):
    """A call that scores held candidates (one prompt's second decision) and fresh ones (another prompt's first)
    feeds the held rows in the fresh rows' last forward, where both fit: one forward fewer than feeding them apart
    (on a device where a forward costs about the same at any width, what it bills). The scores are whole scoring's."""
    scorer = scorer_with(PROMPT_FIRST)
    ref = whole_scorer(scorer)
    sizes: list[int] = []
    forward = CachedScoring._forward
    monkeypatch.setattr(CachedScoring, "_forward", lambda self, p, enc, out, counts=None: (
        sizes.append(p.size), forward(self, p, enc, out, counts))[1])
    prompts = [[{"role": "user", "content": PROMPTS[g]}] for g in range(2)]
    first = [Scored(0, prompts[0], t, [1], [2]) for t in ("the dog", "a cat", "the field", "a student")]
    session = MeteredSession(scorer.session(), Meter(2))
    assert close(session.score([0, 1, 2, 3], first), scored(ref, first, Meter(2)))
    sizes.clear()
    grown = [Scored(0, prompts[0], it.text + " quietly .", [1], [2]) for it in first]
    new = [Scored(1, prompts[1], t, [1], [2]) for t in ("the cat", "a dog .", "repair the field")]
    items = grown + new
    assert close(session.score(list(range(7)), items), scored(ref, items, Meter(2)))
    assert sizes[-1] == 7 and 4 not in sizes  # the held rows went with the fresh ones' last forward
    assert sorted(session.held()) == list(range(7))
    sizes.clear()
    again = [Scored(it.group, it.prompt, it.text + " a", [1], [2]) for it in items]
    assert close(session.score(list(range(7)), again), scored(ref, again, Meter(2)))
    assert sizes == [7]  # held only: one forward


def test_candidates_alike_are_fed_once_and_go_on_apart():
    """Candidates of a prompt with the same encoding in a call (alike at a first decision, or grown alike since)
    are one input: fed once, as scoring the distinct ones alone feeds, with one score; each that goes on holds a
    copy of the cache fed, so that they grow apart with whole scoring's scores. Whole scoring scores them once too."""
    scorer = scorer_with(PROMPT_FIRST)
    ref = whole_scorer(scorer)
    prompt = [{"role": "user", "content": PROMPTS[0]}]

    def items(texts):
        return [Scored(0, prompt, t, [1], [2]) for t in texts]

    def fed(meter):
        return int(meter.tokens["reward"].sum())

    first = items(["the dog", "the dog", "a cat", "the dog"])
    meter, alone = Meter(1), Meter(1)
    session = MeteredSession(scorer.session(), meter)
    got = session.score(list("abcd"), first)
    assert close(got, scored(ref, first, Meter(1))) and got[0] == got[1] == got[3]
    MeteredSession(scorer.session(), alone).score(["a", "c"], [first[0], first[2]])
    assert fed(meter) == fed(alone)
    assert sorted(session.held()) == list("abcd")
    whole, whole_alone = Meter(1), Meter(1)
    scored(ref, first, whole)
    scored(ref, [first[0], first[2]], whole_alone)
    assert fed(whole) == fed(whole_alone)

    # a and b grew alike (held twins: fed once), d apart; c is final and leaves at the next release
    before = fed(meter)
    grown = items(["the dog repair", "the dog repair", "a cat .", "the dog quietly"])
    got = session.score(list("abcd"), grown, final=[False, False, True, False])
    assert close(got, scored(ref, grown, Meter(1))) and got[0] == got[1]
    old = [scorer.encode(it) for it in first]
    new = [scorer.encode(it) for it in grown]
    assert fed(meter) - before == sum(len(new[i]) - len(os.path.commonprefix([old[i], new[i]])) for i in (0, 2, 3))
    session.release([])
    assert sorted(session.held()) == list("abd")

    # twins go on apart, each from its own copy; a final twin is scored and not kept
    apart = items(["the dog repair the field", "the dog repair a cat", "the dog quietly"])
    assert close(session.score(list("abd"), apart), scored(ref, apart, Meter(1)))
    last = items(["the dog repair the field .", "the dog repair the field .", "the dog quietly"])
    got = session.score(list("abd"), last, final=[False, True, False])
    assert close(got, scored(ref, last, Meter(1))) and got[0] == got[1]
    session.release([])
    assert sorted(session.held()) == list("ad")


def test_a_session_without_a_cache_scores_candidates_alike_once():
    """Scorers that keep no state (a process reward, a python function, a bidirectional reward model) score a call's
    candidates alike once per prompt: the same response tokens of another prompt are another input."""
    calls: list[list[str]] = []

    def score(items):
        from workers.accounting.work import Work
        from workers.scoring.protocol import Scores

        calls.append([it.text for it in items])
        return Scores([float(len(it.text) + 10 * it.group) for it in items], Work())

    prompt = [{"role": "user", "content": PROMPTS[0]}]
    items = [Scored(0, prompt, "a", [], [1]), Scored(0, prompt, "a", [], [1]), Scored(1, prompt, "a", [], [1]),
             Scored(0, prompt, "a b", [], [1, 2])]
    assert Rescoring(score).score(list(range(4)), items).values == [1.0, 1.0, 11.0, 3.0]
    assert calls == [["a", "a", "a b"]]


def test_a_session_levels_by_the_device_and_one_level_less_feeds_no_fewer_tokens_in_fewer_forwards():
    """The radix tree's levels (`default_levels`): every level on the CPU, where tokens cost; none on an accelerator,
    where a forward costs about the same at any width. Levels 0 scores the same in fewer forwards, feeding more."""
    from workers.scoring.reward_model import default_levels
    from workers.scoring.reward_session import MAX_LEVELS

    assert default_levels(torch.device("cpu")) == MAX_LEVELS and default_levels(torch.device("cuda")) == 0
    scorer = scorer_with(PROMPT_FIRST)
    assert scorer.levels == MAX_LEVELS
    prompt = [{"role": "user", "content": PROMPTS[0]}]
    texts = ["the dog repair the field .", "the dog repair a cat .", "the dog quietly .", "a student ."]
    items = [Scored(0, prompt, t, [1], [2]) for t in texts]
    fed = {}
    for levels in (MAX_LEVELS, 0):
        meter = Meter(1)
        got = MeteredSession(CachedScoring(scorer, levels), meter).score(list("abcd"), items)
        fed[levels] = (int(meter.forwards["reward"].sum()), int(meter.tokens["reward"].sum()), got)
    assert close(fed[0][2], fed[MAX_LEVELS][2])
    assert fed[0][0] < fed[MAX_LEVELS][0] and fed[0][1] > fed[MAX_LEVELS][1], fed
