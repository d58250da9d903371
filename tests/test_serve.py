"""`jax-llama serve` (llama_twins.server over jax_llama.inference.serving's batching engine),
through the real `openai` client and raw HTTP: chat and completions, streamed and not, stop
strings, n, seed, logprobs and echo; concurrent requests decoded together and each equal to
`generate` alone; a client that leaves mid-stream frees its row; every bad input answered with an
OpenAI-style error, the server still serving; the API key; lm-eval's local-completions model
against the server."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import small_config

import jax_llama
from bridge.chat import find_template
from bridge.tokenizer import ByteTokenizer, find_tokenizer
from jax_llama.inference.generate import generate
from jax_llama.inference.serving import Engine, Request, prompt_logprobs

openai = pytest.importorskip("openai", reason="the openai client is not installed (.[test])")
uvicorn = pytest.importorskip("uvicorn", reason="uvicorn is not installed (.[serve])")
httpx = pytest.importorskip("httpx")
from llama_twins.server import Server, serve_in_thread

CONFIG = small_config(vocab_size=259, max_seq_len=256)
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
NAME = "tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random model with its head scaled by 8 (decisive logits: greedy answers far from
    ties), the byte tokenizer and a chat template."""
    root = tmp_path_factory.mktemp("serve") / "model"
    _, params = jax_llama.init(CONFIG, seed=3)
    params = {**params, "output": jax.tree_util.tree_map(lambda w: 8 * w, params["output"])}
    jax_llama.save(root, CONFIG, params)
    ByteTokenizer().save(root)
    (root / "chat_template.jinja").write_text(TEMPLATE)
    return root


@contextmanager
def serving(checkpoint: Path, max_batch: int = 4, api_key: str | None = None):
    """The server on a free loopback port, in a thread: yields (base URL, Server)."""
    tokenizer = find_tokenizer(str(checkpoint))
    model, params = jax_llama.load(checkpoint)
    engine = Engine(model, params, max_batch=max_batch)
    server = Server(engine, model, params, tokenizer, find_template(str(checkpoint), tokenizer,
                                                                    None), NAME, api_key)
    url, stop = serve_in_thread(server)
    try:
        yield url, server
    finally:
        stop()


@pytest.fixture(scope="module")
def served(checkpoint):
    with serving(checkpoint) as (url, server):
        yield url, server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def alone(server: Server, ids: list[int], max_tokens: int) -> str:
    """What `generate` gives for this prompt by itself, greedy, as text."""
    out = generate(server.model, server.params, [ids], max_tokens,
                   stop_ids=server.stop_ids).tokens[0]
    return server.tokenizer.decode([t for t in out if t not in server.stop_ids])


def chat_ids(server: Server, text: str) -> list[int]:
    return server.template.encode([{"role": "user", "content": text}], server.tokenizer,
                                  add_generation_prompt=True)


PROMPTS = [f"prompt {i}: " + "abcdefghij"[: i + 1] for i in range(8)]


# -- answers ----------------------------------------------------------------------------------

def test_chat_completion_streamed_and_not_is_generate_s_greedy_answer(served, client):
    url, server = served
    want = alone(server, chat_ids(server, "hello there"), 24)
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user",
                                                               "content": "hello there"}],
                                       max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("length", "stop") and r.object == "chat.completion"
    n_prompt = len(chat_ids(server, "hello there"))
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens <= 24
    chunks = list(client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hello there"}], max_tokens=24,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == r.choices[0].finish_reason and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        r.usage.completion_tokens


def test_a_stream_ends_with_done_after_the_finish_reason(served):
    url, _ = served
    with httpx.stream("POST", url + "/v1/completions", json={
            "model": NAME, "prompt": "abc", "max_tokens": 5, "temperature": 0,
            "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] == "length"


def test_concurrent_requests_are_batched_and_each_is_its_prompt_alone(served, client):
    """Eight requests at once on a server of 4 rows: decoded together (up to 4 a step, the rest
    waiting for a free row) and each the greedy text generate gives for its prompt alone."""
    url, server = served
    want = {p: alone(server, server.tokenizer.encode(p, bos=True), 20) for p in PROMPTS}
    before = len(server.engine.batch_sizes)

    def ask(p):
        return client.completions.create(model=NAME, prompt=p, max_tokens=20,
                                          temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        got = dict(zip(PROMPTS, pool.map(ask, PROMPTS)))
    assert got == want
    assert max(server.engine.batch_sizes[before:]) == 4


def test_stop_strings_are_never_returned_nor_partly_streamed(served, client):
    url, server = served
    full = alone(server, server.tokenizer.encode("stop test", bos=True), 30)
    stop = next(full[i:i + 3] for i in range(4, len(full) - 3)
                if "\ufffd" not in full[i:i + 3])
    want = full[:full.index(stop)]
    r = client.completions.create(model=NAME, prompt="stop test", max_tokens=30,
                                  temperature=0, stop=[stop, "NEVER-SEEN"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="stop test", max_tokens=30, temperature=0, stop=stop, stream=True)]
    assert "".join(pieces) == want
    assert not any(stop[:k] in "".join(pieces)[len(want) - k + 1:] for k in range(1, 4))


def test_n_choices_and_seeds(served, client):
    msgs = [{"role": "user", "content": "sample me"}]
    a = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=1.0,
                                       seed=7, n=3)
    b = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=1.0,
                                       seed=7, n=3)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]  # a seed reproduces its answers
    assert len(set(texts)) > 1                                # n draws, not one repeated
    other = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12,
                                           temperature=1.0, seed=8)
    assert other.choices[0].message.content != texts[0]


