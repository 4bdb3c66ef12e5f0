"""§10.7 tasks as word prediction: scoring, classification, multiple choice, Q/A, tl;dr,
and evaluation with a stride."""

import json
import math

import numpy as np
import pytest
import torch
import transformers  # a dev dependency: missing, it must fail, not skip

from conftest import varied_char_run
from tlm import load_model, load_tokenizer
from tlm.cli import main
from tlm.evaluate import evaluate_tokens
from tlm.model.loss import cross_entropy
from tlm.tasks import (
    TaskError,
    answer,
    classify,
    encode_pair,
    multiple_choice,
    score,
    summarize,
)
from tlm.tasks.score import score_reference
from tlm.tokenizer import CharTokenizer, InputTooLong


@pytest.fixture(scope="module")
def run(docs_chars, tmp_path_factory):
    """A run of a random char model whose predictions depend on the context."""
    return varied_char_run(docs_chars, tmp_path_factory.mktemp("runs") / "tiny", context_length=40)


def test_a_score_is_the_sum_of_one_forward_pass(run):
    model, tok = load_model(run), load_tokenizer(run)
    context = "The for statement "
    continuations = ["x", "is used to iterate", " loops", "for"]
    scored = score(model, tok, context, continuations)
    for s, continuation in zip(scored, continuations, strict=True):
        ctx, cont = encode_pair(tok, context, continuation)
        reference = score_reference(model, torch.tensor([ctx + cont]), len(ctx))
        assert s.tokens == cont and len(s.logprobs) == len(cont)
        assert torch.allclose(torch.tensor(s.logprobs), reference, atol=1e-5)
        assert s.logprob == pytest.approx(reference.sum().item(), abs=1e-4)
        assert s.bytes == len(tok.decode(cont).encode())
    greedy = model.generate(torch.tensor([[tok.eot_id, *tok.encode("The for")]]), max_new_tokens=5)
    text = tok.decode(greedy[0, -5:].tolist())
    assert score(model, tok, "The for", [text])[0].greedy  # what greedy decoding produces
    assert not score(model, tok, "The for", [text[:-1] + ("q" if text[-1] != "q" else "z")])[
        0
    ].greedy


def test_a_text_longer_than_the_context_is_refused_as_everywhere(run):
    """The model reads 40 tokens: a context and continuation that fit exactly are scored,
    one more is refused in one line (`tokenizer.within`), never cut short."""
    model, tok = load_model(run), load_tokenizer(run)
    fits = "The " * 9 + "Th"  # <|endoftext|> + 38 characters, then the continuation "e " (-1)
    assert len(score(model, tok, fits, ["e "])) == 1
    with pytest.raises(InputTooLong, match="has 41 tokens; the model reads at most 40"):
        score(model, tok, fits + "e", ["e "])


def test_classify_on_a_character_model_without_braces_in_its_vocabulary(make_model):
    """The labels are checked after the template's end, never encoded with "{text}" in it:
    a character model that cannot spell "{" classifies (it used to refuse every template)."""
    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz .:")
    model = make_model(vocab_size=tok.vocab_size)
    results = classify(model, tok, ["a good day", "a bad day"], ["yes", "no"], "{text}. ok:")
    assert [sorted(r.probabilities) for r in results] == [["no", "yes"]] * 2
    with pytest.raises(TaskError, match="labels 'yes' and 'yes' tokenize to the same"):
        classify(model, tok, ["a day"], ["yes", "yes"], "{text}. ok:")


def test_the_contexts_trailing_space_belongs_to_the_continuation(bpe_tokenizer):
    spaced = encode_pair(bpe_tokenizer, "The sentiment is: ", "positive")
    assert spaced == encode_pair(bpe_tokenizer, "The sentiment is:", " positive")
    ctx, cont = spaced
    assert bpe_tokenizer.decode(cont) == " positive" and ctx[0] == bpe_tokenizer.eot_id


def test_scores_equal_transformers_on_a_gpt2_directory(gpt2_dir):
    hf = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    model, tok = load_model(gpt2_dir), load_tokenizer(gpt2_dir)
    context, continuations = "A list is a", [" sequence", " mutable object", "n error"]
    for s, continuation in zip(
        score(model, tok, context, continuations), continuations, strict=True
    ):
        ctx, cont = encode_pair(tok, context, continuation)
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logprobs = hf(ids).logits.log_softmax(-1)[0]
        expected = logprobs[len(ctx) - 1 : -1].gather(1, ids[0, len(ctx) :, None])[:, 0]
        assert torch.allclose(torch.tensor(s.logprobs), expected, atol=1e-4)


