"""`speculant export-vllm`: a speculant plugin (entry point group `speculant`) adding the
exporter as a command, beside `speculant train eagle3` which makes the heads it exports."""
from __future__ import annotations

from speculant import hookimpl


def run(args) -> int:
    import json

    from vllm_speculant.export import export

    out, method = export(args.head, args.output, dtype=args.dtype)
    config = json.loads((out / "config.json").read_text())
    # EAGLE3 drafts a few tokens a step well; a DFlash block drafts block_size - 1 in one forward.
    n = config["block_size"] - 1 if method == "dflash" else 3
    spec = {"method": method, "model": str(out), "num_speculative_tokens": n}
    print(f"{out}: load it in vLLM with speculative_config={json.dumps(spec)}")
    return 0


@hookimpl
def speculant_add_commands(subparsers, register):
    p = subparsers.add_parser("export-vllm", help="write an EAGLE3 head or DFlash drafter (GGUF) as a checkpoint vLLM's eagle3 or dflash method loads")
    p.add_argument("head", help="the drafter, llama.cpp's eagle3 or dflash GGUF layout (what `speculant train eagle3|dflash` writes)")
    p.add_argument("-o", "--output", required=True, help="directory to write config.json and model.safetensors into")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="the weights' dtype (default bfloat16; vLLM casts to the target's dtype on load)")
    register("export-vllm", run)
