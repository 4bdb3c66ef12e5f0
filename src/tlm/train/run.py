"""Starting or resuming a run: resolve the configs, refuse what would lose work."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tlm.chat import chat_tokenizer
from tlm.checkpoint import LOCK, check_unlocked, latest_checkpoint, read_config
from tlm.config import ModelConfig, TrainConfig, from_dict
from tlm.data import ChatData, PairData, TokenData, open_data
from tlm.data.labeled import TASKS, LabeledData, read_labeled
from tlm.data.tokens import fingerprint_differences
from tlm.errors import UserError
from tlm.load import load_tokenizer, model_config
from tlm.tokenizer import Tokenizer, encoder_tokenizer


class RunError(UserError):
    """A run that cannot start as asked; the message says why."""


# A translation run's defaults are the paper's (Vaswani et al. 2017 §3, §5): flags override
TRANSLATION_MODEL = {"model_type": "encoder-decoder", "position": "sinusoidal", "norm": "post"}
TRANSLATION_MODEL |= {"activation": "relu", "dropout": 0.1}
TRANSLATION_TRAIN = {"schedule": "inverse-sqrt", "lr": 1.0, "warmup_steps": 4000, "beta2": 0.98}
TRANSLATION_TRAIN |= {"label_smoothing": 0.1, "weight_decay": 0.0, "batch_tokens": 4096}
# A masked-LM encoder's defaults are BERT's blocks (Devlin et al. 2019): flags override
ENCODER_MODEL = {"model_type": "encoder", "norm": "post", "position": "learned"}
# Instruction tuning's defaults (conversations, `--init-from BASE`): flags override
CHAT_TRAIN = {"batch_size": 16, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 20}


def new_run_configs(
    model_values: dict[str, Any], train_values: dict[str, Any]
) -> tuple[ModelConfig, TrainConfig, TokenData | PairData]:
    """Configs for a fresh run; the vocabulary size comes from the prepared data."""
    train_config = from_dict(TrainConfig, train_values)
    if not train_config.data:
        raise RunError("--data is required: a folder written by tlm prepare")
    if not train_config.out:
        raise RunError("--out is required: the run directory to create")
    check_new_run(Path(train_config.out))
    model_values = dict(model_values)
    task = model_values.get("task")
    if task is not None and task not in TASKS:
        raise RunError(f"--task must be one of {', '.join(TASKS)}; got {task!r}")
    data = read_labeled(train_config.data, task) if task else open_data(train_config.data)
    if task:  # fine-tuning an encoder: init_from's shape, the data's labels
        model_values = _task_model_values(train_config, model_values, data)
    if isinstance(data, PairData):
        if train_config.init_from:
            raise RunError("--init-from fine-tunes a language model; a translation run starts anew")
        model_values = {**TRANSLATION_MODEL, **model_values}
        train_config = from_dict(TrainConfig, {**TRANSLATION_TRAIN, **train_values})
    if isinstance(data, ChatData):
        train_config = from_dict(TrainConfig, {**CHAT_TRAIN, **train_values})
    if train_config.objective == "mlm":
        model_values = {**ENCODER_MODEL, **model_values}
    tokenizer = run_tokenizer(train_config, data)
    if train_config.init_from and not task:
        model_values = _init_model_values(train_config.init_from, model_values, data, tokenizer)
    given = model_values.setdefault("vocab_size", tokenizer.vocab_size)
    if given != tokenizer.vocab_size:
        raise RunError(
            f"--vocab-size {given} differs from the run's vocabulary {tokenizer.vocab_size}"
        )
    model_config = from_dict(ModelConfig, model_values)
    pretraining = model_config.model_type == "encoder" and model_config.task is None
    if pretraining != (train_config.objective == "mlm"):
        raise RunError(
            "an encoder (--model-type encoder) pretrains with --objective mlm, and "
            "--objective mlm trains an encoder; a task (--task) fine-tunes one"
        )
    if isinstance(data, TokenData):
        if model_config.model_type == "encoder-decoder":
            raise RunError(f"{data.folder} is one text stream: it trains a decoder or an encoder")
        if not isinstance(data, ChatData):  # conversations are packed into windows
            _check_window(data, model_config)
    return model_config, train_config, data


def resume_run_configs(
    out: str, model_values: dict[str, Any], train_values: dict[str, Any]
) -> tuple[ModelConfig, TrainConfig, TokenData | PairData]:
    """The saved configs of run `out`; any value given now must equal the saved one."""
    check_unlocked(Path(out))
    if latest_checkpoint(out) is None:
        raise RunError(f"{out} has no checkpoint to resume from")
    saved = read_config(out)
    model_config = ModelConfig.from_dict(saved["model"])
    train_config = TrainConfig.from_dict(saved["train"])
    differ = _differences(model_config, model_values) + _differences(train_config, train_values)
    if differ:
        raise RunError(f"--resume: config differs from the saved run: {'; '.join(differ)}")
    task = model_config.task
    data = read_labeled(train_config.data, task) if task else open_data(train_config.data)
    if run_tokenizer(train_config, data).vocab_size != model_config.vocab_size:
        raise RunError(
            f"{train_config.data} has vocabulary {data.vocab_size}; "
            f"the run was trained on {model_config.vocab_size}"
        )
    if "data" in saved:  # runs from before tlm recorded the data compare the vocabulary only
        differ = fingerprint_differences(saved["data"], data.fingerprint())
        if differ:
            raise RunError(
                f"--resume: {train_config.data} is not the data this run was trained on "
                f"({'; '.join(differ)}); prepare it as it was, or start a new run"
            )
    return model_config, train_config, data


def run_tokenizer(config: TrainConfig, data) -> Tokenizer:
    """The tokenizer a run of `config` on `data` writes and reads: the data's, with an
    encoder's special tokens added for masked-LM pretraining; for labeled examples (which
    have none), the encoder's that it fine-tunes."""
    if isinstance(data, LabeledData):
        return load_tokenizer(config.init_from)
    tokenizer = load_tokenizer(data.folder)
    return encoder_tokenizer(tokenizer) if config.objective == "mlm" else tokenizer


