"""What a packed copy or a kernel's plan read from a module tree, kept so that a call can tell at once if it holds.

Why: a packed copy (cpu_kernels/packed.py) and a kernel's plan (cpu_kernels/decoder_layer.py,
cpu_kernels/decoder_stack.py) are made from weights that may change under them, and proving them current through the
modules (attribute lookups through nn.Module.__getattr__ for every tensor) costs a decode step a measurable share of its
time (docs/benchmarks.md, The whole stack in one call). A watch remembers each link it followed (the dict a module
keeps a submodule, parameter or attribute in, the key, the object found, or that there was none), the size of dicts
that must not grow (a layer list; the forward hooks of modules a kernel runs in place of), and each tensor it reached
(its in-place version, where its data lives, its strides), and checks them all with C-level maps.

What it sees: a module, parameter or attribute replaced, added or removed; a forward hook or an instance's own
forward; a module given another class (`module.__class__ = ...`) or its class's forward patched; a tensor edited in
place, moved by a `.data` swap, `set_`, `model.to` or `share_memory` (it holds the storage it saw, so new data cannot
be handed the old address). A name computed on each read (a parametrized weight) cannot be watched: such a watch never
holds, and the plan is remade each time. What it cannot see, as PyTorch's own version counter cannot: an edit through
`.data` (`weight.data.copy_(...)`), which writes the storage behind the tensor's back. Nor a subclass that changes
what a module computes through a method other than `forward`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat

from torch import Tensor, nn
from torch.nn.modules import module as module_globals

COUNTER = operator.attrgetter("_version")
CLASS_FORWARD = operator.attrgetter("__class__.forward")
MISSING = object()  # what a watched link found where there was no such key (a None value is not the same)
HOOKS = ("_forward_hooks", "_forward_pre_hooks")


@dataclass
class Watch:
    """Links (where, key, what was found there), dicts of a set size (a layer list's layers; forward hooks: none) and
    tensors (in-place version, data address, strides), kept as parallel lists: holds() checks them with C-level maps,
    since it runs once per forward over a whole model."""

    wheres: list[dict] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    found: list[object] = field(default_factory=list)
    sized: list[dict] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    counted: list[Tensor] = field(default_factory=list)  # tensors with a version counter (not inference tensors)
    versions: list[int] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    addresses: list[int] = field(default_factory=list)
    strides: list[tuple[int, ...]] = field(default_factory=list)  # a .data swap to a transposed view keeps the address
    # modules whose class's forward must stay (`module.__class__ = ...`, or the class's forward patched)
    typed: list[object] = field(default_factory=list)
    forwards: list[object] = field(default_factory=list)
    # the storage each tensor had, held so that its address cannot be handed to new data while the watch lives
    # (model.bfloat16().float() frees a weight and often gets the same address back, version and strides unchanged)
    pinned: list[Tensor] = field(default_factory=list, repr=False)
    blind: bool = False  # it read what it cannot watch (a parametrized weight, computed on each read): never holds
    # what is watched already: (id(where), key), (id(tensor), None), (id(module), type)
    seen: set[tuple[int, object]] = field(default_factory=set, repr=False)

    def holds(self) -> bool:
        """Every link leads where it did, every dict keeps its size, and every tensor is unedited where it was."""
        return (
            not self.blind
            and all(map(operator.is_, map(dict.get, self.wheres, self.keys, repeat(MISSING)), self.found))
            and list(map(len, self.sized)) == self.sizes
            and list(map(COUNTER, self.counted)) == self.versions
            and list(map(Tensor.data_ptr, self.tensors)) == self.addresses
            and list(map(Tensor.stride, self.tensors)) == self.strides
            and list(map(CLASS_FORWARD, self.typed)) == self.forwards
        )

    def follow(self, root: nn.Module, path: str) -> object:
        """Walk the dotted path from root, remembering each step; returns what it ends at (None where missing)."""
        node: object = root
        for name in path.split("."):
            places = holders(node)
            where = next((d for d in places if name in d), None)
            if where is None:
                if hasattr(node, name):  # computed on each read: what it comes from cannot be watched here
                    self.blind = True
                    return getattr(node, name)
                for d in places:  # missing: watched wherever it could be set
                    self.keep(d, name, MISSING)
                return None
            node = where[name]
            self.keep(where, name, node)
            if node is None:
                return None
        return node

    def keep(self, where: dict, key: str, found: object) -> None:
        self.add_link(where, key, found)
        if isinstance(found, Tensor):
            self.add_tensor(found, counter(found), found.data_ptr(), found.stride())

    def keep_size(self, where: dict) -> None:
        self.add_size(where, len(where))

    def add_link(self, where: dict, key: str, found: object) -> None:
        if new(self.seen, (id(where), key)):
            self.wheres.append(where)
            self.keys.append(key)
            self.found.append(found)

    def add_size(self, where: dict, size: int) -> None:
        if new(self.seen, (id(where), len)):
            self.sized.append(where)
            self.sizes.append(size)

    def add_tensor(self, t: Tensor, version: int | None, address: int, strides: tuple[int, ...]) -> None:
        """version None: a tensor that keeps no counter (made in inference mode)."""
        if new(self.seen, (id(t), None)):
            self.tensors.append(t)
            self.pinned.append(t.detach())
            self.addresses.append(address)
            self.strides.append(strides)
            if version is not None:
                self.counted.append(t)
                self.versions.append(version)

    def keep_plain(self, modules: list[nn.Module]) -> bool:
        """Watch that these modules stay plain (no hooks, no forward of an instance's own) and run their class's forward
        of now; whether they are plain now."""
        for m in modules:
            self.keep_forward(m)
        dicts = hook_dicts(modules)
        for where in dicts:
            self.keep_size(where)
        own = [m.__dict__.get("forward", MISSING) for m in modules]
        for m, forward in zip(modules, own, strict=True):
            self.keep(m.__dict__, "forward", forward)
        return not any(map(len, dicts)) and all(f is MISSING for f in own)

    def keep_forward(self, module: object) -> None:
        self.add_forward(module, CLASS_FORWARD(module))

    def add_forward(self, module: object, forward: object) -> None:
        if new(self.seen, (id(module), type)):
            self.typed.append(module)
            self.forwards.append(forward)

    def extend(self, other: Watch) -> None:
        """Add another watch's links, sizes and tensors as it saw them."""
        self.blind |= other.blind
        for link in zip(other.wheres, other.keys, other.found, strict=True):
            self.add_link(*link)
        for where, size in zip(other.sized, other.sizes, strict=True):
            self.add_size(where, size)
        versions = dict(zip(map(id, other.counted), other.versions, strict=True))
        for t, address, strides in zip(other.tensors, other.addresses, other.strides, strict=True):
            self.add_tensor(t, versions.get(id(t)), address, strides)
        self.pinned += other.pinned  # the other's storages, as it saw them
        for module, forward in zip(other.typed, other.forwards, strict=True):
            self.add_forward(module, forward)


def watching(modules: Sequence[nn.Module], paths: Sequence[str]) -> Watch:
    """A watch of each dotted path from each module, as the modules are now."""
    seen = Watch()
    for module in modules:
        for path in paths:
            seen.follow(module, path)
    return seen


def plain(modules: list[nn.Module]) -> bool:
    """No forward hooks on these modules (nor global ones) and no forward of their own set on an instance: a one-call
    kernel that runs in their place would skip either."""
    return not any(map(len, hook_dicts(modules))) and all("forward" not in m.__dict__ for m in modules)


def hook_dicts(modules: list[nn.Module]) -> list[dict]:
    dicts = [getattr(m, name) for m in modules for name in HOOKS]
    return dicts + [module_globals._global_forward_hooks, module_globals._global_forward_pre_hooks]


def counter(t: Tensor) -> int | None:
    """The tensor's in-place version; None where it keeps none (an inference tensor, or a parameter made in inference
    mode and given new data outside it, which still refuses to report one)."""
    if t.is_inference():
        return None
    try:
        return t._version
    except RuntimeError:
        return None


def new(seen: set, key: tuple) -> bool:
    """Whether key was not in seen; it is now."""
    if key in seen:
        return False
    seen.add(key)
    return True


def holders(node: object) -> list[dict]:
    """Where an object keeps its names: a module its submodules, parameters, buffers, then plain attributes."""
    if isinstance(node, nn.Module):
        return [node._modules, node._parameters, node._buffers, node.__dict__]
    return [vars(node)]
