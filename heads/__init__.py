from . import dflash, draft_model, eagle, eagle3, medusa  # noqa: F401  (importing a kind registers it in drafter.REGISTRY)
