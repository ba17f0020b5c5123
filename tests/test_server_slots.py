"""llama-server's slot actions on the prompt cache: POST /slots/ID?action=save|restore|erase with
--slot-save-path. A restored slot continues like the slot it was saved from, and its output is a
cold start's; every bad request is a one-line 4xx/5xx in OpenAI's shape and the server goes on."""
from __future__ import annotations

import asyncio
import hashlib
import os
import stat

import pytest
import torch
from hypothesis import given, settings, strategies as st

from speculant.loader import load_model
from speculant.testing.tiny_gguf import write_tiny_model
from speculant_server import slot_files
from speculant_server.cli import main as serve_main
from speculant_server.protocol import ApiError

from test_server_util import Slow, aiotest, make_engine, post, serve, tiny_model

A = "the quick brown fox jumps over the lazy dog " * 3
A2 = A + "and runs away from the farmer"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("models"))


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "slots"
    d.mkdir()
    return d


def completion(prompt, **extra):
    return {"prompt": prompt, "n_predict": 8, "temperature": 0, **extra}


# The continuation: long enough that a state restored even slightly wrong shows in the text (a KV
# cache scaled by 0.9 gives the same first 8 tokens here, not the same 24).
def continuation(**extra):
    return completion(A2, n_predict=24, **extra)


async def slot(client, slot_id, action, body=None):
    """(status, JSON) of POST /slots/ID?action=..."""
    query = "" if action is None else f"?action={action}"
    return await post(client, f"/slots/{slot_id}{query}", {} if body is None else body)


async def cold_text(model) -> str:
    async with serve(make_engine(model, n_ctx=512), n_slots=1) as c:
        status, r = await post(c, "/completion", continuation())
    assert status == 200 and r["tokens_predicted"] == 24
    return r["content"]


def kept_state(client, engine, i):
    """(tokens, row_prompts, target KV) of slot i's kept entry (read while the engine thread idles)."""
    from speculant_server.app import STATE

    entry = client.server.app[STATE].worker.cache.slots[i]
    kv = {k: v.clone() for k, v in engine.context.get_state(entry.seq_id).items()}
    return entry.tokens, entry.row_prompts, kv


def n_cache_tokens(slots, i) -> int:
    return next(s["n_cache_tokens"] for s in slots if s["id"] == i)


def assert_error(status, body, want_status, *words):
    """One clear line in OpenAI's shape."""
    assert status == want_status, body
    err = body["error"]
    assert err["code"] == want_status and isinstance(err["type"], str)
    message = err["message"]
    assert "\n" not in message and "Traceback" not in message, message
    for w in words:
        assert w in message, (w, message)
    return message


# --- the round trip ------------------------------------------------------------------------------
@aiotest
async def test_save_erase_restore_continues_like_a_cold_start(model, folder):
    engine = make_engine(model, n_ctx=512)
    async with serve(engine, n_slots=2, slot_save_path=str(folder)) as c:
        _, first = await post(c, "/completion", completion(A))
        s = first["id_slot"]
        tokens, row_prompts, kv = kept_state(c, engine, s)
        status, saved = await slot(c, s, "save", {"filename": "a.bin"})
        assert status == 200, saved
        kept = n_cache_tokens(await (await c.get("/slots")).json(), s)
        assert saved["id_slot"] == s and saved["filename"] == "a.bin"
        assert saved["n_saved"] == kept > first["tokens_evaluated"]  # the prompt and what followed it
        assert saved["n_written"] == (folder / "a.bin").stat().st_size and saved["timings"]["save_ms"] >= 0
        assert sorted(os.listdir(folder)) == ["a.bin"]  # no temporary file left behind

        status, erased = await slot(c, s, "erase")
        assert status == 200 and erased == {"id_slot": s, "n_erased": kept}
        assert n_cache_tokens(await (await c.get("/slots")).json(), s) == 0

        status, restored = await slot(c, s, "restore", {"filename": "a.bin"})
        assert status == 200, restored
        assert restored["id_slot"] == s and restored["filename"] == "a.bin" and restored["n_restored"] == kept
        assert restored["n_read"] == saved["n_written"] and restored["timings"]["restore_ms"] >= 0
        assert n_cache_tokens(await (await c.get("/slots")).json(), s) == kept
        tokens2, row_prompts2, kv2 = kept_state(c, engine, s)
        assert tokens2 == tokens and row_prompts2 == row_prompts
        assert kv2.keys() == kv.keys() and all(torch.equal(kv2[k], kv[k]) for k in kv)  # bit for bit

        _, warm = await post(c, "/completion", continuation())
    assert warm["id_slot"] == s and warm["timings"]["cache_n"] >= first["tokens_evaluated"] - 1
    assert warm["content"] == await cold_text(model)


