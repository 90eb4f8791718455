"""``kvgraft engine serve`` end to end: a real server process on 127.0.0.1 with libraries built by
the real ``kvgraft library deposit`` on the tiny model, driven by the official ``openai`` client
(and httpx for the raw bodies a client library would never send), and ``kvgraft ask --engine``.

Each server is a subprocess (``tests/processes.py``): started, waited for within a bound, stopped
SIGTERM first. The answers are compared with the local ``kvgraft ask``: the server grafts and
decodes exactly as it does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvgraft.cli import main

from ..processes import REPO, KvgraftProcess, free_port

DATA = REPO / "data" / "datasets"
MODEL = "tiny-llama-test"
#: The model of the `busy` server, whose answers must outlast its request timeout.
BUSY_MODEL = "smollm2-135m"
#: Every error answer's body: OpenAI's error object.
ERROR_KEYS = {"message", "type", "param", "code"}


class EngineServer(KvgraftProcess):
    """``kvgraft engine serve`` in a subprocess on 127.0.0.1; always stopped by ``stop``."""

    what = "engine server"

    def __init__(self, log: Path, *args: str | Path) -> None:
        port = free_port()
        super().__init__(["engine", "serve", "--port", str(port), "--log-level", "warning", *map(str, args)], log, port)

    def ready(self) -> bool:
        return httpx.get(self.url + "/health", timeout=2).status_code == 200

    def client(self, *, address: str | None = None, **kwargs: Any) -> openai.OpenAI:
        """The official client, without its retries (a test wants the first answer); ``address``:
        the loopback address it connects from (another address is another client to the server)."""
        if address is not None:
            kwargs["http_client"] = httpx.Client(transport=httpx.HTTPTransport(local_address=address))
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60, **kwargs)


@contextlib.contextmanager
def engine_server(log: Path, *args: str | Path) -> Iterator[EngineServer]:
    """A started, answering engine server; stopped when the block ends, whatever happens."""
    server = EngineServer(log, *args)
    try:
        server.wait_ready(timeout=90)
        yield server
    finally:
        server.stop()


@dataclass(frozen=True)
class Libraries:
    """Two libraries of the tiny model (GSM8K train problems 0-2 and 3-4) and the trust file."""

    root: Path
    trust: Path
    first: Path
    second: Path
    questions: list[str]

    def entry(self, library: Path, question: str) -> str:
        """The artifact digest of ``question``'s entry in ``library``'s index."""
        for line in (library / "index.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row["problem"] == question:
                return str(row["artifact"])
        raise AssertionError(f"{question[:40]!r} is not in {library}")


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory, key: Path) -> Libraries:
    root = tmp_path_factory.mktemp("engine-serve")
    trust = root / "trusted-keys.json"
    assert main(["keys", "trust", "--file", str(trust), "--name", "alice", "--public-key", str(key.with_name("k.pem.pub"))]) == 0
    lines = (DATA / "gsm8k_train.jsonl").read_text().splitlines(keepends=True)[:5]
    for name, part in (("first", lines[:3]), ("second", lines[3:])):
        data = root / f"{name}.jsonl"
        data.write_text("".join(part))
        code = main(["--json", "library", "deposit", "--model", MODEL, "--dataset", str(data), "--library", str(root / name),
                     "--key", str(key)])
        assert code == 0
    return Libraries(root, trust, root / "first", root / "second", [json.loads(line)["question"] for line in lines])


@pytest.fixture(scope="module")
def server(libs: Libraries) -> Iterator[EngineServer]:
    with engine_server(libs.root / "server.log", "--model", MODEL, "--library", libs.first, "--library", libs.second,
                       "--trusted-keys", libs.trust) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: EngineServer) -> openai.OpenAI:
    return server.client()


def _local_ask(capsys: pytest.CaptureFixture[str], libs: Libraries, library: Path, question: str) -> dict[str, Any]:
    capsys.readouterr()
    code = main(["--json", "ask", "--library", str(library), "--question", question, "--trusted-keys", str(libs.trust)])
    out, err = capsys.readouterr()
    assert code == 0, err
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _chat(question: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], **extra}


def _streamed_chat(client: openai.OpenAI, question: str, **extra: Any) -> tuple[str, list[Any]]:
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                 stream=True, **extra))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


# --- the API -------------------------------------------------------------------------------------


def test_models_are_listed_as_openai_lists_them(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL, "model", "kvgraft")]
    assert models[0].created > 1_700_000_000


def test_models_retrieve_regression_was_404(client: openai.OpenAI) -> None:
    # Was: GET /v1/models/{id} was 404, so openai's models.retrieve failed (issue 37).
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "kvgraft") and model.created > 1_700_000_000
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found" and "'gpt-4o' is not served here" in missing.value.message


@pytest.mark.parametrize(("field", "value"), [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]),
    ("response_format", {"type": "json_object"}),
    ("logprobs", True),
    ("top_logprobs", 2),
    ("tool_choice", "required"),
    ("logit_bias", {"50256": -100}),
])
def test_unserved_fields_regression_were_silently_ignored(client: openai.OpenAI, libs: Libraries, field: str,
                                                          value: Any) -> None:
    # Was: tools, response_format and logprobs were ignored, and a plain answer came back as if
    # the request had been served (issue 37). Now a 400 naming the field.
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**_chat(libs.questions[1], **{field: value}))
    error = refused.value
    assert (error.status_code, error.code, error.param) == (400, "unsupported_parameter", field)
    assert f"400 - {field} is not served: kvgraft answers with plain text only" in error.message
    assert f"leave {field} out" in error.message


def test_unserved_fields_at_their_defaults_pass(client: openai.OpenAI, libs: Libraries) -> None:
    chat = client.chat.completions.create(**_chat(libs.questions[1], response_format={"type": "text"}, logprobs=False,
                                                  tools=[], logit_bias={}))
    assert chat.to_dict()["kvgraft"]["kind"] == "recalled"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=libs.questions[1], logprobs=0)  # 0 is not "none"
    assert refused.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=libs.questions[1], echo=True)
    assert refused.value.param == "echo"


def test_deposited_question_is_recalled_with_its_provenance(client: openai.OpenAI, libs: Libraries,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    question = libs.questions[1]
    entry = libs.entry(libs.first, question)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, temperature=0,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "an earlier question"},
                  {"role": "assistant", "content": "an earlier answer"}, {"role": "user", "content": question}],
    )
    chat = raw.parse()
    kv = chat.to_dict()["kvgraft"]
    assert (kv["kind"], kv["method"], kv["entry"], kv["score"], kv["finished"]) == ("recalled", "exact", entry, 1.0, True)
    # The verified answer of the deposited problem, right, whatever the tiny model restates.
    reference = str(json.loads((DATA / "gsm8k_train.jsonl").read_text().splitlines()[1])["answer"]).rsplit("#### ", 1)[1]
    assert kv["answer"] == reference
    assert 1 <= kv["decode_tokens"] <= 16 and kv["signature"].startswith("verified")
    assert kv["context_tokens"] > kv["prompt_tokens"] > 0 and kv["energy_method"] in ("measured", "estimated")
    assert (raw.headers["x-kvgraft-kind"], raw.headers["x-kvgraft-method"], raw.headers["x-kvgraft-entry"]) == (
        "recalled", "exact", entry)
    assert chat.object == "chat.completion" and chat.model == MODEL and chat.id.startswith("chatcmpl-")
    assert chat.usage is not None and chat.usage.completion_tokens == kv["decode_tokens"]
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    text = chat.choices[0].message.content
    assert text == "\\boxed{" + reference + "}" and chat.choices[0].finish_reason == "stop"

    # The local ask grafts and decodes the same way: the same text, entry and answer.
    local = _local_ask(capsys, libs, libs.first, question)
    assert (local["text"], local["entry"], local["answer"], local["decode_tokens"]) == (text, entry, kv["answer"], kv["decode_tokens"])

    # Streamed: the same text, the provenance on the last chunk.
    streamed, chunks = _streamed_chat(client, question)
    assert streamed == text
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    assert chunks[-1].to_dict()["kvgraft"]["entry"] == entry

    # Content as a list of text parts is the same question.
    parts = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": question}]}])
    assert parts.choices[0].message.content == text

    # Completions: the prompt is the question.
    completion = client.completions.create(model=MODEL, prompt=question)
    assert completion.choices[0].text == text and completion.to_dict()["kvgraft"]["method"] == "exact"
    pieces = list(client.completions.create(model=MODEL, prompt=[question], stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == text
    assert pieces[-1].to_dict()["kvgraft"]["entry"] == entry


def test_exact_hit_in_the_second_library_wins(client: openai.OpenAI, libs: Libraries) -> None:
    question = libs.questions[3]
    kv = client.chat.completions.create(**_chat(question)).to_dict()["kvgraft"]
    assert (kv["method"], kv["entry"]) == ("exact", libs.entry(libs.second, question))


def test_new_question_is_answered_with_the_most_similar_entry(client: openai.OpenAI, libs: Libraries,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    question = libs.questions[0] + " Please answer quickly."
    chat = client.chat.completions.create(**_chat(question, max_tokens=24))
    kv = chat.to_dict()["kvgraft"]
    assert (kv["kind"], kv["method"], kv["entry"]) == ("assisted", "similar", libs.entry(libs.first, libs.questions[0]))
    assert 0.66 <= kv["score"] < 1 and kv["decode_tokens"] <= 24
    local = _local_ask(capsys, libs, libs.first, question)
    assert local["entry"] == kv["entry"]
    streamed, chunks = _streamed_chat(client, question, max_tokens=24, stream_options={"include_usage": True})
    assert streamed == chat.choices[0].message.content
    # With include_usage the last chunk has no choices and carries the usage.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == kv["decode_tokens"]


def test_answer_kinds_regression_an_unrelated_question_is_unassisted_never_a_verified_answer(
        client: openai.OpenAI, libs: Libraries, capsys: pytest.CaptureFixture[str]) -> None:
    # Was: "Write a haiku about the sea." got an AIME entry grafted at similarity 0.077, and the
    # last number of a decode the budget cut off came back as its answer.
    for question in ("Write a haiku about the sea.", "What is 2+2?"):
        raw = client.chat.completions.with_raw_response.create(**_chat(question, max_tokens=4))
        chat = raw.parse()
        kv = chat.to_dict()["kvgraft"]
        assert (kv["kind"], kv["method"], kv["entry"]) == ("unassisted", "none", None), question
        assert kv["score"] < 0.66 and kv["context_tokens"] > kv["prompt_tokens"]  # the instruction alone
        assert (kv["finished"], kv["stopped_by"], kv["answer"]) == (False, "max_new_tokens", None), question
        assert chat.choices[0].finish_reason == "length"
        assert (raw.headers["x-kvgraft-kind"], raw.headers["x-kvgraft-entry"]) == ("unassisted", "none")
        streamed, chunks = _streamed_chat(client, question, max_tokens=4)
        assert streamed == chat.choices[0].message.content and chunks[-1].to_dict()["kvgraft"]["kind"] == "unassisted"
    # The command line says so in words: no answer, the model alone.
    capsys.readouterr()
    assert main(["ask", "--library", str(libs.first), "--question", "Write a haiku about the sea.", "--max-new-tokens", "4",
                 "--trusted-keys", str(libs.trust)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no answer: the model's decode was cut off by the token budget (raise --max-new-tokens)"), out
    assert "unassisted: the model alone" in out and "recalled" not in out and "verified" not in out.split("signature")[0]


def test_stop_strings_cut_the_answer_and_end_decoding(client: openai.OpenAI, libs: Libraries) -> None:
    question = libs.questions[2] + " Think."
    full = client.chat.completions.create(**_chat(question, max_tokens=32)).choices[0].message.content
    assert full is not None and len(full) >= 8, full
    stop = full[5:7]
    expected = full[: full.find(stop)]
    chat = client.chat.completions.create(**_chat(question, max_tokens=32, stop=[stop, "never-there"]))
    assert chat.choices[0].message.content == expected and chat.choices[0].finish_reason == "stop"
    assert chat.to_dict()["kvgraft"]["decode_tokens"] < 32
    streamed, chunks = _streamed_chat(client, question, max_tokens=32, stop=stop)
    assert streamed == expected and chunks[-1].choices[0].finish_reason == "stop"
    text = client.completions.create(model=MODEL, prompt=question, max_tokens=32, stop=stop).choices[0].text
    assert text == expected


def test_max_tokens_ends_with_finish_reason_length(client: openai.OpenAI, libs: Libraries) -> None:
    question = libs.questions[2] + " Think."
    chat = client.chat.completions.create(**_chat(question, max_tokens=3))
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 3 == chat.to_dict()["kvgraft"]["decode_tokens"]
    chat = client.chat.completions.create(**_chat(question, max_tokens=64, max_completion_tokens=2))
    assert chat.usage is not None and chat.usage.completion_tokens == 2


def test_sampling_regression_a_temperature_was_400(client: openai.OpenAI, libs: Libraries) -> None:
    # Was: any temperature but 0 was a 400, so OpenAI clients that send one by default failed (issue 39).
    question = "Once upon a time there was a library"
    first = client.chat.completions.create(**_chat(question, temperature=0.9, top_p=0.95, seed=11, max_tokens=8))
    again = client.chat.completions.create(**_chat(question, temperature=0.9, top_p=0.95, seed=11, max_tokens=8))
    kv = first.to_dict()["kvgraft"]
    assert kv["seed"] == 11 and kv["kind"] == "unassisted" and kv["decode_tokens"] >= 1
    assert first.choices[0].message.content == again.choices[0].message.content  # reproducible from the seed
    greedy = client.chat.completions.create(**_chat(question, max_tokens=8))
    assert greedy.to_dict()["kvgraft"]["seed"] is None
    others = {client.chat.completions.create(**_chat(question, temperature=1.5, seed=s, max_tokens=8)).choices[0].message.content
              for s in range(4)}
    assert len(others) > 1, others  # the seed matters
    # No seed sent: the server draws one and reports it; sent back, it gives the same answer.
    drawn = client.chat.completions.create(**_chat(question, temperature=0.9, max_tokens=8))
    seed = drawn.to_dict()["kvgraft"]["seed"]
    assert isinstance(seed, int) and seed >= 0
    replay = client.chat.completions.create(**_chat(question, temperature=0.9, seed=seed, max_tokens=8))
    assert replay.choices[0].message.content == drawn.choices[0].message.content
    # What clients send by default is served: temperature 0.7, top_p 1, n 1, no penalties.
    assert client.chat.completions.create(**_chat(question, temperature=0.7, top_p=1, n=1, presence_penalty=0,
                                                  frequency_penalty=0, max_tokens=2)).choices[0].finish_reason == "length"
    # Streamed: the same text as the same seed unstreamed.
    streamed, chunks = _streamed_chat(client, question, temperature=0.9, top_p=0.95, seed=11, max_tokens=8)
    assert streamed == first.choices[0].message.content and chunks[-1].to_dict()["kvgraft"]["seed"] == 11


def test_sampling_n_choices_each_with_its_seed(client: openai.OpenAI, libs: Libraries) -> None:
    question = "Once upon a time there was a library"
    chat = client.chat.completions.create(**_chat(question, temperature=1.0, seed=20, n=3, max_tokens=6))
    assert [c.index for c in chat.choices] == [0, 1, 2]
    seeds = [c.to_dict()["kvgraft"]["seed"] for c in chat.choices]
    assert seeds == [20, 21, 22] and chat.to_dict()["kvgraft"]["seed"] == 20
    # Choice i is the answer of seed + i alone.
    alone = client.chat.completions.create(**_chat(question, temperature=1.0, seed=22, max_tokens=6))
    assert chat.choices[2].message.content == alone.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == sum(
        c.to_dict()["kvgraft"]["decode_tokens"] for c in chat.choices)
    # Greedy has one answer; a deposited question's is the verified one, whatever the temperature.
    greedy = client.completions.create(model=MODEL, prompt=question, n=2, max_tokens=4)
    assert greedy.choices[0].text == greedy.choices[1].text
    recall = client.chat.completions.create(**_chat(libs.questions[1], temperature=1.5, seed=3, n=2))
    assert {c.to_dict()["kvgraft"]["kind"] for c in recall.choices} == {"recalled"}
    assert recall.choices[0].message.content == recall.choices[1].message.content and recall.to_dict()["kvgraft"]["seed"] is None
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**_chat(question, n=2, stream=True))
    assert refused.value.param == "n" and "served only without streaming" in refused.value.message
    for field, value, says in (("temperature", 2.5, "temperature"), ("n", 9, "n"), ("top_p", 0, "top_p"), ("seed", -1, "seed")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**_chat(question, **{field: value}))
        assert says in refused.value.message, (field, refused.value.message)


def test_unknown_model_is_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(**_chat("hello", model="gpt-4o"))
    assert missing.value.code == "model_not_found" and "'gpt-4o' is not served here" in missing.value.message


_MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.mark.parametrize(("what", "path", "body", "status", "says"), [
    ("not JSON", "/v1/chat/completions", b"{nope", 400, "not JSON"),
    ("not UTF-8", "/v1/chat/completions", b'{"model": "\xff\xfe"}', 400, "not JSON"),
    ("an array", "/v1/chat/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("nested too deep", "/v1/chat/completions", b"[" * 5000 + b"]" * 5000, 400, "not JSON"),
    ("max_tokens as a string", "/v1/chat/completions", {"model": MODEL, "messages": _MESSAGES, "max_tokens": "8"}, 400, "max_tokens"),
    ("max_tokens 0", "/v1/chat/completions", {"model": MODEL, "messages": _MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ("stream as a number", "/v1/chat/completions", {"model": MODEL, "messages": _MESSAGES, "stream": 1}, 400, "stream"),
    ("messages as a string", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("no model", "/v1/chat/completions", {"messages": _MESSAGES}, 400, "model: Field required"),
    ("no user message", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": "x"}]}, 400,
     "no user message"),
    ("an empty question", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "  "}]}, 400,
     "the question is empty"),
    ("an image part", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "only text parts"),
    ("too many messages", "/v1/chat/completions", {"model": MODEL, "messages": _MESSAGES * 300}, 400, "at most 256"),
    ("a message too long", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300_000}]},
     400, "messages.0.content"),
    ("five stop strings", "/v1/chat/completions", {"model": MODEL, "messages": _MESSAGES, "stop": list("abcde")}, 400, "stop"),
    ("a prompt of token ids", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]}, 400, "prompt"),
    ("a question past the window", "/v1/completions", {"model": MODEL, "prompt": "x " * 3000}, 400, "window"),
    ("a body past the limit", "/v1/completions", {"model": MODEL, "prompt": "x" * (1 << 20)}, 413, "at most 1048576"),
])
def test_bad_input_is_a_4xx_with_the_error_body(server: EngineServer, what: str, path: str, body: Any, status: int,
                                                says: str) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, (what, r.text[:300])
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "invalid_request_error", error
    assert says in error["message"], (what, error)
    assert "Traceback" not in r.text


def test_unknown_fields_are_ignored(server: EngineServer, libs: Libraries) -> None:
    body = _chat(libs.questions[1], top_p=1, user="someone", seed=7, frobnicate={"deep": [1, 2]})
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["kvgraft"]["method"] == "exact"


def test_unknown_paths_and_methods_are_404_and_405(server: EngineServer) -> None:
    r = httpx.get(server.url + "/v1/embeddings", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert "GET /v1/embeddings is not part of this server's API" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and set(r.json()["error"]) == ERROR_KEYS


# --- the queue, timeouts, hanging up -----------------------------------------------------------


@pytest.fixture(scope="module")
def busy(libs: Libraries) -> Iterator[EngineServer]:
    """A server without a library (the model's own answers run to max_tokens), one place in its
    queue and a short request timeout. SmolLM2, not the tiny model: the tiny model decodes to its
    window in about 2 s under the SDPA profile, before the timeout could bind."""
    # The torch profile: these tests are about the one-at-a-time worker's queue. Without a
    # --profile, smollm2-135m is served under llamacpp-cpu, whose base answers join one running
    # llama.cpp batch (test_llamacpp.py tests that).
    with engine_server(libs.root / "busy.log", "--model", BUSY_MODEL, "--profile", "cpu-fp32-sdpa", "--max-queue", "1",
                       "--request-timeout", "3") as running:
        yield running


_LONG = {"model": BUSY_MODEL, "prompt": "Once upon a time", "max_tokens": 4000, "stream": True}


def _health(server: EngineServer) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(server.url + "/health", timeout=5).json()
    return doc


def _until(condition: Any, what: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {seconds} s")
        time.sleep(0.02)


def _from(address: str) -> httpx.Client:
    """An httpx client connecting from ``address`` (a loopback address): one client to the server."""
    return httpx.Client(timeout=30, transport=httpx.HTTPTransport(local_address=address))


def test_queue_full_is_429_and_a_hang_up_cancels_decoding(busy: EngineServer) -> None:
    # Three clients (three addresses): each within its share, the third finds the queue full.
    answers: dict[str, Any] = {}
    with _from("127.0.0.1") as http, http.stream("POST", busy.url + "/v1/completions", json=_LONG) as first:
        # The first answer is streaming: the worker is busy with it.
        assert first.status_code == 200 and first.headers["content-type"].startswith("text/event-stream")
        # Kept: a dropped line iterator closes the response, which is a hang-up.
        lines = first.iter_lines()
        assert next(lines).startswith("data: ")
        assert _health(busy)["running"] is True

        def second() -> None:
            with _from("127.0.0.2") as other:
                answers["second"] = other.post(busy.url + "/v1/completions", json={**_LONG, "stream": False, "max_tokens": 4})

        waiting = threading.Thread(target=second)
        waiting.start()
        _until(lambda: _health(busy)["queued"] == 1, "the second request waits in the queue")

        with _from("127.0.0.3") as third:
            full = third.post(busy.url + "/v1/completions", json={**_LONG, "stream": False})
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        error = full.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
        assert "--max-queue 1" in error["message"]
        with pytest.raises(openai.RateLimitError):
            busy.client(address="127.0.0.4").completions.create(model=BUSY_MODEL, prompt="x", max_tokens=1)
        hung_up = time.monotonic()
    # The first client hung up: its decoding stops at the next token and the waiting one is answered.
    waiting.join(timeout=30)
    # Without the cancellation the first answer would decode until its 3 s timeout.
    assert time.monotonic() - hung_up < 1.5, "the waiting request was not answered promptly after the hang-up"
    assert answers["second"].status_code == 200 and answers["second"].json()["usage"]["completion_tokens"] == 4
    _until(lambda: _health(busy)["running"] is False and _health(busy)["queued"] == 0, "the worker is idle")


def test_client_fairness_regression_one_client_kept_everyone_else_at_429(libs: Libraries) -> None:
    # Was: one anonymous client holding --max-queue + 1 requests of max_tokens 65536 kept every
    # other client at 429, and could renew them without end (issue 37). One client now holds at
    # most its share (half the places, 65536 tokens); the rest stay free for others. Its own
    # server with a long timeout: the hog's answer must still be decoding while the others ask.
    hog = {**_LONG, "max_tokens": 65536}
    answers: dict[str, Any] = {}
    with engine_server(libs.root / "fair.log", "--model", BUSY_MODEL, "--profile", "cpu-fp32-sdpa", "--max-queue", "1",
                       "--request-timeout", "120") as fair:
        with _from("127.0.0.5") as http, http.stream("POST", fair.url + "/v1/completions", json=hog) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")
            for _ in range(2):  # --max-queue 1: the hog's max-queue + 1 requests, and a renewal
                again = http.post(fair.url + "/v1/completions", json={**hog, "stream": False})
                assert again.status_code == 429 and again.headers["retry-after"] == "1"
                error = again.json()["error"]
                assert (error["type"], error["code"]) == ("rate_limit_error", "client_quota")
                assert "this client (127.0.0.5) already holds 1 requests of 65536 max_tokens" in error["message"]
                assert "one client's share of this server is 1 requests and 65536 tokens" in error["message"]

            def other() -> None:
                client = fair.client(address="127.0.0.6")
                answers["other"] = client.completions.create(model=BUSY_MODEL, prompt="hi", max_tokens=2)

            # Another client still gets the waiting place; it is answered once the hog's request ends.
            waiting = threading.Thread(target=other)
            waiting.start()
            _until(lambda: _health(fair)["queued"] == 1, "the other client's request waits in the queue", seconds=30)
            assert http.post(fair.url + "/v1/completions", json=hog).json()["error"]["code"] == "client_quota"
        waiting.join(timeout=60)
        assert answers["other"].usage is not None and answers["other"].usage.completion_tokens == 2
        _until(lambda: _health(fair)["running"] is False and _health(fair)["queued"] == 0, "the worker is idle", seconds=30)
        # The hog's share came back when its request ended.
        r = httpx.post(fair.url + "/v1/completions", json={"model": BUSY_MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200


def test_non_streaming_hang_up_cancels_decoding(busy: EngineServer) -> None:
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(busy.url + "/v1/completions", json={**_LONG, "stream": False}, timeout=0.5)
    t0 = time.monotonic()
    r = httpx.post(busy.url + "/v1/completions", json={"model": BUSY_MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and time.monotonic() - t0 < 1.5


def test_a_request_past_its_timeout_is_504_and_stops(busy: EngineServer) -> None:
    t0 = time.monotonic()
    r = httpx.post(busy.url + "/v1/completions", json={**_LONG, "stream": False}, timeout=30)
    assert r.status_code == 504 and 2.5 < time.monotonic() - t0 < 6
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("timeout_error", "request_timeout")
    assert "request timeout of 3 s" in error["message"]
    # Streamed, the answer has begun: the failure is the stream's last event (the client raises it).
    with pytest.raises(openai.APIError, match="request timeout of 3 s"):
        for _ in busy.client().completions.create(model=BUSY_MODEL, prompt="Once upon a time", max_tokens=4000, stream=True):
            pass
    _until(lambda: _health(busy)["running"] is False, "the worker stopped decoding", seconds=3)


def test_without_a_library_the_model_answers_alone(busy: EngineServer) -> None:
    chat = busy.client().chat.completions.create(**{**_chat("Once upon a time", max_tokens=5), "model": BUSY_MODEL})
    kv = chat.to_dict()["kvgraft"]
    assert (kv["kind"], kv["method"], kv["entry"], kv["signature"], kv["answer"]) == (
        "unassisted", "none", None, "none (nothing grafted)", None)
    assert kv["context_tokens"] == kv["prompt_tokens"] > 0 and kv["decode_tokens"] == 5


# --- libraries that do not verify ----------------------------------------------------------------


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_an_altered_entry_is_refused_never_grafted(tmp_path: Path, libs: Libraries) -> None:
    library = tmp_path / "lib"
    shutil.copytree(libs.first, library)
    with engine_server(tmp_path / "server.log", "--model", MODEL, "--library", library, "--trusted-keys", libs.trust) as server:
        question = libs.questions[0]
        rows = [json.loads(line) for line in (library / "index.jsonl").read_text().splitlines()]
        _flip_last_byte(library / next(r["directory"] for r in rows if r["problem"] == question) / "kv.safetensors")
        r = httpx.post(server.url + "/v1/chat/completions", json=_chat(question), timeout=30)
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "artifact_refused")
        assert "was refused, not grafted" in error["message"] and str(tmp_path) not in error["message"]
        # Streamed, it is refused before the stream starts.
        r = httpx.post(server.url + "/v1/chat/completions", json=_chat(question, stream=True), timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "artifact_refused"
        # The other entries are still answered.
        r = httpx.post(server.url + "/v1/chat/completions", json=_chat(libs.questions[1]), timeout=30)
        assert r.status_code == 200 and r.json()["kvgraft"]["method"] == "exact"


def _serve_and_fail(home: Path | None, *args: str | Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if home is not None:
        env["KVGRAFT_HOME"] = str(home)
        env.pop("KVGRAFT_TRUSTED_KEYS", None)
    return subprocess.run([sys.executable, "-m", "kvgraft", "engine", "serve", "--port", str(free_port()), *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


def test_a_library_whose_prefix_does_not_verify_keeps_the_server_from_starting(tmp_path: Path, libs: Libraries) -> None:
    library = tmp_path / "lib"
    shutil.copytree(libs.first, library)
    _flip_last_byte(library / "prefix" / "kv.safetensors")
    r = _serve_and_fail(None, "--model", MODEL, "--library", library, "--trusted-keys", libs.trust)
    assert r.returncode == 1, r.stderr
    assert "cannot start" in r.stderr and "kvgraft: ArtifactError" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_libraries_are_served_only_with_trusted_keys(tmp_path: Path, libs: Libraries) -> None:
    r = _serve_and_fail(tmp_path / "empty-home", "--model", MODEL, "--library", libs.first)
    assert r.returncode == 1 and "kvgraft: NoTrustedKeysError: no trusted keys" in r.stderr, r.stderr
    r = _serve_and_fail(None, "--model", "smollm2-135m", "--library", libs.first, "--trusted-keys", libs.trust)
    assert r.returncode == 1 and "holds tiny-llama-test state, not smollm2-135m" in r.stderr, r.stderr
    assert "EngineServerConfigError" in r.stderr and f"leave --library {libs.first} out" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# --- kvgraft ask --engine --------------------------------------------------------------------------


def test_ask_engine_prints_what_the_local_ask_prints(server: EngineServer, libs: Libraries,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    question = libs.questions[1]
    local = _local_ask(capsys, libs, libs.first, question)
    code = main(["--json", "ask", "--engine", server.url, "--question", question])
    out, err = capsys.readouterr()
    assert code == 0, err
    remote = json.loads(out)
    assert set(local) <= set(remote)
    same = ("kind", "finished", "answer", "text", "entry", "method", "signature", "score", "prompt_tokens", "decode_tokens",
            "context_tokens")
    assert {k: remote[k] for k in same} == {k: local[k] for k in same}
    assert remote["kind"] == "recalled" and remote["answer"] == str(json.loads(
        (DATA / "gsm8k_train.jsonl").read_text().splitlines()[1])["answer"]).rsplit("#### ", 1)[1]
    assert remote["engine"] == server.url and remote["model"] == MODEL
    code = main(["ask", "--engine", server.url + "/", "--question", question])
    out, _ = capsys.readouterr()
    assert code == 0 and out.startswith(f"recalled (verified): {local['answer']} (the deposited problem's checked answer, "
                                        f"entry {local['entry']}, signature verified"), out


def test_ask_engine_failures_are_one_line(server: EngineServer, libs: Libraries, capsys: pytest.CaptureFixture[str]) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    assert main(["ask", "--engine", down, "--question", "What is 2 + 2?"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvgraft: CliError: cannot reach the engine server at {down}") and err.count("\n") == 1
    assert "kvgraft engine serve" in err
    assert main(["ask", "--engine", server.url, "--model", "gpt-4o", "--question", "What is 2 + 2?"]) == 1
    err = capsys.readouterr().err
    assert "answered /v1/chat/completions with 404" in err and "'gpt-4o' is not served here" in err
    assert main(["ask", "--engine", server.url, "--trusted-keys", str(libs.trust), "--question", "x"]) == 1
    assert "the trust options are for --library" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["ask", "--engine", server.url, "--library", str(libs.first), "--question", "x"])
    assert usage.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


# --- the real model --------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_recall_over_the_server(tmp_path: Path, key: Path, libs: Libraries, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "two.jsonl"
    data.write_text("".join((DATA / "gsm8k_train.jsonl").read_text().splitlines(keepends=True)[:2]))
    library = tmp_path / "lib"
    assert main(["--json", "library", "deposit", "--model", "smollm2-135m", "--dataset", str(data), "--library", str(library),
                 "--key", str(key)]) == 0
    local = _local_ask(capsys, libs, library, libs.questions[0])
    with engine_server(tmp_path / "server.log", "--model", "smollm2-135m", "--library", library, "--trusted-keys", libs.trust) as server:
        chat = server.client().chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": libs.questions[0]}])
        unrelated = server.client().chat.completions.create(
            model="smollm2-135m", max_tokens=8, messages=[{"role": "user", "content": "Write a haiku about the sea."}]).to_dict()["kvgraft"]
    kv = chat.to_dict()["kvgraft"]
    assert (kv["kind"], kv["method"], kv["entry"]) == ("recalled", "exact", libs.entry(library, libs.questions[0]))
    assert 1 <= kv["decode_tokens"] <= 16 and kv["answer"] == local["answer"] == "72" and local["kind"] == "recalled"
    assert chat.choices[0].message.content == local["text"] == "\\boxed{72}"
    # An unrelated question is never recalled, and nothing is grafted for it.
    assert (unrelated["kind"], unrelated["entry"]) == ("unassisted", None)


def test_ask_engine_loads_no_torch(tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    code = (
        "import sys\n"
        "from kvgraft.cli import main\n"
        f"status = main(['ask', '--engine', {down!r}, '--question', 'What is 2 + 2?'])\n"
        "sys.stderr.write('HEAVY=' + ','.join(m for m in ('torch', 'transformers', 'kvgraft.engine') if m in sys.modules) + '\\n')\n"
        "sys.exit(status)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 1 and "cannot reach the engine server" in r.stderr, r.stderr
    assert r.stderr.rsplit("HEAVY=", 1)[1].strip() == ""
