"""`tlm prepare --task chat`: conversations in OpenAI's and ShareGPT's shapes, JSONL and
Parquet, rendered with their mask; a conversation that breaks a rule is one line naming it and
nothing is written; and the built-in python-qa corpus."""

import json

import numpy as np
import pytest

from tlm.chat import render, speaks
from tlm.cli import main
from tlm.data import ChatData, CorpusError, open_data, prepare_chat
from tlm.data.python_qa import python_qa
from tlm.tokenizer import load_tokenizer, train_tokenizer

CHATS = [
    [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}],
    [
        {"role": "system", "content": "be terse"},
        {"role": "user", "content": "one?"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three?"},
        {"role": "assistant", "content": "four"},
    ],
    [{"role": "user", "content": "ok?"}, {"role": "assistant", "content": "yes, ok"}],
]
SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt"}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sharegpt(messages):
    return {
        "conversations": [{"from": SHAREGPT[m["role"]], "value": m["content"]} for m in messages]
    }  # noqa: E501


def conversations_of(data: ChatData, split: str):
    tokens, mask, offsets = data.split(split), data.mask(split), data.offsets(split)
    return [
        (tokens[a:b].tolist(), mask[a:b].tolist())
        for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    ]


def test_conversations_are_written_as_rendered_with_their_mask(tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CHATS * 4])
    meta = prepare_chat([str(source)], tmp_path / "data", tokenizer="char", val_fraction=0.25)
    data = open_data(tmp_path / "data")
    assert isinstance(data, ChatData) and meta["task"] == "chat"
    tok = load_tokenizer(tmp_path / "data")
    assert speaks(tok)
    train, val = conversations_of(data, "train"), conversations_of(data, "val")
    assert [len(train), len(val)] == [9, 3]
    assert train + val == [render(m, tok) for m in CHATS * 4]  # back to back, in order
    splits = meta["splits"]
    assert splits["train"]["supervised"] == sum(sum(mask) for _, mask in train)
    assert splits["train"]["tokens"] == len(data.split("train")) == len(data.mask("train"))


def test_sharegpt_jsonl_and_parquet_give_the_same_tokens(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    openai = write_jsonl(tmp_path / "a.jsonl", [{"messages": m} for m in CHATS])
    shared = write_jsonl(tmp_path / "b.jsonl", [sharegpt(m) for m in CHATS])
    pq.write_table(pa.table({"messages": CHATS}), tmp_path / "c.parquet", row_group_size=2)
    turns = [sharegpt(m)["conversations"] for m in CHATS]
    pq.write_table(pa.table({"conversations": turns}), tmp_path / "d.parquet")
    folders = []
    sources = [("a", openai), ("b", shared), ("c", tmp_path / "c.parquet")]
    for name, source in [*sources, ("d", tmp_path / "d.parquet")]:
        prepare_chat([str(source)], tmp_path / name, tokenizer="bpe", vocab_size=280)
        folders.append(tmp_path / name)
    tokens = [[conversations_of(ChatData(f), split) for split in ("train", "val")] for f in folders]
    assert tokens[0] == tokens[1] == tokens[2] == tokens[3]


@pytest.mark.parametrize(
    "line, rule",
    [
        ('{"messages": [{"role": "robot", "content": "x"}]}', "unknown role 'robot'"),
        ('{"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "y"}]}', "empty content"),  # noqa: E501
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
        ('{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}, {"role": "assistant", "content": "z"}]}', "the user's turn where the assistant's is due"),  # noqa: E501
        ('{"conversations": [{"from": "bot", "value": "x"}]}', "unknown role 'bot'"),
        ('{"text": "no conversation"}', "no messages"),
        ("{not json", "not JSON"),
    ],
)  # fmt: skip
def test_a_bad_conversation_is_one_line_naming_file_line_and_rule(tmp_path, capsys, line, rule):
    good = json.dumps({"messages": CHATS[0]})
    source = tmp_path / "chats.jsonl"
    source.write_text(f"{good}\n\n{good}\n{line}\n{good}\n")
    with pytest.raises(CorpusError, match=f"chats.jsonl:4: .*{rule}"):
        prepare_chat([str(source)], tmp_path / "data", tokenizer="char")
    code = main(["prepare", "--task", "chat", str(source), "--out", str(tmp_path / "data")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "chats.jsonl:4:" in err
    assert not (tmp_path / "data").exists() and list(tmp_path.iterdir()) == [source]


def test_a_reused_tokenizer_keeps_its_ids_and_gains_the_template(tmp_path):
    base = train_tokenizer("char", [m["content"] for c in CHATS for m in c])
    base.save(tmp_path / "tokenizer.json")
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CHATS])
    prepare_chat([str(source)], tmp_path / "data", tokenizer=str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "data")
    assert tok.vocab_size == base.vocab_size + 4 and tok.encode("hi there") == base.encode(
        "hi there"
    )
    missing = write_jsonl(
        tmp_path / "new.jsonl",
        [{"messages": [CHATS[0][0], {"role": "assistant", "content": "Zebra"}]}],
    )  # noqa: E501
    with pytest.raises(CorpusError, match=r"new.jsonl:1: character 'Z'"):
        prepare_chat([str(missing)], tmp_path / "d2", tokenizer=str(tmp_path / "tokenizer.json"))


def test_python_qa_is_deterministic_and_holds_out_whole_subjects():
    train, val, text = python_qa()
    again = python_qa()
    assert (train, val, text) == again
    assert len(train) > 3000 and len(val) > 200
    every = [m for _, m in train + val]
    assert any(m[0]["role"] == "system" for m in every)
    assert any(sum(x["role"] == "assistant" for x in m) == 2 for m in every)  # two turns
    asked = {x["content"] for _, m in train for x in m if x["role"] == "user"}
    held = [x["content"] for _, m in val for x in m if x["role"] == "user"]
    assert not asked & set(held) - {"And its signature?"}
    prompts = {q.split()[-1] for q in held if q.startswith("What does") and "module" not in q}
    assert prompts and not any(f"What does {p}" in asked for p in prompts)


def test_python_qa_prepares_with_its_own_split(tmp_path):
    meta = prepare_chat(["python-qa"], tmp_path / "qa", tokenizer="char")
    train, val, _ = python_qa()
    splits = meta["splits"]
    assert [splits["train"]["conversations"], splits["val"]["conversations"]] == [
        len(train),
        len(val),
    ]  # noqa: E501
    mask = ChatData(tmp_path / "qa").mask("val")
    assert 0 < mask.mean() < 1 and set(np.unique(mask)) == {0, 1}
