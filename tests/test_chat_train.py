"""Instruction tuning: packed conversations are learned as if alone, the loss counts the
assistant's tokens only (normalised over the whole step), new special tokens get rows, a
step with nothing to learn is counted, and a tiny model learns to stop."""

import contextlib
import json
import os
import shutil
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from chatting import WORDS, chats
from chatting import base_and_data as make_base_and_data

from conftest import tiny_config
from tlm import TransformerLM, load_model
from tlm.chat import END, render
from tlm.cli import main
from tlm.config import TrainConfig
from tlm.data import ChatData, prepare_chat
from tlm.data.packing import best_fit, fitted
from tlm.tasks.chat import chat_loss, evaluate_chat
from tlm.tokenizer import load_tokenizer, train_tokenizer
from tlm.train import Runtime
from tlm.train.chat import ChatWindows
from tlm.train.loop import Trainer
from tlm.train.opening import initial_weights


@pytest.fixture(scope="module")
def base_and_data(tmp_path_factory):
    return make_base_and_data(tmp_path_factory.mktemp("chat"))


@pytest.mark.parametrize("position", ["rope", "learned"])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_documents_packed_in_a_window_are_computed_as_if_alone(position, norm):
    torch.manual_seed(0)
    model = TransformerLM(tiny_config(position=position, norm=norm)).eval()
    a, b = torch.randint(0, 97, (1, 9)), torch.randint(0, 97, (1, 14))
    window = torch.cat([a, b, torch.zeros(1, 9, dtype=torch.long)], dim=1)  # + padding
    documents = torch.tensor([[0] * 9 + [1] * 14 + [-1] * 9])
    packed = model(window, documents=documents)
    torch.testing.assert_close(packed[:, :9], model(a), atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[:, 9:23], model(b), atol=1e-5, rtol=0)


