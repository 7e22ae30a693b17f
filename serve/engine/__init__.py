"""The speculative engine, batch 1: prefill with prefix caching, draft, verify, keep."""
