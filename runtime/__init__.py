"""The target's runtime: draftsmith's Llama-family model (`llama.py`), its batch-invariant attention
(`attention.py`), static caches (`kv_cache.py`) and static-shape forward for torch.compile (`static_forward.py`).
Importing it registers no drafter kinds."""
