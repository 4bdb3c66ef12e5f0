"""The chat template: the renderer's ids and mask, its rules, the special tokens, and the same
ids and mask from `transformers`' apply_chat_template on the exported template."""

import pytest

from tlm.chat import END, JINJA, ChatError, chat_tokenizer, check, parse, render, speaks
from tlm.data.corpus import Source
from tlm.generate.chat import chat_prompt
from tlm.interop.export import write_tokenizer_files
from tlm.tokenizer import EOT, load_tokenizer, train_tokenizer, with_specials

TEXTS = [p.text for p in Source("python-docs", None).pieces()][:20] + ["héllo wörld ✓ 漢字\n"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is len?"}, {"role": "assistant", "content": "It counts."}],
    [
        {"role": "system", "content": "Answer briefly.\n"},
        {"role": "user", "content": " What is a for statement? "},
        {"role": "assistant", "content": "A loop over\nan iterable."},
        {"role": "user", "content": "And while?"},
        {"role": "assistant", "content": "A loop while a condition holds: héllo ✓ 漢字"},
    ],
    [
        {"role": "user", "content": "def f(x):\n    return x"},
        {"role": "assistant", "content": "f returns x"},
        {"role": "user", "content": "thanks"},
    ],
]  # fmt: skip


TEXTS += [m["content"] for messages in CONVERSATIONS for m in messages]


@pytest.fixture(scope="module", params=["bpe", "char"])
def tok(request):
    base = train_tokenizer(request.param, TEXTS, 600 if request.param == "bpe" else None)
    return chat_tokenizer(base)


def test_a_conversation_renders_turn_by_turn_with_the_answers_masked_in():
    tok = chat_tokenizer(train_tokenizer("char", ["abcdefgh .?"]))
    sid, uid, aid = (tok.special_id(f"<|{r}|>") for r in ("system", "user", "assistant"))
    end = tok.special_id(END)
    messages = [
        {"role": "system", "content": "be."},
        {"role": "user", "content": "ab?"},
        {"role": "assistant", "content": "cd"},
        {"role": "user", "content": "e"},
        {"role": "assistant", "content": "f."},
    ]
    ids, mask = render(messages, tok)
    enc = tok.encode
    assert ids == [
        tok.eot_id, sid, *enc("be."), end, uid, *enc("ab?"), end, aid, *enc("cd"), end,
        uid, *enc("e"), end, aid, *enc("f."), end,
    ]  # fmt: skip
    assert mask == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    prompt, prompt_mask = render(messages[:4], tok, generation=True)
    assert prompt == ids[: len(prompt) - 1] + [aid] and prompt[-1] == aid
    assert prompt_mask == mask[: len(prompt) - 1] + [0]  # the marker the reply follows: 0


@pytest.mark.parametrize(
    "messages, generation, rule",
    [
        ([], False, "non-empty list"),
        ([{"role": "user"}], False, "role and a content"),
        ([{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}], False, "unknown role 'robot'"),  # noqa: E501
        ([{"role": "user", "content": "  "}, {"role": "assistant", "content": "y"}], False, "empty content"),  # noqa: E501
        ([{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}], False, "empty content"),  # noqa: E501
        ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], False, "only the first"),  # noqa: E501
        ([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}], False, "message 2 is the user's turn"),  # noqa: E501
        ([{"role": "assistant", "content": "x"}], False, "message 1 is the assistant's turn"),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "x"}], False, "no assistant turn"),  # noqa: E501
        ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], True, "ends with the user's"),  # noqa: E501
        ([{"role": "user", "content": "x <|end|>"}, {"role": "assistant", "content": "y"}], False, "special token <|end|>"),  # noqa: E501
        ([{"role": "user", "content": f"x{EOT}"}, {"role": "assistant", "content": "y"}], False, "special token"),  # noqa: E501
    ],
)  # fmt: skip
def test_a_conversation_that_breaks_a_rule_is_refused_naming_it(messages, generation, rule):
    with pytest.raises(ChatError, match=rule.replace("|", r"\|")):
        check(messages, generation)


def test_rendered_ids_parse_back_to_the_messages(tok):
    for messages in CONVERSATIONS:
        ids, _ = render(messages, tok)
        assert parse(ids, tok) == messages


def test_special_tokens_are_added_after_the_vocabulary_and_survive_saving(tok, tmp_path):
    assert speaks(tok)
    plain = train_tokenizer(tok.kind, TEXTS, 600 if tok.kind == "bpe" else None)
    assert not speaks(plain)
    assert tok.vocab_size == plain.vocab_size + 4
    assert [tok.special_id(s) for s in ("<|system|>", END)] == [
        plain.vocab_size,
        plain.vocab_size + 3,
    ]
    assert tok.encode("a for loop") == plain.encode("a for loop")  # old ids kept
    assert with_specials(tok, ["<|user|>"]) is tok  # nothing to add
    tok.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert again.to_json() == tok.to_json() and speaks(again)
    ids = tok.encode("hello<|end|>wörld")  # a special token's name is the token
    assert tok.special_id(END) in ids and tok.decode(ids) == "hello<|end|>wörld"
    assert tok.token_bytes()[tok.special_id(END)] == 0


def test_a_tokenizer_without_the_template_cannot_render():
    with pytest.raises(ChatError, match="no chat template"):
        render(CONVERSATIONS[0], train_tokenizer("char", ["abc"]))


def test_transformers_renders_the_exported_template_to_the_same_ids_and_mask(tok, tmp_path):
    from transformers import AutoTokenizer

    write_tokenizer_files(tok, tmp_path, 512)
    assert (tmp_path / "chat_template.jinja").read_text() == JINJA
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for messages in CONVERSATIONS:
        if messages[-1]["role"] == "assistant":
            ids, mask = render(messages, tok)
            out = hf.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            assert out["input_ids"] == ids
            assert out["assistant_masks"] == mask
        asking = messages if messages[-1]["role"] == "user" else messages[:-1]
        prompt, _ = render(asking, tok, generation=True)
        out = hf.apply_chat_template(
            asking, tokenize=True, add_generation_prompt=True, return_dict=True
        )
        assert out["input_ids"] == prompt


def test_content_given_as_text_parts_is_their_text(tok):
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "len?"}]
    as_parts = [{"role": "user", "content": parts}, {"role": "assistant", "content": "It counts."}]
    assert render(as_parts, tok) == render(CONVERSATIONS[0], tok)
    with pytest.raises(ChatError, match="not text"):
        check([{"role": "user", "content": [{"type": "image_url"}]}], generation=True)


def test_a_prompt_that_drops_the_oldest_turns_returns_the_messages_it_kept(tok):
    """`chat_prompt` keeps the system message and the newest turns that fit and returns
    them: what a conversation that goes on continues from (`tlm chat`'s history)."""
    asked = CONVERSATIONS[1][:-1]  # system, user, assistant, user
    whole, _ = render(asked, tok, generation=True)
    assert chat_prompt(asked, tok, len(whole), 0).messages == asked  # it fits: all kept
    prompt = chat_prompt(asked, tok, len(whole) - 1, 0)  # one short: the oldest exchange goes
    assert prompt.dropped == 2 and prompt.messages == [asked[0], asked[3]]
    assert prompt.ids == render(prompt.messages, tok, generation=True)[0]
