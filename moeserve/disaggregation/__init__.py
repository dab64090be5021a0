"""Prefill-decode disaggregation: roles, the KV transfer interface and its backends, the bootstrap
server and its control messages (docs/disaggregation.md)."""
