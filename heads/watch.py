"""What a kernel's plan read from a module tree, kept so that a forward can tell in one pass whether it still holds.

Why: a plan points into weights (heads/decoder_layer.py, heads/decoder_stack.py), and rebuilding the proof that they
are current the way the modules do (attribute lookups through nn.Module.__getattr__, each packed linear's own check)
cost a decode step some 5 ms over SmolLM2's 30 layers. A watch remembers each link it followed (the dict a module
keeps a submodule, parameter or attribute in, the key, the object found) and each tensor it reached (its in-place
version and where its data lives), and checks them all in one loop.

What it sees: a module, parameter or attribute replaced; a tensor edited in place, moved by a `.data` swap, `set_`,
`model.to` or `share_memory`. What it cannot see, as PyTorch's own version counter cannot: an edit through
`.data` (`weight.data.copy_(...)`), which writes the storage behind the tensor's back.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from torch import Tensor, nn

COUNTER = operator.attrgetter("_version")


@dataclass
class Watch:
    """Links (where, key, what was found there) and tensors (in-place version, data address), kept as parallel
    lists: holds() checks them with C-level maps, since it runs once per forward over a whole model."""

    wheres: list[dict] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    found: list[object] = field(default_factory=list)
    counted: list[Tensor] = field(default_factory=list)  # tensors with a version counter (not inference tensors)
    versions: list[int] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    addresses: list[int] = field(default_factory=list)
    seen: set[tuple[int, object]] = field(default_factory=set, repr=False)  # (id(where), key), (id(tensor), None)

    def holds(self) -> bool:
        """Every link leads where it did, and every tensor is unedited where it was."""
        return (
            all(map(operator.is_, map(dict.get, self.wheres, self.keys), self.found))
            and list(map(COUNTER, self.counted)) == self.versions
            and list(map(Tensor.data_ptr, self.tensors)) == self.addresses
        )

    def follow(self, root: nn.Module, path: str) -> object:
        """Walk the dotted path from root, remembering each step; returns what it ends at (None where missing)."""
        node: object = root
        for name in path.split("."):
            where = container(node, name)
            node = where.get(name)
            self.keep(where, name, node)
            if node is None:
                break
        return node

    def keep(self, where: dict, key: str, found: object) -> None:
        if new(self.seen, (id(where), key)):
            self.wheres.append(where)
            self.keys.append(key)
            self.found.append(found)
        if isinstance(found, Tensor) and new(self.seen, (id(found), None)):
            self.tensors.append(found)
            self.addresses.append(found.data_ptr())
            if not found.is_inference():
                self.counted.append(found)
                self.versions.append(found._version)

    def extend(self, other: Watch) -> None:
        """Add another watch's links and tensors as it saw them."""
        for where, key, found in zip(other.wheres, other.keys, other.found, strict=True):
            if new(self.seen, (id(where), key)):
                self.wheres.append(where)
                self.keys.append(key)
                self.found.append(found)
        counted = dict(zip(map(id, other.counted), other.versions, strict=True))
        for t, address in zip(other.tensors, other.addresses, strict=True):
            if new(self.seen, (id(t), None)):
                self.tensors.append(t)
                self.addresses.append(address)
                if id(t) in counted:
                    self.counted.append(t)
                    self.versions.append(counted[id(t)])


def new(seen: set, key: tuple) -> bool:
    """Whether key was not in seen; it is now."""
    if key in seen:
        return False
    seen.add(key)
    return True


def container(node: object, name: str) -> dict:
    """The dict that holds node.name: a module's submodules, parameters or buffers, else its plain attributes (a
    missing name is watched where a module would be assigned)."""
    if isinstance(node, nn.Module):
        for where in (node._modules, node._parameters, node._buffers):
            if name in where:
                return where
        return node.__dict__ if name in node.__dict__ else node._modules
    return vars(node)
