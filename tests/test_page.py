"""`tlm serve`'s page in Chromium: text streamed token by token, the distribution panel held
against the API and tlm's own filters, attention step by step held against the model's
hook points, the keyboard, narrow windows, and what a bad prompt or a dying server shows."""

import math
import urllib.request

import openai
import pytest
import torch

from conftest import console_errors
from serving import ARTIFACTS, KEY, TEXT, local, post, start
from tlm.cli import main
from tlm.generate.sampling import process_logits
from tlm.interpret import run_with_cache
from tlm.load import load_model, load_tokenizer
from tlm.tokenizer import document_ids

pytestmark = pytest.mark.slow  # a server and a browser

PROMPT = "The for statement"


def by(kind):
    from selenium.webdriver.common.by import By

    return getattr(By, kind)


def wait_for(browser, condition, timeout=30):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout).until(condition)


def slide(browser, name, value):
    """Move a range input as a user's drag does: its value, then its input event."""
    browser.execute_script(
        "const s = document.getElementById(arguments[0]); s.value = arguments[1];"
        "s.dispatchEvent(new Event('input', {bubbles: true}));",
        name,
        str(value),
    )


def knobs(browser, temperature, k, p):
    for name, value in (("temperature", temperature), ("top-k", k), ("top-p", p)):
        slide(browser, name, value)


def type_into(browser, field, text):
    box = browser.find_element(by("ID"), field)
    box.clear()
    box.send_keys(text)


def shown(browser):
    """(data-index, data-id) of every token on show."""
    return browser.execute_script(
        "return [...document.querySelectorAll('#output .token')]"
        ".map(t => [Number(t.dataset.index), Number(t.dataset.id)])"
    )


def rows(browser):
    """The distribution panel's rows: (token id, text, p after the filters)."""
    return browser.execute_script(
        "return [...document.querySelectorAll('#dist tr[data-token]')]"
        ".map(r => [Number(r.dataset.id), r.dataset.token, Number(r.dataset.p)])"
    )


def panel(browser, name, T):
    """A grid panel as a [T, T] tensor (-inf where a cell says so; NaN where none is)."""
    cells = browser.execute_script(
        "return [...document.querySelectorAll(`#${arguments[0]} td[data-row]`)]"
        ".map(c => [Number(c.dataset.row), Number(c.dataset.col), c.dataset.value])",
        name,
    )
    grid = torch.full((T, T), float("nan"), dtype=torch.float64)
    for i, j, value in cells:
        grid[i, j] = float(value)
    return grid


def generate(browser, prompt, max_tokens):
    type_into(browser, "prompt", prompt)
    type_into(browser, "max_tokens", str(max_tokens))
    browser.find_element(by("ID"), "generate").click()
    wait_for(browser, lambda b: b.find_element(by("ID"), "status").text.startswith("done"))


@pytest.fixture
def page(browser, server):
    browser.set_window_size(1280, 800)
    browser.get(server + "/")
    type_into(browser, "key", KEY)
    yield browser
    assert console_errors(browser) == []


def test_tokens_stream_with_their_positions_and_ids(page, server, served_run):
    knobs(page, 0, 0, 1)  # greedy
    generate(page, PROMPT, 24)
    prompt = post(server + "/tokenize", {"prompt": PROMPT})[1]["tokens"]
    expected = local(served_run, PROMPT, 24)
    ended = [prompt[0]] if expected.finish_reason == "eos" else []  # <|endoftext|> is a token
    tokens = shown(page)
    assert [i for i, _ in tokens] == list(range(len(tokens)))
    assert [t for _, t in tokens] == prompt + expected.tokens + ended
    first = page.find_elements(by("CSS_SELECTOR"), "#output .token.generated")[0]
    assert "p = " in first.get_attribute("title")  # probability and alternatives on hover
    html = urllib.request.urlopen(server + "/").read().decode()
    assert "http://" not in html and "https://" not in html and " src=" not in html  # offline
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.save_screenshot(str(ARTIFACTS / "serve-page.png"))


