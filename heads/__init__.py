# importing a kind's module registers it (heads/kinds.py): a new kind's module joins this line
from . import draft_model, eagle, eagle3, medusa, training_free  # noqa: F401

# isort: off
# the block drafters after the others: registration order is the order spec lists and messages name kinds in
from . import dflash, peagle  # noqa: F401
# isort: on
