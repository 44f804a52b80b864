"""The benches run end to end on tiny arguments (their figures are measured by hand; see docs/benchmarks.md)."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.slow


def test_bon_sr_bench_prints_and_records_its_figures(tmp_path, capsys):
    from bench import bon_sr

    out = tmp_path / "bon_sr.json"
    assert bon_sr.main(["--prompts", "4", "--repeats", "1", "--ns", "4", "--bon-ns", "1,2,4", "--nmin", "2",
                        "--sr", "4:0.5,4:0.5:2,4:0.5:mem1", "--seeds", "0", "--max-new-tokens", "12", "--json",
                        str(out)]) == 0
    printed = capsys.readouterr().out
    assert "model.generate" in printed and "Speculative Rejection vs Best-of-N" in printed
    report = json.loads(out.read_text())
    for row in report["throughput"].values():
        assert row["ours_tokens"] > 0 and row["generate_tokens"] > 0 and row["ratio"] > 0
    rows = report["sr"]["rows"]
    assert rows["Best-of-2"]["improvement_score"] == pytest.approx(100.0)  # the baseline against itself
    assert rows["Best-of-2"]["relative_compute"] == pytest.approx(1.0)
    assert rows["Best-of-1"]["tokens"] < rows["Best-of-4"]["tokens"]
    sr = rows["SR n=4 alpha=0.5, every 2 tokens"]
    assert sr["rounds"] > 0 and sr["tokens"] < rows["Best-of-4"]["tokens"]
    assert rows["SR n=4 alpha=0.5, memory, Best-of-1's space"]["rounds"] > 0
    assert "SR n=4 alpha=0.5 (minimal config: memory, Best-of-1's space)" in rows


def test_draft_target_bench_prints_and_records_its_figures(tmp_path, capsys):
    from bench import draft_target

    out = tmp_path / "draft_target.json"
    assert draft_target.main(["--first", "0", "--prompts", "2", "--repeats", "1", "--max-new-tokens", "8",
                              "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Speculative decoding vs the target's greedy decoding" in printed
    report = json.loads(out.read_text())
    assert report["c"] > 0
    assert set(report) >= {"sd", "mjsd", "cdsl", "sr"}


@pytest.mark.slow
def test_real_model_bench_prints_paper_001s_table_2(tmp_path, capsys):
    from assets import smollm2
    from bench import real_model

    if smollm2.unavailable() is not None:
        pytest.skip(smollm2.unavailable())
    out = tmp_path / "real.json"
    assert real_model.main(["--engines", "hf", "--prompts", "2", "--per-call", "2", "--max-new-tokens", "8",
                            "--bon", "2", "4", "--sr", "4", "--every", "4", "--skip-lexical", "--generate", "2",
                            "--generate-prompts", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Paper 001's Table 2 on SmolLM2-135M-Instruct" in printed and "generate(num_return_sequences=N)" in printed
    rows = json.loads(out.read_text())["hf logprob"]
    assert rows["Best-of-4"]["speedup_cpu"] == pytest.approx(1.0) and rows["Best-of-4"]["speedup_tokens"] == 1.0
    for label, r in rows.items():
        assert r["perplexity"] == pytest.approx(math.exp(-r["mean_best_reward"])) and r["reward_tokens"] == 0


def test_gpu_bench_runs_its_own_code_on_the_cpu(tmp_path, capsys):
    """`bench.gpu` measures on a CUDA device; `--device cpu --small` runs the same code, as a check of the bench."""
    from bench import gpu

    out = tmp_path / "gpu.json"
    assert gpu.main(["--device", "cpu", "--dtype", "float32", "--small", "--ns", "4", "--new-tokens", "8",
                     "--prompt-tokens", "8", "--repeats", "1", "--profile", "--cudnn-ab", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "## profile: engine, N=4" in printed and "## profile: generate, N=4" in printed
    report = json.loads(out.read_text())
    (versus,), (rejection,) = report["versus_generate"], report["rejection"]
    assert versus["engine"]["tokens"] == versus["generate"]["tokens"] == 4 * 8  # random weights: every row to 8
    assert rejection["sr"]["rounds"] > 0 and rejection["sr"]["tokens"] < rejection["bon"]["tokens"]
    assert [r["cudnn"] for r in report["cudnn_ab"]] == [True, False] * 3


def test_bill_matches_speculative_rejection_against_best_of_k_from_every_subset():
    """bench.bill's Best-of-k reward is the mean over every k-subset of a Best-of-n run's candidates (checked by
    enumeration), the N matched to a reward lies between whole k, and Best-of-N's costs are linear in N."""
    import itertools
    import random

    from bench.bill import best_of_k, cost_at, matched_n

    rng = random.Random(0)
    rows = [{"candidates": [{"reward": rng.random()} for _ in range(6)]} for _ in range(3)]
    for k in range(1, 7):
        want = sum(sum(max(c["reward"] for c in subset) for subset in itertools.combinations(r["candidates"], k))
                   / math.comb(6, k) for r in rows) / len(rows)
        assert best_of_k(rows, k) == pytest.approx(want)
    assert best_of_k(rows, 6) == pytest.approx(sum(max(c["reward"] for c in r["candidates"]) for r in rows) / 3)
    curve = [best_of_k(rows, k) for k in range(1, 7)]
    assert matched_n(curve, (curve[2] + curve[3]) / 2) == pytest.approx(3.5)
    assert matched_n(curve, curve[5] + 1) == 6 and matched_n(curve, curve[0] - 1) == 1
    assert cost_at([8, 16, 32], [200, 400, 800], 24) == pytest.approx(600)
    assert cost_at([8, 16, 32], [200, 400, 800], 4) == pytest.approx(100)  # below the runs: the first segment's line


def test_bill_measures_a_prms_sessions_against_scoring_it_whole(tmp_path, capsys):
    """bench.bill's PRM case, its sessions against every decision scored whole: both ways in separate runs (filed
    as CASE and CASE@whole) and alternating on one runner (CASE@ab), the same rows for fewer PRM tokens."""
    from bench import bill

    out = tmp_path / "bill.json"
    args = ["--cases", "tiny-prm", "--ns", "8", "--prompts", "4", "--new-tokens", "16", "--json", str(out)]
    for session in ("cached", "whole", "ab"):
        assert bill.main(args + ["--reward-session", session]) == 0
    assert "same rows: True" in capsys.readouterr().out
    cases = json.loads(out.read_text())["cases"]
    cached, whole, ab = (cases[f"tiny-prm{s} hf n=8"] for s in ("", "@whole", "@ab"))
    for side in ("BoN-8", "SR-8"):
        assert cached[side]["generated_tokens"] == whole[side]["generated_tokens"]
        assert 0 < cached[side]["reward_tokens"] < whole[side]["reward_tokens"]
    assert ab["same_rows"] and ab["cached"]["reward_tokens"] == cached["SR-8"]["reward_tokens"]
    assert ab["whole"]["reward_tokens"] == whole["SR-8"]["reward_tokens"]
    assert ab["cached / whole"]["reward_tokens"] < 0.5