def test_the_distribution_panel_is_the_models_filtered_in_tlms_order(page, server, served_run):
    knobs(page, 0, 0, 1)
    generate(page, PROMPT, 12)
    ids = [t for _, t in shown(page)]
    at = len(post(server + "/tokenize", {"prompt": PROMPT})[1]["tokens"]) + 2  # third generated
    page.find_element(by("CSS_SELECTOR"), f".token[data-index='{at}']").click()
    wait_for(page, lambda b: len(rows(b)) == 20)

    knobs(page, 1, 0, 1)  # the model's own distribution: exp of the API's log-probabilities
    body = {"prompt": ids[:at], "max_tokens": 1, "temperature": 0, "logprobs": 20}
    status, answer, _ = post(server + "/v1/completions", body)
    logprobs = answer["choices"][0]["logprobs"]
    top = logprobs["top_logprobs"][0]  # {text: logprob}
    assert status == 200 and logprobs["token_ids"] == [ids[at]]
    assert abs(logprobs["rest"][0] - (1 - sum(math.exp(lp) for lp in top.values()))) < 1e-6
    on_page = {text: p for _, text, p in rows(page)}
    assert len(top) == len(on_page) == 20
    for text, logprob in top.items():
        assert abs(on_page[text] - math.exp(logprob)) < 1e-4

    model = load_model(served_run)
    with torch.no_grad():
        logits = model(torch.tensor([ids[:at]]))[0, -1]
    raw = logits.softmax(dim=-1)
    for temperature, k, p in [(0.5, 0, 1), (1, 1, 1), (1, 0, 0.5), (1.5, 10, 0.9), (0, 0, 1)]:
        knobs(page, temperature, k, p)
        filtered = process_logits(logits, temperature, k or None, p if p < 1 else None)
        want = filtered.softmax(dim=-1)
        got = rows(page)
        for token, _, q in got:
            assert abs(q - float(want[token])) < 1e-4, (temperature, k, p, token)
        kept = [q for _, _, q in got if q > 0]
        if (temperature, k) == (0.5, 0):  # eq. 10.49 itself
            sharpened = torch.softmax(logits / 0.5, dim=-1)
            assert all(abs(q - float(sharpened[t])) < 1e-4 for t, _, q in got)
            assert max(q for _, _, q in got) > float(raw.max())
        if k == 1 or temperature == 0:
            assert kept == [1.0]
        if p == 0.5 and k == 0:  # the smallest set whose mass reaches 0.5
            mass = raw.sort(descending=True).values.cumsum(dim=0)
            assert len(kept) == int((mass < 0.5).sum()) + 1
            assert sum(float(raw[t]) for t, _, q in got if q > 0) >= 0.5 - 1e-6
        rest = float(
            page.find_element(by("CSS_SELECTOR"), "#dist tr.others").get_attribute("data-rest")
        )
        assert abs(rest - (1 - sum(float(want[t]) for t, _, _ in got))) < 1e-4

    knobs(page, 0, 0, 1)  # continue greedily from the same position: the same tokens come
    page.find_element(by("ID"), "continue").click()
    wait_for(page, lambda b: b.find_element(by("ID"), "status").text.startswith("done"))
    again = [t for _, t in shown(page)]
    assert again[:at] == ids[:at] and again[at : len(ids)] == ids[at:]
    assert len(again) > len(ids)  # 12 new tokens from the earlier position


