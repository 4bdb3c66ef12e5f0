"""Fine-tuning an encoder (issue 66, J&M §11.4): labeled examples read and refused in one
line, encoded as BERT reads them, accuracy and F1 held to scikit-learn's and seqeval's, runs
that learn to classify and to tag, the commands, and BertFor*Classification parity."""

import json
import random

import numpy as np
import pytest
import torch

from conftest import WORDS
from tlm.cli import main
from tlm.data.corpus import CorpusError
from tlm.data.labeled import IGNORED, Example, encode_example, read_labeled
from tlm.evaluate import accuracy_f1, entity_f1, labeled_scores, padded, task_loss
from tlm.load import load_model, load_tokenizer
from tlm.train.order import PassOrder

KEYWORDS = ("import", "return")


def classified(n: int, seed: int) -> list[dict]:
    """Texts of random words, labeled by whether "import" is among them."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(3, 8))
        rows.append({"text": " ".join(words), "label": "yes" if "import" in words else "no"})
    return rows


def tagged(n: int, seed: int) -> list[dict]:
    """Random words, the keywords tagged B-KW (and a following "object" I-KW)."""
    rng, rows = random.Random(seed), []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(3, 8))
        tags = ["B-KW" if w in KEYWORDS else "O" for w in words]
        tags = [
            "I-KW" if w == "object" and i and tags[i - 1] != "O" else t
            for i, (w, t) in enumerate(zip(words, tags, strict=True))
        ]
        rows.append({"tokens": words, "tags": tags})
    return rows


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, words_mlm):
    """A classifier and a tagger fine-tuned from the words encoder, and the files."""
    folder = tmp_path_factory.mktemp("finetune")
    files = {
        "classify": write(folder / "cls.jsonl", classified(600, 0)),
        "tag": write(folder / "tag.jsonl", tagged(600, 1)),
    }
    for task, file in files.items():
        args = ["train", "--task", task, "--init-from", str(words_mlm), "--data", str(file)]
        args += ["--out", str(folder / task), "--max-steps", "100", "--batch-size", "16"]
        args += ["--lr", "1e-3", "--warmup-steps", "10", "--eval-interval", "50", "--quiet"]
        assert main(args) == 0
    return folder, files


def test_runs_learn_to_classify_and_to_tag(runs):
    folder, _ = runs
    for task, least in (("classify", 0.75), ("tag", 0.9)):
        rows = (folder / task / "metrics.jsonl").read_text().splitlines()
        last = [json.loads(r) for r in rows if "val_f1" in r][-1]
        assert last["val_accuracy"] > least and last["val_f1"] > least, (task, last)
        model = load_model(folder / task)
        assert model.config.task == task and not hasattr(model, "W_T")  # the MLM head is gone
    card = (folder / "tag" / "MODEL_CARD.md").read_text()
    assert "`O`, `B-KW`, `I-KW`" in card and "tlm tag" in card


def test_the_commands(runs, capsys):
    folder, files = runs
    assert main(["eval", str(folder / "tag"), "--data", str(files["tag"]), "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["n"] == 600 and scores["f1"] > 0.85
    assert main(["classify", str(folder / "classify"), "module import string", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["label"] == "yes" and abs(sum(got["probabilities"].values()) - 1) < 1e-5
    assert main(["tag", str(folder / "tag"), "python import module return", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tags"] == ["O", "B-KW", "O", "B-KW"]
    assert main(["classify", str(folder / "tag"), "python"]) == 2
    assert "not fine-tuned to classify" in capsys.readouterr().err
    assert main(["fill-mask", str(folder / "tag"), "pyt[MASK]on"]) == 2
    assert "fine-tuned to tag: its MLM head is gone" in capsys.readouterr().err


def test_labeled_files_are_refused_in_one_line(tmp_path, words_mlm, capsys):
    bad = {
        '{"tokens": ["a", "b"], "tags": ["O"]}': "2 tokens but 1 tags",
        '{"tokens": "a b", "tags": ["O"]}': "a tagged example has 'tokens' and 'tags'",
        '{"tokens": ["", "a"], "tags": ["O", "O"]}': "token 0 is empty",
        '{"tokens": ["pyth\u00f6n"], "tags": ["O"]}': "character 'ö' is not in the tokenizer",
    }
    for line, message in bad.items():
        write(tmp_path / "bad.jsonl", [{"tokens": ["python"], "tags": ["O"]}])
        with open(tmp_path / "bad.jsonl", "a") as f:
            f.write(line + "\n")
        args = [
            "train",
            "--task",
            "tag",
            "--init-from",
            str(words_mlm),
            "--out",
            str(tmp_path / "r"),
        ]
        assert main([*args, "--data", str(tmp_path / "bad.jsonl")]) == 2
        err = capsys.readouterr().err
        assert f"bad.jsonl:2: {message}" in err and err.count("\n") == 1
    with pytest.raises(CorpusError, match=r"cls.jsonl:1: 'label'"):
        read_labeled(write(tmp_path / "cls.jsonl", [{"text": "a"}]), "classify")


def test_the_split_and_the_labels(tmp_path):
    rows = classified(300, 2)
    shuffled = random.Random(0).sample(rows, len(rows))
    a, b = (read_labeled(write(tmp_path / f"{n}.jsonl", r), "classify") for n, r in
            (("a", rows), ("b", shuffled)))  # fmt: skip
    assert sorted(e.first for e in a.val) == sorted(e.first for e in b.val)  # by hash, not order
    assert 10 < len(a.val) < 60 and a.labels == ("no", "yes")
    two = [{"text": f"x{i}", "label": 10 - i % 2} for i in range(40)]
    numbers = read_labeled(write(tmp_path / "n.jsonl", two), "classify")
    assert numbers.labels == ("9", "10")  # numbers in their order
    assert read_labeled(write(tmp_path / "t.jsonl", tagged(50, 3)), "tag").labels[0] == "O"


def test_examples_are_encoded_as_bert_reads_them(words_mlm):
    tok = load_tokenizer(words_mlm)
    cls, sep = tok.special_id("[CLS]"), tok.special_id("[SEP]")
    pair = encode_example(Example("w", "python", "module", 1), tok, "classify", 32)
    assert pair.ids == [cls, *tok.encode("python"), sep, *tok.encode("module"), sep]
    assert pair.segments == [0] * 8 + [1] * 7 and not pair.cut
    cut = encode_example(Example("w", "python" * 4, "module", 1), tok, "classify", 16)
    assert len(cut.ids) == 16 and cut.cut and cut.ids.count(sep) == 2  # the longer one cut
    words = encode_example(Example("w", ("python", "import"), None, (0, 1)), tok, "tag", 32)
    assert words.ids == [cls, *tok.encode("python"), *tok.encode(" import"), sep]
    assert words.label == [IGNORED, 0] + [IGNORED] * 5 + [1] + [IGNORED] * 6 + [IGNORED]


def test_scores_are_scikit_learns_and_seqevals():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    seqeval_metrics = pytest.importorskip("seqeval.metrics")
    rng = random.Random(0)
    for n_labels in (2, 3):
        gold = [rng.randrange(n_labels) for _ in range(200)]
        guess = [g if rng.random() < 0.7 else rng.randrange(n_labels) for g in gold]
        ours = accuracy_f1(gold, guess, n_labels)
        average = "binary" if n_labels == 2 else "macro"
        assert ours["f1"] == pytest.approx(sklearn_metrics.f1_score(gold, guess, average=average))
        assert ours["accuracy"] == pytest.approx(sklearn_metrics.accuracy_score(gold, guess))
    tags = ["O", "B-X", "I-X", "B-Y", "I-Y"]
    gold = [[rng.choice(tags) for _ in range(rng.randint(1, 12))] for _ in range(300)]
    guess = [[t if rng.random() < 0.7 else rng.choice(tags) for t in row] for row in gold]
    assert entity_f1(gold, guess)["f1"] == pytest.approx(seqeval_metrics.f1_score(gold, guess))


def test_a_pass_grouped_by_length_takes_every_example_once_in_steps_of_like_length():
    """Grouped steps (--group-by-length, the default) pad little, take each example once a
    pass also where passes and steps do not align, in an order drawn again on resume."""
    lengths = [random.Random(n).randint(3, 120) for n in range(1000)]
    grouped = PassOrder(1000, 32, 7, lengths)
    steps = [grouped.step(s) for s in range(94)]  # 3,008 items: three passes and a bit
    stream = np.concatenate(steps)
    for e in range(3):
        assert sorted(stream[e * 1000 : (e + 1) * 1000].tolist()) == list(range(1000))
    longest = [max(lengths[i] for i in step) for step in steps]
    used = sum(lengths[i] for i in stream) / (32 * sum(longest))
    assert used > 0.85, used  # drawn at random: about 0.3 of each step is text
    assert longest[:31] != sorted(longest[:31]) and longest[:31] != sorted(longest[:31])[::-1]
    again = PassOrder(1000, 32, 7, lengths)
    assert [again.step(s).tolist() for s in (60, 3)] == [steps[60].tolist(), steps[3].tolist()]


@pytest.mark.parametrize("task", ["classify", "tag"])
def test_validation_scores_each_example_as_alone(runs, words_mlm, task):
    """labeled_scores sorts the examples by length into batches: its loss, accuracy and F1
    are those of each example scored by itself, in the file's order."""
    folder, files = runs
    model, tok = load_model(folder / task), load_tokenizer(words_mlm)
    data = read_labeled(str(files[task]), task)
    examples = [encode_example(e, tok, task, 32) for e in data.val]
    pad = tok.special_id("[PAD]")
    total = scored = 0
    guesses = []
    with torch.no_grad():
        for e in examples:
            ids, segments, mask, labels = padded([e], pad)
            logits = model(ids, segments, mask)
            n = int((labels != IGNORED).sum())
            total, scored = total + task_loss(logits, labels).item() * n, scored + n
            best = logits.argmax(-1)[0]
            guesses.append(best.item() if task == "classify" else best[labels[0] != IGNORED])
    got = labeled_scores(model, examples, task, data.labels, pad, "cpu")
    assert got["loss"] == pytest.approx(total / scored, rel=1e-5)
    if task == "classify":
        gold = [e.label for e in examples]
        assert got == {"loss": got["loss"], **accuracy_f1(gold, guesses, 2)}
    else:
        gold = [[data.labels[t] for t in e.label if t != IGNORED] for e in examples]
        names = [[data.labels[t] for t in g.tolist()] for g in guesses]
        assert got == {"loss": got["loss"], **entity_f1(gold, names)}


