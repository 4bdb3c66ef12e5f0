"""Verifiable rewards and prompts to check them on (issue 63, parts 3 and 6): the built-in
verifiers, a user's module:function, pass@k's estimator, `tlm prepare --task prompts` and
`tlm eval --task verify`."""

import itertools
import json

import pytest
import torch

from conftest import save_run, tiny_config
from tlm import TransformerLM
from tlm.chat import chat_tokenizer, render
from tlm.cli import main
from tlm.data import PromptData
from tlm.tasks.verify import pass_at_k
from tlm.tokenizer import train_tokenizer
from tlm.train.rewards import RewardError, json_schema, number, regex, reward_of

WORDS = ["cat", "dog", "sun", "moon"]


@pytest.mark.parametrize(
    "reply, answer, want",
    [
        ("so it is 1,234.", 1234, 1.0),
        ("12, then 13", "13", 1.0),
        ("3.0", 3, 1.0),
        ("13 then 12", 13, 0.0),
        ("no number", 7, 0.0),
        ("-5", "-5", 1.0),
    ],
)
def test_number_compares_the_replys_last_number(reply, answer, want):
    assert number(reply, answer) == want


def test_regex_matches_the_whole_reply_and_json_schema_validates():
    assert regex(" cats\n", "cats?") == 1.0 and regex("cats and dogs", "cats?") == 0.0
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert json_schema('{"n": 3}', schema) == 1.0
    assert json_schema('{"n": "3"}', schema) == 0.0 and json_schema("not json", schema) == 0.0
    assert json_schema('{"n": 3}', json.dumps(schema)) == 1.0  # a schema given as text
    with pytest.raises(RewardError, match="not a regular expression"):
        regex("x", "(")


def test_a_users_reward_is_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def loud(reply, answer):\n    return float(reply.isupper())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert reward_of("my_rewards:loud")("YES", None) == 1.0
    for bad, message in (("nope", "must be one of"), ("no_such_module:f", "cannot use reward")):
        with pytest.raises(RewardError, match=message):
            reward_of(bad)


@pytest.mark.parametrize(
    "n, c, k", [(8, 0, 1), (8, 3, 1), (8, 3, 8), (5, 2, 3), (6, 6, 2), (4, 1, 4)]
)
def test_pass_at_k_is_the_chance_that_one_of_k_drawn_from_n_is_correct(n, c, k):
    correct = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(correct, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


@pytest.fixture
def prompts_run(tmp_path):
    tok = chat_tokenizer(train_tokenizer("char", ["say " + " ".join(WORDS)]))
    torch.manual_seed(0)
    run = save_run(tmp_path / "run", TransformerLM(tiny_config(vocab_size=tok.vocab_size)), tok)
    rows = [{"prompt": f"say {w}", "answer": w} for w in WORDS]
    rows.append({"prompt": [{"role": "user", "content": "say sun"}], "answer": "sun"})
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = tmp_path / "data"
    args = ["prepare", "--task", "prompts", str(tmp_path / "prompts.jsonl"), "--out", str(data)]
    assert main([*args, "--tokenizer", str(run), "--val-fraction", "0.4"]) == 0
    return run, data, tok


def test_prompts_render_up_to_the_assistants_marker_with_their_answers(prompts_run):
    _, data, tok = prompts_run
    prepared = PromptData(data)
    want, _ = render([{"role": "user", "content": "say dog"}], tok, generation=True)
    assert prepared.prompt("train", 1) == want and prepared.answers("train") == WORDS[:3]
    assert prepared.answers("val") == ["moon", "sun"] and not prepared.mask("train").any()


def test_a_bad_prompt_record_is_one_line(tmp_path, capsys):
    source = tmp_path / "p.jsonl"
    source.write_text('{"prompt": "say cat", "answer": "cat"}\n{"prompt": "say dog"}\n')
    assert main(["prepare", "--task", "prompts", str(source), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"tlm: error: {source}:2: a record is an object with a prompt and an answer"


def test_eval_verify_counts_passes_by_the_verifier(prompts_run, tmp_path, monkeypatch, capsys):
    run, data, _ = prompts_run
    (tmp_path / "verdicts.py").write_text(
        "def always(reply, answer):\n    return 1.0\n\n"
        "def never(reply, answer):\n    return 0.0\n\n"
        "def long(reply, answer):\n    return float(len(reply) >= 3)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["eval", "--task", "verify", str(run), "--data", str(data), "--split", "train"]
    got = {}
    for name in ("always", "never", "long"):
        assert main([*base, "--reward", f"verdicts:{name}", "--max-new-tokens", "5", "--json"]) == 0
        got[name] = json.loads(capsys.readouterr().out)
    assert got["always"]["pass1"] == got["always"]["pass8"] == got["always"]["greedy"] == 1.0
    assert got["never"]["pass1"] == got["never"]["pass8"] == 0.0 and got["never"]["n"] == 8
    long = got["long"]
    assert long["pass1"] == pytest.approx(long["mean_reward"])  # pass@1 is the mean of c / n
    assert long["pass1"] <= long["pass8"] and long["prompts"] == 3
    assert main([*base, "--reward", "number"]) == 0
    assert "pass@1" in capsys.readouterr().out


def test_parquet_prompts_and_pairs_prepare_as_their_jsonl(prompts_run, tmp_path, capsys):
    """Prompts ({prompt, answer}) and preference pairs ({prompt, chosen, rejected}) read from
    Parquet give the folders their JSONL gives; a file without a field is one line."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    run = prompts_run[0]
    tables = {
        "prompts": [{"prompt": f"say {w}", "answer": w} for w in WORDS],
        "preference": [{"prompt": f"say {w}", "chosen": w, "rejected": w + w} for w in WORDS],
    }
    for task, rows in tables.items():
        folders = []
        for kind in ("jsonl", "parquet"):
            source = tmp_path / f"{task}.{kind}"
            if kind == "jsonl":
                source.write_text("".join(json.dumps(r) + "\n" for r in rows))
            else:
                pq.write_table(pa.Table.from_pylist(rows), source)
            folders.append(tmp_path / f"{task}-{kind}")
            args = ["prepare", "--task", task, str(source), "--out", str(folders[-1])]
            assert main([*args, "--tokenizer", str(run), "--val-fraction", "0.4"]) == 0
        for name in ("train.bin", "val.bin", "train.idx", "train.mask"):
            assert (folders[0] / name).read_bytes() == (folders[1] / name).read_bytes(), name
        lacking = tmp_path / f"{task}-lacking.parquet"
        pq.write_table(pa.Table.from_pylist([{"prompt": "say cat"}]), lacking)
        capsys.readouterr()
        assert main(["prepare", "--task", task, str(lacking), "--out", str(tmp_path / "x")]) == 2
        assert capsys.readouterr().err.count("\n") == 1
