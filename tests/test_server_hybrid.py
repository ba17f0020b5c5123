"""`speculant serve` on a hybrid target (tiny lfm2): requests served with speculation give plain
decoding's text, a second chat turn resumes from a prompt-end checkpoint, and /props and
/metrics say how partial acceptances went back."""
import pytest
import torch

from speculant.loader import load_model
from speculant.testing.tiny_gguf import write_tiny_model

from test_server_util import Lookup, aiotest, make_engine, post, serve


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("lfm2") / "lfm2.gguf", "lfm2", n_layers=4, n_ctx=1024)
    model = load_model(path, progress=False)
    torch.set_num_threads(1)
    return model


PROMPT = "a b c a b c a b c a b c a b c a b c"


@pytest.mark.parametrize("use_checkpoints", [False, True], ids=["per-row", "replay"])
@aiotest
async def test_hybrid_target_served(lfm2, use_checkpoints):
    async with serve(make_engine(lfm2, 512)) as c:
        status, plain = await post(c, "/completion", {"prompt": PROMPT, "n_predict": 24, "temperature": 0})
        assert status == 200
    engine = make_engine(lfm2, 512, speculators=[Lookup()], adaptive=False, spec_use_checkpoints=use_checkpoints)
    async with serve(engine) as c:
        status, body = await post(c, "/completion", {"prompt": PROMPT, "n_predict": 24, "temperature": 0})
        assert status == 200 and body["content"] == plain["content"] and body["timings"]["draft_n"] > 0
        spec = (await (await c.get("/props")).json())["speculative"]
        rec = spec["recurrent"]
        assert rec["mode"] == ("checkpoint-replay" if use_checkpoints else "per-row")
        cut = body["timings"]["draft_n_accepted"] < body["timings"]["draft_n"]
        assert not cut or (rec["replays"] > 0 if use_checkpoints else rec["rollbacks"] > 0)
        assert (rec["saves"] > 0) == use_checkpoints
        metrics = await (await c.get("/metrics")).text()
        assert f"speculant:recurrent_replays_total {float(rec['replays'])}" in metrics
        assert f"speculant:recurrent_rollbacks_total {float(rec['rollbacks'])}" in metrics
        # A second turn continuing the first: served from the kept state, the same text as cold.
        status, again = await post(c, "/completion", {"prompt": PROMPT + body["content"] + " a b", "n_predict": 8,
                                                       "temperature": 0})
        assert status == 200 and again["tokens_cached"] > 0
    async with serve(make_engine(lfm2, 512)) as c:
        status, cold = await post(c, "/completion", {"prompt": PROMPT + body["content"] + " a b", "n_predict": 8,
                                                      "temperature": 0})
    assert again["content"] == cold["content"]
