"""The OpenAI contract of `tlm serve`: every sampling parameter honoured as the decoding
core honours it, the rest accepted or refused by name (never ignored), the fuzzing findings
fixed, and the request and response bodies described by /openapi.json."""

import json
import urllib.error
import urllib.request

import pytest

from serving import KEY, local, post
from tlm.load import load_tokenizer

pytestmark = pytest.mark.slow  # a server process


def get(url):
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def chat(server, **body):
    return post(
        server + "/v1/chat/completions", {"messages": [{"role": "user", "content": "for?"}], **body}
    )


def test_logit_bias_of_100_selects_its_token(server, served_run):
    token = load_tokenizer(served_run).encode(" while")[0]
    body = {"prompt": "The", "max_tokens": 5, "temperature": 0, "logprobs": 1}
    status, answer, _ = post(server + "/v1/completions", {**body, "logit_bias": {str(token): 100}})
    assert status == 200
    assert answer["choices"][0]["logprobs"]["token_ids"] == [token] * 5
    status, banned, _ = post(server + "/v1/completions", {**body, "logit_bias": {str(token): -100}})
    assert token not in banned["choices"][0]["logprobs"]["token_ids"]


@pytest.mark.parametrize(
    "settings",
    [
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"presence_penalty": 2.0, "temperature": 0.9, "seed": 4},  # a reply long enough to repeat
    ],
)
def test_penalties_give_what_the_core_gives(server, served_run, settings):
    body = {"prompt": "The for", "max_tokens": 24, "temperature": 0, **settings}
    status, answer, _ = post(server + "/v1/completions", body)
    sampled = body["temperature"] > 0
    expected = local(
        served_run, "The for", 24, do_sample=sampled, temperature=body["temperature"],
        frequency_penalty=settings.get("frequency_penalty", 0.0),
        presence_penalty=settings.get("presence_penalty", 0.0), seed=settings.get("seed"),
    )  # fmt: skip
    assert status == 200 and answer["choices"][0]["text"] == expected.text
    plain = post(
        server + "/v1/completions", {**body, "frequency_penalty": 0, "presence_penalty": 0}
    )
    assert plain[1]["choices"][0]["text"] != expected.text  # the penalties change the answer


def test_best_of_answers_the_likeliest_candidates(server, served_run):
    body = {"prompt": "The", "max_tokens": 10, "temperature": 1.2, "seed": 5, "logprobs": 0}
    every = post(server + "/v1/completions", {**body, "n": 4})[1]["choices"]
    best = post(server + "/v1/completions", {**body, "n": 2, "best_of": 4})[1]
    totals = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in every}
    ranked = sorted(totals, key=totals.get, reverse=True)
    assert [c["text"] for c in best["choices"]] == ranked[:2]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert best["usage"]["completion_tokens"] == sum(
        len(c["logprobs"]["tokens"]) for c in every
    )  # every candidate's tokens count
    refused = post(server + "/v1/completions", {**body, "n": 3, "best_of": 2})
    assert refused[0] == 400 and refused[1]["error"]["param"] == "best_of"
    refused = post(server + "/v1/completions", {**body, "best_of": 2, "stream": True})
    assert refused[0] == 400 and refused[1]["error"]["param"] == "best_of"


def test_max_completion_tokens_and_stream_usage(server):
    status, answer, _ = chat(server, max_completion_tokens=3, temperature=0, ignore_eos=True)
    assert status == 200 and answer["usage"]["completion_tokens"] == 3
    # greedy: a sampled reply may reach "\nUser:", the chat's stop, within 4 tokens
    body = {
        "messages": [{"role": "user", "content": "for?"}],
        "max_tokens": 4, "ignore_eos": True, "stream": True, "temperature": 0,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    request = urllib.request.Request(
        server + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        lines = [line.decode() for line in response if line.startswith(b"data: {")]
    chunks = [json.loads(line[6:]) for line in lines]
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]  # the role once, as OpenAI's
    assert deltas[0]["role"] == "assistant" and not any("role" in d for d in deltas[1:])
    assert chunks[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": {}, "content": None}, "messages[0].role"),  # a 500 before
        ({"role": [], "content": "x"}, "messages[0].role"),  # likewise
        ({"role": "user", "content": "x", "name": {}}, "messages[0].name"),  # accepted before
        ({"role": "tool", "content": "x"}, "messages[0].role"),
        ({"role": "user"}, "messages[0].content"),
    ],
)
def test_fuzzing_findings_are_400s_naming_the_field(server, message, param):
    status, answer, _ = post(server + "/v1/chat/completions", {"messages": [message]})
    assert status == 400 and answer["error"]["param"] == param, answer


