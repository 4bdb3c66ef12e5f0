"""tlm serve as a real process on a loopback port, driven by the official openai client."""

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

from conftest import console_errors
from tlm.cli import main
from tlm.generate import GenerationConfig, complete
from tlm.inference import for_inference
from tlm.load import load_model, load_tokenizer

pytestmark = pytest.mark.slow  # every test here starts processes or a server

KEY = "test-key"
ARTIFACTS = Path(__file__).resolve().parents[1] / "out" / "test-artifacts"  # screenshots
CHAT = (  # three turns: the model learns to write "\nUser:" after a reply
    "System: Be brief.\nUser: for?\nAssistant: It runs a block.\nUser: while?\nAssistant: Again."
    "\nUser: if?\nAssistant: Once."
)
TEXT = "The for statement runs a block once for each item. The while statement repeats it.\n\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    corpus = folder / "corpus.jsonl"  # 400 documents: the model learns to end one
    docs = [TEXT.strip(), CHAT] * 200
    corpus.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    data, run = folder / "data", folder / "run"
    assert main(["prepare", str(corpus), "--out", str(data), "--vocab-size", "300", "--quiet"]) == 0
    args = ["train", "--data", str(data), "--out", str(run), "--n-layers", "2", "--d-model", "32"]
    args += ["--n-heads", "2", "--context-length", "64", "--max-steps", "300", "--batch-size", "8"]
    assert main([*args, "--quiet"]) == 0
    return run


def start(run, *extra):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "tlm", "serve", str(run), "--port", str(port), *extra]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server(run):
    proc, url = start(run, "--slots", "4", "--max-queue", "64", "--api-key", KEY)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def local(run, prompt, max_tokens, stop=(), **settings):
    model, tokenizer = for_inference(load_model(run), "float32"), load_tokenizer(run)
    config = GenerationConfig(max_new_tokens=max_tokens, eos_token_id=tokenizer.eot_id, **settings)
    return complete(model, tokenizer, [prompt], config, stop)[0]


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
    assert echoed.choices[0].logprobs.text_offset == [3 + o for o in lp.text_offset]
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
    expected = local(run, "The while", 40).text
    others = []

    def busy(i):
        stream = client.completions.create(
            model="run",
            prompt=TEXT[: 5 + i],
            max_tokens=60,
            temperature=1.2,
            top_p=0.9,
            seed=i,
            stream=True,
        )
        others.append("".join(c.choices[0].text for c in stream))

    threads = [threading.Thread(target=busy, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    got = client.completions.create(model="run", prompt="The while", max_tokens=40, temperature=0)
    for t in threads:
        t.join()
    assert got.choices[0].text == expected and len(others) == 8


def post(url, body, key=KEY, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers


@pytest.mark.parametrize(
    "body, key, status, param, code",
    [
        (None, KEY, 400, None, "invalid_json"),
        ({"prompt": 3}, KEY, 400, "prompt", "invalid_type"),
        ({"prompt": "a", "max_tokens": "9"}, KEY, 400, "max_tokens", "invalid_type"),
        ({"prompt": "a", "temperature": 3}, KEY, 400, "temperature", "invalid_value"),
        ({"prompt": "a", "top_p": 0}, KEY, 400, "top_p", "invalid_value"),
        ({"prompt": "a", "n": 0}, KEY, 400, "n", "invalid_value"),
        ({"prompt": "a", "logprobs": 9}, KEY, 400, "logprobs", "invalid_value"),
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
        deadline = time.monotonic() + 2  # the closed streams leave; retry as Retry-After says
        while (got := post(url + "/v1/completions", {"prompt": "a", "max_tokens": 2})[0]) == 429:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert got == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def health(url):
    with urllib.request.urlopen(url + "/health", timeout=5) as response:
        return json.loads(response.read())


def test_a_client_that_goes_away_frees_its_slot(client, server):
    stream = client.completions.create(
        model="run", prompt="The", max_tokens=10**6, stream=True, extra_body={"ignore_eos": True}
    )
    for _, _ in zip(range(3), stream, strict=False):
        pass
    assert health(server)["busy"] == 1
    stream.close()  # a million tokens to go: only the cancel can free the slot in time
    deadline = time.monotonic() + 1
    while health(server)["busy"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)


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


def test_the_page_streams_text_and_shows_the_explorer(browser, server, run):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server + "/")
    for field, value in (("key", KEY), ("temperature", "0"), ("max_tokens", "24")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "generate").click()
    wait = WebDriverWait(browser, 30)
    wait.until(lambda b: b.find_element(By.ID, "status").text.startswith("done"))
    expected = local(run, "The for statement", 24)
    assert browser.find_element(By.ID, "output").text == "The for statement" + expected.text
    tokens = browser.find_elements(By.CSS_SELECTOR, "#output .tok")
    assert len(tokens) == len(expected.tokens) + (expected.finish_reason == "eos")
    assert "p = " in tokens[0].get_attribute("title")  # probability and alternatives on hover
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "serve-page.png"))
    browser.find_element(By.ID, "inspect").click()
    browser.switch_to.frame(wait.until(lambda b: b.find_element(By.ID, "explorer")))
    T = 4  # <|endoftext|> The for statement
    wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#grid tr[data-query]")) == T)
    browser.switch_to.default_content()
    browser.save_screenshot(str(ARTIFACTS / "serve-page-explorer.png"))
    assert console_errors(browser) == []


def test_an_int8_server_decodes_and_refuses_inspection_in_one_line(run, browser):
    """int8 keeps no fp32 weights (memory follows the format), and inspection reads them:
    the openai client completes, and the page's Inspect button shows the one-line refusal."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    proc, url = start(run, "--dtype", "int8")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        completion = client.completions.create(model="run", prompt="The", max_tokens=3)
        assert completion.choices[0].text and completion.usage.completion_tokens <= 3
        status, answer, _ = post(url + "/v1/inspect", {"prompt": "a"})
        assert status == 400 and answer["error"]["code"] == "unsupported_dtype"
        browser.get(url + "/")
        browser.find_element(By.ID, "inspect").click()
        error = WebDriverWait(browser, 30).until(
            lambda b: b.find_element(By.ID, "error").text or None
        )
        assert error.startswith("400: ") and "--dtype float32" in error
        assert error.count("\n") == 0
        logged = console_errors(browser)  # read, so that the next page test starts clean
        assert len(logged) == 1 and "/v1/inspect" in logged[0] and "400" in logged[0]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
