"""A process reward model as the reward (`models.reward.kind: process`, workers/scoring/process_reward.py) on the hf
engine: steps, tags, scores against transformers' own sequence-classification head, the refusals, and Speculative
Rejection with the PRM as its partial reward. The PRM is the tiny reward's backbone under a two-label head drawn from
a seed, with a `<step>` special token added (`assets.smollm2.build_seeded_reward`): its scores mean nothing."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import job_config, winnow, write_config
from trio_helpers import config, demo_items
from transformers import AutoModelForSequenceClassification

import assets
from assets import smollm2
from pipeline.preflight import model_spec_problems
from stores.model_folders import PROCESS_REWARD
from tests.metered import MeteredSession, scored
from workers.accounting.cost import Meter
from workers.actor.runner import Runner
from workers.loading import load_process_reward_model
from workers.scoring import reward_model
from workers.scoring.items import Scored, reward_input
from workers.scoring.process_reward import ProcessRewardScorer, Steps

TAG = "<step>"
PROMPT = [{"role": "user", "content": "write a story about a dog"}]
TEXTS = ["once upon a time\n\nthere was a dog", "once upon a time", "", "the dog ran\n\n\n\nhome fast\n\n",
         "a dog\n\nsat\n\nand then the dog ran home"]


@pytest.fixture(scope="module")
def prm(tmp_path_factory):
    out = tmp_path_factory.mktemp("prm") / "tiny-prm"
    return smollm2.build_seeded_reward(out, assets.builtin_path("tiny-reward"), seed=1, num_labels=2, step_tag=TAG)


@pytest.fixture(scope="module")
def loaded(prm):
    return load_process_reward_model(str(prm), "models.reward.path", torch.device("cpu"), "float32", False)


def scorer(loaded, **steps) -> ProcessRewardScorer:
    rule = Steps(**{"separator": "\n\n", "tag": TAG, "label": 1, "aggregate": "min", **steps})
    return ProcessRewardScorer(loaded.model, loaded.tokenizer, rule, batch_tokens=8192)


def items(texts: list[str]) -> list[Scored]:
    return [Scored(0, PROMPT, t, [], []) for t in texts]


def test_a_response_becomes_its_steps_each_followed_by_the_tag():
    rule = Steps("\n\n", TAG, 1, "min")
    assert rule.split("a\n\n b \n\n\n\nc\n\n") == ["a", "b", "c"]
    assert rule.tagged("a\n\nb") == f"a{TAG}b{TAG}"
    assert rule.tagged("") == TAG  # no text: one empty step
    assert rule.tagged("only one step") == f"only one step{TAG}"


@pytest.fixture(scope="module")
def oracle(prm, loaded):
    """Each step's score from transformers' own sequence-classification head: the model's pooled logits of the input
    cut right after that step's tag (a causal model: the tag's logits do not see what follows)."""
    model = AutoModelForSequenceClassification.from_pretrained(prm, dtype=torch.float32).eval()
    rule = Steps("\n\n", TAG, 1, "min")
    tag = loaded.tokenizer.convert_tokens_to_ids(TAG)
    out = []
    for it in items(TEXTS):
        ids = reward_input(loaded.tokenizer, it, rule.tagged(it.text))
        at = [i for i, t in enumerate(ids) if t == tag]
        assert len(at) == len(rule.split(it.text))
        with torch.inference_mode():
            out.append([model(torch.tensor([ids[: i + 1]])).logits[0].softmax(-1).tolist() for i in at])
    return out


@pytest.mark.parametrize("aggregate, label, of", [
    ("min", 1, min), ("last", 1, lambda xs: xs[-1]), ("mean", 1, lambda xs: sum(xs) / len(xs)),
    ("product", 1, math.prod), ("min", 0, min)])
def test_each_step_is_scored_at_its_tag_as_the_sequence_head_scores_it_and_the_steps_aggregate(
        loaded, oracle, aggregate, label, of):
    meter = Meter(1)
    got = scored(scorer(loaded, aggregate=aggregate, label=label), items(TEXTS), meter)
    want = [of([p[label] for p in steps]) for steps in oracle]
    assert all(abs(a - b) <= 1e-5 for a, b in zip(got, want)) and len(got) == len(want), (got, want)
    assert len(set(round(x, 6) for x in got)) >= 3  # a random head, different texts: not trivially true
    assert int(meter.tokens["reward"].sum()) > 0


def test_a_one_label_head_gives_the_sigmoid_of_its_logit(tmp_path, loaded):
    one = smollm2.build_seeded_reward(tmp_path / "one", assets.builtin_path("tiny-reward"), seed=2, num_labels=1,
                                      step_tag=TAG)
    model = load_process_reward_model(str(one), "models.reward.path", torch.device("cpu"), "float32", False)
    got = scored(ProcessRewardScorer(model.model, model.tokenizer, Steps("\n\n", TAG, 0, "last"), 8192),
                 items(TEXTS[:1]), Meter(1))
    ids = reward_input(model.tokenizer, items(TEXTS[:1])[0], Steps("\n\n", TAG, 0, "last").tagged(TEXTS[0]))
    last_tag = max(i for i, t in enumerate(ids) if t == model.tokenizer.convert_tokens_to_ids(TAG))
    with torch.inference_mode():  # the sequence head over the input cut after the last step's tag
        want = float(model.model(torch.tensor([ids[: last_tag + 1]])).logits[0, 0].sigmoid())
    assert abs(got[0] - want) <= 1e-6


def test_a_tag_that_is_not_one_token_or_is_the_unknown_token_or_a_label_past_the_head_is_refused(loaded):
    with pytest.raises(ValueError, match=r"models.reward.step_tag: '<st ep>' is \d+ tokens"):
        scorer(loaded, tag="<st ep>")
    with pytest.raises(ValueError, match=r"models.reward.step_tag: .* is the unknown token"):
        scorer(loaded, tag="ки")
    with pytest.raises(ValueError, match=r"models.reward.step_tag: 'dog' does not stay one token after a step"):
        scorer(loaded, tag="dog")  # one word on its own, but glued to the step's last word it is another
    with pytest.raises(ValueError, match=r"models.reward.label: 2 is no label of the process reward model, which "
                                         r"has 2 \(0 to 1\)"):
        scorer(loaded, label=2)


def test_a_causal_lm_is_no_process_reward_model_and_a_sequence_classifier_is_one(prm):
    problems = model_spec_problems("builtin:tiny-target", "models.reward.path", PROCESS_REWARD)
    assert any("a process reward model needs a token classifier" in p for p in problems), problems
    assert model_spec_problems(str(prm), "models.reward.path", PROCESS_REWARD) == []


def sr(prm, **over):
    return config(models={"reward": {"kind": "process", "path": str(prm), "step_tag": TAG, **over}},
                  method={"name": "speculative_rejection", "n": 8, "alpha": 0.5, "schedule": "fixed",
                          "every_k_tokens": 4},
                  generation={"max_new_tokens": 16, "temperature": 1.0})


def test_speculative_rejection_rejects_on_the_prms_partial_rewards(prm, loaded):
    rows = Runner(sr(prm)).run(demo_items(2))
    rule = Steps("\n\n", TAG, 1, "min")
    for i, (row, item) in enumerate(zip(rows, demo_items(2))):
        assert row["error"] is None, row["error"]
        assert row["stats"]["rejection_rounds"] > 0
        assert any(c["finish_reason"] == "rejected" for c in row["candidates"])
        assert all(0.0 <= p <= 1.0 for c in row["candidates"] for p in c["partial_rewards"])
        assert any(c["partial_rewards"] for c in row["candidates"])
        # the answer's reward is the PRM's score of its text, as a fresh scorer gives it
        want = scored(ProcessRewardScorer(loaded.model, loaded.tokenizer, rule, 8192),
                      [Scored(0, item["prompt"], row["best_text"], [], [])], Meter(1))[0]
        assert abs(row["best_reward"] - want) <= 1e-5
        assert row["cost"]["reward_tokens"] > 0


@pytest.mark.parametrize("aggregate", ["min", "last", "product"])
def test_a_session_feeds_only_what_is_new_and_scores_as_whole_scoring(loaded, aggregate):
    """A causal PRM scores incrementally: across calls its candidates grow (an unfinished step longer, new steps),
    some alike, some final or gone, and the session's rewards are whole scoring's while it feeds a fraction of its
    tokens: each step's tag keeps the score it had."""
    rule = scorer(loaded, aggregate=aggregate)
    assert rule.incremental and not rule.shares_prefix  # whole scoring reads each input in full
    words = "once upon a time there was a dog who ran home fast and sat".split()
    rng = __import__("random").Random(0)
    texts = {(g, c): "" for g in range(2) for c in range(5)}
    session_meter, whole = Meter(2), Meter(2)
    session = MeteredSession(rule.session(), session_meter)
    for call in range(7):
        if call:
            for k in list(texts):
                texts[k] += rng.choice([" ", " ", "\n\n"]) + rng.choice(words)
            texts[(1, 0)] = texts[(1, 1)]  # twins: alike from here on
        keys = sorted(texts)
        final = [call == 6 or (call == 3 and k == (0, 4)) for k in keys]
        it = [Scored(g, [{"role": "user", "content": f"a story {g}"}], texts[(g, c)], [], []) for g, c in keys]
        got, want = session.score(keys, it, final), scored(rule, it, whole)
        assert all(abs(a - b) <= 1e-6 for a, b in zip(got, want)), (call, got, want)
        session.release([k for k, f in zip(keys, final) if f])
        texts = {k: t for k, t, f in zip(keys, [texts[k] for k in keys], final) if not f}
    assert len(set(round(x, 6) for x in want)) >= 3
    assert 0 < session_meter.tokens["reward"].sum() < whole.tokens["reward"].sum() / 3, (
        session_meter.tokens["reward"].sum(), whole.tokens["reward"].sum())


