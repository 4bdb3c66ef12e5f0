"""schemathesis fuzzes `tlm serve` against its own /openapi.json: no 5xx, every response
valid against the documented schema and status codes, and invalid bodies refused. Seeded
(derandomized), a few hundred requests; the run with streaming on is marked slow."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from serving import KEY

pytestmark = pytest.mark.slow  # a server process
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
OPENAI = r"^/v1/(completions|chat/completions|models)$"
PAGE = r"^/(tokenize|detokenize|tokenizer_info|v1/(distribution|attention|inspect))$"
SHORT = {
    "max_tokens": 8,
    "max_completion_tokens": 8,
}  # no bound in the schema: clamping keeps validity


def operations(server, paths: str = OPENAI, count: int = 3):
    api = schemathesis.openapi.from_url(server + "/openapi.json").include(path_regex=paths)
    found = [result.ok() for result in api.get_all_operations()]
    assert len(found) == count  # OpenAI's: completions, chat, models
    return found


def short(case, stream: bool) -> None:
    """Keep an answer short (a request for 10⁹ tokens is valid, but slow), and streaming
    off or on; a body that is not an object is left as generated."""
    if isinstance(case.body, dict):
        for name, most in SHORT.items():
            value = case.body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > most:
                case.body[name] = most
        given = case.body.get("stream")  # an invalid one (a list) stays, to be refused
        if isinstance(given, bool) or (given is None and stream):
            case.body["stream"] = stream


def fuzz(operation, examples: int, mode: GenerationMode, stream: bool, checks) -> None:
    @given(case=operation.as_strategy(mode))
    @settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case):
        short(case, stream)
        case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"}, checks=checks)

    run()


def test_the_openai_routes_keep_their_schema(server):
    """About 300 requests: valid bodies answered as documented, invalid ones refused."""
    for operation in operations(server):
        fuzz(operation, 60, GenerationMode.POSITIVE, stream=False, checks=CHECKS)
        if operation.method.upper() == "POST":  # a GET without parameters has nothing to break
            fuzz(operation, 40, GenerationMode.NEGATIVE, stream=False, checks=CHECKS)


def test_streamed_answers_keep_their_status_codes(server):
    """Streaming on: the event stream is not JSON, so its status codes and the absence of
    server errors are what is checked."""
    for operation in operations(server):
        fuzz(operation, 40, GenerationMode.POSITIVE, stream=True, checks=CHECKS[:2])


def test_the_pages_routes_keep_their_schema(server):
    """tlm's extras (the page's and lm-eval's remote tokenizer's), typed like OpenAI's:
    about 250 requests."""
    for operation in operations(server, PAGE, 6):
        fuzz(operation, 25, GenerationMode.POSITIVE, stream=False, checks=CHECKS)
        if operation.method.upper() == "POST":
            fuzz(operation, 25, GenerationMode.NEGATIVE, stream=False, checks=CHECKS)
