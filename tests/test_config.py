"""TreeConfig: one default per knob, method names round-trip, bad values refused."""

from __future__ import annotations

import pytest

from sglang_tree_spec.config import METHODS, TreeConfig


@pytest.mark.parametrize("method", METHODS)
def test_every_method_is_one_config(method):
    config = TreeConfig.for_method(method, budget=16)
    assert config.method == method
    assert config.drafts == (method != "ar")


def test_topk_defaults_to_the_budget_and_the_chain_reads_one():
    assert TreeConfig(budget=256).k == 256  # exact: the budget's most probable prefixes
    assert TreeConfig(budget=256, topk=8).k == 8
    assert TreeConfig(budget=16, chain=True).k == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"budget": -1}, "budget"),
        ({"budget": 2048}, "budget"),
        ({"topk": 0}, "topk"),
        ({"graft": "retrieval"}, "graft"),
        ({"chain": True, "graft": "unified"}, "chain"),
    ],
)
def test_bad_values_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TreeConfig(**kwargs)
