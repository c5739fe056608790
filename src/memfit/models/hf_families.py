"""Hugging Face families beyond causal LMs, built from a config.json with random weights (never downloads).

    task_of(data)                          # "seq2seq" for T5ForConditionalGeneration, from `architectures`
    build_family(path, "image-classification", image_size=384)
    family_batch("seq2seq", config, batch=8, seq=512)(device)   # input_ids, decoder_input_ids, labels

Each task names the Auto class that builds it and the batch one training step feeds it; the loss is the
model's own (`output.loss`, computed from `labels`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from memfit.core.errors import ConfigError

# task -> (transformers' mapping of model_type -> class name, Auto class, architecture name endings)
TASKS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM", ("ForCausalLM", "LMHeadModel")),
    "seq2seq": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM", ("ForConditionalGeneration",)),
    "masked-lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM", ("ForMaskedLM",)),
    "image-classification": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification",
                             ("ForImageClassification",)),
}
FAMILIES = ("causal LMs (gpt2, llama, mistral, qwen2, mixtral, ...), seq2seq (t5, bart, ...), masked LMs "
            "(bert, roberta, ...) and image classifiers (vit, ...)")


def _mapping(task: str) -> dict[str, str]:
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        raise ConfigError("a config.json model needs `transformers`: pip install 'memfit[hf]'") from None

    return getattr(modeling_auto, TASKS[task][0])


def _arch_task(data: dict) -> tuple[str | None, str | None]:
    """(architecture name, its task) from the config's `architectures`, when it names one memfit knows."""
    archs = data.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        return None, None
    arch = archs[0]
    for task, (_, _, endings) in TASKS.items():
        if arch.endswith(endings):
            if task == "seq2seq" and data["model_type"] not in _mapping("seq2seq"):
                continue  # e.g. a vision-language ...ForConditionalGeneration
            return arch, task
    return arch, None


def task_of(data: dict, requested: str | None = None, path: Any = "config.json") -> str:
    """The task to build: `requested` (checked against the config) or the config's own."""
    kind = data["model_type"]
    if requested is not None and requested not in TASKS:
        raise ConfigError(f"unknown --task {requested!r}; accepted: {', '.join(TASKS)}")
    arch, task = _arch_task(data)
    if requested is not None and task is not None and requested != task:
        raise ConfigError(f"--task {requested} does not match {path}, a {arch} ({task}); use --task {task} "
                          "or leave --task out")
    task = requested or task
    if task is None:
        if data.get("is_encoder_decoder") and kind in _mapping("seq2seq"):
            task = "seq2seq"
        else:
            task = next((t for t in TASKS if kind in _mapping(t)), None)
    if task is None or kind not in _mapping(task):
        what = f"has no {task} class" if task else "has no class memfit builds"
        raise ConfigError(f"Hugging Face config {path}: model_type {kind!r} {what}; memfit builds {FAMILIES}")
    return task


def hf_config(data: dict, image_size: int | None = None, path: Any = "config.json") -> Any:
    """transformers' config object of `data`, checked (memfit.models.hf_check): one line for what is wrong."""
    from memfit.models.hf_check import checked

    return checked(data, path, image_size)


def build_family(data: dict, task: str, image_size: int | None = None, path: Any = "config.json") -> nn.Module:
    """The task's model for this config, with random weights, in the current device / fake-tensor context."""
    import transformers

    from memfit.models.hf_check import build_quietly

    config = hf_config(data, image_size, path)
    return build_quietly(lambda: getattr(transformers, TASKS[task][1]).from_config(config), f"{task} model", path)


def family_batch(task: str, config: Any, batch: int, seq: int | None,
                 image_size: int | None = None) -> Callable[[torch.device], dict[str, torch.Tensor]]:
    """A function device -> one micro-batch with valid values (random tokens / pixels and labels)."""
    if task == "image-classification":
        size = image_size or getattr(config, "image_size", 224)
        size = size if isinstance(size, int) else int(size[0])
        channels, labels = getattr(config, "num_channels", 3), max(int(getattr(config, "num_labels", 2)), 1)

        def images(device: torch.device) -> dict[str, torch.Tensor]:
            return {"pixel_values": torch.randn(batch, channels, size, size, device=device),
                    "labels": torch.randint(0, labels, (batch,), device=device)}

        return images
    vocab = int(config.get_text_config().vocab_size if hasattr(config, "get_text_config") else config.vocab_size)

    def tokens(device: torch.device) -> dict[str, torch.Tensor]:
        x = torch.randint(0, vocab, (batch, seq), device=device)
        if task == "seq2seq":  # the decoder reads the targets shifted right, as a seq2seq training step does
            y = torch.randint(0, vocab, (batch, seq), device=device)
            return {"input_ids": x, "decoder_input_ids": y, "labels": y}
        return {"input_ids": x, "labels": x}

    return tokens
