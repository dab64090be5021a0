"""MTP / NextN speculative decoding: a one-layer draft proposes a chain of tokens, the target
verifies them in one pass (lossless: greedy prefix match, or rejection sampling)."""
