"""Structured outputs over real processes, colocated and P/D: a tiny random model emits
junk, and the mask must force every answer into shape.

The colocated cluster runs prompts in chunks of 16 tokens (chunked prefill); the P/D one
streams KV in chunks too and decodes with n-gram speculation, so the decode worker's
matchers resume from the prefill worker's first token and drafts are masked. Both see
``n = 2`` and a prefix hit. Bad specs are 400s; the ``openai`` SDK's ``parse`` works.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import pytest

from tests.cluster import Cluster

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "tag", "flags"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tag": {"enum": ["red", "green"]},
                         "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
DRAFTED = "tandem:spec_decode_num_draft_tokens_total"
# Prompts long enough to be prefilled in several chunks of 16, and one that quotes JSON
# of the schema's shape (prompt lookup drafts from it).
QUOTED = '{"n":12,"tag":"green","flags":[true,true]} ' * 3
PROMPTS = ["Describe the weather today as a record, please, in detail and briefly.",
           f"Copy this exactly: {QUOTED}", "hi"]


@pytest.fixture(scope="module", params=["colocated", "pd"])
def cluster(request, tiny_model_dir) -> Iterator[Cluster]:
    extra = ("--num-kv-blocks", "512", "--max-num-batched-tokens", "16")
    if request.param == "colocated":
        spec = Cluster(str(tiny_model_dir), prefill=0, decode=0, colocated=1, extra=extra)
    else:
        spec = Cluster(str(tiny_model_dir), prefill=1, decode=1,
                       extra=(*extra, "--speculative-config", SPEC))
    with spec as c:
        c.mode = request.param
        yield c


def chat(cluster: Cluster, content: str, **fields) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 80, **fields}
    r = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def completion(cluster: Cluster, prompt: str, **fields) -> dict:
    body = {"prompt": prompt, "max_tokens": 40, **fields}
    r = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_json_schema_answer_validates(cluster):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    answers = []
    for prompt in PROMPTS:
        for temperature in (0.0, 1.0):
            out = chat(cluster, prompt, response_format=fmt, n=2, temperature=temperature, seed=7)
            answers += out["choices"]
    assert len(answers) == 2 * 2 * len(PROMPTS)
    for choice in answers:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    if cluster.mode == "pd":  # the decode worker drafted, masked, under the constraint
        [decode] = cluster.workers("decode")
        assert cluster.metric(decode, DRAFTED) > 0


def test_a_prefix_hit_still_yields_valid_json(cluster):
    prompt = "A long shared prefix that fills more than one KV block of sixteen tokens. " * 2
    fields = {"structured_outputs": {"json": SCHEMA}, "temperature": 1.0, "max_tokens": 60}
    first = completion(cluster, prompt, **fields)
    again = completion(cluster, prompt, **fields, seed=3)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    for choice in first["choices"] + again["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def test_regex_and_choice_on_completions(cluster):
    pattern = r"[a-c]{2}-[0-9]{1,3}"
    for fields in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        out = completion(cluster, PROMPTS[0], n=2, temperature=1.0, **fields)
        for choice in out["choices"]:
            assert re.fullmatch(pattern, choice["text"]), choice
    options = ["sunny", "rain", "partly cloudy"]
    for fields in ({"structured_outputs": {"choice": options}}, {"guided_choice": options}):
        out = chat(cluster, PROMPTS[0], n=2, temperature=1.0, **fields)
        assert all(c["message"]["content"] in options for c in out["choices"]), out


def test_json_object_and_a_lark_grammar(cluster):
    out = chat(cluster, PROMPTS[2], response_format={"type": "json_object"}, temperature=0.0,
               max_tokens=120)
    for choice in out["choices"]:
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:  # greedy junk may not close in time; what came is still a JSON object's start
            assert choice["message"]["content"].startswith("{")
    grammar = 'start: "answer: " ("yes" | "no") "."'
    out = completion(cluster, "Q?", structured_outputs={"grammar": grammar}, temperature=1.0)
    assert out["choices"][0]["text"] in ("answer: yes.", "answer: no.")


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "required": "a"}}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", {"structured_outputs": {"regex": "[0-"}}, "structured_outputs.regex"),
    ("/v1/completions", {"structured_outputs": {"grammar": "start: missing"}},
     "structured_outputs.grammar"),
    ("/v1/chat/completions", {"guided_choice": []}, "guided_choice"),
])
def test_a_bad_spec_is_an_openai_400(cluster, path, fields, param):
    body = {"prompt": "x"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(f"{cluster.url}{path}", json={**body, **fields}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"]


def test_openai_sdk_parse_with_a_pydantic_model(cluster):
    from typing import Literal

    import openai
    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        city: Literal["Paris", "Oslo"]
        celsius: int = Field(ge=-50, le=50)
        windy: bool

    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none")
    for seed in (1, 2):
        completion = client.chat.completions.parse(
            model=client.models.list().data[0].id, response_format=Reading,
            messages=[{"role": "user", "content": "Weather?"}], temperature=1.0, seed=seed,
            max_tokens=60)
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Reading) and -50 <= parsed.celsius <= 50


def test_a_streamed_answer_assembles_to_valid_json(cluster):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 80,
            "response_format": fmt, "stream": True, "temperature": 1.0, "seed": 5}
    parts, finish = [], None
    with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                parts.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)
