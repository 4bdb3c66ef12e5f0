"""A run fine-tuned on conversations, talked to: `tlm chat` in a terminal and `tlm serve`'s
/v1/chat/completions through the official openai client, both answering in the template
and stopping at end of turn with the replies tlm's decoding core gives."""

import subprocess
import sys

import openai
import pytest
from chatting import fine_tuned

from serving import KEY, start
from tlm.cli import main
from tlm.generate import GenerationConfig
from tlm.generate.chat import chat_prompt, replies
from tlm.load import load_model, load_tokenizer

pytestmark = pytest.mark.slow  # a server and terminal sessions as processes

LONG = [  # 15 turns: more than the context of 32 holds
    m
    for w in ["cat", "dog", "sun", "moon", "tree", "leaf", "rain"]
    for m in ({"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w})
] + [{"role": "user", "content": "say fish"}]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return fine_tuned(tmp_path_factory.mktemp("chat"))


def own_reply(run, messages, max_tokens=16):
    """tlm's decoding core's greedy reply (and how many turns its prompt dropped)."""
    model, tokenizer = load_model(run).eval(), load_tokenizer(run)
    config = GenerationConfig(max_new_tokens=max_tokens)
    prompt = chat_prompt(messages, tokenizer, 32, min(max_tokens, 16))
    reply = replies(model, tokenizer, [prompt], config)[0]
    return reply, prompt.dropped


def test_tlm_chat_answers_one_message_and_a_conversation(run, capsys):
    reply, _ = own_reply(run, [{"role": "user", "content": "say moon"}])
    assert reply.finish_reason == "eos" and reply.text == "moon"
    assert main(["chat", str(run), "--message", "say moon", "--max-new-tokens", "16"]) == 0
    assert capsys.readouterr().out == "moon\n"
    typed = "say cat\nsay dog\n/reset\nsay star\n"
    done = subprocess.run(
        [sys.executable, "-m", "tlm", "chat", str(run), "--max-new-tokens", "16"],
        input=typed, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    history = [{"role": "user", "content": "say cat"}, {"role": "assistant", "content": "cat"}]
    second, _ = own_reply(run, [*history, {"role": "user", "content": "say dog"}])
    assert done.stdout.splitlines() == ["cat", second.text, "star"]
    assert "forgotten" in done.stderr


def test_a_conversation_longer_than_the_context_drops_its_oldest_turns(run, capsys):
    reply, dropped = own_reply(run, LONG)
    assert dropped > 0 and reply.text == "fish"
    typed = "".join(m["content"] + "\n" for m in LONG if m["role"] == "user")
    done = subprocess.run(
        [sys.executable, "-m", "tlm", "chat", str(run), "--max-new-tokens", "16"],
        input=typed, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.stdout.splitlines()[-1] == "fish" and "oldest" in done.stderr


def test_a_base_run_is_refused_in_one_line(run, capsys):
    assert main(["chat", str(run.parent / "base"), "--message", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no chat template" in err


def test_the_server_answers_in_the_template_and_stops_at_end_of_turn(run):
    proc, url = start(run, "--api-key", KEY)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        for messages in ([{"role": "user", "content": "say leaf"}], LONG):
            expected, _ = own_reply(run, messages)
            got = client.chat.completions.create(
                model="chat", messages=messages, max_tokens=16, temperature=0
            )
            assert got.choices[0].message.content == expected.text
            assert got.choices[0].finish_reason == "stop"
            chunks = client.chat.completions.create(
                model="chat", messages=messages, max_tokens=16, temperature=0, stream=True
            )
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
        with pytest.raises(openai.BadRequestError, match="user's turn"):
            client.chat.completions.create(
                model="chat",
                messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            )
    finally:
        proc.terminate()
        proc.wait(timeout=10)
