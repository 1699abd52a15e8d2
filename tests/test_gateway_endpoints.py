"""The small endpoints (/tokenize, /detokenize, /version, /v1/models/{id}), OpenAI errors
for unknown routes and methods, and the stateless /v1/responses subset.

Shapes and refusals are checked on a gateway without a router (everything here is
answered before a request would reach a worker); generation through /v1/responses on a
real tiny cluster, with the openai SDK as a client would use it.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Iterator

import httpx
import pytest
from transformers import AutoTokenizer

from services.gateway.app import GatewaySettings
from tests.cluster import Cluster
from tests.test_gateway_http import ServedGateway, assert_openai_error, local_port, nobody_listens

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def post(client: httpx.Client, route: str, body) -> httpx.Response:
    """JSON with escapes, so a lone surrogate ("\\ud800") goes as the client wrote it."""
    return client.post(route, content=json.dumps(body),
                       headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def gateway(tiny_model_dir) -> Iterator[ServedGateway]:
    with ServedGateway(GatewaySettings(router=nobody_listens(), model=str(tiny_model_dir))) as gw:
        yield gw


@pytest.fixture(scope="module")
def client(gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def served_name(client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


# ---- /tokenize and /detokenize ------------------------------------------------------------

def test_tokenize_a_prompt_as_vllm_does(client, hf):
    r = client.post("/tokenize", json={"prompt": "Hello world, hello tokens"})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = hf.encode("Hello world, hello tokens", add_special_tokens=True)
    assert body == {"count": len(ids), "max_model_len": 1024, "tokens": ids, "token_strs": None}


def test_tokenize_token_strs_and_special_tokens(client, hf):
    r = client.post("/tokenize", json={"prompt": "<|im_start|>x", "add_special_tokens": False,
                                       "return_token_strs": True})
    body = r.json()
    ids = hf.encode("<|im_start|>x", add_special_tokens=False)
    assert body["tokens"] == ids and body["count"] == len(ids)
    assert body["token_strs"] == hf.convert_ids_to_tokens(ids)
    assert body["token_strs"][0] == "<|im_start|>"


def test_tokenize_messages_renders_the_chat_template(client, hf):
    body = client.post("/tokenize", json={"messages": MESSAGES}).json()
    text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == hf.encode(text, add_special_tokens=False)
    assert hf.decode(body["tokens"]).endswith("<|im_start|>assistant\n")
    bare = client.post("/tokenize", json={"messages": MESSAGES,
                                          "add_generation_prompt": False}).json()
    assert bare["tokens"] == body["tokens"][:bare["count"]] and bare["count"] < body["count"]


def test_tokenize_does_not_refuse_a_prompt_longer_than_the_context(client):
    body = client.post("/tokenize", json={"prompt": "word " * 3000}).json()
    assert body["count"] > body["max_model_len"] == 1024  # how a client sees it will not fit


def test_detokenize_round_trips(client, hf):
    ids = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    r = client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": hf.decode(ids)}
    assert r.json()["prompt"].startswith("<|im_start|>system\nBe brief.")  # specials kept
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_the_served_model_name_is_accepted_and_another_is_a_404(client, served_name):
    ok = client.post("/tokenize", json={"model": served_name, "prompt": "hi"})
    assert ok.status_code == 200
    for route, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        error = assert_openai_error(client.post(route, json={**body, "model": "gpt-9"}), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"


@pytest.mark.parametrize("route,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": ["hi"]}, "prompt"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"prompt": "x" * (1024 * 1024 + 1)}, "prompt"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": 1}, "return_token_strs"),
    ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, "messages"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages.[0].role"),
    ("/tokenize", {"messages": [{"role": "user", "content": 3}]}, "messages.[0].content"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": "no"}, "add_generation_prompt"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools.[0].function"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"prompt": "hi", "model": 3}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
    ("/detokenize", {"tokens": [1, 2.5]}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [49152]}, "tokens"),
    ("/detokenize", {"tokens": [2**70]}, "tokens"),
    ("/detokenize", {"tokens": [0] * (1024 * 1024 + 1)}, "tokens"),
])
def test_bad_tokenize_input_is_a_400_naming_the_field(client, route, body, param):
    error = assert_openai_error(post(client, route, body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error", error


@pytest.mark.parametrize("route", ["/tokenize", "/detokenize", "/v1/responses"])
@pytest.mark.parametrize("raw", [b"", b"[1]", b'"prompt"', b'{"prompt": "hi"', b"\xff",
                                 b"[" * 50_000])
def test_bad_json_on_the_new_routes_is_a_400(client, route, raw):
    r = client.post(route, content=raw, headers={"Content-Type": "application/json"})
    assert assert_openai_error(r, 400)["type"] == "invalid_request_error"
    assert local_port(client.get("/version")) == local_port(r)  # the connection survived


# ---- /version, /v1/models/{id}, unknown routes and methods -------------------------------

def test_version_is_the_package_version(client):
    r = client.get("/version")
    assert r.status_code == 200 and r.json() == {"version": importlib.metadata.version("tandem")}


def test_a_model_by_id_is_its_models_list_entry(client, served_name):
    [card] = client.get("/v1/models").json()["data"]
    r = client.get(f"/v1/models/{served_name}")
    assert r.status_code == 200 and r.json() == card
    error = assert_openai_error(client.get("/v1/models/no-such/model"), 404)
    assert error == {"message": "The model `no-such/model` does not exist or you do not have "
                                "access to it.", "type": "not_found_error", "param": "model",
                     "code": "model_not_found"}


def test_the_openai_sdk_retrieves_the_model(gateway, served_name):
    import openai

    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    assert sdk.models.retrieve(served_name).id == served_name
    with pytest.raises(openai.NotFoundError) as e:
        sdk.models.retrieve("gpt-9")
    assert e.value.code == "model_not_found"


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/nope", 404), ("POST", "/v1/nope", 404), ("GET", "/v1/embeddings", 404),
    ("DELETE", "/v1/models/x/y/z", 405), ("GET", "/tokenize", 405), ("PUT", "/detokenize", 405),
    ("POST", "/version", 405), ("GET", "/v1/responses", 405), ("GET", "/v1/responses/resp_1", 404),
])
def test_unknown_routes_and_methods_are_openai_errors(client, method, path, status):
    r = client.request(method, path)
    error = assert_openai_error(r, status)
    assert f"{method} {path}" in error["message"] or "does not store" in error["message"]
    if status == 405:
        assert r.headers["allow"] and r.headers["allow"] in error["message"]


def test_probes_and_metrics_keep_their_bodies(client):
    assert client.get("/health").json()["status"] == "unavailable"  # no router here
    assert client.get("/ready").json()["status"] == "not ready"
    assert "tandem:http_requests" in client.get("/metrics").text


def test_the_new_routes_are_in_the_published_openapi(client):
    paths = client.get("/openapi.json").json()["paths"]
    for path, method in (("/tokenize", "post"), ("/detokenize", "post"), ("/version", "get"),
                         ("/v1/models/{model_id}", "get"), ("/v1/responses", "post")):
        assert "200" in paths[path][method]["responses"], path
    tokenize = paths["/tokenize"]["post"]["requestBody"]["content"]["application/json"]
    assert [v["required"] for v in tokenize["schema"]["oneOf"]] == [["prompt"], ["messages"]]


# ---- /v1/responses refusals (answered before admission) -----------------------------------

@pytest.mark.parametrize("extra,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"text": "plain"}, "text.format"),
    ({"truncation": "auto"}, "truncation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tool_calls": 1}, "max_tool_calls"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"input": None}, "input"),
    ({"input": 7}, "input"),
    ({"input": []}, "input"),
    ({"input": ["hi"]}, "input.[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input.[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.[0].role"),
    ({"input": [{"role": "user", "content": 1}]}, "input.[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.[0].content.[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
     "input.[0].content.[0]"),
    ({"input": "\ud800"}, "input"),
    ({"instructions": 5}, "instructions"),
    ({"instructions": "\udc00"}, "instructions"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": "8"}, "max_output_tokens"),
    ({"max_output_tokens": 5000}, "input"),  # with the input, more than the context holds
    ({"input": "word " * 1100}, "input"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"stream": "yes"}, "stream"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"model": 3}, "model"),
])
def test_responses_outside_the_subset_is_a_400_naming_the_field(client, extra, param):
    body = {"input": "hi", "max_output_tokens": 4, **extra}
    error = assert_openai_error(post(client, "/v1/responses", body), 400)
    assert error["param"] == param, error
    if param == "max_output_tokens":
        assert "max_tokens" not in error["message"].replace("max_output_tokens", "")


def test_responses_with_another_model_is_a_404(client):
    r = client.post("/v1/responses", json={"model": "gpt-9", "input": "hi"})
    assert assert_openai_error(r, 404)["code"] == "model_not_found"


def test_a_valid_response_request_gets_as_far_as_the_router(client):
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "instructions": "Be brief.", "store": False, "max_output_tokens": 4,
            "metadata": {"k": "v"}, "parallel_tool_calls": False, "tool_choice": "auto"}
    assert "router" in assert_openai_error(client.post("/v1/responses", json=body), 503)["message"]


# ---- /v1/responses on a real cluster ------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tiny_model_dir) -> Iterator[Cluster]:
    with Cluster(str(tiny_model_dir)) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(cluster):
    import openai

    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)


def chat_text(sdk, messages, max_tokens):
    r = sdk.chat.completions.create(model=sdk.models.list().data[0].id, messages=messages,
                                    max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


def test_a_response_is_the_chat_answer_in_the_responses_shape(sdk):
    want, reason, usage = chat_text(sdk, MESSAGES, 12)
    r = sdk.responses.create(model=sdk.models.list().data[0].id, instructions="Be brief.",
                             input="Hi there", max_output_tokens=12, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.output_text == want and r.output[0].type == "message"
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == usage.prompt_tokens
    assert r.usage.output_tokens == usage.completion_tokens
    assert r.usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert r.instructions == "Be brief." and r.max_output_tokens == 12 and r.temperature == 0
    if reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_max_output_tokens_cuts_the_response_as_incomplete(cluster, sdk):
    messages = [{"role": "user", "content": "Count:"}]
    _, reason, _ = chat_text(sdk, messages, 3)
    assert reason == "length"  # a random model all but never picks EOS in 3 tokens
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Count:"}]}],
            "max_output_tokens": 3, "temperature": 0}
    r = httpx.post(f"{cluster.url}/v1/responses", json=body, timeout=60).json()
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0]["status"] == "incomplete" and r["usage"]["output_tokens"] == 3


def test_tokenize_counts_what_a_chat_request_is_charged(cluster, sdk):
    _, _, usage = chat_text(sdk, MESSAGES, 2)
    counted = httpx.post(f"{cluster.url}/tokenize", json={"messages": MESSAGES}, timeout=30)
    assert counted.json()["count"] == usage.prompt_tokens


def stream_events(cluster, body) -> list[tuple[str, dict]]:
    events = []
    with httpx.stream("POST", f"{cluster.url}/v1/responses", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == kind
                events.append((kind, data))
    return events


def test_a_streamed_response_sends_the_events_in_order(cluster, sdk):
    want, reason, _ = chat_text(sdk, [{"role": "user", "content": "Tell me a story"}], 10)
    events = stream_events(cluster, {"input": "Tell me a story", "max_output_tokens": 10,
                                     "temperature": 0})
    kinds = [k for k, _ in events]
    deltas = kinds.count("response.output_text.delta")
    last = "response.incomplete" if reason == "length" else "response.completed"
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", last]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    data = dict(events)
    text = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    assert text == want == data["response.output_text.done"]["text"]
    final = data[last]["response"]
    assert final["output"][0]["content"][0]["text"] == want
    assert final["output"][0]["id"] == data["response.output_item.added"]["item"]["id"]
    assert final["id"] == data["response.created"]["response"]["id"]
    assert data["response.created"]["response"]["status"] == "in_progress"
    if reason == "length":
        assert final["status"] == "incomplete"
        assert final["incomplete_details"] == {"reason": "max_output_tokens"}


def test_the_sdk_streams_a_response(sdk):
    model = sdk.models.list().data[0].id
    want, _, _ = chat_text(sdk, [{"role": "user", "content": "Once upon"}], 8)
    stream = sdk.responses.create(model=model, input="Once upon", max_output_tokens=8,
                                  temperature=0, stream=True)
    events = list(stream)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == want and events[-1].response.output_text == want
    # The SDK's accumulating helper sees the same events (its get_final_response wants
    # response.completed: a random model runs to max_output_tokens, so it ends incomplete).
    with sdk.responses.stream(model=model, input="Once upon", max_output_tokens=8,
                              temperature=0) as s:
        helped = list(s)
    texts = [e.snapshot for e in helped if e.type == "response.output_text.delta"]
    assert texts[-1] == want and helped[-1].type == "response.incomplete"
    assert helped[-1].response.output_text == want


def test_a_stream_that_cannot_fit_is_refused_before_it_starts(cluster):
    r = httpx.post(f"{cluster.url}/v1/responses", timeout=60,
                   json={"input": "word " * 1100, "stream": True})
    assert assert_openai_error(r, 400)["param"] == "input"


# ---- the Responses stream's events, without a cluster -------------------------------------

def parse_events(frames: list[bytes]) -> list[dict]:
    out = []
    for frame in frames:
        event, data = frame.decode().rstrip("\n").split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert event == f"event: {out[-1]['type']}"
    return out


def test_a_stream_that_fails_ends_with_error_and_response_failed():
    from common.sampling_params import SamplingParams
    from services.gateway.assembler import ChoiceDelta
    from services.gateway.errors import APIError
    from services.gateway.parsing import ParsedRequest
    from services.gateway.responses_api import ResponsesRequest
    from services.gateway.responses_events import ResponsesStream

    parsed = ParsedRequest("chat", "tiny", [1, 2], SamplingParams(max_tokens=4), stream=True,
                           request_id="resp_x")
    stream = ResponsesStream(ResponsesRequest(parsed, instructions="Be brief."))
    events = parse_events([*stream.start(), *stream.delta(ChoiceDelta(0, "Hi", [], None)),
                           *stream.delta(ChoiceDelta(0, "", [], None)),
                           *stream.error(APIError.unavailable("the worker died"))])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "error", "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(7))
    assert events[5]["message"] == "the worker died"
    assert events[5]["code"] == "service_unavailable_error"
    failed = events[6]["response"]
    assert failed["status"] == "failed" and failed["id"] == "resp_x"
    assert failed["error"] == {"code": "service_unavailable_error", "message": "the worker died"}
    assert failed["instructions"] == "Be brief."


@pytest.mark.parametrize(("param", "has_instructions", "input_is_text", "renamed"), [
    ("messages.[1].content", True, False, "input.[0].content"),
    ("messages.[0].content", True, False, "instructions"),
    ("messages.[2]", False, False, "input.[2]"),
    ("messages.[1].content", True, True, "input"),
    ("messages", True, False, "input"),
    ("max_tokens", False, False, "max_output_tokens"),
])
def test_a_chat_error_names_the_responses_field(param, has_instructions, input_is_text, renamed):
    from services.gateway.errors import APIError
    from services.gateway.responses_api import responses_error

    error = responses_error(APIError.invalid("bad", param), has_instructions, input_is_text)
    assert error.param == renamed