def test_speculative_rejection_with_a_prm_decides_as_whole_scoring_would(prm, monkeypatch):
    """Speculative Rejection's rows with the PRM's sessions are those of a PRM scored whole at every decision (a
    model whose probe fails), for fewer PRM tokens."""
    rows = Runner(sr(prm)).run(demo_items(3))
    monkeypatch.setattr(reward_model, "incremental_is_exact", lambda scorer, share=False: False)
    whole = Runner(sr(prm)).run(demo_items(3))
    for a, b in zip(rows, whole):
        assert [(c["text"], c["finish_reason"]) for c in a["candidates"]] == \
            [(c["text"], c["finish_reason"]) for c in b["candidates"]]
        assert a["best_reward"] == pytest.approx(b["best_reward"], abs=1e-6)
        assert [p for c in a["candidates"] for p in c["partial_rewards"]] == pytest.approx(
            [p for c in b["candidates"] for p in c["partial_rewards"]], abs=1e-6)
    fed, again = (sum(r["cost"]["reward_tokens"] for r in x) for x in (rows, whole))
    assert fed < again / 2, (fed, again)


def test_a_process_reward_counts_its_cut_inputs_and_its_rows_carry_the_count(prm, loaded):
    """Issue 30: a PRM cuts an input longer than its context to its end and counts the cut, and its rows carry
    stats.reward_inputs_truncated (it was written for the plain reward model only)."""
    meter = Meter(2)
    scored(scorer(loaded), items(["the dog ran home"]) + [Scored(1, PROMPT, " ".join(["the dog ran home"] * 80), [],
                                                                      [])], meter)
    assert meter.reward_inputs_truncated.tolist() == [0, 1]
    rows = Runner(sr(prm)).run(demo_items(2))
    assert [r["stats"]["reward_inputs_truncated"] for r in rows] == [0, 0]


