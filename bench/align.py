"""RL on verifiable rewards beside TRL (not a test): tlm's GRPO and TRL's `GRPOTrainer` from
the same SFT model, on the same prompts, reward, group size, batch and steps.

    python bench/align.py                        # from tlm demo align's SFT run and prompts
    python bench/align.py --steps 40 --sft RUN --prompts DIR --out runs/bench-align

1. The SFT run's held-out pass@1 (greedy) and pass@8 (tlm's evaluator, tasks/verify.py, on
   the first EVAL held-out prompts).
2. tlm: `tlm train --objective grpo --init-from SFT` for --steps steps: B prompts a step,
   G replies each (at most M new tokens, temperature 1), advantage r − mean, DAPO's
   token-level loss, beta 0, one update a batch, a constant learning rate.
3. TRL: `GRPOTrainer` on `tlm export-hf SFT` (GPT-NeoX's layout) with the same settings:
   per-device batch B×G completions, `num_generations` G, `max_completion_length` M,
   temperature 1 (no top-k or top-p), `beta` 0, `loss_type` dapo, `scale_rewards` none, one
   iteration, constant learning rate, AdamW with tlm's betas, decay and clipping (TRL decays
   every weight but biases and norms; tlm also spares the embeddings). The prompts are the
   rendered template's text, which the export's tokenizer turns into the same ids (checked);
   the reward is tlm's (`number`). Its model is saved and read back by tlm, so both are
   measured by the same evaluator.
4. Printed: each side's pass@1 gain, wall time (the training loop, and the whole process),
   their ratio, each side's share of time spent sampling (tlm logs it; TRL's: its model's
   `generate` timed), and tlm's RL sampling rate against `tlm generate`'s on one batch of
   the same B×G rows (the goal: at least 0.8×).

Both sides run in this order, one at a time, on the same threads; the host's kernels are
printed beside the figures, which compare only within one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _peers import host  # noqa: E402

from tlm.cli.demo_align import GRPO, measure  # noqa: E402
from tlm.config import TrainConfig  # noqa: E402
from tlm.data import PromptData  # noqa: E402
from tlm.generate import GenerationConfig  # noqa: E402
from tlm.generate.text import complete_tokens  # noqa: E402
from tlm.load import load_language_model, load_tokenizer  # noqa: E402
from tlm.train.grpo import PromptGroups  # noqa: E402
from tlm.train.rewards import number  # noqa: E402


def tlm_side(sft: Path, prompts: Path, out: Path, args: argparse.Namespace) -> dict:
    """tlm's GRPO as a user runs it; the loop's seconds from its metrics, the process's."""
    run = out / "tlm"
    command = [sys.executable, "-m", "tlm", "train", "--objective", "grpo", "--init-from", str(sft)]
    command += ["--data", str(prompts), "--out", str(run), "--reward", "number", "--quiet"]
    command += ["--max-steps", str(args.steps), "--batch-size", str(args.batch)]
    command += ["--group-size", str(args.group), "--max-new-tokens", str(args.max_new_tokens)]
    command += ["--lr", str(args.lr), "--min-lr", str(args.lr), "--warmup-steps", "0"]
    command += ["--eval-interval", str(10 * args.steps), "--log-interval", "1", "--device", "cpu"]
    started = time.perf_counter()
    subprocess.run(command, check=True)
    whole = time.perf_counter() - started
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward" in r]
    return {
        "run": run,
        "loop_s": train[-1]["time"],
        "whole_s": whole,
        "sampling_share": sum(r["sampling_share"] for r in train) / len(train),
        "reward": [r["reward"] for r in train],
    }