@aiotest
async def test_a_file_restores_into_another_server_and_slot(model, folder):
    """The use of it: a prompt's state outlives the server. Restored into slot 1 of a fresh server,
    the next request goes there, reuses it, and answers as a cold start does."""
    async with serve(make_engine(model, n_ctx=512), n_slots=1, slot_save_path=str(folder)) as c:
        _, first = await post(c, "/v1/completions", {"prompt": A, "max_tokens": 8, "temperature": 0})
        status, saved = await slot(c, 0, "save", {"filename": ".hidden-names-are-fine"})
        assert status == 200, saved
    async with serve(make_engine(model, n_ctx=512), n_slots=2, slot_save_path=str(folder)) as c:
        status, restored = await slot(c, 1, "restore", {"filename": ".hidden-names-are-fine"})
        assert status == 200 and restored["n_restored"] == saved["n_saved"]
        _, warm = await post(c, "/v1/completions", {"prompt": A2, "max_tokens": 24, "temperature": 0})
        _, again = await post(c, "/completion", continuation())
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 1
    assert again["id_slot"] == 1 and again["timings"]["cache_n"] > 0
    text = await cold_text(model)
    assert warm["choices"][0]["text"] == text and again["content"] == text


@aiotest
async def test_a_drafter_on_hidden_states_drafts_after_a_restore(model, folder, tmp_path):
    """The file carries the EAGLE3 head's states of the saved rows (`export_state`): restored into
    another server with the same head, the conversation drafts as in the server that saved it."""
    from speculant.speculator import build_speculators
    from speculant_eagle3.testing import write_random_head
    from safetensors import safe_open

    head = write_random_head(tmp_path / "head.gguf", model.info.path, n_draft_vocab=200)[0]

    def engine():
        spec = build_speculators(["eagle3"], {"seed": 3}, target=model, draft_model=head)
        return make_engine(model, n_ctx=512, speculators=spec, adaptive=False, draft_n_max=4)

    async with serve(engine(), n_slots=1, slot_save_path=str(folder)) as c:
        _, first = await post(c, "/completion", completion(A))
        status, saved = await slot(c, 0, "save", {"filename": "eagle3.bin"})
        assert status == 200, saved
        _, kept = await post(c, "/completion", continuation())
    with safe_open(str(folder / "eagle3.bin"), "pt") as f:
        assert f.metadata()["spec.eagle3"].startswith("eagle3:")
        assert f.get_slice("spec.eagle3.states").get_shape()[0] == saved["n_saved"]
    async with serve(engine(), n_slots=1, slot_save_path=str(folder)) as c:
        status, restored = await slot(c, 0, "restore", {"filename": "eagle3.bin"})
        assert status == 200, restored
        _, warm = await post(c, "/completion", continuation())
    assert kept["timings"]["draft_n"] > 0 and warm["content"] == kept["content"] == await cold_text(model)
    assert (warm["timings"]["draft_n"], warm["timings"]["draft_n_accepted"]) == \
        (kept["timings"]["draft_n"], kept["timings"]["draft_n_accepted"])


