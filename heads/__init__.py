"""Drafter heads, the registry of kinds, and the Llama-family runner they are built from. Importing the package
registers the built-in kinds (registry.py)."""

from . import registry  # noqa: F401
