"""Beam search, batched across prompts, against transformers' own beam search on the same model."""

from __future__ import annotations

import pytest
import torch

from tests.test_speculative import (  # noqa: F401  (one_thread is an autouse fixture)
    EOS, PAD, greedy_reference, one_thread, pair, run, toy_context, toy_prompts,
)


def hf_beam(model, prompt: list[int], num_beams: int, length_penalty: float, limit: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=num_beams, do_sample=False,
                             length_penalty=length_penalty, max_new_tokens=limit, eos_token_id=EOS,
                             pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("num_beams,length_penalty", [(3, 1.0), (4, 0.0), (2, 2.0)])
def test_beam_search_matches_transformers(num_beams, length_penalty):
    target, _ = pair(sharpness=1.5)
    prompts = toy_prompts(5, 48, 12, seed=31)
    method = {"name": "beam", "num_beams": num_beams, "length_penalty": length_penalty}
    results = run(method, toy_context(target, None, num_prompts=5), prompts)
    for p, res in zip(prompts, results):
        assert res.candidates[0].tokens == hf_beam(target, p.ids, num_beams, length_penalty, 12)


def test_one_beam_is_greedy_decoding_and_more_beams_search_wider():
    target, _ = pair(sharpness=1.5)
    prompts = toy_prompts(4, 48, 10, seed=32)
    one = run({"name": "beam", "num_beams": 1, "length_penalty": 0.0}, toy_context(target, None, num_prompts=4),
              prompts)
    wide = run({"name": "beam", "num_beams": 4, "length_penalty": 0.0}, toy_context(target, None, num_prompts=4),
               prompts)
    for p, a in zip(prompts, one):
        assert a.candidates[0].tokens == greedy_reference(target, p.ids, 10)
    assert any(a.candidates[0].tokens != b.candidates[0].tokens for a, b in zip(one, wide))
