"""Python rewards for the bad-input tests (`models.reward.function: reward_fixtures:NAME`)."""

from __future__ import annotations


async def async_score(prompts, texts):
    """An async reward: refused before the run (the reward is called synchronously)."""
    return [0.0 for _ in texts]


class AsyncScorer:
    async def __call__(self, prompts, texts):
        return [0.0 for _ in texts]


async_object = AsyncScorer()