def test_a_seeded_answer_does_not_depend_on_the_rest_of_the_batch(served, client):
    url, server = served
    msgs = [{"role": "user", "content": "sample me"}]
    solo = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12,
                                          temperature=0.8, seed=11,
                                          extra_body={"top_k": 40}).choices[0].message.content

    def busy(_):
        return client.completions.create(model=NAME, prompt="noise", max_tokens=30,
                                          temperature=1.0, seed=1).choices[0].text

    with ThreadPoolExecutor(4) as pool:
        noise = [pool.submit(busy, i) for i in range(3)]
        again = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12,
                                               temperature=0.8, seed=11,
                                               extra_body={"top_k": 40})
        [f.result() for f in noise]
    assert again.choices[0].message.content == solo


def test_logprobs_and_echo_are_the_model_s_own(served, client):
    """Chat logprobs: the chosen token's and the top alternatives', most likely first. Echo with
    logprobs on /v1/completions: each prompt token's log-probability given the ones before,
    equal to a plain forward's log-softmax (float32, the same numbers up to a few ulps:
    rtol 1e-5), the first token None; then the completion's."""
    url, server = served
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) >= 1
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], rel=1e-6)  # greedy: the top one

    ids = server.tokenizer.encode("the echo", bos=True)
    r = client.completions.create(model=NAME, prompt="the echo", max_tokens=1, temperature=0,
                                  logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("the echo")
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1
    logits = server.model.apply({"params": server.params}, np.array([ids]))
    logp = jax.nn.log_softmax(np.asarray(logits[0], np.float32), axis=-1)
    want = [float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], want, rtol=1e-5)
    assert prompt_logprobs(server.model, server.params, ids)[1].logprob == \
        pytest.approx(want[0], rel=1e-5)
    # max_tokens 0 with echo: the prompt scored, nothing generated
    r = client.completions.create(model=NAME, prompt=[ids], max_tokens=0, logprobs=0, echo=True)
    assert len(r.choices[0].logprobs.token_logprobs) == len(ids)
    assert r.usage.completion_tokens == 0


# -- rows and clients -------------------------------------------------------------------------

