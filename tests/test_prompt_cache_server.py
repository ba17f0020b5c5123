"""The prompt cache through the server: a chat's next turn continues from its slot's state, a
request goes to the slot that shares most with it, states moved out of a slot wait in the
host-memory LRU (--cache-ram), and usage, timings, /slots and /metrics say what was reused."""
from __future__ import annotations

import pytest

from test_server_util import aiotest, make_engine, post, serve, tiny_model

SYSTEM = {"role": "system", "content": "You answer in short sentences about small programs."}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("models"))


def chat(messages, **extra):
    return {"messages": messages, "max_tokens": 10, "temperature": 0, **extra}


def completion(prompt, **extra):
    return {"prompt": prompt, "n_predict": 8, "temperature": 0, **extra}


async def metric(client, name) -> float:
    async with client.get("/metrics") as r:
        text = await r.text()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


@aiotest
async def test_second_turn_continues_from_the_first(model):
    turn1 = [SYSTEM, {"role": "user", "content": "write a loop that counts to ten"}]
    async with serve(make_engine(model, n_ctx=512), n_slots=1) as c:
        _, first = await post(c, "/v1/chat/completions", chat(turn1))
        answer = first["choices"][0]["message"]["content"]
        turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "now count down"}]
        _, warm = await post(c, "/v1/chat/completions", chat(turn2))
        _, off = await post(c, "/v1/chat/completions", chat(turn2, cache_prompt=False))
        assert await metric(c, "speculant:prompt_tokens_cached_total") == warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    async with serve(make_engine(model, n_ctx=512), n_slots=1) as c:
        _, cold = await post(c, "/v1/chat/completions", chat(turn2))

    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"]  # turn 1's prompt at least, its answer too if re-tokenized alike
    assert warm["timings"]["cache_n"] == cached
    assert warm["timings"]["prompt_n"] == warm["usage"]["prompt_tokens"] - cached
    assert off["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    text = cold["choices"][0]["message"]["content"]
    assert warm["choices"][0]["message"]["content"] == text and off["choices"][0]["message"]["content"] == text


A = "the quick brown fox jumps over the lazy dog " * 3
B = "lorem ipsum dolor sit amet consectetur adipiscing elit " * 3


@aiotest
async def test_request_goes_to_the_slot_that_shares_its_prefix(model):
    async with serve(make_engine(model, n_ctx=512), n_slots=2) as c:
        _, a = await post(c, "/completion", completion(A))
        _, b = await post(c, "/completion", completion(B))
        assert a["id_slot"] != b["id_slot"]  # nothing shared: the least recently used slot
        _, a2 = await post(c, "/completion", completion(A + "and runs away"))
        _, b2 = await post(c, "/completion", completion(B + "sed do eiusmod"))
        async with c.get("/slots") as r:
            slots = await r.json()
    assert a2["id_slot"] == a["id_slot"] and b2["id_slot"] == b["id_slot"]
    assert a2["timings"]["cache_n"] >= a["tokens_evaluated"] - 1 and b2["timings"]["cache_n"] >= b["tokens_evaluated"] - 1
    assert all(s["n_cache_tokens"] > 0 and not s["is_processing"] for s in slots)


@pytest.mark.parametrize("cache_ram,kept", [(8192 << 20, True), (0, False)], ids=["cache-ram", "no-cache-ram"])
@aiotest
async def test_one_slot_two_conversations_take_turns_through_the_ram_cache(model, cache_ram, kept):
    """-np 1: B's request moves A's state out of the slot; with --cache-ram it waits there and A's
    next request takes it back, without it A starts over."""
    async with serve(make_engine(model, n_ctx=512), n_slots=1, cache_ram=cache_ram) as c:
        _, a = await post(c, "/completion", completion(A))
        _, b = await post(c, "/completion", completion(B))
        _, a2 = await post(c, "/completion", completion(A + "and runs away"))
        _, b2 = await post(c, "/completion", completion(B + "sed do eiusmod"))
    assert b["timings"]["cache_n"] == 0
    for first, second in ((a, a2), (b, b2)):
        if kept:
            assert second["timings"]["cache_n"] >= first["tokens_evaluated"] - 1
        else:
            assert second["timings"]["cache_n"] == 0


@aiotest
async def test_ram_cache_limit_evicts_the_oldest(model):
    """A limit that holds one state: of A and B moved out in turn, only the newer one is kept."""
    engine = make_engine(model, n_ctx=512)
    async with serve(engine, n_slots=1, cache_ram=1) as c:  # 1 byte: nothing fits
        _, a = await post(c, "/completion", completion(A))
        _, b = await post(c, "/completion", completion(B))
        _, a2 = await post(c, "/completion", completion(A + "and runs away"))
    assert a2["timings"]["cache_n"] == 0
    one_state = max(engine.context.nbytes(i) for i in engine.context.seqs)  # each state holds 256 rows here
    async with serve(make_engine(model, n_ctx=512), n_slots=1, cache_ram=int(one_state * 1.5)) as c:
        _, a = await post(c, "/completion", completion(A))
        _, b = await post(c, "/completion", completion(B))  # A moves to the cache
        _, c3 = await post(c, "/completion", completion("a third text with nothing in common " * 3))  # B moves in, A out
        _, b2 = await post(c, "/completion", completion(B + "sed do eiusmod"))
        _, a2 = await post(c, "/completion", completion(A + "and runs away"))
    assert b2["timings"]["cache_n"] > 0 and a2["timings"]["cache_n"] == 0


@aiotest
async def test_the_ram_cache_keeps_one_copy_of_a_prefix(model):
    """The same request on two slots at once leaves two equal states; moved out to the LRU, one
    copy is kept (a state another holds whole serves nothing the other does not). Before, a
    soak on a few prompts filled --cache-ram with such copies."""
    import asyncio

    engine = make_engine(model, n_ctx=1024)
    async with serve(engine, n_slots=2) as c:
        a = await asyncio.gather(*[post(c, "/completion", completion(A)) for _ in range(2)])
        assert {r["id_slot"] for _, r in a} == {0, 1} and len(engine.context.seqs) == 2
        await asyncio.gather(*[post(c, "/completion", completion(B)) for _ in range(2)])  # both A states move out
        assert len(engine.context.seqs) == 3  # B and B in the slots, one A in the cache
        _, longer = await post(c, "/completion", completion(A + "and runs away"))  # continues A
        _, again = await post(c, "/completion", completion(A))  # inside the longer state: one state for both
        assert len(engine.context.seqs) == 3
    assert longer["timings"]["cache_n"] >= a[0][1]["tokens_evaluated"] - 1
    assert again["timings"]["cache_n"] >= a[0][1]["tokens_evaluated"] - 1 and again["content"] == a[0][1]["content"]


@aiotest
async def test_conversations_sharing_a_system_prompt_keep_their_own_states(model):
    """-np 1, two chats with one system prompt, turns interleaved: B's first turn takes a copy of
    the system prompt's rows from A's state instead of cutting it down, so A's second turn still
    continues from all of its first. Every answer is the cold start's."""
    def turn(user, before=()):
        return [SYSTEM, *before, {"role": "user", "content": user}]

    async def answer(c, messages):
        _, r = await post(c, "/v1/chat/completions", chat(messages))
        return r

    async with serve(make_engine(model, n_ctx=1024), n_slots=1) as c:
        a1 = await answer(c, turn("write a loop that counts to ten"))
        b1 = await answer(c, turn("print the letters of a word"))
        a_next = turn("write a loop that counts to ten") + [{"role": "assistant", "content": a1["choices"][0]["message"]["content"]},
                                                         {"role": "user", "content": "now count down"}]
        b_next = turn("print the letters of a word") + [{"role": "assistant", "content": b1["choices"][0]["message"]["content"]},
                                                       {"role": "user", "content": "backwards"}]
        a2, b2 = await answer(c, a_next), await answer(c, b_next)
    async with serve(make_engine(model, n_ctx=1024), n_slots=1, cache_ram=0) as c:
        cold = [await answer(c, m) for m in (a_next, b_next)]

    cached = lambda r: r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached(b1) < b1["usage"]["prompt_tokens"]  # the system prompt's rows, copied
    assert cached(a2) >= a1["usage"]["prompt_tokens"] and cached(b2) >= b1["usage"]["prompt_tokens"]
    for warm, ref in zip((a2, b2), cold):
        assert warm["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
