"""`speculant export-vllm`: a speculant plugin (entry point group `speculant`) adding the
exporter as a command, beside `speculant train eagle3` which makes the heads it exports."""
from __future__ import annotations

from speculant import hookimpl


def run(args) -> int:
    from vllm_speculant.eagle3_export import export

    out = export(args.head, args.output, dtype=args.dtype)
    print(f"{out}: load it in vLLM with speculative_config={{\"method\": \"eagle3\", \"model\": \"{out}\", "
          "\"num_speculative_tokens\": 3}")
    return 0


@hookimpl
def speculant_add_commands(subparsers, register):
    p = subparsers.add_parser("export-vllm", help="write an EAGLE3 head (GGUF) as a checkpoint vLLM's eagle3 method loads")
    p.add_argument("head", help="the head, llama.cpp's eagle3 GGUF layout (what `speculant train eagle3` writes)")
    p.add_argument("-o", "--output", required=True, help="directory to write config.json and model.safetensors into")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="the weights' dtype (default bfloat16; vLLM casts to the target's dtype on load)")
    register("export-vllm", run)
