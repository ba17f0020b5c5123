"""The `vllm.general_plugins` entry point: vLLM calls `register()` in each of its processes at
start-up (vllm/plugins/__init__.py, load_general_plugins), before any model is built.

The proposer itself needs no registration (vLLM imports the class path it is given). What this
does is fail early and once: speculant's plugins are discovered and $SPECULANT_VLLM_ARGS parsed
in the process that reads the user's configuration, so a typo in a flag or a spec type that is
not installed is an error at start-up, not in a GPU worker after the model has loaded. It may run
several times per process (vLLM's warning), and is cheap after the first.
"""
from __future__ import annotations

import os

from speculant.logs import get_logger

from vllm_speculant import options

log = get_logger(__name__)


def register() -> None:
    if not os.environ.get(options.ENV):
        return  # nothing to check: named proposer classes with default options, or no proposer of ours
    opts = options.parse(require_types=False)  # raises SpeculantError naming the flag
    log.info("vllm-speculant options", spec_types=",".join(opts.spec_types) or "from the proposer class")
