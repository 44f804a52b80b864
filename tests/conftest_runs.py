"""Hand-made run folders for the build-sft and report tests: rows in schemas.rows.ROW_SCHEMA plus a manifest.

`cand(...)`, `row(...)` build rows; `write_run(uri, rows, ...)` writes ``uri/manifest.json`` and
``uri/candidates/part-*.parquet`` through fsspec, so the same helper writes local, ``memory://`` and ``s3://`` runs.
"""

from __future__ import annotations

import io
import json
import posixpath

import fsspec
import pyarrow.parquet as pq
import pytest

from schemas.manifest import Manifest
from schemas.rows import empty_cost, error_row, rows_to_table


def cand(text: str, reward: float | None, finish: str = "eos", tokens: int = 10,
         partial: list[float] | None = None) -> dict:
    return {"text": text, "num_tokens": tokens, "reward": reward, "finish_reason": finish,
            "partial_rewards": partial or []}


def msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def row(pid: str, cands: list[dict], method: str = "best_of_n", device_seconds: float = 1.0,
        target_tokens: int | None = None, prompt: str | None = None, draft_tokens: int = 0,
        reward_tokens: int = 0) -> dict:
    """A successful row; best_* point at the highest-reward finished candidate; target_tokens default to the
    candidates' tokens."""
    scored = [(c["reward"], i) for i, c in enumerate(cands)
              if c["reward"] is not None and c["finish_reason"] != "rejected"]
    best = max(scored)[1] if scored else None
    cost = empty_cost()
    cost["device_seconds"] = device_seconds
    cost["wall_seconds"] = device_seconds
    cost["target_tokens"] = sum(c["num_tokens"] for c in cands) if target_tokens is None else target_tokens
    cost["draft_tokens"], cost["reward_tokens"] = draft_tokens, reward_tokens
    return {
        "prompt_id": pid,
        "prompt": msgs(prompt or f"question {pid}"),
        "method": method,
        "candidates": cands,
        "best_index": best,
        "best_text": None if best is None else cands[best]["text"],
        "best_reward": None if best is None else cands[best]["reward"],
        "cost": cost,
        "stats": {"generated_tokens": sum(c["num_tokens"] for c in cands)},
        "error": None,
    }


def err_row(pid: str, method: str = "best_of_n") -> dict:
    return error_row(pid, msgs(f"question {pid}"), method, "RuntimeError: out of memory")


def write_run(uri: str, rows: list[dict], name: str = "run", method: str = "best_of_n",
              usd_per_device_hour: float = 2.0, files: int = 2, method_params: dict | None = None,
              reward: dict | None = None, engine: str | None = None, parameters: dict | None = None,
              models: dict | None = None) -> str:
    """Write a run folder at `uri` (rows split over `files` Parquet files) and return `uri`; `reward` is the
    manifest's config.models.reward (default: a model reward at path `rm`), `engine` its models.engine (default:
    none, as in a run from before the field existed), `parameters` its recorded parameter counts (default: none, as
    in a run from before they were recorded), `models` more config.models keys (e.g. a draft)."""
    fs, path = fsspec.core.url_to_fs(uri)
    fs.makedirs(posixpath.join(path, "candidates"), exist_ok=True)
    chunks = [rows[i::files] for i in range(files)] if rows else []
    for i, chunk in enumerate(c for c in chunks if c):
        buf = io.BytesIO()
        pq.write_table(rows_to_table(chunk), buf)
        with fs.open(posixpath.join(path, "candidates", f"part-{i:05d}-ab12.parquet"), "wb") as f:
            f.write(buf.getvalue())
    config = {"name": name, "method": {"name": method, **(method_params or {})},
              "cost": {"usd_per_device_hour": usd_per_device_hour}, "output": {"path": uri},
              "models": {"target": "builtin:tiny-target", "reward": reward or {"kind": "model", "path": "rm"},
                         **(models or {})}}
    if engine is not None:
        config["models"]["engine"] = engine
    manifest = Manifest(
        name=name, config=config, config_hash=f"hash-{name}", winnow_version="0.1.0",
        status="succeeded", started_at="2026-01-01T00:00:00Z", finished_at="2026-01-01T01:00:00Z",
        rows=len(rows), errors=sum(r["error"] is not None for r in rows), parameters=parameters,
    )
    with fs.open(posixpath.join(path, "manifest.json"), "w") as f:
        f.write(json.dumps(manifest.model_dump(mode="json"), indent=2))
    return uri


# ---------------------------------------------------------------------------------------------------------------
# S3 through moto's local server (test dependency `moto[server]`); skipped where moto is not installed.

_MOTO: dict = {}


@pytest.fixture
def s3_endpoint(monkeypatch):
    """A moto S3 server on localhost (started once per session) with bucket `winnow-test`; AWS_* env points at it.

    Yields the endpoint URL. s3fs picks the endpoint up from AWS_ENDPOINT_URL; its instance cache is cleared before
    and after so no other test sees a filesystem bound to this server.
    """
    pytest.importorskip("moto.server", reason="moto[server] not installed (test extra)")
    s3fs = pytest.importorskip("s3fs")
    if "server" not in _MOTO:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        _MOTO["server"], _MOTO["endpoint"] = server, f"http://{host}:{port}"
    endpoint = _MOTO["endpoint"]
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    if not fs.exists("winnow-test"):
        fs.mkdir("winnow-test")
    yield endpoint
    fs.rm("winnow-test", recursive=True)
    s3fs.S3FileSystem.clear_instance_cache()


# ---------------------------------------------------------------------------------------------------------------
# A synthetic but realistic run set (for the report test and docs/report-example.png). Not real model output.


