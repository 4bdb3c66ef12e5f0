"""`tlm lm-eval`: score a model on lm-evaluation-harness's tasks (`tlm.tasks.harness`)."""

from __future__ import annotations

import argparse

from tlm.cli.args import add_command, add_model_flags, fail, model_device

EXAMPLE = """examples:
  tlm lm-eval runs/demo --tasks my_choice --include-path my_tasks
  tlm lm-eval runs/demo --tasks hellaswag,arc_easy --limit 200 --output-path out/lm-eval

Runs EleutherAI's lm-evaluation-harness (pip install "tlm[eval]") on the model through
tlm's own scoring and decoding, conditioned as lm-eval's hf backend is, and prints
lm-eval's results table. --output-path writes what `lm_eval --output_path P --log_samples`
writes: the results and one file of per-sample records per task. Tasks whose datasets
are downloaded need the network; a local task is lm-eval YAML over a JSON file
(docs/serve.md).
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "lm-eval", "score a model with lm-evaluation-harness", EXAMPLE)
    parser.add_argument("run", help="run directory or Hugging Face GPT-2 / GPT-NeoX directory")
    parser.add_argument("--tasks", required=True, help="task names, comma-separated")
    parser.add_argument("--include-path", help="a folder of task YAML files of your own")
    parser.add_argument("--limit", type=float, help="examples per task (a fraction if < 1)")
    parser.add_argument("--num-fewshot", type=int, help="examples put before each (task's own)")
    parser.add_argument("--batch-size", type=int, default=16, help="requests at once (16)")
    parser.add_argument("--output-path", help="a folder for the results and samples")
    add_model_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        from lm_eval.utils import make_table
    except ImportError:
        fail('lm-eval is not installed: pip install "tlm[eval]"')
    from tlm.tasks.harness import harness_evaluate

    if args.batch_size < 1:
        fail("--batch-size must be at least 1")
    limit = None if args.limit is None else (args.limit if args.limit < 1 else int(args.limit))
    results = harness_evaluate(
        args.run, [t.strip() for t in args.tasks.split(",") if t.strip()], args.include_path,
        limit, args.num_fewshot, args.batch_size, args.output_path, args.weights,
        str(model_device(args)),
    )  # fmt: skip
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return 0
