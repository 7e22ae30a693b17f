"""Drafter heads and the registry of kinds; the target's model they are built from is runtime/. Importing the
package registers the built-in kinds (registry.py)."""

from . import registry  # noqa: F401
