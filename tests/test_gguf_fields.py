"""speculant.gguf's field copier keeps every key's value and GGUF type, and the script built on
it (scripts/qwen2_as_llama.py, which lets llama.cpp's EAGLE3 drafter tap a qwen2 target) writes
a llama model that computes what the qwen2 original computes."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from speculant.gguf import copy_fields, field_value
from speculant.loader import load_model
from speculant.testing.tiny_gguf import write_tiny_model
from speculant.types import Batch

ROOT = Path(__file__).parent.parent


def _write(path, fields):
    w = GGUFWriter(str(path), "test")
    for name, (value, vtype, sub) in fields.items():
        w.add_key_value(name, value, vtype, sub_type=sub)
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_copy_keeps_values_and_types(tmp_path):
    T = GGUFValueType
    fields = {
        "a.u8": (7, T.UINT8, None), "a.i32": (-3, T.INT32, None), "a.u64": (2**40, T.UINT64, None),
        "a.f32": (0.5, T.FLOAT32, None), "a.bool": (True, T.BOOL, None), "a.str": ("héllo", T.STRING, None),
        "tok.strs": (["a", b"\xff raw byte", ""], T.ARRAY, T.STRING), "tok.ints": ([1, -2, 3], T.ARRAY, T.INT32),
        "tok.floats": ([0.25, -1.5], T.ARRAY, T.FLOAT32),
    }
    _write(tmp_path / "src.gguf", fields)
    src = GGUFReader(str(tmp_path / "src.gguf"))
    w = GGUFWriter(str(tmp_path / "dst.gguf"), "test")
    n = copy_fields(src, w, keep=lambda name: name.startswith(("a.", "tok.")) and name != "a.u8", rename=lambda name: "x." + name)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert n == len(fields) - 1
    dst = GGUFReader(str(tmp_path / "dst.gguf"))
    assert "x.a.u8" not in dst.fields and not any(k.startswith("x.GGUF.") for k in dst.fields)
    for name, (value, vtype, sub) in fields.items():
        if name == "a.u8":
            continue
        got, got_type, got_sub = field_value(dst.fields["x." + name])
        assert (got_type, got_sub) == (vtype, sub), name
        assert got == value, name


def test_qwen2_as_llama_computes_what_qwen2_computes(tmp_path):
    spec = importlib.util.spec_from_file_location("qwen2_as_llama", ROOT / "scripts" / "qwen2_as_llama.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    src = write_tiny_model(tmp_path / "qwen2.gguf", "qwen2", qtype="F32", seed=3)
    script.main(src, str(tmp_path / "llama.gguf"))
    assert field_value(GGUFReader(str(tmp_path / "llama.gguf")).fields["general.architecture"])[0] == "llama"
    tokens = [5, 17, 99, 3, 250, 42, 7]
    logits = []
    for path in (src, str(tmp_path / "llama.gguf")):
        model = load_model(path)
        assert model.info.architecture == Path(path).stem
        logits.append(model.forward(Batch.for_sequence(0, 0, tokens, logits="all"), model.new_context(32)).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