@aiotest
async def test_save_overwrites_whole(model, folder):
    async with serve(make_engine(model, n_ctx=512), n_slots=1, slot_save_path=str(folder)) as c:
        await post(c, "/completion", completion(A))
        _, one = await slot(c, 0, "save", {"filename": "x"})
        await post(c, "/completion", completion("something else entirely, and longer than before " * 3))
        _, two = await slot(c, 0, "save", {"filename": "x"})
        status, back = await slot(c, 0, "restore", {"filename": "x"})
    assert one["n_saved"] != two["n_saved"]
    assert status == 200 and back["n_restored"] == two["n_saved"] and back["n_read"] == two["n_written"]
    assert os.listdir(folder) == ["x"]


# --- errors ---------------------------------------------------------------------------------------
@aiotest
async def test_save_and_restore_are_off_without_a_folder(model):
    async with serve(make_engine(model), n_slots=1) as c:
        await post(c, "/completion", completion("hello"))
        for action in ("save", "restore"):
            status, body = await slot(c, 0, action, {"filename": "a.bin"})
            assert_error(status, body, 501, "--slot-save-path")
            assert body["error"]["type"] == "not_supported_error"
        status, body = await slot(c, 0, "erase")  # needs no folder
        assert status == 200 and body["n_erased"] > 0
        status, _ = await post(c, "/completion", completion("hello"))
        assert status == 200


@pytest.mark.parametrize("slot_id, action, body, status, words", [
    ("0", None, {}, 400, ["'action'", "required"]),
    ("0", "load", {}, 400, ["'action'", "'load'"]),
    ("x", "erase", {}, 400, ["no slot 'x'", "0 to 1"]),
    ("2", "erase", {}, 400, ["no slot '2'"]),
    ("-1", "save", {"filename": "a"}, 400, ["no slot '-1'"]),
    ("99999999999999999999999", "restore", {"filename": "a"}, 400, ["no slot"]),
    ("0", "save", {}, 400, ["'filename'", "required"]),
    ("0", "restore", {"filename": 5}, 400, ["'filename'", "string"]),
    ("0", "save", "not json", 400, ["not valid JSON"]),
    ("0", "restore", {"filename": "absent.bin"}, 404, ["absent.bin"]),
    ("0", "save", {"filename": "a"}, 400, ["holds no prompt state"]),  # nothing has run on slot 0 yet
], ids=["no-action", "unknown-action", "slot-not-a-number", "slot-out-of-range", "slot-negative", "slot-huge",
        "no-filename", "filename-not-a-string", "body-not-json", "missing-file", "empty-slot"])
@aiotest
async def test_bad_requests(model, folder, slot_id, action, body, status, words):
    async with serve(make_engine(model), n_slots=2, slot_save_path=str(folder)) as c:
        got, answer = await slot(c, slot_id, action, body)
        assert_error(got, answer, status, *words)
        got, _ = await post(c, "/completion", completion("hello"))
        assert got == 200
    assert os.listdir(folder) == []


BAD_NAMES = ["", ".", "..", "../escaped.bin", "a/b.bin", "/tmp/abs.bin", "..\\up.bin", "a\x00b", "line\nbreak",
             "tab\there", "\x7f", "c1\x85control", "x" * 256, "é" * 128, "\ud800"]


@aiotest
async def test_filenames_that_are_not_plain_names_are_refused(model, tmp_path, folder):
    before = sorted(p.name for p in tmp_path.iterdir())
    async with serve(make_engine(model), n_slots=1, slot_save_path=str(folder)) as c:
        await post(c, "/completion", completion("hello"))
        for name in BAD_NAMES:
            for action in ("save", "restore"):
                status, body = await slot(c, 0, action, {"filename": name})
                assert_error(status, body, 400, "'filename'")
                assert body["error"]["param"] == "filename"
        status, ok = await slot(c, 0, "save", {"filename": "x" * 255})  # the longest name allowed
        assert status == 200, ok
        status, _ = await post(c, "/completion", completion("hello"))
        assert status == 200
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert os.listdir(folder) == ["x" * 255]


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.text(alphabet=st.sampled_from(["/", "\\", ".", "a", "\x00", ":", "~"]), max_size=8)))
def test_a_name_never_reaches_outside_the_folder(name):
    folder = "/srv/slots"
    try:
        path = slot_files.path_in(folder, slot_files.check_filename(name))
    except ApiError as e:
        assert e.status == 400 and e.extra.get("param") == "filename"
        return
    assert os.path.dirname(path) == folder and os.path.basename(path) == name
    assert os.path.normpath(path) == path and name not in (".", "..")  # nothing for the OS to resolve upwards


