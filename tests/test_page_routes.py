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
        ("/v1/inspect", {"prompt": "word " * 100}, 400, "prompt", "context_length_exceeded"),
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
    assert status == 200 and set(dist) == {"position", "top", "logprobs"} and len(dist["top"]) == 20
    assert post(server + "/detokenize", {"tokens": []})[1] == {"prompt": ""}
    status, tokens, _ = post(server + "/tokenize", {"prompt": "The", "add_special_tokens": True})
    assert status == 200 and set(tokens) == {"tokens", "texts", "count", "max_model_len"}
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["texts"])
