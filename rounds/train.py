"""A round's fine-tune: TRL's SFTTrainer on the round's SFT set, a full fine-tune or LoRA (peft), on CPU or one GPU.

`fine_tune` trains into a temporary folder beside the model folder and renames it into place only when the model,
its tokenizer and the record `finish` writes (the lineage, `reporting.rounds.ModelLineage`) are all there: the model
folder is whole or absent, and a killed training leaves only a temporary folder, which the next attempt removes. A
LoRA's adapters are merged into the weights before saving, so the folder is a plain Hugging Face model that
`winnow generate` loads as any target.

**Training cost**: device-seconds are the wall time of the training loop (`Trainer.train`: forward, backward and
optimizer steps; loading and saving are left out, as a run's device-seconds leave out model loading) x the devices
it held (1: one GPU, or the CPU host as a run's cost meter counts a CPU actor). Compute is an estimate from the
tokens the loop processed (prompt and completion, every epoch): 6 x parameters x tokens for a full fine-tune (forward
2, backward 4), 4 x parameters x tokens with LoRA (the frozen weights need no weight gradient; the adapters' own
FLOPs are left out).

Needs the `train` extra (trl, peft): `pip install -e '.[train]'`.
"""

from __future__ import annotations

import gc
import glob
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Callable

from rounds.config import TrainConfig

INSTALL = "pip install -e '.[train]'"


def missing_packages(lora: bool) -> list[str]:
    """The packages training needs that cannot be imported here (trl; peft for LoRA)."""
    import importlib.util

    wanted = ["trl", "datasets"] + (["peft"] if lora else [])
    return [name for name in wanted if importlib.util.find_spec(name) is None]


@dataclass
class Trained:
    """What one fine-tune did and cost (module docstring)."""

    device: str
    threads: int | None  # torch's CPU threads while training (None on a GPU)
    devices: int
    wall_seconds: float  # the training loop
    device_seconds: float
    examples: int
    epochs: float
    steps: int
    tokens: int  # prompt and completion tokens the loop processed, every epoch
    loss_tokens: int  # completion tokens the loss was taken on, every epoch
    parameters: int
    trainable_parameters: int
    flops: float
    train_loss: float | None
    method: str  # "full fine-tune" or "LoRA r=.., alpha=.."

    def record(self) -> dict:
        return asdict(self)


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but torch sees no GPU here; use 'auto' or 'cpu'")
    return choice


def remove_partial(out: str) -> list[str]:
    """Remove the temporary folders that killed trainings left beside `out`; returns them."""
    stale = sorted(glob.glob(f"{glob.escape(out)}.tmp-*"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def fine_tune(parent: str, dataset_dir: str, out: str, cfg: TrainConfig, seed: int,
              finish: Callable[[str, Trained], None], log: Callable[[str], None] = print) -> Trained:
    """Fine-tune the model folder `parent` on the `datasets.save_to_disk` folder `dataset_dir` (TRL's conversational
    prompt-completion form: `winnow build-sft`'s ``hf/``) and save the result at `out`; `finish(tmp, trained)`
    writes the model's own records into the temporary folder before it is renamed to `out`."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    for path in remove_partial(out):
        log(f"removed {path}, left by a training that did not finish")
    device = _device(cfg.device)
    tmp = f"{out}.tmp-{uuid.uuid4().hex[:12]}"
    os.makedirs(tmp)
    threads = torch.get_num_threads()
    if device == "cpu" and cfg.cpu_threads is not None:
        torch.set_num_threads(cfg.cpu_threads)
    try:
        tokenizer = AutoTokenizer.from_pretrained(parent)
        model = AutoModelForCausalLM.from_pretrained(parent, dtype=torch.float32)
        parameters = sum(p.numel() for p in model.parameters())
        train = datasets.load_from_disk(dataset_dir).select_columns(["prompt", "completion"])
        peft_config, method = None, "full fine-tune"
        if cfg.lora is not None:
            from peft import LoraConfig

            lora = cfg.lora
            peft_config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                     target_modules=lora.target_modules, task_type="CAUSAL_LM")
            method = f"LoRA r={lora.r}, alpha={lora.alpha}"
        bf16 = device == "cuda" and torch.cuda.is_bf16_supported()
        args = SFTConfig(
            output_dir=os.path.join(tmp, "_trainer"), num_train_epochs=cfg.epochs,
            per_device_train_batch_size=cfg.batch_size, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            # warmup_steps below 1 is a ratio of the steps (transformers' warmup_ratio is deprecated)
            learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler, warmup_steps=cfg.warmup_ratio,
            weight_decay=cfg.weight_decay, max_length=cfg.max_length, completion_only_loss=True,
            use_cpu=device == "cpu", bf16=bf16, fp16=False, gradient_checkpointing=False,
            save_strategy="no", report_to="none", logging_steps=10, disable_tqdm=True, seed=seed, data_seed=seed,
            dataloader_pin_memory=device == "cuda", dataloader_num_workers=0,
        )
        trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer,
                             peft_config=peft_config)
        processed = trainer.train_dataset
        per_epoch = sum(len(ids) for ids in processed["input_ids"])
        if "labels" in processed.column_names:
            loss_per_epoch = sum(sum(1 for t in labels if t != -100) for labels in processed["labels"])
        elif "completion_mask" in processed.column_names:
            loss_per_epoch = sum(sum(m) for m in processed["completion_mask"])
        else:
            loss_per_epoch = per_epoch
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        where = f"{device}, {torch.get_num_threads()} thread(s)" if device == "cpu" else device
        log(f"training {method} of {parent} on {len(train)} examples ({per_epoch} tokens an epoch) on {where}, "
            f"{cfg.epochs:g} epoch(s)")
        started = time.perf_counter()
        result = trainer.train()
        wall = time.perf_counter() - started
        tokens = round(per_epoch * cfg.epochs)
        trained = Trained(
            device=device, threads=torch.get_num_threads() if device == "cpu" else None, devices=1,
            wall_seconds=wall, device_seconds=wall * 1, examples=len(train),
            epochs=cfg.epochs, steps=int(result.global_step), tokens=tokens,
            loss_tokens=round(loss_per_epoch * cfg.epochs), parameters=parameters, trainable_parameters=trainable,
            flops=float((4 if cfg.lora is not None else 6) * parameters * tokens),
            train_loss=float(result.training_loss) if result.training_loss is not None else None, method=method,
        )
        final = trainer.model.merge_and_unload() if cfg.lora is not None else trainer.model
        shutil.rmtree(os.path.join(tmp, "_trainer"), ignore_errors=True)
        final.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        finish(tmp, trained)
        del trainer, final, model
        gc.collect()
        os.rename(tmp, out)
        return trained
    finally:
        torch.set_num_threads(threads)
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