@pytest.mark.parametrize("name", ["../x", "a/b", "/abs", "..", ".", ""])
def test_path_in_alone_keeps_to_the_folder(name):
    """The second line of defence holds without the first."""
    with pytest.raises(ApiError) as e:
        slot_files.path_in("/srv/slots/", name)
    assert e.value.status == 400


@aiotest
async def test_a_folder_of_that_name_is_refused(model, folder):
    (folder / "sub").mkdir()
    async with serve(make_engine(model), n_slots=1, slot_save_path=str(folder)) as c:
        await post(c, "/completion", completion("hello"))
        for action in ("save", "restore"):
            status, body = await slot(c, 0, action, {"filename": "sub"})
            assert_error(status, body, 400, "'sub'", "folder")
    assert os.listdir(folder / "sub") == []


def _rewrite(path, change):
    """Load a slot file, let `change(tensors, meta)` edit it, write it back with a right checksum."""
    from safetensors import safe_open
    from safetensors.torch import save

    with safe_open(str(path), "pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    change(tensors, meta)
    meta.pop("sha256", None)
    meta["sha256"] = hashlib.sha256(slot_files._payload(save(tensors, meta))).hexdigest()
    path.write_bytes(save(tensors, meta))


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


def _set(key, value):
    return lambda tensors, meta: meta.__setitem__(key, value)


def _kv_shape(tensors, meta):
    tensors["k.0"] = tensors["k.0"][:1]  # one KV head fewer


def _token_outside_vocab(tensors, meta):
    tensors["tokens"][0] = 10**6


def _row_prompts_garbled(tensors, meta):
    tensors["row_prompts"][0, 0] = 5


CORRUPTIONS = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-100]), ["not a slot file", "safetensors"]),
    "empty": (lambda p: p.write_bytes(b""), ["not a slot file"]),
    "huge": (lambda p: p.write_bytes(bytes(4 << 20)), ["more than any state of this model"]),  # never read in
    "text": (lambda p: p.write_text("this is not a slot file, it is a note to self\n" * 20), ["not a slot file"]),
    "pickle": (lambda p: torch.save({"tokens": [1, 2, 3]}, p), ["not a slot file"]),
    "data-flipped": (_flip_last_byte, ["corrupted", "checksum"]),
    "no-format": (lambda p: _rewrite(p, lambda t, m: m.pop("format")), ["no format"]),
    "newer-format": (lambda p: _rewrite(p, _set("format", "speculant-slot-99")), ["speculant-slot-99"]),
    "other-arch": (lambda p: _rewrite(p, _set("architecture", "llama")), ["another model", "architecture 'llama'"]),
    "other-vocab": (lambda p: _rewrite(p, _set("n_vocab", "32000")), ["another model", "n_vocab '32000'"]),
    "kv-shape": (lambda p: _rewrite(p, _kv_shape), ["does not fit", "shape"]),
    "no-layer": (lambda p: _rewrite(p, lambda t, m: t.pop("v.1")), ["does not fit", "v.1"]),
    "token-id": (lambda p: _rewrite(p, _token_outside_vocab), ["corrupted", "vocabulary"]),
    "row-prompts": (lambda p: _rewrite(p, _row_prompts_garbled), ["corrupted", "row_prompts"]),
}


