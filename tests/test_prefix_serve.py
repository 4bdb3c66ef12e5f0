"""`tlm serve`'s prefix cache (issue 64, parts 1 and 4) through the official openai client:
a conversation's later turns and clients that share a system prompt get the replies a
server without the cache gives, their usage says how many prompt tokens were cached, and
/metrics and /health add up."""

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from serving import KEY, health, start

pytestmark = pytest.mark.slow  # two server processes

SYSTEM = "Be brief about the statements of Python."
ASKED = ["for?", "while?"]  # a third turn would pass the context of 64


@pytest.fixture(scope="module")
def servers(served_run):
    """The same run served with the cache (its default size) and without (0 MB)."""
    on, off = (
        start(served_run, "--api-key", KEY),
        start(served_run, "--api-key", KEY, "--prefix-cache-mb", "0"),
    )
    yield on[1], off[1]
    for proc, _ in (on, off):
        proc.terminate()
        proc.wait(timeout=10)


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def converse(url):
    """Two turns after a system prompt, greedy: each reply, and each turn's usage."""
    messages, replies, usages = [{"role": "system", "content": SYSTEM}], [], []
    for asked in ASKED:
        messages.append({"role": "user", "content": asked})
        got = client(url).chat.completions.create(
            model="run", messages=messages, max_tokens=6, temperature=0
        )
        reply = got.choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
        usages.append(got.usage)
    return replies, usages


def series(url) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(tlm_pre\w+) (\S+)$", text, re.M)}


def test_turns_and_shared_prompts_answer_as_without_the_cache_and_the_figures_add_up(servers):
    on, off = servers
    assert health(on)["prefix_cache"]["budget"] > 0 and health(off)["prefix_cache"] is None
    with_cache, cached_usage = converse(on)
    without, plain_usage = converse(off)
    assert with_cache == without
    cached = [u.prompt_tokens_details.cached_tokens for u in cached_usage]
    assert [u.prompt_tokens_details.cached_tokens for u in plain_usage] == [0, 0]
    assert cached[0] == 0 and all(c > 0 and c % 16 == 0 for c in cached[1:])
    assert all(c < u.prompt_tokens for c, u in zip(cached, cached_usage, strict=True))
    prompts = [f"{SYSTEM}\nUser: {w}\nAssistant:" for w in ("a", "b", "c", "d", "e", "f")]

    def ask(url, prompt):
        return client(url).completions.create(
            model="run", prompt=prompt, max_tokens=5, temperature=0
        )

    with ThreadPoolExecutor(6) as pool:  # six clients at once, one system prompt
        shared = list(pool.map(lambda p: ask(on, p), prompts))
        alone = list(pool.map(lambda p: ask(off, p), prompts))
    assert [r.choices[0].text for r in shared] == [r.choices[0].text for r in alone]
    reused = sum(cached) + sum(r.usage.prompt_tokens_details.cached_tokens for r in shared)
    figures, plain = series(on), series(off)
    assert figures["tlm_prefix_cache_tokens_reused"] == reused > 0
    assert figures["tlm_prefill_tokens"] + reused == plain["tlm_prefill_tokens"]
    assert figures["tlm_prefix_cache_lookups"] == len(ASKED) + len(prompts)
    assert figures["tlm_prefix_cache_hits"] >= len(ASKED) - 1 + len(prompts) - 1
    held = health(on)["prefix_cache"]
    assert held["blocks"] == figures["tlm_prefix_cache_blocks"] > 0
    assert held["bytes"] == figures["tlm_prefix_cache_bytes"] <= held["budget"]
    assert plain["tlm_prefix_cache_lookups"] == 0 and plain["tlm_prefix_cache_bytes"] == 0