def test_the_same_config_gives_the_same_rows(prm):
    runner = Runner(sr(prm, aggregate="mean"))
    first = runner.run(demo_items(2))
    second = Runner(sr(prm, aggregate="mean"), share=runner).run(demo_items(2))
    strip = [{k: v for k, v in r.items() if k != "cost"} for r in first]
    assert strip == [{k: v for k, v in r.items() if k != "cost"} for r in second]


def test_winnow_validate_names_a_process_reward_without_its_step_tag(tmp_path, prm):
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path, models={
        "target": "builtin:tiny-target", "reward": {"kind": "process", "path": str(prm)}}))
    done = winnow("validate", str(cfg))
    assert done.returncode == 2, done.stderr
    assert "models.reward.step_tag: required field is missing" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_process_reward_is_a_reward_definition_of_its_own_with_its_model_counted():
    from types import SimpleNamespace

    from runfolder.parameters import model_specs
    from runfolder.runs import reward_definition

    reward = {"kind": "process", "path": "/m/prm", "step_tag": TAG, "aggregate": "min", "label": 1,
              "step_separator": "\n\n"}

    def definition(**over):
        return reward_definition(SimpleNamespace(manifest=SimpleNamespace(config={
            "models": {"target": "t", "reward": {**reward, **over}}})))

    assert definition().kind == "process" and "`/m/prm`" in definition().text
    assert definition() == definition()
    assert definition(aggregate="mean") != definition()  # another aggregate: another scale, never ranked together
    assert definition(step_tag="<s>") != definition()
    assert model_specs({"target": "t", "reward": reward})["reward"] == "/m/prm"


@pytest.mark.slow
def test_winnow_generate_with_a_process_reward(tmp_path, prm):
    """The job as a user runs it, on a local Ray: Speculative Rejection with the PRM; every answer's reward is a
    probability, and the manifest counts the PRM's parameters for the cost basis."""
    import json

    import pyarrow.dataset as pads

    cfg = write_config(tmp_path / "job.yaml", job_config(
        tmp_path, data={"source": "builtin:demo-prompts", "prompt_column": "prompt", "id_column": "id", "limit": 2},
        models={"target": "builtin:tiny-target", "reward": {"kind": "process", "path": str(prm), "step_tag": TAG}},
        method={"name": "speculative_rejection", "n": 8}))
    done = winnow("generate", str(cfg))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = pads.dataset(str(tmp_path / "run" / "candidates")).to_table().to_pylist()
    assert len(rows) == 2 and all(r["error"] is None and 0.0 <= r["best_reward"] <= 1.0 for r in rows)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["parameters"]["reward"] > 0


@pytest.mark.parametrize("reward, message", [
    ({"step_tag": "<st ep>"}, "models.reward.step_tag: '<st ep>' is 4 tokens of the process reward model's tokenizer"),
    ({"step_tag": TAG, "label": 5}, "models.reward.label: 5 is no label of the process reward model, which has 2"),
])
def test_a_step_tag_or_label_the_prm_cannot_take_is_refused_before_anything_is_written(tmp_path, prm, reward,
                                                                                        message):
    cfg = write_config(tmp_path / "job.yaml", job_config(tmp_path, models={
        "target": "builtin:tiny-target", "reward": {"kind": "process", "path": str(prm), **reward}}))
    done = winnow("generate", str(cfg))
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()
