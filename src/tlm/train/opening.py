"""Opening a run: everything the `Trainer` needs, built with the I/O it takes.

`open_run` seeds, builds the model (GPT-2's initialisation, a resumed checkpoint, or
--init-from's weights), writes the new run's config.json and tokenizer.json, wraps the
model for DDP or FSDP, builds the optimizer (and loads a resumed one), opens the batch
source for the data's kind and the metrics file, then hands them to the `Trainer`, whose
construction does none of this. On a CPU it also sets tlm's attention kernel and
glibc's malloc to keep freed memory for the next step (`inference/devices/heap.py`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tlm.checkpoint import latest_checkpoint, load_checkpoint, write_config
from tlm.config import ModelConfig, TrainConfig
from tlm.data import ChatData, PairData, PreferenceData, PromptData, TokenData
from tlm.data.labeled import LabeledData
from tlm.inference.devices.heap import keep_freed_memory
from tlm.io import write_text_atomic
from tlm.load import load_model
from tlm.model import build_model
from tlm.model.attention import use_attention_kernel
from tlm.train.attention_kernel import causal_attention
from tlm.train.chat import ChatWindows
from tlm.train.distributed import Runtime
from tlm.train.dpo import PreferencePairs
from tlm.train.finetune import LabeledBatches
from tlm.train.grpo import PromptGroups
from tlm.train.loop import Progress, Trainer
from tlm.train.mlm import MaskedWindows
from tlm.train.optim import build_optimizer
from tlm.train.precision import pick_precision
from tlm.train.report import Metrics
from tlm.train.run import RunError, run_tokenizer
from tlm.train.translate import PairBatches
from tlm.train.windows import TokenWindows


def open_run(
    model_config: ModelConfig,
    config: TrainConfig,
    data: TokenData | PairData,
    tokenizer_json: str,
    resume: bool = False,
    progress_bar: bool = True,
    runtime: Runtime | None = None,
) -> Trainer:
    """A `Trainer` for a new run at config.out, or, with `resume`, for the run there."""
    rt = runtime or Runtime.from_env(config.device)
    _check_batch(config, rt)
    precision = pick_precision(config.precision, rt.device)  # refused before anything is written
    run = Path(config.out)
    torch.manual_seed(config.seed)
    model = build_model(model_config, init=False)
    model.reset_parameters(seed=config.seed)  # resume / init_from overwrite it below
    model.to(rt.device)
    if rt.device.type == "cpu":  # tlm's fp32 or bf16 kernel where it applies (causal ones)
        use_attention_kernel(model, causal_attention)
        keep_freed_memory()  # each step reuses the last one's memory: no page faults
    batches = _batches(data, model_config, config, rt)
    state, saved = Progress(), None
    if resume:  # the weights now, whole; the optimizer once it is built (maybe sharded)
        saved = load_checkpoint(latest_checkpoint(run), model, None)
        fields = Progress.__dataclass_fields__  # runs saved before a field existed lack it
        state = Progress(**{k: saved[k] for k in fields if k in saved})
        batches.load_state_dict(saved.get("batches", {}))  # the source's counts go on
    elif config.init_from and not config.reinit:  # fine-tuning: a trained model's weights
        _load_initial(model, initial_weights(config.init_from, model_config))
    if not resume and rt.is_main:
        run.mkdir(parents=True, exist_ok=True)
        write_config(run, model_config, config.to_dict(), data.fingerprint(), precision.to_dict())
        write_text_atomic(run / "tokenizer.json", tokenizer_json)
    if isinstance(batches, PreferencePairs):  # the init run's weights, now: the reference
        batches.hold_reference(model, run, resume, precision.dtype, rt.is_main)
    if isinstance(batches, PromptGroups) and not resume:  # (a resume reads it: init_from)
        batches.hold_reference(model)
    elif isinstance(batches, PromptGroups) and config.beta > 0:
        reference = build_model(model_config, init=False)
        reference.load_state_dict(initial_weights(config.init_from, model_config), assign=True)
        batches.hold_reference(reference.to(rt.device))
    if rt.rank:  # rank 0 keeps the seeded (or resumed) stream; the others differ from it
        torch.manual_seed(config.seed + rt.rank)  # (dropout masks)
    wrapped = rt.wrap(model)  # DDP, or FSDP2 sharding in place
    optimizer = build_optimizer(model, config, ns_dtype=precision.dtype)
    if saved is not None:
        rt.load_optimizer(model, optimizer, saved["optimizer"])
    metrics = None
    if rt.is_main:
        metrics = Metrics(run / "metrics.jsonl", state.step if resume else None)
    parts = (batches, model, wrapped, optimizer, rt, state, metrics, progress_bar)
    return Trainer(model_config, config, *parts, precision=precision)


def _check_batch(config: TrainConfig, rt: Runtime) -> None:
    global_batch = config.batch_size * config.grad_accum  # windows per step, all ranks
    if global_batch % rt.world_size:
        raise RunError(
            f"the global batch of {global_batch} windows (--batch-size x --grad-accum) "
            f"does not split evenly over {rt.world_size} processes"
        )
    if rt.fsdp and config.optimizer == "muon":  # Newton-Schulz needs a whole matrix
        raise RunError("--optimizer muon needs whole weight matrices: use DDP, not --fsdp")


def _batches(data, model_config: ModelConfig, config: TrainConfig, rt: Runtime):
    """The batch source of the data's kind: token windows, conversations packed in
    windows, preference pairs (DPO), or translation pairs."""
    if config.windows != "random" and type(data) is not TokenData:
        raise RunError(
            "--windows documents draws windows of a token stream; conversations and pairs "
            "are packed whole already"
        )
    if (config.objective == "dpo") != isinstance(data, PreferenceData):
        raise RunError(
            "preference pairs (tlm prepare --task preference) train with --objective dpo, "
            "and --objective dpo trains on them"
        )
    if (config.objective == "grpo") != isinstance(data, PromptData):
        raise RunError(
            "prompts with answers (tlm prepare --task prompts) train with --objective grpo, "
            "and --objective grpo trains on them"
        )
    if isinstance(data, LabeledData):
        if rt.world_size != 1:
            raise RunError("fine-tuning an encoder for a task runs on one process")
        tokenizer = run_tokenizer(config, data)
        return LabeledBatches(data, tokenizer, model_config, config)
    if config.objective == "mlm":
        if type(data) is not TokenData:
            raise RunError("--objective mlm masks a token stream: data from tlm prepare CORPUS")
        return MaskedWindows(data, model_config, config, rt.world_size)
    if isinstance(data, PromptData):
        return PromptGroups(data, model_config, config, rt.world_size)
    if isinstance(data, PreferenceData):
        return PreferencePairs(data, model_config, config, rt.world_size)
    if isinstance(data, PairData):
        return PairBatches(data, model_config, config, rt)
    if isinstance(data, ChatData):
        return ChatWindows(data, model_config, config, rt.world_size)
    return TokenWindows(data, model_config, config, rt.world_size)


def _load_initial(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """`state` into `model`; a task's head (W_P, b_P, W_C, b_C: not in the pretrained run)
    keeps its seeded initial values, and the pretrained MLM head is left out."""
    head = ("W_P", "b_P", "W_C", "b_C")
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    if getattr(model.config, "task", None) is None or any(k not in head for k in missing):
        model.load_state_dict(state)  # strict: anything else missing is an error
        return
    model.load_state_dict({k: state[k] for k in own if k in state}, strict=False)


def initial_weights(source: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights of `--init-from`, learned positions cut to this run's context length.
    A vocabulary grown by special tokens (the chat template's) gets a row of E (and a
    column of an untied W_U) for each new token, set to the mean of the trained ones: a
    new token starts as an average token, its logit near the others', rather than as
    noise the head has never seen."""
    state = load_model(source).state_dict()
    if "embedding.P" in state:
        state["embedding.P"] = state["embedding.P"][: config.context_length]  # [N, d] -> [T, d]
    E = state["embedding.E"]
    new = config.vocab_size - E.shape[0]
    if new > 0:
        state["embedding.E"] = torch.cat([E, E.mean(0, keepdim=True).expand(new, -1)])
        if "W_U" in state:  # [d, V]
            W_U = state["W_U"]
            state["W_U"] = torch.cat([W_U, W_U.mean(1, keepdim=True).expand(-1, new)], dim=1)
    return state
