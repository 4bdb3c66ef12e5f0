"""tlm serve as a real process on a loopback port, driven by the official openai client."""

import threading
import time
import urllib.request

import openai
import pytest
import torch

from serving import KEY, SETTLE, TEXT, eventually, health, local, post, start
from tlm.load import load_model, load_tokenizer

pytestmark = pytest.mark.slow  # every test here starts processes or a server


@pytest.fixture(scope="module")
def run(served_run):
    return served_run


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def test_greedy_through_the_api_equals_tlm_generate_and_streams_the_same(client, run):
    expected = local(run, "The for", 24)
    got = client.completions.create(model="run", prompt="The for", max_tokens=24, temperature=0)
    assert got.choices[0].text == expected.text and len(expected.text) > 10
    ended = expected.finish_reason == "eos"  # usage counts the end-of-text token too
    assert got.usage.completion_tokens == len(expected.tokens) + ended
    chunks = list(
        client.completions.create(
            model="run", prompt="The for", max_tokens=24, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason.replace("eos", "stop")


def test_n_seeds_stops_and_logprobs(client, run):
    def sample(seed):
        r = client.completions.create(model="run", prompt="The", max_tokens=16, n=3, seed=seed)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample(7)
    assert sample(7) == first and len(first) == 3 and len(set(first)) > 1
    assert sample(8) != first
    greedy = local(run, "The while", 30).text
    for stop in (greedy[len(greedy) // 2 : len(greedy) // 2 + 3], " statement rep"):
        assert stop in greedy
        r = client.completions.create(
            model="run", prompt="The while", max_tokens=30, temperature=0, stop=[stop]
        )
        assert r.choices[0].text == greedy[: greedy.index(stop)]
        assert r.choices[0].finish_reason == "stop"
        chunks = client.completions.create(
            model="run", prompt="The while", max_tokens=30, temperature=0, stop=[stop], stream=True
        )  # text that could begin the stop string is held back, never sent
        assert "".join(c.choices[0].text for c in chunks) == greedy[: greedy.index(stop)]
    r = client.completions.create(
        model="run", prompt="The", max_tokens=5, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    chunks = client.completions.create(
        model="run", prompt="The", max_tokens=5, temperature=0, logprobs=3, stream=True
    )  # offsets run on across the chunks, and start after an echoed prompt
    assert [c.choices[0].logprobs.text_offset[0] for c in chunks] == lp.text_offset
    echoed = client.completions.create(
        model="run", prompt="The", max_tokens=5, temperature=0, logprobs=3, echo=True
    )
    echo = echoed.choices[0].logprobs  # the prompt's token first, as OpenAI answers
    assert echo.tokens[0] == "The" and echo.text_offset == [0] + [3 + o for o in lp.text_offset]
    assert len(lp.token_logprobs) == 5 and all(len(t) == 3 for t in lp.top_logprobs)
    model, tokenizer = load_model(run), load_tokenizer(run)
    ids = torch.tensor([[tokenizer.eot_id, *tokenizer.encode("The")]])
    with torch.no_grad():
        first_logprob = model(ids)[0, -1].log_softmax(-1).max().item()  # greedy: the top one
    assert lp.token_logprobs[0] == pytest.approx(first_logprob, abs=1e-4)
    assert max(lp.top_logprobs[0].values()) == pytest.approx(first_logprob, abs=1e-4)


def test_chat_renders_the_template_and_stops_at_the_next_turn(client, run):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "for?"}]
    r = client.chat.completions.create(model="run", messages=messages, max_tokens=20, temperature=0)
    prompt = "System: Be brief.\nUser: for?\nAssistant:"
    assert "\nUser:" in local(run, prompt, 20).text  # the model would write the next turn
    expected = local(run, prompt, 20, stop=("\nUser:",))
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.text.lstrip(" ")
    chunks = client.chat.completions.create(
        model="run", messages=messages, max_tokens=20, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text.lstrip(" ")


def test_greedy_is_unchanged_while_eight_other_requests_decode(client, run):
    """Greedy's text with eight sampled streams decoding beside it: they must be seen
    decoding (a chunk arrives) while it is in flight, or the test proves nothing."""
    expected = local(run, "The while", 40).text
    others, chunks, started = [], [], threading.Semaphore(0)

    def busy(i):
        stream = client.completions.create(
            model="run",
            prompt=TEXT[: 5 + i],
            max_tokens=60,
            temperature=1.2,
            top_p=0.9,
            seed=i,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text = []
        for c in stream:
            if not text:
                started.release()
            chunks.append(time.monotonic())
            text.append(c.choices[0].text)
        others.append("".join(text))

    threads = [threading.Thread(target=busy, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for _ in range(4):  # the server's 4 slots are decoding others
        assert started.acquire(timeout=SETTLE)
    began = time.monotonic()
    got = client.completions.create(model="run", prompt="The while", max_tokens=40, temperature=0)
    ended = time.monotonic()
    for t in threads:
        t.join()
    assert got.choices[0].text == expected and len(others) == 8
    assert any(began < at < ended for at in chunks)  # others decoded while greedy did


@pytest.mark.parametrize(
    "body, key, status, param, code",
    [
        (None, KEY, 400, None, "invalid_json"),
        ({"prompt": 3}, KEY, 400, "prompt", "invalid_type"),
        ({"prompt": "a", "max_tokens": "9"}, KEY, 400, "max_tokens", "invalid_type"),
        ({"prompt": "a", "temperature": 3}, KEY, 400, "temperature", "invalid_value"),
        ({"prompt": "a", "top_p": -0.1}, KEY, 400, "top_p", "invalid_value"),
        ({"prompt": "a", "n": 0}, KEY, 400, "n", "invalid_value"),
        ({"prompt": "a", "logprobs": 21}, KEY, 400, "logprobs", "invalid_value"),
        ({"prompt": [0, 99999]}, KEY, 400, "prompt", "invalid_value"),
        ({"prompt": [[0, 1], "a"]}, KEY, 400, "prompt", "invalid_type"),
        ({"prompt": [0, True]}, KEY, 400, "prompt", "invalid_type"),
        ({"prompt": "a", "stop": [""]}, KEY, 400, "stop", "invalid_value"),
        ({"prompt": "word " * 100}, KEY, 400, "prompt", "context_length_exceeded"),
        ({"prompt": "a", "model": "gpt-4"}, KEY, 404, "model", "model_not_found"),
        ({"prompt": "a"}, "wrong", 401, None, "invalid_api_key"),
    ],
)
def test_each_bad_request_gets_its_status_and_the_server_goes_on(
    server, body, key, status, param, code
):
    raw = b"{not json" if body is None else None
    got, answer, _ = post(server + "/v1/completions", body, key, raw)
    assert got == status
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param and answer["error"]["code"] == code
    assert post(server + "/v1/completions", {"prompt": "a", "max_tokens": 2})[0] == 200


def test_a_full_queue_answers_429_with_retry_after(run):
    proc, url = start(run, "--slots", "1", "--max-queue", "2")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    long = {"model": "run", "prompt": "The", "max_tokens": 10**6, "stream": True}
    try:
        streams = [client.completions.create(**long, extra_body={"ignore_eos": True})]
        next(iter(streams[0]))  # decoding in the one slot
        streams += [client.completions.create(**long, extra_body={"ignore_eos": True})]
        streams += [client.completions.create(**long, extra_body={"ignore_eos": True})]
        status, answer, headers = post(url + "/v1/completions", {"prompt": "a"})  # queue: 2
        assert status == 429 and headers["Retry-After"] == "1"
        assert answer["error"]["type"] == "rate_limit_error"
        assert answer["error"]["code"] == "queue_full"
        status, answer, _ = post(url + "/v1/completions", {"prompt": "a", "n": 3})
        assert status == 400 and answer["error"]["param"] == "n"  # could never fit
        for stream in streams:
            stream.close()
        answered = lambda: post(url + "/v1/completions", {"prompt": "a", "max_tokens": 2})[0]  # noqa: E731
        assert eventually(lambda: answered() != 429)  # the closed streams leave; retry
        assert answered() == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_client_that_goes_away_frees_its_slot(client, server):
    stream = client.completions.create(
        model="run", prompt="The", max_tokens=10**6, stream=True, extra_body={"ignore_eos": True}
    )
    for _, _ in zip(range(3), stream, strict=False):
        pass
    assert health(server)["busy"] == 1
    stream.close()  # a million tokens to go: only the cancel can free the slot in time
    assert eventually(lambda: health(server)["busy"] == 0)


def test_32_streaming_clients_five_requests_each_all_complete(client, server):
    errors, done = [], []

    def user(i):
        try:
            for j in range(5):
                stream = client.completions.create(
                    model="run", prompt=TEXT[: 3 + i], max_tokens=8, seed=j, stream=True
                )
                chunks = list(stream)
                assert chunks[-1].choices[0].finish_reason in ("stop", "length")
                done.append(i)
        except Exception as error:  # noqa: BLE001 - collected and asserted below
            errors.append(repr(error))

    threads = [threading.Thread(target=user, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(done) == 160
    metrics = urllib.request.urlopen(server + "/metrics").read().decode()
    assert "tlm_time_to_first_token_seconds_count" in metrics and "tlm_busy_slots" in metrics
    assert health(server)["busy"] == 0


def test_a_completion_ends_at_the_end_of_text(client, run):
    for seed in range(20):  # a sample that ends its document (this model ends them)
        expected = local(run, "The", 100, do_sample=True, seed=seed)  # as the server
        if expected.finish_reason == "eos":
            break
    assert expected.finish_reason == "eos"
    got = client.completions.create(model="run", prompt="The", max_tokens=100, seed=seed)
    assert got.choices[0].text == expected.text and "<|endoftext|>" not in expected.text
    assert got.choices[0].finish_reason == "stop"


def test_token_id_prompts_and_the_pages_endpoints(server, run):
    """A prompt of token ids is read as given (the page continues from a position this way),
    and the page's three extras answer what the model computes."""
    status, tokens, _ = post(server + "/tokenize", {"prompt": "The for"})
    ids = tokens["tokens"]
    assert status == 200 and ids[0] == 0 and tokens["texts"][1:] == ["The", " for"]
    greedy = {"max_tokens": 8, "temperature": 0}
    by_text = post(server + "/v1/completions", {"prompt": "The for", **greedy})[1]
    by_ids = post(server + "/v1/completions", {"prompt": [ids, ids], **greedy})[1]
    assert [c["text"] for c in by_ids["choices"]] == [by_text["choices"][0]["text"]] * 2

    model = load_model(run)
    with torch.no_grad():
        logprobs = model(torch.tensor([ids]))[0, -1].log_softmax(dim=-1)
    status, dist, _ = post(server + "/v1/distribution", {"prompt": ids, "token": 5, "top": 3})
    assert status == 200 and dist["position"] == len(ids)
    assert torch.allclose(torch.tensor(dist["logprobs"]), logprobs.sort(descending=True).values)
    assert [t["id"] for t in dist["top"]] == logprobs.topk(3).indices.tolist()
    rank = int((logprobs > logprobs[5]).sum())
    assert dist["token"]["rank"] == rank and abs(dist["token"]["logprob"] - logprobs[5]) < 1e-6

    status, steps, _ = post(server + "/v1/attention", {"prompt": "The for", "layer": 1, "head": 0})
    assert status == 200 and steps["ids"] == ids and len(steps["masked"]) == len(ids)
    assert steps["masked"][0][1] is None and steps["scores"][0][1] is not None
    for body, param in (({"prompt": "a", "layer": 2}, "layer"), ({"prompt": 3}, "prompt")):
        status, answer, _ = post(server + "/v1/attention", body)
        assert status == 400 and answer["error"]["param"] == param
