"""A plan's watch (cpu_kernels/watch.py): it holds until a link it followed or a tensor it reached changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from draftsmith.cpu_kernels.watch import Watch


def watched() -> tuple[nn.Module, Watch]:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    seen = Watch()
    for path in ("0.weight", "0.bias", "1.weight", "1.eps", "1.extra"):
        seen.follow(model, path)
    return model, seen


def swap_data(m: nn.Module) -> None:
    m[0].weight.data = torch.zeros(4, 4)


def edit_in_place(m: nn.Module) -> None:
    with torch.no_grad():
        m[0].bias.add_(1)


def replace_parameter(m: nn.Module) -> None:
    m[1].weight = nn.Parameter(torch.ones(4))


def replace_module(m: nn.Module) -> None:
    m[0] = nn.Linear(4, 4)


def change_attribute(m: nn.Module) -> None:
    m[1].eps = 0.5


def add_the_missing_name(m: nn.Module) -> None:
    m[1].extra = nn.Identity()


def move_storage(m: nn.Module) -> None:
    m.to(torch.float64)


def swap_in_a_transposed_view(m: nn.Module) -> None:
    m[0].weight.data = m[0].weight.data.t()  # the same address and version


def register_what_was_a_plain_none(m: nn.Module) -> None:
    m[1].__dict__["extra"] = None  # as PackedLinear keeps a missing bias
    m[1].extra = nn.Parameter(torch.ones(4))


@pytest.mark.parametrize(
    "change",
    [
        swap_data,
        edit_in_place,
        replace_parameter,
        replace_module,
        change_attribute,
        add_the_missing_name,
        move_storage,
        swap_in_a_transposed_view,
    ],
)
def test_a_change_breaks_the_watch(change):
    model, seen = watched()
    assert seen.holds()
    change(model)
    assert not seen.holds()


def test_reading_and_running_keep_it():
    model, seen = watched()
    with torch.no_grad():
        model(torch.randn(2, 4))
    assert model[1].eps == 1e-5 and seen.holds()
    # "0" and "1" once each; "extra", missing, wherever a module could keep it
    assert seen.keys == ["0", "weight", "bias", "1", "weight", "eps", *["extra"] * 4]


def test_a_merged_watch_keeps_what_each_saw():
    model, first = watched()
    edit_in_place(model)  # after the first watch, before the second
    second = Watch()
    second.follow(model, "0.bias")
    merged = Watch()
    merged.extend(second)
    assert merged.holds()
    merged.extend(first)  # the bias was already kept, at its new version; the first watch's other links are added
    assert merged.holds() and len(merged.wheres) == len(first.wheres)
    swap_data(model)
    assert not merged.holds()


def test_inference_tensors_are_watched_by_identity_and_address():
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(4, 4))
    seen = Watch()
    seen.follow(model, "0.weight")
    assert seen.holds() and not seen.counted
    with torch.inference_mode():
        model[0].weight.data = torch.zeros(4, 4)
    assert not seen.holds()


def test_a_none_replaced_by_a_parameter_breaks_it():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model[1].__dict__["extra"] = None
    seen = Watch()
    seen.follow(model, "1.extra")
    assert seen.holds()
    model[1].extra = nn.Parameter(torch.ones(4))  # moves from the plain attributes to the parameters
    assert not seen.holds()


def test_a_parametrized_weight_is_never_trusted():
    model = nn.Sequential(nn.Linear(4, 4))
    torch.nn.utils.parametrize.register_parametrization(model[0], "weight", nn.Identity())
    seen = Watch()
    assert isinstance(seen.follow(model, "0.weight"), torch.Tensor)
    assert not seen.holds()


def test_hooks_and_an_own_forward_break_a_plain_watch():
    model = nn.Sequential(nn.Linear(4, 4))
    seen = Watch()
    assert seen.keep_plain([model[0]]) and seen.holds()
    handle = model[0].register_forward_pre_hook(lambda module, args: None)
    assert not seen.holds() and not Watch().keep_plain([model[0]])
    handle.remove()
    assert seen.holds()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    assert not seen.holds()
    handle.remove()
    model[0].forward = lambda x: x
    assert not seen.holds() and not Watch().keep_plain([model[0]])


def test_new_data_cannot_take_the_old_address():
    """model.bfloat16().float() frees each weight and would often get the same address back, with the same version
    and strides: the watch holds the old storage, so the new data lands elsewhere."""
    models = [nn.Linear(64 + i, 32) for i in range(10)]
    watches = []
    for model in models:
        seen = Watch()
        seen.follow(model, "weight")
        watches.append(seen)
    for model in models:
        model.bfloat16().float()
    assert not any(seen.holds() for seen in watches)


def test_a_parameter_made_in_inference_mode_and_given_new_data_is_watched():
    with torch.inference_mode():
        model = nn.Linear(4, 4)
    model.weight.data = torch.randn(4, 4)  # not an inference tensor now, yet it reports no version
    seen = Watch()
    seen.follow(model, "weight")
    assert seen.holds() and not seen.counted