def test_a_classifier_starts_from_the_pretrained_pooler():
    """Fine-tuned from an encoder pretrained with NSP, a classifier keeps its pooler (BERT's
    [CLS] representation trained by NSP); its W_C starts as seeded; the NSP head is left."""
    from conftest import tiny_config
    from tlm.model import Encoder
    from tlm.train.opening import _load_initial

    torch.manual_seed(0)
    pretrained = Encoder(tiny_config(model_type="encoder", nsp=True))
    classifier = Encoder(tiny_config(model_type="encoder", task="classify", labels=("a", "b")))
    seeded = classifier.W_C.detach().clone()
    _load_initial(classifier, pretrained.state_dict())
    assert torch.equal(classifier.W_P, pretrained.W_P) and torch.equal(classifier.W_C, seeded)
    assert torch.equal(classifier.blocks[0].attn.W_Q, pretrained.blocks[0].attn.W_Q)


@pytest.mark.parametrize("task", ["classify", "tag"])
def test_transformers_computes_the_fine_tuned_heads(runs, words_mlm, task, tmp_path):
    """A BERT-shaped encoder (post-norm, learned positions) fine-tuned a few steps, exported
    as BertFor{Sequence,Token}Classification: transformers' logits are tlm's, and tlm reads
    the export back."""
    transformers = pytest.importorskip("transformers")
    from conftest import save_run, tiny_config
    from tlm.model import Encoder

    _, files = runs
    tok = load_tokenizer(words_mlm)
    torch.manual_seed(0)
    base = Encoder(tiny_config(model_type="encoder", norm="post", vocab_size=tok.vocab_size))
    with torch.no_grad():
        for name, p in base.named_parameters():
            p.normal_(1.0 if name.endswith("gamma") else 0.0, 0.2)
    save_run(tmp_path / "base", base, tok)
    args = ["train", "--task", task, "--init-from", str(tmp_path / "base"), "--data"]
    args += [str(files[task]), "--out", str(tmp_path / "run"), "--max-steps", "3", "--quiet"]
    assert main(args) == 0
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    name = {"classify": "BertForSequenceClassification", "tag": "BertForTokenClassification"}
    theirs = getattr(transformers, name[task]).from_pretrained(tmp_path / "hf").eval()
    ours, back = load_model(tmp_path / "run"), load_model(tmp_path / "hf")
    ids = torch.randint(0, tok.vocab_size, (2, 12))
    mask = torch.tensor([[1] * 12, [1] * 9 + [0] * 3])
    with torch.no_grad():
        want = theirs(input_ids=ids, attention_mask=mask).logits
        assert torch.allclose(want[0], ours(ids, None, mask)[0], atol=1e-5)
        assert torch.allclose(back(ids, None, mask), ours(ids, None, mask), atol=1e-6)
    assert theirs.config.id2label == dict(enumerate(ours.config.labels))
    assert back.config.labels == ours.config.labels and back.config.task == task