@pytest.mark.slow
def test_classify_picks_the_label_with_the_higher_probability(run):
    model, tok = load_model(run), load_tokenizer(run)
    template, labels = 'The word "{text}" is', ["good", "bad", "odd"]
    texts = ["nice", "awful", "strange", "fine"]
    for result, text in zip(classify(model, tok, texts, labels, template), texts, strict=True):
        sums = []
        for label in labels:  # the direct computation: one forward pass per label
            ctx, cont = encode_pair(tok, template.replace("{text}", text), " " + label)
            sums.append(score_reference(model, torch.tensor([ctx + cont]), len(ctx)).sum())
        assert result.label == labels[int(torch.stack(sums).argmax())]
        probs = torch.stack(sums).softmax(0)
        assert list(result.probabilities.values()) == pytest.approx(probs.tolist(), abs=1e-4)


@pytest.mark.slow
def test_classify_command_accuracy_and_confusion_on_a_hand_made_file(run, tmp_path, capsys):
    model, tok = load_model(run), load_tokenizer(run)
    template, labels = "{text} is", ["good", "bad"]
    texts = ["nice", "awful", "fine", "poor", "great", "sad"]
    predicted = [r.label for r in classify(model, tok, texts, labels, template)]
    gold = ["good", "bad", "good", "bad", "good", "bad"]
    data = tmp_path / "in.jsonl"
    data.write_text(
        "".join(
            json.dumps({"text": t, "label": g}) + "\n" for t, g in zip(texts, gold, strict=True)
        )
    )
    args = ["classify", str(run), "--labels", "good,bad", "--template", template]
    assert main([*args, "--input", str(data), "--gold-field", "label", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in out["results"]] == predicted
    right = [p == g for p, g in zip(predicted, gold, strict=True)]
    p = sum(right) / 6
    assert out["summary"]["acc"] == pytest.approx(p)
    assert out["summary"]["acc_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / 5))
    expected = [[0, 0], [0, 0]]
    for g, pr in zip(gold, predicted, strict=True):
        expected[labels.index(g)][labels.index(pr)] += 1
    assert out["summary"]["confusion"] == expected
    tsv = tmp_path / "in.tsv"
    tsv.write_text("".join(f"{t}\t{g}\n" for t, g in zip(texts, gold, strict=True)))
    assert main([*args, "--input", str(tsv), "--gold-field", "x", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["confusion"] == expected


def test_multiple_choice_accuracy_by_sum_and_per_byte(run, tmp_path, capsys):
    model, tok = load_model(run), load_tokenizer(run)
    items = [
        {"context": "The for", "choices": [" statement", " x", " loop loop"], "gold": 0},
        {"context": "A list", "choices": [" is", " of things"], "gold": 1},
        {"context": "def f(x):", "choices": ["\n    return x", " pass", "!"], "gold": 2},
    ]
    results = multiple_choice(model, tok, items)
    picks_sum, picks_byte = [], []
    for item in items:
        scored = score(model, tok, item["context"], item["choices"])
        picks_sum.append(int(np.argmax([s.logprob for s in scored])))
        picks_byte.append(int(np.argmax([s.logprob / s.bytes for s in scored])))
    assert results["acc"] == pytest.approx(
        np.mean([p == it["gold"] for p, it in zip(picks_sum, items, strict=True)])
    )
    assert results["acc_norm"] == pytest.approx(
        np.mean([p == it["gold"] for p, it in zip(picks_byte, items, strict=True)])
    )
    assert results["chance"] == pytest.approx((1 / 3 + 1 / 2 + 1 / 3) / 3)
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(it) + "\n" for it in items))
    assert main(["score", str(run), "--choices", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["acc"] == results["acc"]


@pytest.mark.parametrize("T, length", [(8, 30), (8, 9), (13, 50)])
def test_stride_one_scores_each_token_with_its_full_window(make_model, T, length):
    model = make_model(context_length=T)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    tokens = np.random.default_rng(0).integers(0, 97, length).astype(np.uint16)
    ones = np.ones(97, dtype=np.int64)
    strided = evaluate_tokens(model, tokens, ones, batch_size=4, stride=1)
    ids = torch.from_numpy(tokens.astype(np.int64))
    nll = []
    for t in range(1, length):  # token t given ids[max(0, t - T) : t]
        window = ids[max(0, t - T) : t][None]
        with torch.no_grad():
            nll.append(-model(window)[0, -1].log_softmax(-1)[ids[t]].item())
    assert strided["tokens"] == length - 1
    assert strided["loss"] == pytest.approx(float(np.mean(nll)), abs=1e-5)
    plain = evaluate_tokens(model, tokens, ones, batch_size=4)
    for stride in (T, T + 5, length + 3):  # stride >= the window: plain evaluation
        assert evaluate_tokens(model, tokens, ones, 4, stride=stride)["loss"] == plain["loss"]
    if length > 2 * T:  # a stride between gives a loss between, every token once
        middle = evaluate_tokens(model, tokens, ones, batch_size=4, stride=T // 2)
        assert middle["tokens"] == length - 1


def test_eval_command_takes_a_stride(run, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("The for statement is used to iterate over the elements of a sequence.")
    assert main(["eval", str(run), "--text", str(text), "--json", "--stride", "1"]) == 0
    strided = json.loads(capsys.readouterr().out)
    model, tok = load_model(run), load_tokenizer(run)
    ids = torch.tensor([tok.eot_id, *tok.encode(text.read_text())])
    T = model.config.context_length
    with torch.no_grad():
        nll = [
            cross_entropy(model(ids[max(0, t - T) : t][None])[:, -1:], ids[t : t + 1][None]).item()
            for t in range(1, len(ids))
        ]
    assert strided["stride"] == 1 and strided["loss"] == pytest.approx(np.mean(nll), abs=1e-5)
    assert main(["eval", str(run), "--text", str(text), "--stride", "0"]) == 2
    assert "stride must be in [1, 40]" in capsys.readouterr().err


def test_answer_and_summarize_continue_their_prompt_formats(run):
    model, tok = load_model(run), load_tokenizer(run)

    def greedy_line(prompt):
        ids = torch.tensor([[tok.eot_id, *tok.encode(prompt)]])
        out = model.generate(ids, max_new_tokens=12)[0, ids.shape[1] :].tolist()
        return tok.decode(out).split("\n")[0].strip()

    assert answer(model, tok, "What is a list?", max_new_tokens=12) == greedy_line(
        "Q: What is a list?\nA:"
    )
    context = "Lists: seq."  # the whole prompt fits the 40 tokens the model reads
    assert answer(model, tok, "What is a list?", context, 12) == greedy_line(
        "Lists: seq.\n\nQ: What is a list?\nA:"
    )
    assert summarize(model, tok, "A long text.\n", 12) == greedy_line("A long text.\ntl;dr:")


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["classify", "--labels", "good,bad", "--template", "no slot"],
            "the template has no {text}",
        ),
        (
            ["classify", "--labels", "good, ", "--template", "{text} is"],
            "label '' tokenizes to nothing",
        ),
        (
            ["classify", "--labels", "good,good", "--template", "{text}"],
            "tokenize to the same tokens",
        ),
        (["score", "--choices", "BAD"], "BAD:2: no string field 'context'"),
        (["score", "--context", "x", "--continuation", ""], "tokenizes to nothing"),
        (
            [
                "classify",
                "--labels",
                "a,b",
                "--template",
                "{text}",
                "--input",
                "BAD_CLS",
                "--gold-field",
                "label",
            ],
            "BAD_CLS.jsonl:1: no string field 'label'",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(run, tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "BAD").write_text(
        '{"context": "a", "choices": ["x", "y"], "gold": 0}\n{"gold": 1}\n'
    )
    (tmp_path / "BAD_CLS.jsonl").write_text('{"text": "a"}\n')
    args = [a.replace("BAD_CLS", "BAD_CLS.jsonl") if a == "BAD_CLS" else a for a in args]
    if "classify" in args and "--input" not in args:
        args += ["--input", str(tmp_path / "in.txt")]
        (tmp_path / "in.txt").write_text("nice\n")
    assert main([args[0], str(run), *args[1:]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tlm: error:") and message in err and err.count("\n") == 1


def test_empty_or_one_token_text_is_refused(run, tmp_path, capsys):
    for content in ("", "a"):
        path = tmp_path / "t.txt"
        path.write_text(content)
        assert main(["eval", str(run), "--text", str(path)]) == 2
        assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(TaskError, match="the question is empty"):
        answer(load_model(run), load_tokenizer(run), "  ")


def test_the_three_rankings_sum_per_token_per_byte():
    from tlm.tasks import Scored
    from tlm.tasks.choose import best

    def option(total, n_tokens, n_bytes):
        return Scored("", [0] * n_tokens, [total / n_tokens] * n_tokens, False, n_bytes)

    options = [option(-6, 3, 12), option(-4, 1, 2), option(-5, 5, 5)]
    assert best(options) == {"acc": 1, "acc_per_token": 2, "acc_norm": 0}


def test_the_documented_word_order_sets_pair_equal_characters():
    from pathlib import Path

    from tlm.tasks.inputs import read_choices

    folder = Path(__file__).resolve().parents[1] / "docs" / "tasks"
    for name, n in (("python-word-order.jsonl", 41), ("shakespeare-word-order.jsonl", 30)):
        items = read_choices(str(folder / name))
        assert len(items) == n
        for item in items:
            right, wrong = item["choices"][item["gold"]], item["choices"][1 - item["gold"]]
            assert sorted(right) == sorted(wrong) and right != wrong
            assert right.split(" ")[0] == wrong.split(" ")[0]