def trl_side(sft: Path, prompts: PromptData, out: Path, args: argparse.Namespace) -> dict:
    """TRL's GRPOTrainer on the export of the same SFT run, its model saved for tlm."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    started = time.perf_counter()
    hf = out / "hf-sft"
    if not hf.is_dir():
        subprocess.run([sys.executable, "-m", "tlm", "export-hf", str(sft), str(hf)], check=True)
    tokenizer, ours = AutoTokenizer.from_pretrained(hf), load_tokenizer(sft)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    answers = prompts.answers("train")
    rows = []
    for i, (ids, answer) in enumerate(zip(prompts.prompts("train"), answers, strict=True)):
        text = ours.decode(ids)
        if i < 50:  # the peer reads the same tokens as tlm
            assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids, text
        rows.append({"prompt": text, "answer": answer})
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    generating = [0.0]
    generate = model.generate

    def timed_generate(*a, **k):
        begun = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            generating[0] += time.perf_counter() - begun

    model.generate = timed_generate

    def reward(completions, answer, **_) -> list[float]:
        return [float(number(c, a)) for c, a in zip(completions, answer, strict=True)]

    config = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, num_generations=args.group,
        per_device_train_batch_size=args.batch * args.group, temperature=1.0,
        max_completion_length=args.max_new_tokens,
        top_k=0, top_p=1.0, beta=0.0, loss_type="dapo", scale_rewards="none", num_iterations=1,
        adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.1, max_grad_norm=1.0, use_cpu=True,
        bf16=False, report_to="none", logging_steps=1, save_strategy="no", seed=1337,
        shuffle_dataset=True,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )  # fmt: skip
    begun = time.perf_counter()
    trainer.train()
    loop = time.perf_counter() - begun
    trainer.save_model(str(out / "trl-model"))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "run": out / "trl-model",
        "loop_s": loop,
        "whole_s": time.perf_counter() - started,
        "sampling_share": generating[0] / loop,
        "reward": rewards,
    }


def sampling_rates(sft: Path, prompts: PromptData, args: argparse.Namespace) -> tuple[float, float]:
    """Tokens/s of GRPO's own sampling (`PromptGroups.sample`) and of `tlm generate`'s path
    (`complete_tokens`, num_return_sequences G) on the same B prompts, G rows each."""
    model, tokenizer = load_language_model(sft, torch.device("cpu")), load_tokenizer(sft)
    config = TrainConfig(
        objective="grpo", reward="number", group_size=args.group, batch_size=args.batch,
        max_new_tokens=args.max_new_tokens, data=str(prompts.folder), init_from=str(sft),
    )  # fmt: skip
    groups = PromptGroups(prompts, model.config, config, world_size=1)
    chosen = list(range(args.batch))
    rates = {"rl": [], "generate": []}
    ends = groups.end_id, tokenizer.eot_id
    sampled = GenerationConfig(
        max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0,
        num_return_sequences=args.group, eos_token_id=ends,
    )  # fmt: skip
    for round_ in range(3):  # alternating, the best of three each
        begun = time.perf_counter()
        batch = groups.sample(model, round_, chosen)
        rates["rl"].append(sum(map(len, batch.replies)) / (time.perf_counter() - begun))
        begun = time.perf_counter()
        replies = complete_tokens(
            model, tokenizer, [groups.prompts["train"][i] for i in chosen],
            replace(sampled, seed=round_),
        )  # fmt: skip
        count = sum(len(r.tokens) for r in replies)
        rates["generate"].append(count / (time.perf_counter() - begun))
    return max(rates["rl"]), max(rates["generate"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft", default="runs/demo-align/sft", help="the SFT run both start from")
    parser.add_argument(
        "--prompts", default="data/demo-align/prompts", help="tlm prepare --task prompts"
    )
    parser.add_argument("--out", default="runs/bench-align")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=GRPO["batch_size"], help="prompts a step")
    parser.add_argument("--group", type=int, default=GRPO["group_size"], help="replies a prompt")
    parser.add_argument("--max-new-tokens", type=int, default=GRPO["max_new_tokens"])
    parser.add_argument("--lr", type=float, default=GRPO["lr"])
    args = parser.parse_args()
    sft, out = Path(args.sft), Path(args.out)
    if not (sft / "model.safetensors").is_file():
        sys.exit(f"bench/align.py: no run at {sft}: make it with `tlm demo align` (or pass --sft)")
    prompts = PromptData(args.prompts)
    out.mkdir(parents=True, exist_ok=True)
    print(f"host: {host()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    shape = f"{args.batch} prompts x {args.group} replies of <= {args.max_new_tokens} tokens"
    print(f"{args.steps} steps of {shape}")
    rl, plain = sampling_rates(sft, prompts, args)
    print(f"sampling inside RL {rl:,.0f} tok/s, tlm generate {plain:,.0f} tok/s: {rl / plain:.2f}x")
    before = measure(sft, prompts, "cpu")
    print(f"SFT: pass@1 {before['pass1']:.1%}, pass@8 {before['pass8']:.1%}")
    sides = {"tlm": tlm_side(sft, Path(args.prompts), out, args)}
    sides["TRL"] = trl_side(sft, prompts, out, args)
    for name, side in sides.items():
        side |= measure(side["run"], prompts, "cpu")
        print(
            f"{name}: pass@1 {side['pass1']:.1%} ({side['pass1'] - before['pass1']:+.1%}), "
            f"pass@8 {side['pass8']:.1%}; loop {side['loop_s']:.1f} s, "
            f"whole {side['whole_s']:.1f} s, sampling {side['sampling_share']:.0%} of the loop; "
            f"mean reward {sum(side['reward']) / len(side['reward']):.3f}"
        )
    ratio = sides["TRL"]["loop_s"] / sides["tlm"]["loop_s"]
    whole = sides["TRL"]["whole_s"] / sides["tlm"]["whole_s"]
    print(f"TRL's time / tlm's: loop {ratio:.2f}x, whole {whole:.2f}x (goal: >= 3x)")
    gains = {name: side["pass1"] - before["pass1"] for name, side in sides.items()}
    print(f"pass@1 gain: tlm {gains['tlm']:+.1%}, TRL {gains['TRL']:+.1%} (goal: tlm's >= TRL's)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