def test_keyboard_picks_tokens_and_moves_the_sliders(page):
    from selenium.webdriver.common.keys import Keys

    generate(page, PROMPT, 4)
    first = page.find_element(by("CSS_SELECTOR"), "#output .token[tabindex='0']")
    first.send_keys(Keys.ARROW_RIGHT)
    focused = page.switch_to.active_element
    assert focused.get_attribute("data-index") == "1"
    focused.send_keys(Keys.ARROW_RIGHT, Keys.ARROW_RIGHT, Keys.ENTER)
    wait_for(page, lambda b: b.find_element(by("ID"), "dist-section").is_displayed())
    assert page.find_element(by("ID"), "dist-position").text.startswith("3 ")
    slider = page.find_element(by("ID"), "top-k")
    slider.send_keys(Keys.ARROW_RIGHT)  # top-k 1: one token left
    wait_for(page, lambda b: [q for _, _, q in rows(b) if q > 0] == [1.0])
    assert page.find_element(by("ID"), "top-k-value").text == "1"


def test_attention_step_by_step_equals_the_hook_points(page, server, served_run):
    prompt = TEXT[:40]
    type_into(page, "prompt", prompt)
    page.find_element(by("ID"), "inspect").click()
    wait_for(page, lambda b: b.find_elements(by("CSS_SELECTOR"), "#contrib td[data-row]"))
    from selenium.webdriver.support.ui import Select

    Select(page.find_element(by("ID"), "layer")).select_by_value("1")
    Select(page.find_element(by("ID"), "head")).select_by_value("1")
    css = "#scores[data-layer='1'][data-head='1']"
    wait_for(page, lambda b: b.find_elements(by("CSS_SELECTOR"), css))

    ids = post(server + "/tokenize", {"prompt": prompt})[1]["tokens"]
    T = len(ids)
    names = [f"blocks.1.attn.{n}" for n in ("q", "k", "v", "scores", "pattern")]
    _, cache = run_with_cache(load_model(served_run), torch.tensor([ids]), names)
    q, k, v, scores, pattern = (cache[n][0, 1].double() for n in names)
    masked = panel(page, "masked", T)
    assert torch.equal(masked.isinf(), scores.isinf()) and scores.isinf().sum() == T * (T - 1) / 2
    finite = ~scores.isinf()
    assert torch.allclose(masked[finite], scores[finite], atol=1e-5, rtol=0)
    before = panel(page, "scores", T)
    assert torch.allclose(before[finite], scores[finite], atol=1e-5, rtol=0)
    assert torch.allclose(before, q @ k.T / math.sqrt(q.shape[-1]), atol=1e-5, rtol=0)
    assert torch.allclose(panel(page, "pattern", T), pattern, atol=1e-5, rtol=0)

    contrib = panel(page, "contrib", T)  # the query: the last position unless chosen
    assert not contrib[: T - 1].isfinite().any()
    assert torch.allclose(contrib[T - 1], pattern[T - 1] * v.norm(dim=-1), atol=1e-5, rtol=0)
    Select(page.find_element(by("ID"), "query")).select_by_value("2")
    contrib = panel(page, "contrib", T)
    assert contrib[2, :3].isfinite().all() and contrib.isfinite().sum() == 3

    page.switch_to.frame(page.find_element(by("ID"), "explorer"))  # tlm inspect's explorer
    wait_for(page, lambda b: len(b.find_elements(by("CSS_SELECTOR"), "#grid tr[data-query]")) == T)
    page.switch_to.default_content()


def test_panels_of_a_long_prompt_come_fast_and_fit_a_narrow_window(page, server):
    prompt = TEXT * 3
    while (T := post(server + "/tokenize", {"prompt": prompt})[1]["count"]) > 64:
        prompt = prompt[:-8]  # about the longest that fits the context (64)
    type_into(page, "prompt", prompt)
    page.find_element(by("ID"), "inspect").click()
    wait_for(page, lambda b: b.find_element(by("ID"), "attention-section").get_attribute("data-ms"))
    took = float(page.find_element(by("ID"), "attention-section").get_attribute("data-ms"))
    print(f"attention panels of a {T}-token prompt {took:.0f} ms after the click")  # not asserted
    assert len(page.find_elements(by("CSS_SELECTOR"), "#pattern td[data-row]")) == T * T
    page.find_element(by("CSS_SELECTOR"), ".token[data-index='5']").click()
    wait_for(page, lambda b: len(rows(b)) == 20)
    page.save_screenshot(str(ARTIFACTS / "serve-page-attention.png"))
    overflow = "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
    assert page.execute_script(overflow) <= 0
    page.set_window_size(480, 900)  # a phone's width: the page reflows, nothing off-screen
    assert page.execute_script(overflow) <= 0
    page.save_screenshot(str(ARTIFACTS / "serve-page-narrow.png"))


