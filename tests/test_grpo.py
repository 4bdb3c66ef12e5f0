"""RL on verifiable rewards (issue 63, part 3): GRPO's objective as its equation, and a run
that samples with tlm's own decoder, rewards, and learns what the verifier checks."""

import contextlib
import json
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import save_run, tiny_config
from tlm import TransformerLM
from tlm.chat import chat_tokenizer
from tlm.cli import main
from tlm.config import TrainConfig
from tlm.data import PromptData
from tlm.load import load_language_model
from tlm.model.loss import grpo_loss, token_logprobs
from tlm.tokenizer import train_tokenizer
from tlm.train import Runtime
from tlm.train.grpo import PromptGroups

WORDS = ["cat", "dog", "sun", "moon", "tree", "leaf", "rain", "snow", "fish", "bird"]


def test_the_objective_is_the_clipped_surrogate_with_the_k3_kl():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=g, dtype=torch.float64) - 2
    old = logp + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.5
    ref = logp + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.3
    advantage = torch.tensor([[1.5], [-0.7], [0.0]], dtype=torch.float64)
    learned = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.bool)
    loss, kl = grpo_loss(logp, old, advantage, learned, 0.2, 0.05, ref)
    want = 0.0
    for b in range(3):
        for t in range(5):
            if not learned[b, t]:
                continue
            rho, a = float(torch.exp(logp[b, t] - old[b, t])), float(advantage[b, 0])
            surrogate = min(rho * a, min(max(rho, 0.8), 1.2) * a)
            d = float(ref[b, t] - logp[b, t])
            assert float(kl[b, t]) == pytest.approx(math.exp(d) - d - 1)
            want += -(surrogate - 0.05 * (math.exp(d) - d - 1))
    assert loss.item() == pytest.approx(want)
    fresh = logp.clone().requires_grad_(True)  # first update: ρ = 1, the gradient is A ∇log π
    grpo_loss(fresh, fresh.detach(), advantage, learned, 0.2)[0].backward()
    assert torch.allclose(fresh.grad, -advantage * learned)


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """A random tiny chat model, prompts whose verifier wants a reply that starts with 'c'
    (regex "c.*"), and 30 steps of GRPO from it."""
    folder = tmp_path_factory.mktemp("grpo")
    tok = chat_tokenizer(train_tokenizer("char", ["say " + " ".join(WORDS)]))
    torch.manual_seed(0)
    base = save_run(folder / "base", TransformerLM(tiny_config(vocab_size=tok.vocab_size)), tok)
    rows = [{"prompt": f"say {w}", "answer": "c.*"} for w in WORDS]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = folder / "data"
    args = ["prepare", "--task", "prompts", str(folder / "prompts.jsonl"), "--out", str(data)]
    assert main([*args, "--tokenizer", str(base), "--val-fraction", "0.2"]) == 0
    run = folder / "run"
    args = ["train", "--objective", "grpo", "--init-from", str(base), "--data", str(data)]
    args += ["--out", str(run), "--reward", "regex", "--batch-size", "4", "--group-size", "8"]
    args += ["--max-new-tokens", "8", "--lr", "1e-2", "--warmup-steps", "0", "--quiet"]
    assert main([*args, "--max-steps", "30", "--eval-interval", "15", "--log-interval", "5"]) == 0
    return base, data, run


def test_a_grpo_run_learns_what_its_verifier_checks(grpo_run):
    _, _, run = grpo_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "reward" in r]
    assert trained[0]["reward"] < 0.5 and trained[-1]["pass_rate"] >= 0.9
    assert {"length", "kl", "sampling_share"} <= set(trained[-1])
    assert 0 < trained[-1]["sampling_share"] < 1
    assert [r for r in rows if "val_pass1" in r][-1]["val_pass1"] == 1.0
    assert "grpo: reward `regex`, 8 replies a prompt" in (run / "MODEL_CARD.md").read_text()


