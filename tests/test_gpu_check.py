"""bench/gpu_check.py, the GPU check of one command, known to work before a GPU is lent: its `--cpu` mode runs the
same code at tiny sizes, writes its JSON after each measurement, skips what its budget leaves no time for, and its
table renders from the file (bench.figures)."""

from __future__ import annotations

import json

import pytest
import torch

from bench import figures, gpu_check


def test_the_check_runs_every_part_on_the_cpu_and_its_table_renders(tmp_path, capsys, monkeypatch):
    out = tmp_path / "gpu-check.json"
    assert gpu_check.main(["--cpu", "--json", str(out)]) == 0
    f = json.loads(out.read_text())
    assert f["mode"] == "cpu" and f["skipped"] == []
    assert [e["shape"] for e in f["versus_generate"]] == ["SmolLM2-135M part, a tiny shape",
                                                          "Llama-3.2-1B part, a tiny shape"]
    for e in f["versus_generate"]:
        assert [r["n"] for r in e["runs"]] == [4, 8]
        for r in e["runs"]:
            assert r["static"]["tokens"] == r["dynamic"]["tokens"] == r["generate"]["tokens"] == r["n"] * 8
            assert r["static"]["captures"] == 0  # nothing is captured on the CPU
    assert [e["case"] for e in f["rejection"]] == ["tiny trio",
                                                   "SmolLM2-135M part, a tiny shape + its reward model"]
    for e in f["rejection"]:
        for r in e["runs"]:
            assert r["BoN"]["reward_forwards"] > 0 and r["SR"]["decoding_steps"] > 0
            assert r["SR"]["generated_tokens"] < r["BoN"]["generated_tokens"]  # alpha 0.5 cut some
    printed = capsys.readouterr().out
    assert "engine vs generate()" in printed and "Speculative Rejection (alpha 0.5) vs Best-of-n" in printed
    monkeypatch.setattr(figures, "FIGURES", tmp_path)
    assert figures.gpu_check().startswith("No GPU figures yet: the JSON holds the `--cpu` check (cpu, float32")
    out.write_text(json.dumps({**f, "mode": "gpu", "device": "a test's device"}))  # the table a GPU run renders
    table = figures.gpu_check()
    assert table.startswith("a test's device")
    assert table.count("| SmolLM2-135M part, a tiny shape | N = ") == 4 and "| tiny trio | n = 8 | SR, alpha 0.5 |" in table


def test_a_part_past_the_budget_is_skipped_and_said(tmp_path):
    out = tmp_path / "gpu-check.json"
    assert gpu_check.main(["--cpu", "--budget-s", "0", "--parts", "smollm2,sr-tiny", "--json", str(out)]) == 0
    f = json.loads(out.read_text())
    assert f["versus_generate"] == [] and f["rejection"] == [{"case": "tiny trio", "prompts": 4, "new_tokens": 16,
                                                              "width": 16, "runs": []}]
    assert f["skipped"] == ["engine vs generate(), SmolLM2-135M shape", "SR vs Best-of-n, tiny trio, n = 4"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_the_check_says_so_and_exits_2(capsys):
    assert gpu_check.main([]) == 2
    assert "no CUDA device here; --cpu" in capsys.readouterr().err
