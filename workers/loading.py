"""Loading the draft/target/reward trio from local folders and s3:// prefixes (copied to a local cache once)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from stores.model_folders import CAUSAL_LM, PROCESS_REWARD, REWARD, model_folder_problem


class ModelPathError(ValueError):
    """A model path that does not resolve to a Hugging Face folder; the message names the field and path."""


def local_model_folder(location: str, field: str, role: str | None = None) -> Path:
    """A checked model folder on this machine: a local path as given, an s3:// (or other fsspec) prefix copied to a
    local cache first, and checked for `role` (stores.model_folders). `field` names the config field (e.g.
    "models.target") in error messages. `builtin:` names are resolved by the driver before a config reaches the
    workers (`pipeline.preflight.resolved`)."""
    if location.startswith("builtin:"):
        raise ModelPathError(f"{field}: {location} is a bundled asset's name; resolve the config first "
                             "(pipeline.preflight.resolved), as the job driver does before a worker sees it")
    if "://" in location and not location.startswith("file://"):
        path = _fetch_s3(location, field)
    else:
        path = Path(location.removeprefix("file://")).expanduser()
    problem = model_folder_problem(str(path), field, shown=location, role=role)
    if problem:
        raise ModelPathError(problem)
    return path


def _fetch_s3(uri: str, field: str) -> Path:
    """Copy an s3:// prefix to a local cache folder once (keyed by the URI) and return the folder."""
    import fsspec

    root = Path(os.environ.get("WINNOW_CACHE", Path.home() / ".cache" / "winnow")) / "s3"
    dest = root / hashlib.sha256(uri.encode()).hexdigest()[:16]
    done = dest / ".complete"
    if done.exists():
        return dest
    fs, _, (remote,) = fsspec.get_fs_token_paths(uri)
    if not fs.exists(remote):
        raise ModelPathError(f"{field}: {uri} does not exist")
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    fs.get(remote.rstrip("/") + "/", str(tmp), recursive=True)
    tmp.rename(dest) if not dest.exists() else None
    done.write_text(uri)
    return dest


def pick_device(gpus_per_worker: float) -> torch.device:
    if gpus_per_worker > 0:
        if not torch.cuda.is_available():
            raise RuntimeError("resources.gpus_per_worker > 0 but this worker sees no CUDA device")
        without_cudnn_attention()
        return torch.device("cuda")
    return torch.device("cpu")


def without_cudnn_attention() -> None:
    """Turn off PyTorch's cuDNN backend of scaled_dot_product_attention in this process (the actor's): the engine's
    decoding steps and the reward model's decisions call attention at a new key length each time, and cuDNN builds
    an execution plan for every new shape. On an H100 (torch 2.11) a decoding step's attention took about 2 ms of
    host time per layer that way (`python -m bench.gpu --profile`); the flash and memory-efficient kernels that
    remain need no plan. `python -m bench.gpu --cudnn-ab` measures the difference."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def pick_dtype(setting: str, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    """`models.dtype` to a torch dtype. auto: float32 on CPU; on GPU the checkpoint's 16-bit dtype, else bf16
    where supported, else fp16."""
    if setting != "auto":
        return getattr(torch, setting)
    if device.type != "cuda":
        return torch.float32
    if checkpoint_dtype in (torch.bfloat16, torch.float16):
        return checkpoint_dtype
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def checkpoint_dtype(path: Path) -> torch.dtype | None:
    """The dtype a checkpoint's config.json names (dtype, torch_dtype, or its text config's), or None."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    name = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype")
    return getattr(torch, name, None) if isinstance(name, str) else None


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    path: Path


def load_causal_lm(spec: str, field: str, device: torch.device, dtype_setting: str, trust_remote_code: bool) -> Loaded:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = local_model_folder(spec, field, CAUSAL_LM)
    dtype = pick_dtype(dtype_setting, device, checkpoint_dtype(path))
    with remote_code_guard(field, trust_remote_code):
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    model.to(device).eval()
    return Loaded(model, tok, path)


def reward_folder(spec: str, field: str, trust_remote_code: bool, role: str = REWARD) -> tuple[Path, object, object]:
    """A reward model's local folder, tokenizer and config, checked as both reward engines need them: for a `model`
    reward one label (the scalar logit is the reward; a `process` reward, role PROCESS_REWARD, may have any), and a
    pad token (the EOS token when the tokenizer has none)."""
    from transformers import AutoConfig, AutoTokenizer

    path = local_model_folder(spec, field, role)
    with remote_code_guard(field, trust_remote_code):
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if role == REWARD and getattr(config, "num_labels", 1) != 1:
        raise ModelPathError(f"{field}: reward model must have num_labels = 1, got {config.num_labels}")
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ModelPathError(f"{field}: reward tokenizer has neither a pad nor an EOS token")
        tok.pad_token = tok.eos_token
    return path, tok, config


def load_reward_model(spec: str, field: str, device: torch.device, dtype_setting: str, trust_remote_code: bool) -> Loaded:
    from transformers import AutoModelForSequenceClassification

    path, tok, _ = reward_folder(spec, field, trust_remote_code)
    dtype = pick_dtype(dtype_setting, device, checkpoint_dtype(path))
    with remote_code_guard(field, trust_remote_code):
        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code
        )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    model.to(device).eval()
    return Loaded(model, tok, path)


def load_process_reward_model(spec: str, field: str, device: torch.device, dtype_setting: str,
                              trust_remote_code: bool) -> Loaded:
    """A process reward model: an AutoModelForTokenClassification, or a sequence-classification checkpoint, loaded as
    such (its head is then read at every token: `workers.scoring.process_reward.per_token_logits`)."""
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    path, tok, config = reward_folder(spec, field, trust_remote_code, PROCESS_REWARD)
    archs = getattr(config, "architectures", None) or []
    auto = AutoModelForSequenceClassification if any(a.endswith("ForSequenceClassification") for a in archs) \
        else AutoModelForTokenClassification
    dtype = pick_dtype(dtype_setting, device, checkpoint_dtype(path))
    with remote_code_guard(field, trust_remote_code):
        model = auto.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    model.to(device).eval()
    return Loaded(model, tok, path)


class remote_code_guard:
    """Turns transformers' "requires trust_remote_code" refusal into an error naming the config field."""

    def __init__(self, field: str, allowed: bool):
        self.field, self.allowed = field, allowed

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and not self.allowed and "trust_remote_code" in str(exc):
            raise ModelPathError(
                f"{self.field}: this checkpoint ships its own code; set models.trust_remote_code: true only if you "
                f"trust it ({exc})"
            ) from exc
        return False
