"""Direct preference optimization (issue 63): preference pairs prepared, the loss as its
equations, held equal to TRL's on the Hugging Face export, and a run that learns to prefer."""

import json
import math

import pytest
import torch

from conftest import save_run, tiny_config
from tlm import TransformerLM
from tlm.chat import chat_tokenizer, render
from tlm.cli import main
from tlm.data import PreferenceData
from tlm.data.answer_pairs import answer_pairs
from tlm.load import load_model
from tlm.model.loss import chosen_nll, dpo_loss, sequence_logprobs
from tlm.tokenizer import train_tokenizer
from tlm.train.order import PassOrder

WORDS = ["cat", "dog", "sun", "moon", "tree", "leaf"]


@pytest.fixture(scope="module")
def pairs_run(tmp_path_factory):
    """A random tiny chat model (the base and the reference), 30 'say X' pairs prepared with
    its tokenizer, and a DPO run of 8 steps from it."""
    folder = tmp_path_factory.mktemp("dpo")
    tok = chat_tokenizer(train_tokenizer("char", ["say " + " ".join(WORDS)]))
    torch.manual_seed(0)
    base = save_run(folder / "base", TransformerLM(tiny_config(vocab_size=tok.vocab_size)), tok)
    rows = [
        {"prompt": f"say {a}", "chosen": a, "rejected": b} for a in WORDS for b in WORDS if a != b
    ]
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = folder / "data"
    args = ["prepare", "--task", "preference", str(folder / "pairs.jsonl"), "--out", str(data)]
    assert main([*args, "--tokenizer", str(base), "--val-fraction", "0.2"]) == 0
    run = folder / "run"
    args = ["train", "--objective", "dpo", "--init-from", str(base), "--data", str(data)]
    args += ["--out", str(run), "--batch-size", "4", "--lr", "1e-2", "--warmup-steps", "0"]
    assert (
        main([*args, "--max-steps", "8", "--eval-interval", "4", "--log-interval", "1", "--quiet"])
        == 0
    )
    return base, data, run


def test_each_loss_is_its_equation():
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(6, generator=g, dtype=torch.float64) * 3 for _ in range(4))
    beta, eps = 0.3, 0.2
    h = (pc - rc) - (pr - rr)
    sigma = lambda t: 1 / (1 + torch.exp(-t))  # noqa: E731
    loss, r_w, r_l = dpo_loss(pc, pr, rc, rr, beta)
    assert torch.allclose(loss, -torch.log(sigma(beta * h)))  # Rafailov et al. eq. 7
    assert torch.allclose(r_w, beta * (pc - rc)) and torch.allclose(r_l, beta * (pr - rr))
    conservative, _, _ = dpo_loss(pc, pr, rc, rr, beta, "cdpo", eps)
    written = -(1 - eps) * torch.log(sigma(beta * h)) - eps * torch.log(sigma(-beta * h))
    assert torch.allclose(conservative, written)
    lengths = (torch.tensor([1, 2, 3, 4, 5, 6.0]), torch.tensor([6, 5, 4, 3, 2, 1.0]))
    ipo, _, _ = dpo_loss(pc, pr, rc, rr, beta, "ipo", lengths=lengths)
    per_token = (pc - rc) / lengths[0] - (pr - rr) / lengths[1]
    assert torch.allclose(ipo, (per_token - 1 / (2 * beta)) ** 2)  # Azar et al. eq. 17
    zero = torch.zeros(1, dtype=torch.float64)
    assert dpo_loss(zero, zero, zero, zero, beta)[0].item() == pytest.approx(math.log(2))


def test_sequence_logprobs_sum_the_learned_targets_only():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 7, generator=g)
    targets = torch.randint(0, 7, (2, 5), generator=g)
    learned = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    logp = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(sequence_logprobs(logits, targets, learned), (logp * learned).sum(1))