def test_a_client_that_leaves_mid_stream_frees_its_row(served):
    url, server = served
    with httpx.stream("POST", url + "/v1/completions", json={
            "model": NAME, "prompt": "long one", "max_tokens": 200, "temperature": 0,
            "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    deadline = time.time() + 10
    while server.engine.active and time.time() < deadline:
        time.sleep(0.05)
    assert server.engine.active == 0
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_thirty_two_concurrent_streams_all_complete_unmixed(served, client):
    url, server = served
    prompts = [f"stream {i} " + "xyz"[i % 3] * (i % 5) for i in range(32)]
    want = {p: alone(server, server.tokenizer.encode(p, bos=True), 16) for p in prompts}

    def stream(p):
        return "".join(c.choices[0].text for c in client.completions.create(
            model=NAME, prompt=p, max_tokens=16, temperature=0, stream=True))

    with ThreadPoolExecutor(32) as pool:
        got = dict(zip(prompts, pool.map(stream, prompts)))
    assert got == want


# -- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x" * 300}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 400}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": [[5, 999]]}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logit_bias": {"5": 1}}, 400,
     "logit_bias"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "temperature": True}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x"}, 400, "model"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "robot", "content": "x"}]},
     400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "tools": []}, 400, "tools"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                              "presence_penalty": 0.5}, 400, "presence_penalty"),
])
def test_bad_input_gets_an_error_object_and_the_server_goes_on(served, path, body, status, param):
    url, _ = served
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_the_api_key_guards_every_endpoint(checkpoint):
    with serving(checkpoint, api_key="s3cret") as (url, _):
        for method, path in (("GET", "/health"), ("GET", "/v1/models"),
                             ("POST", "/v1/completions")):
            r = httpx.request(method, url + path, json={"model": NAME, "prompt": "x"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in keyed.models.list().data] == [NAME]
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()


def test_the_engine_refuses_what_cannot_fit(checkpoint):
    model, params = jax_llama.load(checkpoint)
    engine = Engine(model, params, max_batch=2, max_len=64)
    with pytest.raises(Exception, match="leave no room"):
        engine.submit(Request(prompt=[1] * 64, max_tokens=4, on_token=print, on_finish=print))
    assert engine.check(60, 10) == 4   # clipped to the room left
    with pytest.raises(Exception, match="max_batch"):
        Engine(model, params, max_batch=0)
    engine.close()


# -- lm-evaluation-harness ----------------------------------------------------------------------

def test_lm_eval_local_completions_gives_the_jax_llama_model_s_loglikelihoods(served,
                                                                              checkpoint):
    """lm-eval's `local-completions` model against this server (its tokenizer through the
    server's /tokenize) scores what lm-eval's `jax-llama` model scores in process: the same
    log-likelihoods (float32 through two programs: rtol 1e-5) and greedy flags."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (.[eval])")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from jax_llama.harness import JaxLlamaLM

    url, server = served
    args = [("The cat sat ", "on the mat"), ("x", " y"), ("Q: 2+2=", "4"), ("abc", "defg")]
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=a, idx=i)
            for i, a in enumerate(args)]
    remote = LocalCompletionsAPI(base_url=url + "/v1/completions", model=NAME,
                                 num_concurrent=1, max_retries=1, batch_size=2)
    assert remote.tokenizer_backend == "remote"
    ours = JaxLlamaLM(pretrained=str(checkpoint), batch_size=2, add_bos_token=False)
    got = remote.loglikelihood(reqs, disable_tqdm=True)
    want = ours.loglikelihood(reqs, disable_tqdm=True)
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-5)
    assert [bool(g[1]) for g in got] == [bool(w[1]) for w in want]


# -- the real model -----------------------------------------------------------------------------

def test_smollm2_chat_through_the_server_is_generate_s_answer(smollm2, tmp_path):
    """The real SmolLM2 (its GGUF, its own ChatML template): two chat questions asked at once
    get the greedy answers `generate` gives each alone, and one stop string cuts an answer where
    it first appears."""
    questions = ["What is the capital of France?", "Name three primary colours."]
    with serving(smollm2, max_batch=2) as (url, server):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        want = [alone(server, chat_ids(server, q), 24) for q in questions]
        assert all(want)

        def ask(q, stop=None):
            return client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": q}], max_tokens=24,
                temperature=0, stop=stop).choices[0].message.content

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(ask, questions)) == want
        word = want[0].split()[1]
        assert ask(questions[0], stop=[word]) == want[0][:want[0].index(word)]


def test_the_serving_benchmark_runs(checkpoint, tmp_path):
    from llama_twins.bench import serve as bench

    result = bench.run(str(checkpoint), n_requests=4, max_batch=2, new_tokens=6, rounds=1)
    assert result["same_answers"] and result["largest_batch"] == 2
    assert set(result["rows"]) == {"one at a time", "all at once"}
    assert all(r["tokens"] > 0 for r in result["rows"].values())


def test_int8_weights_decode_in_the_engine_as_generate_decodes_them(checkpoint):
    from jax_llama.quantize import quantize

    model, params = jax_llama.load(checkpoint)
    q = quantize(params)
    engine, got, done = Engine(model, q, max_batch=2), [], threading.Event()
    prompt = ByteTokenizer().encode("int8 weights", bos=True)
    engine.submit(Request(prompt=prompt, max_tokens=12, on_token=lambda t: got.append(t.id),
                          on_finish=lambda r: done.set()))
    assert done.wait(60)
    engine.close()
    assert got == generate(model, q, [prompt], 12).tokens[0]


@pytest.mark.parametrize("argv, message", [
    (["serve", "/nonexistent"], "error: /nonexistent: no such file or directory"),
    (["serve", "CKPT", "--port", "0"], "error: --port: must be in 1..65535 (got 0)"),
    (["serve", "CKPT", "--max-batch", "0"], "error: --max-batch: must be a positive integer"),
])
def test_serve_refuses_bad_arguments_in_one_line(checkpoint, capsys, argv, message):
    from llama_twins.cli import main as jax_cli

    argv = [str(checkpoint) if a == "CKPT" else a for a in argv]
    assert jax_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(message), err
