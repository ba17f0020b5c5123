"""The official `openai` client against `python -m speculant_server` on the real 1.5B model with
n-gram speculation: logprobs and top_logprobs (chat), logprobs (completions), and n = 2."""
import math

import pytest

from test_server_clients import real_openai_client

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    yield from real_openai_client(tmp_path_factory, "real-server", "--spec-type", "ngram-simple")


def test_openai_chat_logprobs_real_model(real_server):
    client = real_server
    r = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=16, temperature=0,
                                       logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 16
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 5 and t.logprob <= 0
        assert bytes(t.bytes) == t.token.encode()
        # greedy: the chosen token is the most likely one
        assert math.exp(t.logprob) == pytest.approx(max(math.exp(x.logprob) for x in t.top_logprobs))
        assert t.top_logprobs[0].token == t.token
        assert sum(math.exp(x.logprob) for x in t.top_logprobs) <= 1 + 1e-5

    stream = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=16, temperature=0,
                                            logprobs=True, top_logprobs=5, stream=True)
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_openai_n_and_completions_logprobs_real_model(real_server):
    client = real_server
    r = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=12, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: the same choice twice
    assert r.usage.completion_tokens == 24

    r = client.completions.create(model="any", prompt="def add(a, b):", max_tokens=8, temperature=0.8, seed=3, n=2,
                                  logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
        for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[tok] == value and len(top) <= 4
