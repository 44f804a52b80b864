"""The Ray Data UDF that each actor of the pool runs: it loads the trio once and turns prompts into output rows.

One input row (`pipeline.prompts.INPUT_SCHEMA`) gives exactly one output row (`schemas.rows.ROW_SCHEMA`), in order.
A row whose `input_error` is set becomes an error row without reaching the engine; the others go to
`workers.runner.Runner.run`, which marks prompts it cannot run (longer than the context) as error rows and raises
when the engine itself fails, so the batch, and with it the job, fails loudly.
"""

from __future__ import annotations

import pyarrow as pa

from schemas.config import validate_config
from schemas.rows import error_row, rows_to_table


class GenerateBatch:
    """`map_batches` callable class: ``GenerateBatch(config_dict)(batch) -> batch``."""

    def __init__(self, config: dict):
        from workers.runner import Runner

        self.config = validate_config(config)
        self.method = self.config.method.name
        reward = self.config.models.reward
        self.with_concepts = reward is not None and reward.kind == "lexical"
        self.runner = Runner(self.config)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        out: list[dict | None] = [None] * len(rows)
        todo: list[int] = []
        for i, row in enumerate(rows):
            if row["input_error"] is not None:
                out[i] = error_row(row["prompt_id"], row["prompt"], self.method, row["input_error"])
            else:
                todo.append(i)
        if todo:
            inputs = []
            for i in todo:
                item = {"prompt_id": rows[i]["prompt_id"], "prompt": rows[i]["prompt"]}
                if self.with_concepts:
                    item["concepts"] = rows[i]["concepts"]
                inputs.append(item)
            results = self.runner.run(inputs)
            got = [r.get("prompt_id") if isinstance(r, dict) else None for r in results]
            want = [x["prompt_id"] for x in inputs]
            if got != want:
                raise RuntimeError(
                    f"workers.runner.Runner.run broke its contract: it returned rows for {got} given {want}"
                )
            for i, result in zip(todo, results):
                out[i] = result
        return rows_to_table(out)
