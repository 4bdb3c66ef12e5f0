"""The page's routes (tlm extras: /tokenize, /detokenize, /tokenizer_info, /v1/distribution,
/v1/attention, /v1/inspect) are typed like OpenAI's: /openapi.json describes their bodies,
and a body they refuse is a 400 in OpenAI's error shape naming the field."""

import json
import urllib.request

import pytest

from serving import KEY, post

pytestmark = pytest.mark.slow  # a server process

BODIES = {  # route -> (request model, its fields, response model or None)
    "/tokenize": ("TokenizeRequest", "model prompt add_special_tokens", "Tokens"),
    "/detokenize": ("DetokenizeRequest", "model tokens", "Detokenized"),
    "/v1/distribution": ("DistributionRequest", "model prompt token top", "Distribution"),
    "/v1/attention": ("AttentionRequest", "model prompt layer head", "AttentionSteps"),
    "/v1/inspect": ("InspectRequest", "model prompt", None),
}


def schema_of(answer: dict) -> str:
    return answer["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]


def test_openapi_describes_the_pages_routes(server):
    with urllib.request.urlopen(server + "/openapi.json", timeout=10) as response:
        spec = json.loads(response.read())
    schemas = spec["components"]["schemas"]
    for path, (request, fields, answer) in BODIES.items():
        route = spec["paths"][path]["post"]
        assert schema_of(route["requestBody"]) == request
        assert set(schemas[request]["properties"]) == set(fields.split())
        assert schemas[request]["additionalProperties"] is False  # closed, as OpenAI's bodies
        assert schema_of(route["responses"]["400"]) == "ErrorBody"
        if answer is not None:
            assert schema_of(route["responses"]["200"]) == answer
    assert schema_of(spec["paths"]["/tokenizer_info"]["get"]["responses"]["200"]) == "TokenizerInfo"
    assert schemas["DistributionRequest"]["properties"]["top"]["default"] == 20


@pytest.mark.parametrize(
    "path, body, status, param, code",
    [
        ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, 400, "add_special_tokens",
         "invalid_type"),  # accepted before, and read as true
        ("/tokenize", {"prompt": "a", "return_tokens": True}, 400, "return_tokens",
         "unknown_parameter"),  # ignored before
        ("/tokenize", {"prompt": [1, 2]}, 400, "prompt", "invalid_type"),
        ("/tokenize", {}, 400, "prompt", "invalid_type"),
        ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model", "model_not_found"),
        ("/detokenize", {"tokens": [1, "a"]}, 400, "tokens[1]", "invalid_type"),
        ("/detokenize", {"tokens": [99999]}, 400, "tokens", "invalid_value"),
        ("/v1/distribution", {"prompt": "a", "top": "3"}, 400, "top", "invalid_type"),
        ("/v1/distribution", {"prompt": "a", "top": 0}, 400, "top", "invalid_value"),
        ("/v1/distribution", {"prompt": "a", "top": 10**6}, 400, "top", "invalid_value"),
        ("/v1/distribution", {"prompt": "a", "token": True}, 400, "token", "invalid_type"),
        ("/v1/distribution", {"prompt": "a", "token": -1}, 400, "token", "invalid_value"),
        ("/v1/distribution", {"prompt": "a", "tokens": 5}, 400, "tokens", "unknown_parameter"),
        ("/v1/distribution", {"prompt": []}, 400, "prompt", "invalid_type"),
        ("/v1/attention", {"prompt": "a", "head": 1.5}, 400, "head", "invalid_type"),
        ("/v1/attention", {"prompt": "a", "layer": -1}, 400, "layer", "invalid_value"),
        ("/v1/attention", {"prompt": "a", "head": 2}, 400, "head", "invalid_value"),
        ("/v1/inspect", {"prompt": ["a"]}, 400, "prompt", "invalid_type"),
        ("/v1/inspect", {"prompt": "a", "model": "gpt-4"}, 404, "model", "model_not_found"),
        ("/v1/inspect", {"prompt": ""}, 400, None, None),  # a 500 before (HookError)
        ("/v1/attention", [1, 2], 400, None, "invalid_type"),  # not an object
        ("/v1/distribution", None, 400, None, "invalid_json"),
        ("/tokenize", {"prompt": "a"}, 401, None, "invalid_api_key"),  # (the wrong key)
    ],
)  # fmt: skip
def test_each_bad_body_is_a_400_naming_the_field(server, path, body, status, param, code):
    key = "wrong" if status == 401 else KEY
    got, answer, _ = post(server + path, body, key, b"{not json" if body is None else None)
    assert got == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param and answer["error"]["code"] == code