def test_grpo_is_refused_in_one_line_without_a_reward_or_prompts(grpo_run, tmp_path, capsys):
    base, data, _ = grpo_run
    args = ["train", "--objective", "grpo", "--init-from", str(base), "--out", str(tmp_path / "r")]
    assert main([*args, "--data", str(data)]) == 2
    assert capsys.readouterr().err.strip() == (
        "tlm: error: objective grpo rewards its samples: give --reward NAME"
    )
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "lm")]) == 2
    assert "train with --objective grpo" in capsys.readouterr().err


def test_a_step_skips_the_replies_of_groups_that_scored_alike_and_keeps_its_gradient(grpo_run):
    """With beta 0 a reply whose advantage is 0 adds nothing to the gradient: the step passes
    only the others forward and back (rows counted), and its gradient is the whole batch's,
    normalised over every reply's tokens."""
    base, data, _ = grpo_run
    model = load_language_model(base, torch.device("cpu"))
    config = TrainConfig(
        objective="grpo", reward="regex", group_size=8, batch_size=3, max_new_tokens=8,
        data=str(data), init_from=str(base),
    )  # fmt: skip
    groups = PromptGroups(PromptData(data), model.config, config, world_size=1)
    batch = groups.sample(model, 0, [0, 1, 2])
    batch.advantages = [0.0] * 8 + [0.5, -0.5] * 4 + [0.0] * 7 + [0.25]  # groups 0 and 2 alike
    groups.batch = batch
    rows_seen = []
    model.register_forward_pre_hook(lambda _, args: rows_seen.append(len(args[0])))
    trainer = SimpleNamespace(
        runtime=Runtime(), wrapped=model, forward=model, device=torch.device("cpu"),
        autocast=contextlib.nullcontext,
    )  # fmt: skip
    model.zero_grad()
    loss = groups.step_loss(trainer, 0)
    assert rows_seen == [9]
    skipped = [p.grad.clone() for p in model.parameters()]
    assert [len(o) for o in batch.old[:8]] == [0] * 8 and all(batch.old[8:16])
    x, y, learned = groups._tensors(batch, range(24), torch.device("cpu"))  # every reply
    model.zero_grad()
    logp = token_logprobs(model(x), y)
    advantage = torch.tensor(batch.advantages)[:, None]
    whole, _ = grpo_loss(logp, logp.detach(), advantage, learned, config.clip)
    (whole / learned.sum()).backward()
    assert loss == pytest.approx(whole.item() / learned.sum().item(), abs=1e-7)
    for a, p in zip(skipped, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, atol=1e-7, rtol=1e-5)


@pytest.mark.slow  # a server process
def test_an_aligned_run_chats_serves_and_exports_with_its_template(grpo_run, tmp_path, capsys):
    """Part 7: the GRPO run is a chat run everywhere one is: `tlm chat` and `tlm serve`'s
    /v1/chat/completions give tlm's greedy reply, `tlm export-hf` writes the template
    (transformers renders the conversation to the run's ids), and the card records the
    objective, the reference, beta, the reward and the data."""
    from transformers import AutoTokenizer

    from serving import KEY, post, start
    from tlm.chat import render
    from tlm.generate import GenerationConfig
    from tlm.generate.chat import chat_prompt, replies
    from tlm.load import load_model, load_tokenizer

    base, data, run = grpo_run
    messages = [{"role": "user", "content": "say cat"}]
    model, tokenizer = load_model(run).eval(), load_tokenizer(run)
    prompt = chat_prompt(messages, tokenizer, 32, 6)
    expected = replies(model, tokenizer, [prompt], GenerationConfig(max_new_tokens=6))[0]
    assert main(["chat", str(run), "--message", "say cat", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip() == expected.text.strip()
    proc, url = start(run, "--api-key", KEY)
    try:
        body = {"model": run.name, "messages": messages, "max_tokens": 6, "temperature": 0}
        status, answer, _ = post(url + "/v1/chat/completions", body)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert status == 200 and answer["choices"][0]["message"]["content"] == expected.text
    assert main(["export-hf", str(run), str(tmp_path / "hf")]) == 0
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    out = hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True
    )
    assert out["input_ids"] == render(messages, tokenizer, generation=True)[0]
    card = (run / "MODEL_CARD.md").read_text()
    for recorded in ("grpo: reward `regex`", f"reference: `{base}`", "beta 0.0", str(data)):
        assert recorded in card, recorded