def test_developer_role_null_prompt_and_refusal_null(server):
    developer = {"role": "developer", "content": "Be brief."}
    status, answer, _ = post(
        server + "/v1/chat/completions",
        {"messages": [developer, {"role": "user", "content": "for?"}], "max_tokens": 4},
    )
    assert status == 200 and answer["choices"][0]["message"]["refusal"] is None
    status, answer, _ = post(server + "/v1/completions", {"prompt": None, "max_tokens": 2})
    assert status == 200 and len(answer["choices"]) == 1
    parts = [{"type": "text", "text": "for"}, {"type": "text", "text": "?"}]
    same = post(
        server + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": parts}], "max_tokens": 6, "temperature": 0},
    )
    plain = chat(server, max_tokens=6, temperature=0)
    assert same[1]["choices"][0]["message"] == plain[1]["choices"][0]["message"]


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ({"tool_choice": "auto"}, 400, "tool_choice"),
        ({"functions": [{"name": "f"}]}, 400, "functions"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
        ({"modalities": ["text", "audio"]}, 400, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, 400, "prediction"),
        ({"no_such_field": 1}, 400, "no_such_field"),
        ({"response_format": {"type": "json_schema"}}, 400, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                }
            },
            400,
            "response_format",
        ),
        ({"response_format": {"type": "text"}}, 200, None),
        ({"user": "u1", "store": False, "metadata": {"a": "b"}, "service_tier": "auto"}, 200, None),
        ({"parallel_tool_calls": True, "tool_choice": "none", "modalities": ["text"]}, 200, None),
        (
            {"prompt_cache_key": "k", "safety_identifier": "s", "prompt_cache_retention": "24h"},
            200,
            None,
        ),
        ({"stream_options": {"include_obfuscation": False}}, 200, None),
        ({"reasoning_effort": "low"}, 400, "reasoning_effort"),
        ({"verbosity": "low"}, 400, "verbosity"),
    ],
)
def test_each_field_is_honoured_accepted_or_refused_by_name(server, extra, status, param):
    got, answer, _ = chat(server, max_tokens=2, **extra)
    assert got == status, answer
    if param is not None:
        assert answer["error"]["param"] == param


def test_openapi_describes_the_bodies(server):
    with urllib.request.urlopen(server + "/openapi.json", timeout=10) as response:
        spec = json.loads(response.read())
    schemas = spec["components"]["schemas"]
    assert {"frequency_penalty", "logit_bias", "best_of", "prompt"} <= set(
        schemas["CompletionRequest"]["properties"]
    )
    chat_body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert chat_body["content"]["application/json"]["schema"]["$ref"].endswith("/ChatRequest")
    answers = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert answers["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/Completion")
    assert answers["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")


def test_a_client_gone_before_a_whole_answer_frees_its_rows(server):
    """Not only a stream: a request whose client stops waiting is cancelled, not decoded to
    its max_tokens for nobody."""
    import socket

    from serving import eventually, health

    body = {"prompt": "The", "max_tokens": 1_000_000, "ignore_eos": True}
    with pytest.raises((TimeoutError, socket.timeout, OSError)):
        request = urllib.request.Request(
            server + "/v1/completions", json.dumps(body).encode(),
            {"Authorization": f"Bearer {KEY}"},
        )  # fmt: skip
        urllib.request.urlopen(request, timeout=1)
    assert eventually(lambda: health(server)["busy"] == 0)  # a million tokens: cancelled


def test_a_negative_seed_is_a_seed(server):
    """A negative seed stopped the engine thread before (every later request waited
    forever); now it is a seed like any other."""
    body = {"prompt": "The", "max_tokens": 6, "temperature": 1.0, "seed": -(2**63)}
    first, second = (post(server + "/v1/completions", body) for _ in range(2))
    assert first[0] == second[0] == 200
    assert first[1]["choices"][0]["text"] == second[1]["choices"][0]["text"]
    assert post(server + "/v1/completions", {"prompt": "The", "max_tokens": 2})[0] == 200


def test_published_schema_findings(server):
    """OpenAI's published document (openai/openai-openapi) allows these; each was refused."""
    (served,) = get(server + "/v1/models")["data"]
    assert get(server + "/v1/models/" + served["id"]) == served
    with pytest.raises(urllib.error.HTTPError) as missing:
        get(server + "/v1/models/gpt-4")
    assert missing.value.code == 404
    assert json.loads(missing.value.read())["error"]["code"] == "model_not_found"
    greedy = chat(server, max_tokens=6, temperature=0)[1]["choices"][0]["message"]
    nucleus_zero = chat(server, max_tokens=6, temperature=1.5, top_p=0, seed=3)
    assert nucleus_zero[1]["choices"][0]["message"] == greedy  # top_p 0: the likeliest only
    status, answer, _ = post(server + "/v1/completions", {"prompt": "The", "max_tokens": 0})
    assert status == 200 and answer["choices"][0]["text"] == ""
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 0
