"""The page's chat mode in Chromium, on a run fine-tuned on conversations: the conversation
rendered in the run's template, the reply streamed until end of turn as the API answers it,
and every reply token's distribution panel the one generation drew it from, also once the
conversation has outgrown the context."""

import math

import pytest
from chatting import fine_tuned
from test_page import by, knobs, rows, shown, type_into, wait_for

from conftest import console_errors
from serving import post, start
from tlm.chat import render
from tlm.load import load_tokenizer

pytestmark = pytest.mark.slow  # a server and a browser


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    run = fine_tuned(tmp_path_factory.mktemp("chat"))
    proc, url = start(run)
    yield url, run
    proc.terminate()
    proc.wait(timeout=10)


def send(browser, text):
    type_into(browser, "prompt", text)
    browser.find_element(by("ID"), "generate").click()
    wait_for(browser, lambda b: b.find_element(by("ID"), "status").text.startswith("done"))


def test_the_page_chats_in_the_template_and_explains_every_reply_token(browser, chat_server):
    url, run = chat_server
    tokenizer = load_tokenizer(run)
    browser.set_window_size(1280, 800)
    browser.get(url + "/")
    wait_for(browser, lambda b: b.find_element(by("ID"), "chat-toggle").is_displayed())
    browser.find_element(by("ID"), "chat-mode").click()
    assert browser.find_element(by("ID"), "generate").text == "Send"
    knobs(browser, 0, 0, 1)  # greedy
    type_into(browser, "max_tokens", "16")
    conversation = []
    for word in ["moon", "dog", "star", "rain"]:
        conversation.append({"role": "user", "content": f"say {word}"})
        send(browser, f"say {word}")
        status, answer, _ = post(
            url + "/v1/chat/completions",
            {"messages": conversation, "max_tokens": 16, "temperature": 0},
        )
        reply = answer["choices"][0]["message"]["content"]
        assert status == 200 and answer["choices"][0]["finish_reason"] == "stop"
        assert "(stop)" in browser.find_element(by("ID"), "status").text
        ids = [t for _, t in shown(browser)]
        _, rendered, _ = post(url + "/v1/chat/render", {"messages": conversation, "max_tokens": 16})
        prompt = rendered["tokens"]
        end = tokenizer.special_id("<|end|>")  # shown: the token that ended the turn
        assert ids[: len(prompt)] == prompt and ids[-1] == end
        assert tokenizer.decode(ids[len(prompt) : -1]) == reply
        conversation.append({"role": "assistant", "content": reply})
        kept = conversation[rendered["dropped"] : -1]  # the oldest turns left out
        assert prompt == render(kept, tokenizer, generation=True)[0]

        knobs(browser, 1, 0, 1)  # the model's own distribution at the reply's last token
        at = len(ids) - 1
        browser.find_element(by("CSS_SELECTOR"), f".token[data-index='{at}']").click()
        wait_for(browser, lambda b, at=at: b.find_element(by("ID"), "dist-position").text
                 .startswith(f"{at} ") and rows(b))  # fmt: skip
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 20}
        body["stop"] = ["<|end|>"]
        _, completion, _ = post(url + "/v1/completions", body)
        top = completion["choices"][0]["logprobs"]["top_logprobs"][at - len(prompt)]
        on_page = {text: p for _, text, p in rows(browser)}
        for text, logprob in top.items():
            assert abs(on_page[text] - math.exp(logprob)) < 1e-4, (word, text)
        knobs(browser, 0, 0, 1)
    note = browser.find_element(by("ID"), "chat-note").text
    assert rendered["dropped"] > 0 and "its oldest" in note and "turns are left out" in note
    browser.find_element(by("ID"), "reset").click()
    assert shown(browser) == [] and browser.find_element(by("ID"), "chat-note").text == ""
    assert console_errors(browser) == []