@aiotest
async def test_a_damaged_or_foreign_file_is_a_400(model, folder):
    async with serve(make_engine(model, n_ctx=512), n_slots=1, slot_save_path=str(folder)) as c:
        _, first = await post(c, "/completion", completion(A))
        status, saved = await slot(c, 0, "save", {"filename": "good.bin"})
        assert status == 200
        good = (folder / "good.bin").read_bytes()
        for name, (damage, words) in CORRUPTIONS.items():
            path = folder / f"{name}.bin"
            path.write_bytes(good)
            damage(path)
            status, body = await slot(c, 0, "restore", {"filename": path.name})
            assert_error(status, body, 400, f"'{path.name}'", *words)
        # the slot still holds its own state, untouched by the failed restores
        _, warm = await post(c, "/completion", continuation())
        status, back = await slot(c, 0, "restore", {"filename": "good.bin"})
    assert warm["timings"]["cache_n"] >= first["tokens_evaluated"] - 1
    assert status == 200 and back["n_restored"] == saved["n_saved"]
    assert warm["content"] == await cold_text(model)


@aiotest
async def test_a_file_of_another_model_with_the_same_shapes_is_refused(model, folder, tmp_path):
    """Every tensor would fit: only the metadata tells the models apart."""
    other = load_model(write_tiny_model(tmp_path / "tiny-llama.gguf", "llama", seed=3), progress=False)
    torch.set_num_threads(1)
    async with serve(make_engine(other, n_ctx=512), n_slots=1, slot_save_path=str(folder)) as c:
        await post(c, "/completion", completion(A))
        status, _ = await slot(c, 0, "save", {"filename": "llama.bin"})
        assert status == 200
    async with serve(make_engine(model, n_ctx=512), n_slots=1, slot_save_path=str(folder)) as c:
        status, body = await slot(c, 0, "restore", {"filename": "llama.bin"})
        assert_error(status, body, 400, "another model", "tiny-llama.gguf", "architecture 'llama'")
        status, _ = await post(c, "/completion", completion(A))
        assert status == 200


@aiotest
async def test_a_state_longer_than_the_context_is_refused(model, folder):
    async with serve(make_engine(model, n_ctx=512), n_slots=1, slot_save_path=str(folder)) as c:
        await post(c, "/completion", completion(A, n_predict=100))
        _, saved = await slot(c, 0, "save", {"filename": "long.bin"})
    assert saved["n_saved"] > 64
    async with serve(make_engine(model, n_ctx=64), n_slots=1, slot_save_path=str(folder)) as c:
        status, body = await slot(c, 0, "restore", {"filename": "long.bin"})
        assert_error(status, body, 400, "'long.bin'", "does not fit", "the context holds 64")
        status, _ = await post(c, "/completion", completion("hello"))
        assert status == 200


@aiotest
async def test_a_busy_slot_is_a_409(model, folder):
    engine = make_engine(model, speculators=[Slow(0.02)], adaptive=False)
    async with serve(engine, n_slots=1, slot_save_path=str(folder)) as c:
        await post(c, "/completion", completion("hello"))
        await slot(c, 0, "save", {"filename": "old.bin"})
        busy = asyncio.create_task(post(c, "/completion", {"prompt": "hello", "n_predict": 200, "temperature": 0}))
        for _ in range(200):
            if (await (await c.get("/slots")).json())[0]["is_processing"]:
                break
            await asyncio.sleep(0.01)
        for action, body in (("save", {"filename": "new.bin"}), ("restore", {"filename": "old.bin"}), ("erase", {})):
            status, answer = await slot(c, 0, action, body)
            assert_error(status, answer, 409, "slot 0 is processing a request")
        assert not busy.done()
        status, done = await busy
        assert status == 200 and done["tokens_predicted"] > 0
        status, _ = await slot(c, 0, "save", {"filename": "new.bin"})  # idle again
        assert status == 200
    assert sorted(os.listdir(folder)) == ["new.bin", "old.bin"]


