"""vllm-speculant: speculant's speculators inside vLLM.

* token-only speculators as a vLLM custom proposer:
      speculative_config={"method": "custom_class", "model": "vllm_speculant.Suffix",
                          "num_speculative_tokens": 8}
  (`SpeculantProposer` takes the types from $SPECULANT_VLLM_ARGS, `--spec-type a,b`);
* `speculant export-vllm`: a trained EAGLE3 head (llama.cpp's GGUF layout) as a checkpoint
  directory vLLM's built-in `eagle3` method loads.

Importing this package needs speculant only, never vLLM.
"""
from __future__ import annotations

from vllm_speculant.proposer import SpeculantProposer

__all__ = ["NgramMapK", "NgramMapK4v", "NgramMod", "NgramSimple", "SpeculantProposer", "Suffix"]


# One class per spec type, so that a vLLM user names the method in `speculative_config.model`
# alone (a dotted path of identifiers: vLLM 0.33.0 config/speculative.py:1215).
class Suffix(SpeculantProposer):
    spec_types = ("suffix",)


class NgramSimple(SpeculantProposer):
    spec_types = ("ngram-simple",)


class NgramMapK(SpeculantProposer):
    spec_types = ("ngram-map-k",)


class NgramMapK4v(SpeculantProposer):
    spec_types = ("ngram-map-k4v",)


class NgramMod(SpeculantProposer):
    spec_types = ("ngram-mod",)
