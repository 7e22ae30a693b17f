"""A plan's watch (heads/watch.py): it holds until a link it followed or a tensor it reached changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from draftsmith.heads.watch import Watch


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


@pytest.mark.parametrize(
    "change",
    [swap_data, edit_in_place, replace_parameter, replace_module, change_attribute, add_the_missing_name, move_storage],
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
    assert seen.keys == ["0", "weight", "bias", "1", "weight", "eps", "extra"]  # "0", "1" once; "extra" as missing


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