def check_new_run(out: Path, probe_lock: bool = True) -> None:
    """A new run goes into a folder that does not exist, is empty, or holds only a lock.
    `probe_lock=False` once this process holds the lock itself."""
    if probe_lock:
        check_unlocked(out)
    if out.exists() and any(p.name != LOCK for p in out.iterdir()):
        raise RunError(f"{out} already exists; pass --resume to continue it or choose a new --out")


# may differ between a pretrained model and its fine-tuning run; the shape may not
FINE_TUNING_FIELDS = ("dropout", "attn_dropout", "resid_dropout", "embd_dropout")
# a rotary model fine-tuned past its trained context (docs/long-context.md)
LONG_CONTEXT_FIELDS = (
    "rope_scaling", "rope_factor", "rope_original_context", "yarn_beta_fast", "yarn_beta_slow",
    "attention_window",
)  # fmt: skip


def _init_model_values(
    source: str, given: dict[str, Any], data: TokenData, tokenizer: Tokenizer
) -> dict[str, Any]:
    """The model of `--init-from` (a run or a Hugging Face GPT-2 directory) fixes the shape,
    except that the context may be shortened; its tokenizer must be the data's, or for
    conversations the data's less the chat template's tokens (the model grows rows for
    them: `opening.initial_weights`)."""
    saved = model_config(source).to_dict()
    if isinstance(data, ChatData):
        base = load_tokenizer(source)
        if chat_tokenizer(base).to_json() != load_tokenizer(data.folder).to_json():
            raise RunError(
                f"{data.folder} was not tokenized with the tokenizer of {source}; prepare it "
                f"again with --tokenizer {source}"
            )
        saved["vocab_size"] = data.vocab_size  # the base's rows, then the template's
        return {**saved, **given}
    differ = [
        f"{k}: {saved[k]!r} there, {v!r} given"
        for k, v in given.items()
        if k not in FINE_TUNING_FIELDS + LONG_CONTEXT_FIELDS
        and saved.get(k) != v
        and not _other_context(k, v, saved)
    ]
    if differ:
        raise RunError(f"--init-from {source} fixes the model; {'; '.join(differ)}")
    if load_tokenizer(source).to_json() != tokenizer.to_json():
        raise RunError(
            f"{data.folder} was not tokenized with the tokenizer of {source}; prepare it again "
            f"with --tokenizer {source}"
        )
    return {**saved, **given}


def _task_model_values(
    config: TrainConfig, given: dict[str, Any], data: LabeledData
) -> dict[str, Any]:
    """The model of a task run: the encoder of `--init-from` (its shape; its weights unless
    --reinit), with the task's head over the data's labels."""
    if not config.init_from:
        raise RunError(
            f"--task {data.task} fine-tunes an encoder: give --init-from RUN (an encoder run; "
            "with --reinit, only its shape and tokenizer are taken)"
        )
    saved = model_config(config.init_from).to_dict()
    if saved["model_type"] != "encoder":
        raise RunError(
            f"--init-from {config.init_from} is not an encoder (tlm train --objective mlm)"
        )
    kept = {k: v for k, v in given.items() if k in FINE_TUNING_FIELDS}
    return {**saved, **kept, "task": data.task, "labels": data.labels, "nsp": False}


def _other_context(key: str, value: Any, saved: dict[str, Any]) -> bool:
    """A fine-tuning run may use the first N positions of a longer context, and a model
    whose positions are not learned a longer one."""
    if key != "context_length" or not isinstance(value, int):
        return False
    return value < saved[key] or saved.get("position") != "learned"


def _differences(config: Any, values: dict[str, Any]) -> list[str]:
    given = dataclasses.asdict(type(config).from_dict({**config.to_dict(), **values}))
    saved = config.to_dict()
    return [f"{k}: saved {saved[k]!r}, given {given[k]!r}" for k in values if given[k] != saved[k]]


def _check_window(data: TokenData, config: ModelConfig) -> None:
    n = len(data.split("train"))
    if n < config.context_length + 1:
        raise RunError(
            f"training split has {n} tokens, fewer than one context window "
            f"({config.context_length} + 1); use a larger corpus or a smaller --context-length"
        )