def test_best_fit_puts_each_piece_in_the_tightest_bin():
    assert best_fit([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 33, 300).tolist()
    bins = best_fit(lengths, 32)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(sum(lengths[i] for i in b) <= 32 for b in bins)
    assert len(bins) <= 1.1 * sum(lengths) / 32 + 1  # nearly full


def test_a_long_conversation_is_cut_after_its_last_whole_answer_or_dropped(base_and_data):
    _, data = base_and_data
    tok = load_tokenizer(data.folder)
    end = tok.special_id(END)
    messages = chats(3)[0]["messages"]  # two turns
    ids, mask = (np.array(x) for x in render(messages, tok))
    first_end = [i for i, t in enumerate(ids) if t == end and mask[i]][0] + 1
    assert fitted(ids, mask, len(ids) - 1, end) == len(ids)  # fits whole: n - 1 positions
    assert fitted(ids, mask, len(ids) - 2, end) == first_end  # cut after the first answer
    assert fitted(ids, mask, first_end - 2, end) == 0  # not even that: dropped


def test_the_loss_is_the_mean_over_the_answers_of_each_conversation_alone(base_and_data):
    base, data = base_and_data
    torch.manual_seed(1)
    model = TransformerLM(tiny_config(vocab_size=data.vocab_size, position="rope")).eval()
    tokens, mask, offsets = data.split("train"), data.mask("train"), data.offsets("train")
    total, count = 0.0, 0
    with torch.no_grad():
        for a, b in zip(offsets[:-1], offsets[1:], strict=True):
            ids = torch.tensor(tokens[a:b].astype(np.int64))
            logprobs = model(ids[None, :-1])[0].log_softmax(-1)
            nll = -logprobs.gather(1, ids[1:, None])[:, 0]
            learned = torch.from_numpy(mask[a + 1 : b].astype(bool))
            total, count = total + nll[learned].sum().item(), count + int(learned.sum())
    assert count == data.meta["splits"]["train"]["supervised"] - 0  # every answer token
    assert chat_loss(model, data, "train") == pytest.approx(total / count, abs=1e-5)


def test_the_users_tokens_do_not_count(tmp_path):
    tok = train_tokenizer("char", ["say " + " ".join(WORDS) + "?"])
    tok.save(tmp_path / "tokenizer.json")
    torch.manual_seed(0)
    model = TransformerLM(tiny_config(vocab_size=tok.vocab_size + 4)).eval()
    losses = []
    for tail in ("say moon", "say tree?"):  # a user turn after the last answer differs
        rows = [{"messages": m["messages"] + [{"role": "user", "content": tail}]} for m in chats(8)]
        (tmp_path / f"{tail}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = tmp_path / tail.replace(" ", "_")
        prepare_chat(
            [str(tmp_path / f"{tail}.jsonl")], out, str(tmp_path / "tokenizer.json"), val_fraction=0
        )  # noqa: E501
        losses.append(chat_loss(model, ChatData(out), "train"))
    assert losses[0] == losses[1]


def trainer_for(model):
    return SimpleNamespace(
        runtime=Runtime(), wrapped=model, forward=model, device=torch.device("cpu"),
        autocast=contextlib.nullcontext,
    )  # fmt: skip


def step_gradient(data, model, batch_size, grad_accum, step=0):
    config = TrainConfig(batch_size=batch_size, grad_accum=grad_accum, seed=3)
    windows = ChatWindows(data, model.config, config, world_size=1)
    model.zero_grad()
    loss = windows.step_loss(trainer_for(model), step)
    return loss, [p.grad.clone() for p in model.parameters()], windows


def test_the_step_is_normalised_over_all_its_answer_tokens_not_per_micro_batch(base_and_data):
    _, data = base_and_data
    torch.manual_seed(2)
    model = TransformerLM(tiny_config(vocab_size=data.vocab_size, position="rope"))
    one_loss, one, windows = step_gradient(data, model, 4, 1)
    accum_loss, accum, _ = step_gradient(data, model, 1, 4)
    assert one_loss == pytest.approx(accum_loss, abs=1e-6)
    for a, b in zip(one, accum, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    rows = windows.step_windows(0)  # the direct mean over the step's answer tokens
    x, y, learned, d = windows.train.batch(rows)
    model.zero_grad()
    logits = model(x, documents=d)
    loss = torch.nn.functional.cross_entropy(logits[learned], y[learned])
    loss.backward()
    assert one_loss == pytest.approx(loss.item(), abs=1e-6)
    torch.testing.assert_close(one[0], next(model.parameters()).grad, atol=1e-6, rtol=1e-5)


def test_a_step_with_nothing_to_learn_is_counted_and_changes_nothing(base_and_data, tmp_path):
    _, data = base_and_data
    shutil.copytree(data.folder, tmp_path / "data")
    np.zeros(len(data.mask("train")), dtype=np.uint8).tofile(tmp_path / "data" / "train.mask")
    torch.manual_seed(0)
    model = TransformerLM(tiny_config(vocab_size=data.vocab_size, position="rope"))
    config = TrainConfig(batch_size=4, seed=3)
    windows = ChatWindows(ChatData(tmp_path / "data"), model.config, config, world_size=1)
    assert windows.step_loss(trainer_for(model), 0) == 0.0
    assert windows.empty_steps == 1 and all(p.grad is None for p in model.parameters())


def test_new_special_tokens_start_as_the_mean_of_the_trained_rows(base_and_data):
    base, data = base_and_data
    E = load_model(base).embedding.E.detach()
    grown = initial_weights(str(base), tiny_config(vocab_size=data.vocab_size, position="rope"))
    assert grown["embedding.E"].shape == (E.shape[0] + 4, E.shape[1])
    torch.testing.assert_close(grown["embedding.E"][: E.shape[0]], E)
    torch.testing.assert_close(grown["embedding.E"][E.shape[0] :], E.mean(0).expand(4, -1))


def test_a_tiny_model_fine_tuned_on_conversations_learns_to_stop(base_and_data, tmp_path, capsys):
    base, data = base_and_data
    run = tmp_path / "chat"
    args = ["train", "--init-from", str(base), "--data", str(data.folder), "--out", str(run)]
    assert main([*args, "--max-steps", "60", "--lr", "3e-3", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "conversations in" in err and "padding" in err
    tok = load_tokenizer(run)
    card = (run / "MODEL_CARD.md").read_text()
    assert str(base) in card and "48 training" in card
    before = TransformerLM(tiny_config(vocab_size=data.vocab_size, position="rope")).eval()
    before.load_state_dict(initial_weights(str(base), before.config))
    start = evaluate_chat(before, tok, data, "val", max_new_tokens=12)
    after = evaluate_chat(load_model(run).eval(), tok, data, "val", max_new_tokens=12)
    assert start["stop_rate"] < 0.5 and after["stop_rate"] >= 0.9, (start, after)
    assert after["loss"] < start["loss"] - 1.0


def test_a_chat_run_interrupted_resumes_to_the_weights_of_an_uninterrupted_one(
    base_and_data, tmp_path, monkeypatch
):
    base, data = base_and_data
    args = ["train", "--init-from", str(base), "--data", str(data.folder), "--quiet"]
    args += ["--precision", "float32", "--max-steps", "8", "--eval-interval", "4"]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    step = Trainer.train_step

    def ctrl_c_at_step_5(self, s):  # Ctrl-C during step 5: it completes, is saved, stops
        if s == 4:
            os.kill(os.getpid(), signal.SIGINT)
        return step(self, s)

    monkeypatch.setattr(Trainer, "train_step", ctrl_c_at_step_5)
    assert main([*args, "--out", str(tmp_path / "half")]) == 130
    monkeypatch.undo()
    assert main(["train", "--out", str(tmp_path / "half"), "--resume", "--quiet"]) == 0
    whole, half = (load_model(tmp_path / n).state_dict() for n in ("whole", "half"))
    for name in whole:
        torch.testing.assert_close(whole[name], half[name], atol=1e-6, rtol=0)


def test_a_resumed_run_counts_the_steps_with_nothing_to_learn_before_and_after(
    base_and_data, tmp_path, monkeypatch
):
    """The count of steps without a learned token is saved with the checkpoint: a run
    stopped at step 2 and resumed to 4 has the card of one run straight to 4, and a
    checkpoint saved before the count was kept resumes from 0."""
    base, data = base_and_data
    shutil.copytree(data.folder, tmp_path / "data")  # no answer token: every step is empty
    np.zeros(len(data.mask("train")), dtype=np.uint8).tofile(tmp_path / "data" / "train.mask")
    monkeypatch.setattr("tlm.train.loop.plot_losses", lambda *a: None)  # (cheaper: not read)
    args = ["train", "--init-from", str(base), "--data", str(tmp_path / "data"), "--quiet"]
    args += ["--max-steps", "4", "--eval-interval", "4", "--batch-size", "2"]
    args += ["--precision", "float32"]

    def counted(run):
        card = (tmp_path / run / "MODEL_CARD.md").read_text()
        return int(card.split("Steps with no learned token: ")[1].split(".")[0])

    assert main([*args, "--out", str(tmp_path / "whole")]) == 0 and counted("whole") == 4
    step = Trainer.train_step

    def ctrl_c_at_step_2(self, s):  # Ctrl-C during step 2: it completes, is saved, stops
        if s == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return step(self, s)

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "train_step", ctrl_c_at_step_2)
        for run in ("half", "old"):
            assert main([*args, "--out", str(tmp_path / run)]) == 130
    state = next((tmp_path / "old" / "train_state").glob("step-*")) / "state.json"
    saved = json.loads(state.read_text())
    assert saved.pop("batches") == {"empty_steps": 2}
    state.write_text(json.dumps(saved))  # as a checkpoint from before the count was saved
    for run in ("half", "old"):
        assert main(["train", "--out", str(tmp_path / run), "--resume", "--quiet"]) == 0
    assert counted("half") == counted("whole") and counted("old") == 2


@pytest.mark.slow
def test_two_processes_fine_tune_as_one_with_the_same_global_batch(base_and_data, tmp_path):
    from test_distributed import assert_close_weights, finish, torchrun

    base, data = base_and_data
    args = ["train", "--init-from", str(base), "--data", str(data.folder), "--quiet"]
    args += ["--precision", "float32", "--max-steps", "12", "--eval-interval", "6", "--lr", "3e-3"]
    assert main([*args, "--out", str(tmp_path / "one"), "--batch-size", "4"]) == 0
    out, _ = finish(
        torchrun(*args, "--out", str(tmp_path / "two"), "--batch-size", "1", "--grad-accum", "4")
    )  # noqa: E501
    assert out.count("done: step") == 1
    assert_close_weights(tmp_path / "two", tmp_path / "one")
    logged = [
        [json.loads(r) for r in (tmp_path / n / "metrics.jsonl").open() if "train_loss" in r]
        for n in ("one", "two")
    ]
    for key in ("train_loss", "grad_norm"):  # Adam would hide a gradient of the wrong scale
        one, two = ([r[key] for r in rows] for rows in logged)
        assert one == pytest.approx(two, abs=1e-4), key


def test_conversations_refuse_windows_at_documents(base_and_data, tmp_path, capsys):
    """Conversations are packed whole already: `--windows documents` is for a token stream."""
    base, data = base_and_data
    args = ["train", "--init-from", str(base), "--data", str(data.folder), "--max-steps", "1"]
    assert main([*args, "--out", str(tmp_path / "run"), "--windows", "documents"]) == 2
    assert "conversations and pairs are packed whole already" in capsys.readouterr().err
