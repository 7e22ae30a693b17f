# importing a kind's module registers it (heads/kinds.py): a new kind's module joins this line
from . import draft_model, eagle, eagle3, medusa, training_free  # noqa: F401
