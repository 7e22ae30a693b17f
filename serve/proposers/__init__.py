"""Proposers: each drafting method's side of the engine loop (one file per kind, propose_<kind>.py)."""