def test_pairs_render_the_prompt_then_each_answer_and_learn_the_answer_only(pairs_run):
    base, data, _ = pairs_run
    prepared = PreferenceData(data)
    tok = chat_tokenizer(train_tokenizer("char", ["say " + " ".join(WORDS)]))
    ids, mask = prepared.split("train"), prepared.mask("train")
    offsets = prepared.offsets("train")
    assert prepared.pairs("train") == 24 and len(offsets) == 2 * 24 + 1
    want, _ = render(
        [{"role": "user", "content": "say cat"}, {"role": "assistant", "content": "dog"}], tok
    )
    a, b = offsets[1], offsets[2]  # pair 0's rejected answer: "dog"
    assert ids[a:b].tolist() == want
    learned = [t for t, m in zip(ids[a:b].tolist(), mask[a:b].tolist(), strict=True) if m]
    assert tok.decode(learned[:-1]) == "dog" and len(learned) == 4  # "dog" and <|end|>


@pytest.mark.parametrize(
    "record, rule",
    [
        ({"prompt": "say cat", "chosen": "cat"}, "no rejected"),
        ({"prompt": "say cat", "chosen": "cat", "rejected": "cat"}, "the same answer"),
        ({"prompt": [], "chosen": "a", "rejected": "b"}, "non-empty list of messages"),
        (
            {"prompt": "x", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
            "assistant",
        ),
    ],
)
def test_a_bad_pair_is_one_line_naming_its_file_and_line(tmp_path, capsys, record, rule):
    source = tmp_path / "pairs.jsonl"
    good = {"prompt": "say cat", "chosen": "cat", "rejected": "dog"}
    source.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    code = main(["prepare", "--task", "preference", str(source), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"tlm: error: {source}:2: ") and rule in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_dpo_run_learns_to_prefer_and_logs_its_rewards(pairs_run):
    _, _, run = pairs_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train_loss" in r]
    assert trained[0]["train_loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference
    assert trained[-1]["train_loss"] < trained[0]["train_loss"] - 0.1
    assert {"reward_margin", "reward_accuracy", "reward_chosen"} <= set(trained[-1])
    assert [r for r in rows if "val_loss" in r][-1]["val_reward_accuracy"] > 0.5
    card = (run / "MODEL_CARD.md").read_text()
    assert "dpo, loss `sigmoid`, beta 0.1" in card and (run / "reference.safetensors").is_file()


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "sigmoid+sft"])
def test_the_loss_and_first_layer_gradient_equal_trl_on_the_export(pairs_run, tmp_path, kind):
    """DPO's losses, and RPO's (sigmoid with the chosen answers' NLL at weight 0.5, TRL's
    loss_type ["sigmoid", "sft"]), on the same batch of the HF export."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    base, data, run = pairs_run
    for name, folder in (("base", base), ("run", run)):
        assert main(["export-hf", str(folder), str(tmp_path / name)]) == 0
    pairs = answer_pairs(PreferenceData(data), "train", 32, 0)
    rows = list(range(6))
    x, y, learned = pairs.batch(rows)
    policy, reference = load_model(run), load_model(base)
    policy.train()
    with torch.no_grad():
        ref = sequence_logprobs(reference(x), y, learned)
    logp = sequence_logprobs(policy(x), y, learned)
    lengths = learned.sum(1)
    kind, _, sft = kind.partition("+")
    ours, _, _ = dpo_loss(
        logp[:6], logp[6:], ref[:6], ref[6:], 0.1, kind, 0.0, (lengths[:6], lengths[6:])
    )
    ours = ours.mean() + (0.5 * chosen_nll(logp[:6], lengths[:6].sum()) if sft else 0)
    ours.backward()

    tokens = PreferenceData(data)
    ids, offsets = tokens.split("train"), tokens.offsets("train")
    examples = []
    for r in rows:
        pair = int(pairs.kept[r])
        chosen = ids[offsets[2 * pair] : offsets[2 * pair + 1]].tolist()
        rejected = ids[offsets[2 * pair + 1] : offsets[2 * pair + 2]].tolist()
        start = int(pairs.mask[offsets[2 * pair] :].argmax())  # the answer's first learned token
        examples.append(
            {
                "prompt_ids": chosen[:start],
                "chosen_ids": chosen[start:],
                "rejected_ids": rejected[start:],
            }
        )
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "run", dtype=torch.float32)
    hf_ref = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    config = DPOConfig(
        output_dir=str(tmp_path / "trl"), beta=0.1, loss_type=[kind, sft] if sft else [kind],
        loss_weights=[1.0, 0.5] if sft else None, report_to="none", bf16=False, use_cpu=True,
    )  # fmt: skip
    dataset = Dataset.from_list([{"prompt": "say cat", "chosen": "cat", "rejected": "dog"}])
    tok = AutoTokenizer.from_pretrained(tmp_path / "run")
    trainer = DPOTrainer(
        model=hf, ref_model=hf_ref, args=config, train_dataset=dataset, processing_class=tok
    )
    inputs = DataCollatorForPreference(pad_token_id=0)(examples)
    theirs = trainer._compute_loss(trainer.model, inputs, False)
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)
    d = policy.config.d_model
    our_grad = policy.blocks[0].attn.W_Q.grad  # [d, d]
    their_grad = hf.transformer.h[0].attn.c_attn.weight.grad[:, :d]  # W_Q | W_K | W_V
    assert torch.allclose(our_grad, their_grad, atol=1e-5)
    assert our_grad.abs().max() > 1e-4  # a gradient, not zeros on both sides


def test_sft_weight_adds_the_chosen_answers_nll_per_token_to_the_step(pairs_run, tmp_path):
    """--sft-weight w (RPO): the first step's loss is DPO's (log 2 a pair: the policy is
    still its reference) plus w × the NLL per token of the step's chosen answers, as the
    init run scores them; the card says so; a weight without DPO is refused."""
    base, data, _ = pairs_run
    run = tmp_path / "rpo"
    args = ["train", "--objective", "dpo", "--init-from", str(base), "--data", str(data)]
    args += ["--out", str(run), "--batch-size", "4", "--grad-accum", "2", "--sft-weight", "0.5"]
    assert main([*args, "--max-steps", "1", "--log-interval", "1", "--quiet"]) == 0
    pairs = answer_pairs(PreferenceData(data), "train", 32, 0)
    rows = PassOrder(len(pairs), 8, 1337).step(0).tolist()
    x, y, learned = pairs.batch(rows)
    with torch.no_grad():
        logp = sequence_logprobs(load_model(base)(x), y, learned)
    expected = math.log(2) + 0.5 * float(chosen_nll(logp[:8], learned[:8].sum()))
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged[0]["train_loss"] == pytest.approx(expected, abs=1e-5)
    assert "sft weight 0.5 (RPO)" in (run / "MODEL_CARD.md").read_text()
    lm = ["train", "--data", str(data), "--out", str(tmp_path / "lm"), "--sft-weight", "1"]
    assert main(lm) == 2


def test_eval_gives_the_runs_validation_figures_and_the_aligned_run_chats(pairs_run, capsys):
    base, data, run = pairs_run
    assert main(["eval", "--task", "preference", str(run), "--data", str(data), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "val_loss" in r][-1]  # the reference: the recorded init run
    assert got["loss"] == pytest.approx(last["val_loss"], abs=1e-5)
    assert got["accuracy"] == pytest.approx(last["val_reward_accuracy"])
    assert got["reference"] == str(base) and got["pairs"] == 6
    assert main(["eval", "--task", "preference", str(run), "--data", str(data), "--reference",
                 "none", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["reference"] is None
    assert main(["chat", str(run), "--message", "say cat", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.endswith("\n")  # an aligned run is a chat run: it answers