def test_a_long_prompt_and_a_stream_cut_short_each_show_a_message(browser, served_run):
    proc, url = start(served_run)
    try:
        browser.get(url + "/")
        type_into(browser, "prompt", "word " * 100)  # a prompt is refused, never cut short
        browser.find_element(by("ID"), "generate").click()
        error = wait_for(browser, lambda b: b.find_element(by("ID"), "error").text or None)
        assert error.startswith("400: ") and "reads at most 64" in error
        assert "\n" not in error
        logged = console_errors(browser)  # the request that was refused
        assert len(logged) == 1 and "/v1/completions" in logged[0]

        browser.execute_script(  # the server's stream breaks after its first chunk
            """
            const real = window.fetch;
            window.fetch = async (url, init) => {
              const response = await real(url, init);
              if (!String(url).endsWith("/v1/completions")) return response;
              const reader = response.body.getReader();
              let sent = 0;
              const body = new ReadableStream({async pull(controller) {
                if (sent === 1) { controller.error(new TypeError("network error")); return; }
                const {value, done} = await reader.read();
                if (done) controller.close(); else { controller.enqueue(value); sent += 1; }
              }});
              return new Response(body, {status: response.status, headers: response.headers});
            };"""
        )
        generate_button = browser.find_element(by("ID"), "generate")
        type_into(browser, "prompt", PROMPT)
        generate_button.click()
        error = wait_for(browser, lambda b: b.find_element(by("ID"), "error").text or None)
        kept = browser.find_elements(by("CSS_SELECTOR"), "#output .token.generated")
        assert f"stopped mid-stream after {len(kept)} tokens" in error and kept
        assert generate_button.is_enabled()

        proc.terminate()  # and a server that has gone away
        proc.wait(timeout=10)
        generate_button.click()
        gone = "the server did not answer"
        wait_for(browser, lambda b: gone in b.find_element(by("ID"), "error").text)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)
        console_errors(browser)


def test_an_int8_server_decodes_and_refuses_inspection_in_one_line(served_run, browser):
    """int8 keeps no fp32 weights (memory follows the format), and inspection reads them:
    the openai client completes, and the page's Inspect button shows the one-line refusal."""
    proc, url = start(served_run, "--dtype", "int8")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        completion = client.completions.create(model="run", prompt="The", max_tokens=3)
        assert completion.choices[0].text and completion.usage.completion_tokens <= 3
        status, answer, _ = post(url + "/v1/inspect", {"prompt": "a"})
        assert status == 400 and answer["error"]["code"] == "unsupported_dtype"
        browser.get(url + "/")
        browser.find_element(by("ID"), "inspect").click()
        error = wait_for(browser, lambda b: b.find_element(by("ID"), "error").text or None)
        assert error.startswith("400: ") and "--dtype float32" in error
        assert error.count("\n") == 0
        logged = console_errors(browser)  # read, so that the next page test starts clean
        assert len(logged) == 1 and "/v1/attention" in logged[0] and "400" in logged[0]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def char_server(tmp_path_factory):
    """A character model with context 64 trained on one long document (it never learns to
    end one), served: generation runs past its context."""
    folder = tmp_path_factory.mktemp("char")
    corpus = folder / "plays.txt"
    corpus.write_text(TEXT * 200)
    data, run = folder / "data", folder / "run"
    assert main(["prepare", str(corpus), "--out", str(data), "--tokenizer", "char", "--quiet"]) == 0
    args = ["train", "--data", str(data), "--out", str(run), "--n-layers", "2", "--d-model", "32"]
    args += ["--n-heads", "2", "--context-length", "64", "--max-steps", "60", "--batch-size", "8"]
    assert main([*args, "--quiet"]) == 0
    proc, url = start(run)
    yield url, run
    proc.terminate()
    proc.wait(timeout=10)


