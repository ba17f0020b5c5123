"""speculant: a speculative-decoding microkernel."""
