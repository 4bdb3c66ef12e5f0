"""`tlm train`: a config (TOML file and/or flags) -> a trained run directory."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from tlm.checkpoint import lock_run
from tlm.cli.args import add_command, add_config_flags, config_overrides, fail
from tlm.config import ModelConfig, TrainConfig, load_toml, split_fields
from tlm.train import (
    Diverged,
    Interrupted,
    Runtime,
    check_new_run,
    new_run_configs,
    open_run,
    resume_run_configs,
    run_tokenizer,
)
from tlm.train.precision import pick_precision

EXAMPLE = """example:
  tlm prepare tinyshakespeare --tokenizer char --out data/shakespeare_char
  tlm train --data data/shakespeare_char --out runs/shakespeare_char --n-layers 4 \\
      --n-heads 4 --d-model 128 --context-length 64 --batch-size 12 --max-steps 2000
  tlm train --out runs/shakespeare_char --resume      # continue after Ctrl-C or a crash
  tlm train ... --keep-best --eval-tokens 0   # best.safetensors: lowest loss on all of val
  torchrun --standalone --nproc_per_node=2 -m tlm train --data ... --out ...  # DDP
  torchrun --standalone --nproc_per_node=2 -m tlm train --fsdp ...   # sharded (FSDP2)

Every field of ModelConfig and TrainConfig is a flag (--d-model, --lr, ...); a TOML file
given with --config holds the same keys, flat or under [model] and [train]. Under torchrun
the global batch is still --batch-size x --grad-accum windows, split over the processes
(docs/distributed.md).
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "train", "train a model on a prepared corpus", EXAMPLE)
    parser.add_argument("--config", help="TOML file of model and train settings")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun: shard parameters, gradients and optimizer state (FSDP2)",
    )
    add_config_flags(parser, TrainConfig, "training")
    add_config_flags(parser, ModelConfig, "model")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    model_values, train_values = split_fields(load_toml(args.config)) if args.config else ({}, {})
    model_values |= config_overrides(args, ModelConfig)
    train_values |= config_overrides(args, TrainConfig)
    runtime = Runtime.from_env(train_values.get("device", "auto"), fsdp=args.fsdp)
    try:
        return _train(args, model_values, train_values, runtime)
    finally:
        runtime.close()


def _train(args, model_values, train_values, runtime: Runtime) -> int:
    if args.resume:
        out = train_values.get("out") or fail("--resume needs --out RUN")
        model_config, train_config, data = resume_run_configs(out, model_values, train_values)
    else:
        model_config, train_config, data = new_run_configs(model_values, train_values)
    pick_precision(train_config.precision, runtime.device)  # refused before anything exists
    runtime.barrier()  # every rank has checked the run folder before the main rank writes it
    out = Path(train_config.out)
    main = runtime.is_main
    with lock_run(out) if main else contextlib.nullcontext():  # one writer per run
        if not args.resume and main:
            check_new_run(out, probe_lock=False)  # nobody wrote into it in the meantime
        trainer = open_run(
            model_config,
            train_config,
            data,
            run_tokenizer(train_config, data).to_json(),
            resume=args.resume,
            progress_bar=not args.quiet,
            runtime=runtime,
        )
        params = trainer.model.num_parameters()
        ranks = f" x {runtime.world_size} processes" if runtime.distributed else ""
        summary = getattr(trainer.batches, "summary", None)  # conversations: their packing
        if main and summary is not None:
            print(summary(), file=sys.stderr)
        if main:
            print(
                f"training {params:,} parameters on {trainer.device}{ranks} ({trainer.precision}) "
                f"for {train_config.max_steps:,} steps -> {out}",
                file=sys.stderr,
            )
        try:
            results = trainer.fit()
        except Interrupted as exc:
            if main:
                print(
                    f"tlm: interrupted; saved step {exc.step} to {out}. "
                    f"Continue with: tlm train --out {out} --resume",
                    file=sys.stderr,
                )
            return 130
        except Diverged as exc:
            if main:
                print(
                    f"tlm: error: {exc}; stopped. The last good checkpoint is in "
                    f"{out}/train_state; try a lower --lr or --grad-clip",
                    file=sys.stderr,
                )
            return 1
    if main:
        val = results["val_loss"]
        print(
            f"done: step {results['step']:,}, train loss {results['train_loss']:.4f}, "
            f"val loss {'n/a' if val is None else f'{val:.4f}'}, {results['elapsed']:.1f} s; "
            f"run in {out} (MODEL_CARD.md, plots/loss.png)"
        )
        if results.get("best_step") is not None:
            print(
                f"best: val loss {results['best_val_loss']:.4f} at step {results['best_step']:,} "
                f"in {out}/best.safetensors (read it with --weights best)"
            )
    return 0