@aiotest
async def test_an_idle_engine_thread_wakes_for_a_slot_action(model, folder):
    async with serve(make_engine(model), n_slots=1, slot_save_path=str(folder)) as c:
        await post(c, "/completion", completion("hello"))
        await asyncio.sleep(0.2)  # the engine thread is waiting for work
        status, body = await asyncio.wait_for(slot(c, 0, "erase"), 5)
        assert status == 200 and body["n_erased"] > 0


# --- the file itself ------------------------------------------------------------------------------
@aiotest
async def test_the_file_is_safetensors_with_the_model_in_its_metadata(model, folder):
    from safetensors import safe_open

    async with serve(make_engine(model, n_ctx=512), n_slots=1, slot_save_path=str(folder)) as c:
        await post(c, "/completion", completion(A))
        _, saved = await slot(c, 0, "save", {"filename": "a.bin"})
    with safe_open(str(folder / "a.bin"), "pt") as f:
        meta, names = f.metadata(), set(f.keys())
        tokens, runs = f.get_tensor("tokens"), f.get_tensor("row_prompts")
    info = model.info
    assert meta["format"] == slot_files.FORMAT and meta["model"] == os.path.basename(info.path)
    assert (meta["architecture"], meta["n_layers"], meta["n_embd"], meta["n_vocab"]) == \
        (info.architecture, str(info.n_layers), str(info.n_embd), str(info.n_vocab))
    assert tokens.dtype == torch.int32 and len(tokens) == saved["n_saved"]
    assert runs.dtype == torch.int64 and runs.shape == (1, 2) and runs[0].tolist() == [0, len(model.tokenizer.encode(A))]
    assert names == {"tokens", "row_prompts"} | {f"{kv}.{i}" for kv in "kv" for i in range(info.n_layers)}
    assert stat.S_IMODE((folder / "a.bin").stat().st_mode) == 0o600  # a state holds its prompt


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    snap = slot_files.Snapshot([1, 2, 3], ((0, 3),), {"k.0": torch.zeros(2, 3, 4), "v.0": torch.zeros(2, 3, 4)})
    path = str(tmp_path / "a.bin")
    slot_files.write(path, snap, {"model": "m"})
    old = (tmp_path / "a.bin").read_bytes()

    def crash(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(slot_files.os, "replace", crash)
    with pytest.raises(OSError):
        slot_files.write(path, slot_files.Snapshot([4], ((0, 1),), {"k.0": torch.ones(2, 1, 4)}), {"model": "m"})
    assert (tmp_path / "a.bin").read_bytes() == old and os.listdir(tmp_path) == ["a.bin"]


@aiotest
async def test_a_write_error_is_a_500_and_the_server_goes_on(model, folder):
    async with serve(make_engine(model), n_slots=1, slot_save_path=str(folder)) as c:
        await post(c, "/completion", completion("hello"))
        folder.rmdir()  # gone from under the server
        status, body = await slot(c, 0, "save", {"filename": "a.bin"})
        assert_error(status, body, 500, "could not save slot file 'a.bin'")
        status, _ = await post(c, "/completion", completion("hello"))
        assert status == 200


# --- start-up -------------------------------------------------------------------------------------
def test_the_folder_is_created_at_start_up(capsys, tmp_path):
    made = tmp_path / "new" / "slots"
    assert serve_main(["-m", str(tmp_path / "absent.gguf"), "--port", "0", "--slot-save-path", str(made)]) == 2
    assert made.is_dir()  # made before the model load failed
    assert "absent.gguf" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["a-file", "under-a-file"])
def test_a_folder_that_cannot_be_made_fails_in_one_line(capsys, tmp_path, where):
    (tmp_path / "f").write_text("x")
    path = tmp_path / "f" if where == "a-file" else tmp_path / "f" / "slots"
    assert serve_main(["-m", str(tmp_path / "absent.gguf"), "--port", "0", "--slot-save-path", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--slot-save-path" in err[0] and str(path) in err[0], err