def test_a_position_past_the_context_is_explained_with_the_window_generation_read(
    browser, char_server
):
    """80 tokens on the page from a context of 64: the distribution at a late token is the
    one generation drew it from (its logprobs), read through the same window, which the panel
    names; continuing from there slides the same way; a long prompt's attention is that of
    the last 64 tokens."""
    url, run = char_server
    browser.set_window_size(1280, 800)
    browser.get(url + "/")
    knobs(browser, 0, 0, 1)
    prompt = "The for stateme"  # 15 characters: 16 tokens with <|endoftext|>
    generate(browser, prompt, 64)
    ids = [t for _, t in shown(browser)]
    assert len(ids) == 80
    body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "logprobs": 20}
    status, answer, _ = post(url + "/v1/completions", body)
    logprobs = answer["choices"][0]["logprobs"]
    assert status == 200 and logprobs["token_ids"] == ids[16:]

    knobs(browser, 1, 0, 1)  # the model's own distribution
    for at in (79, 70):
        browser.find_element(by("CSS_SELECTOR"), f".token[data-index='{at}']").click()
        wait_for(browser, lambda b, at=at: b.find_element(by("ID"), "dist-position").text
                 .startswith(f"{at} ") and len(rows(b)) == 20)  # fmt: skip
        window = browser.find_element(by("ID"), "dist-window").text
        assert f"the model saw positions {at - 64}…{at - 1}" in window
        on_page = {text: p for _, text, p in rows(browser)}
        top = logprobs["top_logprobs"][at - 16]
        assert len(top) == len(on_page) == 20
        for text, logprob in top.items():
            assert abs(on_page[text] - math.exp(logprob)) < 1e-4, (at, text)

    knobs(browser, 0, 0, 1)  # continue greedily from position 70: the same tokens again
    browser.find_element(by("ID"), "continue").click()
    wait_for(browser, lambda b: b.find_element(by("ID"), "status").text.startswith("done"))
    again = [t for _, t in shown(browser)]
    assert len(again) == 70 + 64 and again[:80] == ids

    long = (TEXT * 2)[:100]  # 101 tokens: the panels show the last 64, as generation reads them
    type_into(browser, "prompt", long)
    browser.find_element(by("ID"), "inspect").click()
    wait_for(
        browser, lambda b: b.find_element(by("ID"), "attention-section").get_attribute("data-ms")
    )
    note = browser.find_element(by("ID"), "attention-window").text
    assert "the model saw positions 37…100" in note
    tokenizer = load_tokenizer(run)
    window = document_ids(tokenizer, long)[-64:]
    names = [f"blocks.0.attn.{n}" for n in ("pattern", "v")]
    _, cache = run_with_cache(load_model(run), torch.tensor([window]), names)
    pattern, v = (cache[n][0, 0].double() for n in names)
    assert torch.allclose(panel(browser, "pattern", 64), pattern, atol=1e-5, rtol=0)
    contrib = panel(browser, "contrib", 64)
    assert torch.allclose(contrib[63], pattern[63] * v.norm(dim=-1), atol=1e-5, rtol=0)
    assert browser.find_element(by("ID"), "contrib-query").text.startswith("100 ")
    browser.switch_to.frame(browser.find_element(by("ID"), "explorer"))
    wait_for(
        browser, lambda b: len(b.find_elements(by("CSS_SELECTOR"), "#grid tr[data-query]")) == 64
    )
    browser.switch_to.default_content()
    assert console_errors(browser) == []