def test_tokenizer_info_needs_the_key_and_answers_its_shape(server):
    request = urllib.request.Request(server + "/tokenizer_info")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 401
    assert json.loads(refused.value.read())["error"]["code"] == "invalid_api_key"
    request.add_header("Authorization", f"Bearer {KEY}")
    with urllib.request.urlopen(request, timeout=10) as response:
        info = json.loads(response.read())
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 64
    assert set(info) == {"tokenizer_class", "eos_token", "bos_token", "pad_token",
                         "model_max_length"}  # fmt: skip


def test_the_answers_keep_their_shapes(server):
    """What the page and lm-eval read: a distribution without `token` has no `token`; an
    empty list of tokens detokenizes to the empty text; the model's own name is accepted."""
    status, dist, _ = post(server + "/v1/distribution", {"prompt": "The", "model": "run"})
    assert status == 200 and set(dist) == {"position", "window", "top", "logprobs"}
    assert len(dist["top"]) == 20 and dist["window"] == [0, dist["position"] - 1]
    assert post(server + "/detokenize", {"tokens": []})[1] == {"prompt": ""}
    status, tokens, _ = post(server + "/tokenize", {"prompt": "The", "add_special_tokens": True})
    assert status == 200 and set(tokens) == {"tokens", "texts", "count", "max_model_len"}
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["texts"])


def test_a_position_past_the_context_is_read_as_generation_read_it(server):
    """Generation slides its window past the context (64): the distribution at each position
    is the one generation chose from there, its log-probabilities those the completion gave,
    and the answer names the window."""
    body = {"prompt": "The", "max_tokens": 72, "temperature": 0, "logprobs": 5, "ignore_eos": True}
    status, answer, _ = post(server + "/v1/completions", body)
    assert status == 200, answer
    logprobs = answer["choices"][0]["logprobs"]
    prompt = post(server + "/tokenize", {"prompt": "The"})[1]["tokens"]
    ids = prompt + logprobs["token_ids"]
    assert len(ids) > 64 + 8
    for j in (40, 62, 63, 64, 71):  # within the context, at its edge, past it
        at = len(prompt) + j  # ids[at] is generated token j
        status, dist, _ = post(server + "/v1/distribution", {"prompt": ids[:at], "token": ids[at]})
        assert status == 200, dist
        assert dist["position"] == at and dist["window"] == [max(0, at - 64), at - 1]
        assert dist["token"]["rank"] == 0  # greedy's choice
        assert abs(dist["token"]["logprob"] - logprobs["token_logprobs"][j]) < 1e-5
        top = {t["token"]: t["logprob"] for t in dist["top"][:5]}
        assert top.keys() == logprobs["top_logprobs"][j].keys()
        for text, logprob in logprobs["top_logprobs"][j].items():
            assert abs(top[text] - logprob) < 1e-5, (j, text)


def test_the_attention_and_inspection_of_a_long_prompt_read_its_window(server, served_run):
    from tlm.load import load_tokenizer
    from tlm.tokenizer import document_ids

    prompt = "word " * 100
    ids = document_ids(load_tokenizer(served_run), prompt)
    assert len(ids) > 64
    status, steps, _ = post(server + "/v1/attention", {"prompt": prompt, "layer": 1})
    assert status == 200, steps
    assert steps["ids"] == ids[-64:] and steps["window"] == [len(ids) - 64, len(ids) - 1]
    assert len(steps["pattern"]) == len(steps["tokens"]) == 64
    status, inspected, _ = post(server + "/v1/inspect", {"prompt": prompt})
    assert status == 200 and inspected["window"] == steps["window"]
    assert len(inspected["tokens"]) == len(inspected["patterns"][1][0]) == 64  # [L][H][T][T]
