"""Reward scorers: batching under a token budget, the four kinds, and the lexical rule."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch

from lexical import concept_coverage, covered
from tests.metered import scored
from workers.accounting.cost import Meter
from workers.scoring.items import Scored, token_budget_batches
from workers.scoring.scorers import LexicalScorer, PythonScorer


def test_token_budget_batches_respect_the_budget():
    lengths = [5, 50, 7, 20, 20, 3, 100]
    batches = token_budget_batches(lengths, 60)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 60


def test_lexical_coverage_accepts_regular_inflections():
    assert covered("The dogs were running in the parks.", ["dog", "run", "park", "cat"]) == [True, False, True, False]
    assert covered("She makes cakes while baking", ["make", "cake", "bake"]) == [True, True, True]
    assert covered("two babies cried", ["baby", "cry"]) == [True, True]
    assert concept_coverage("a dog", ["dog", "cat"]) == 0.5
    assert concept_coverage("anything", []) == 0.0


def _item(text, concepts=None, group=0):
    return Scored(group, [{"role": "user", "content": "q"}], text, [1, 2], [3], concepts)


def test_lexical_reward_scores_and_refuses_rows_without_concepts():
    r = LexicalScorer()
    assert scored(r, [_item("a dog runs", ["dog", "run", "field"])], Meter(1)) == [pytest.approx(2 / 3)]
    with pytest.raises(ValueError, match="concepts"):
        scored(r, [_item("a dog")], Meter(1))


def test_python_reward_imports_and_checks_its_function():
    mod = types.ModuleType("winnow_test_reward")
    mod.length = lambda prompts, texts: [len(t) for t in texts]
    mod.short = lambda prompts, texts: [1.0]
    mod.nan = lambda prompts, texts: [float("nan")] * len(texts)
    sys.modules["winnow_test_reward"] = mod
    assert scored(PythonScorer("winnow_test_reward:length"), [_item("abc"), _item("hello")], Meter(1)) == [3.0, 5.0]
    with pytest.raises(RuntimeError, match="returned 1 values for 2"):
        scored(PythonScorer("winnow_test_reward:short"), [_item("a"), _item("b")], Meter(1))
    with pytest.raises(RuntimeError, match="non-finite"):
        scored(PythonScorer("winnow_test_reward:nan"), [_item("a")], Meter(1))
    with pytest.raises(ValueError, match="models.reward.function"):
        PythonScorer("winnow_test_reward:missing")


def _boom(prompts, texts):
    raise KeyError("no such rubric")


@pytest.mark.parametrize("fn, needle", [
    (_boom, "models.reward.function: winnow_test_reward2:f raised KeyError: 'no such rubric' (at "),
    (lambda prompts, texts: 0.5, "returned float 0.5; it must return a list of 2 floats"),
    (lambda prompts, texts: "0.5 0.7", "returned str '0.5 0.7'; it must return a list of 2 floats"),
    (lambda prompts, texts: {"a": 1.0, "b": 2.0}, "returned dict"),
    (lambda prompts, texts: [1.0, "high"], "returned 'high' (a str) at index 1; it must return floats"),
    (lambda prompts, texts: [1.0, None], "returned None (a NoneType) at index 1"),
    (lambda prompts, texts: [1.0, [2.0]], "returned [2.0] (a list) at index 1"),
])
def test_a_python_reward_that_raises_or_returns_the_wrong_type_is_named(fn, needle):
    """Issue 26: a python reward's failure names the function (the first line of the failed batch's error)."""
    mod = types.ModuleType("winnow_test_reward2")
    mod.f = fn
    sys.modules["winnow_test_reward2"] = mod
    with pytest.raises(RuntimeError) as err:
        scored(PythonScorer("winnow_test_reward2:f"), [_item("a"), _item("b")], Meter(1))
    assert str(err.value).startswith("models.reward.function: winnow_test_reward2:f ") and needle in str(err.value)
    assert err.value.__cause__ is None  # one cause: the first exception line a failed batch shows is this one
    mod.f = lambda prompts, texts: [True, 2]  # booleans and ints are numbers
    assert scored(PythonScorer("winnow_test_reward2:f"), [_item("a"), _item("b")], Meter(1)) == [1.0, 2.0]


def test_model_reward_renders_with_its_own_template_and_batches():
    from tests.trio_helpers import config
    from workers.actor.runner import Runner

    runner = Runner(config())
    scorer = runner.reward
    items = [_item(t, group=g) for g, t in enumerate(["the dog runs in the field .", "a cat sleeps .", "the"])]
    meter = Meter(3)
    got = scored(scorer, items, meter)
    tok = scorer.tok
    assert tok.get_vocab() != runner.tokenizer.get_vocab()  # the retokenising path is real
    for it, g in zip(items, got):
        text = tok.apply_chat_template(
            it.prompt + [{"role": "assistant", "content": it.text}], tokenize=False
        )
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.inference_mode():
            ref = scorer.model(input_ids=ids).logits[0, 0].item()
        assert g == pytest.approx(ref, abs=1e-4)
    assert meter.forwards["reward"].tolist() == [1, 1, 1]
    small = type(scorer)(scorer.model, scorer.tok, batch_tokens=64)
    meter2 = Meter(3)
    assert scored(small, items, meter2) == pytest.approx(got, abs=1e-4)
    assert int(meter2.tokens["reward"].sum()) == int(meter.tokens["reward"].sum())


def test_a_reward_input_longer_than_the_context_is_scored_on_its_end_and_counted():
    """No silent cut: the input keeps its last max_len tokens (the response's end), and each cut is counted for its
    prompt (stats.reward_inputs_truncated); inputs that fit are untouched."""
    from tests.trio_helpers import config
    from workers.actor.runner import Runner

    scorer = Runner(config()).reward
    long_text = " ".join(["the dog runs in the field ."] * 12)
    items = [_item("a cat sleeps .", group=0), _item(long_text, group=1), _item(long_text, group=1)]
    lengths = [len(scorer.encode(it)) for it in items]
    scorer.max_len = lengths[1] - 5  # shorter than the long inputs, longer than the short one
    assert lengths[0] <= scorer.max_len
    meter = Meter(2)
    got = scored(scorer, items, meter)
    assert meter.reward_inputs_truncated.tolist() == [0, 2]
    end = torch.tensor([scorer.encode(items[1])[-scorer.max_len:]])
    with torch.inference_mode():
        ref = scorer.model(input_ids=end).logits[0, 0].item()
    assert got[1] == pytest.approx(ref, abs=1e-4) and got[2] == pytest.approx(ref, abs=1e-4)


def test_rows_say_how_many_reward_inputs_were_cut_only_for_a_reward_model():
    from tests.trio_helpers import config, demo_items
    from workers.actor.runner import Runner

    model = Runner(config(method={"name": "best_of_n", "n": 2}, generation={"max_new_tokens": 8}))
    lexical = Runner(config(method={"name": "best_of_n", "n": 2}, generation={"max_new_tokens": 8},
                            models={"reward": {"kind": "lexical"}}))
    assert [r["stats"]["reward_inputs_truncated"] for r in model.run(demo_items(2))] == [0, 0]
    assert [r["stats"].get("reward_inputs_truncated") for r in lexical.run(demo_items(2))] == [None, None]


def test_logprob_reward_is_the_mean_token_logprob():
    from tests.trio_helpers import config
    from workers.actor.runner import Runner

    runner = Runner(config(models={"reward": {"kind": "logprob"}}))
    prompt = runner.encode_prompt([{"role": "user", "content": "hello"}])
    resp = runner.tokenizer("the dog runs .", add_special_tokens=False)["input_ids"]
    it = Scored(0, [{"role": "user", "content": "hello"}], "the dog runs .", prompt, resp)
    got = scored(runner.reward, [it, it], Meter(1))
    with torch.inference_mode():
        logits = runner.engine.target(torch.tensor([prompt + resp])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    ref = sum(lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(resp)) / len(resp)
    assert got[0] == pytest.approx(ref, abs=1e-4) and got[1] == pytest.approx(ref, abs=1e-4)


def test_model_reward_shares_the_prompt_prefix_and_scores_as_if_whole():
    from tests.trio_helpers import config
    from workers.actor.runner import Runner

    bundled = Runner(config()).reward
    assert bundled.shares_prefix  # the bundled reward model is causal and takes a cache
    # Its template renders the prompt first, as most reward models' do, and as this one spelled out here does.
    tok = copy.deepcopy(bundled.tok)
    tok.chat_template = (
        "[BOS]{% for m in messages %}### {{ m['role'] | capitalize }}: {{ m['content'] | upper if m['role'] != "
        "'assistant' else m['content'] | lower }}\n{% endfor %}[EOS]"
    )
    scorer = type(bundled)(bundled.model, tok, bundled.batch_tokens)
    texts = ["the dog runs in the field .", "a cat sleeps .", "the", "the dog", "a boy throws a ball to the dog ."]
    items = [
        Scored(g, [{"role": "user", "content": q}], t, [1], [2])
        for g, q in enumerate(["Write a sentence using these concepts: dog, field.", "Write about a cat."])
        for t in texts
    ]
    shared, whole = Meter(2), Meter(2)
    got = scored(scorer, items, shared)
    reference = type(scorer)(scorer.model, scorer.tok, scorer.batch_tokens)
    reference.shares_prefix = False
    want = scored(reference, items, whole)
    assert got == pytest.approx(want, abs=1e-4)
    # the shared part is encoded once per prompt and batch: fewer reward tokens, one more forward per prompt
    assert (shared.tokens["reward"] < whole.tokens["reward"]).all()
    small = type(scorer)(scorer.model, scorer.tok, batch_tokens=64)
    assert scored(small, items, Meter(2)) == pytest.approx(want, abs=1e-4)


def test_prefix_sharing_probe_refuses_a_bidirectional_reward_model():
    from transformers import BertConfig, BertForSequenceClassification

    from tests.trio_helpers import config
    from workers.scoring.reward_model import prefix_sharing_is_exact
    from workers.actor.runner import Runner

    torch.manual_seed(0)
    bert = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64, num_labels=1,
                                                    pad_token_id=0)).eval()
    assert not prefix_sharing_is_exact(bert, 0)
    bundled = Runner(config()).reward
    assert prefix_sharing_is_exact(bundled.model, bundled.pad)
