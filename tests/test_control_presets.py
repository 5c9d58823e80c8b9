"""The shipped auto values live in one table (``control.AUTO``), read by ``ControlConfig``."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from sglang_tree_spec.config import TreeConfig
from sglang_tree_spec.control import AUTO, PLAIN_FORWARDS, ControlConfig, LatencyModel
from sglang_tree_spec.step import make_controller

README = Path(__file__).resolve().parents[1] / "benchmarks" / "README.md"
NOT_TUNED = {"budgets", "fixed_budget", "max_depth", "calibration"}  # set by the caller


def test_every_auto_field_defaults_to_its_preset_and_none_is_off():
    fields = {f.name: f for f in dataclasses.fields(ControlConfig)}
    assert set(AUTO) == set(fields) - NOT_TUNED
    default = ControlConfig()
    for name, value in AUTO.items():
        assert getattr(default, name) == value, name
        if isinstance(value, (bool, int)):  # no shipped switch or count is off
            assert value, name


def test_the_auto_server_runs_the_presets():
    config = TreeConfig(budget=32, auto=True)
    latency = LatencyModel([[0.01] * len(config.budgets)], config.budgets, bs_buckets=(1,))
    auto = make_controller(config, 15, 8, "cpu", latency).config
    assert {name: getattr(auto, name) for name in AUTO} == dict(AUTO)
    pinned = make_controller(config, 15, 8, "cpu", latency, {"hold_steps": 2}).config
    assert pinned.hold_steps == 2 and pinned.choice_decay == AUTO["choice_decay"]


def test_the_benchmarks_table_has_a_row_per_preset():
    """Each preset's evidence is a row of benchmarks/README.md's "Tuned settings" with its
    value; so is the plain step's forward count."""
    text = README.read_text()
    table = text[text.index("## Tuned settings") :]
    rows = dict(re.findall(r"^\| `(\w+)`[^|]*\| ([^|]+) \|", table, flags=re.MULTILINE))
    for name, value in {**AUTO, "PLAIN_FORWARDS": PLAIN_FORWARDS}.items():
        shown = {str(value), f"{value:.2f}"} if isinstance(value, float) else {str(value)}
        if isinstance(value, bool):
            shown = {"on" if value else "off"}
        assert rows.get(name, "").strip() in shown, name