def synthetic_runs(root: str, prompts: int = 40, seed: int = 0) -> list[str]:
    """Write four synthetic runs under `root` and return their URIs: greedy, Best-of-16, Best-of-64 and
    Speculative Rejection (n = 64, alpha = 0.5, three decisions). Each prompt has a latent difficulty; a sample's
    final reward is that plus N(0, 1); its partial reward at decision d is the final reward plus noise that shrinks
    with d. Device-seconds grow with the tokens generated. The numbers are made up to exercise the report."""
    import numpy as np

    rng = np.random.default_rng(seed)
    mu = rng.normal(0.0, 1.0, prompts)
    max_new, decisions = 128, (16, 32, 64)
    seconds_per_token = 0.0009

    def sample(p: int, n: int) -> list[dict]:
        finals = mu[p] + rng.normal(0.0, 1.0, n)
        lengths = rng.integers(40, max_new + 1, n)
        out = []
        for f, length in zip(finals, lengths):
            partial = [float(f + rng.normal(0.0, 1.2 / (d + 1))) for d in range(len(decisions))
                       if decisions[d] < length]
            finish = "length" if length == max_new else "eos"
            out.append(cand(f"p{p} sample {len(out)} r={f:.3f}", float(f), finish, int(length), partial))
        return out

    def speculative_rejection(p: int, n: int, alpha: float) -> tuple[list[dict], int]:
        cands = sample(p, n)
        alive = list(range(n))
        for d, tau in enumerate(decisions):
            running = [i for i in alive if len(cands[i]["partial_rewards"]) > d]
            if len(running) < 2:
                continue
            cut = int(alpha * len(running))
            order = sorted(running, key=lambda i: cands[i]["partial_rewards"][d])
            for i in order[:cut]:
                c = cands[i]
                c.update(finish_reason="rejected", reward=None, num_tokens=tau,
                         partial_rewards=c["partial_rewards"][: d + 1])
                alive.remove(i)
        return cands, sum(c["num_tokens"] for c in cands)

    uris = []
    plans = [("greedy", "greedy", {}, 1), ("bon-16", "best_of_n", {"n": 16}, 16),
             ("bon-64", "best_of_n", {"n": 64}, 64), ("sr-64-a0.5", "speculative_rejection",
                                                     {"n": 64, "alpha": 0.5}, 64)]
    for name, method, params, n in plans:
        rows = []
        for p in range(prompts):
            if method == "speculative_rejection":
                cands, tokens = speculative_rejection(p, n, params["alpha"])
            else:
                cands = sample(p, n)
                for c in cands:
                    c["partial_rewards"] = [] if method == "greedy" else c["partial_rewards"]
                tokens = sum(c["num_tokens"] for c in cands)
            batch_overhead = 0.4 + rng.gamma(4.0, 0.02)
            rows.append(row(f"p{p:03d}", cands, method, device_seconds=batch_overhead + seconds_per_token * tokens,
                            target_tokens=tokens))
        if method == "speculative_rejection":
            rows[3] = err_row("p003", method)
        uris.append(write_run(posixpath.join(root, name), rows, name=name, method=method, method_params=params))
    return uris


# ---------------------------------------------------------------------------------------------------------------
# Hand-made runs whose cost-reward frontier is known (for the frontier tests).

FRONTIER_PRICE = 36.0  # USD per device-hour: 1 device-second = $0.01
FRONTIER_PARAMETERS = 5000  # target parameters: 100 tokens per device-second x 2 x 5000 = 1 MFLOP per device-second
FRONTIER_SPREAD = [-0.2, -0.15, -0.1, -0.05, 0.0, 0.05, 0.1, 0.15, 0.2, 0.0]  # per-prompt offsets, mean 0


def frontier_runs(root: str, seconds_scale: dict[str, float] | None = None) -> dict[str, str]:
    """Five runs over the same 10 prompts; name -> URI. Best reward of prompt i = level + FRONTIER_SPREAD[i],
    device-seconds constant per run (so USD per prompt = device-seconds x $0.01), and target tokens 100 x the
    device-seconds on a target of FRONTIER_PARAMETERS recorded in the manifest (so compute per prompt = 1 MFLOP per
    device-second, and both bases give one frontier). `seconds_scale` multiplies a run's device-seconds, not its
    tokens: a repeat of the same runs on a busier or quieter machine.

    | run       | level | device-s | verdict                                                                  |
    |-----------|-------|----------|--------------------------------------------------------------------------|
    | bon       | 1.0   | 2        | the baseline; frontier point 2                                           |
    | cheap-low | 0.4   | 1        | frontier point 1 (cheapest), below the baseline, outside its interval    |
    | dominated | 0.5   | 3        | dominated by bon only (cheap-low has less reward), below the baseline    |
    | tie-a     | 2.0   | 4        | frontier point 3                                                         |
    | tie-b     | 2.01  | 5        | frontier point 4; tie-a and tie-b are within each other's intervals      |

    The baseline's candidates per prompt are its best and one 1.0 below it, so its single-sample reward is 0.5.
    """
    levels = {"bon": (1.0, 2.0), "cheap-low": (0.4, 1.0), "dominated": (0.5, 3.0), "tie-a": (2.0, 4.0),
              "tie-b": (2.01, 5.0)}
    out = {}
    for name, (level, seconds) in levels.items():
        rows = []
        for i, d in enumerate(FRONTIER_SPREAD):
            best = level + d
            cands = [cand(f"{name} p{i} best", best), cand(f"{name} p{i} other", best - 1.0)]
            rows.append(row(f"p{i:02d}", cands, device_seconds=seconds * (seconds_scale or {}).get(name, 1.0),
                            target_tokens=int(100 * seconds)))
        out[name] = write_run(posixpath.join(root, name), rows, name=name, usd_per_device_hour=FRONTIER_PRICE,
                              parameters={"target": FRONTIER_PARAMETERS})
    return out
