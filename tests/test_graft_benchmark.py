"""benchmarks/graft_acceptance.py on the committed small pair, tiny: every method, exactness,
the chain baseline and the JSON / plot it writes."""

from __future__ import annotations

import json

import pytest
from benchmark_helpers import load_benchmark


@pytest.fixture(scope="module")
def graft_benchmark():
    return load_benchmark("graft_acceptance")


def test_small_pair_run_compares_every_method_with_the_chain(graft_benchmark, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "graft.json"
    argv = ["--prompts", "3", "--new-tokens", "8", "--budgets", "8", "--train-prompts", "2"]
    argv += ["--batch-size", "2", "--domains", "copy-edit", "--out", str(out)]
    record = graft_benchmark.main(argv)  # raises if any method's greedy output differs

    assert json.loads(out.read_text()) == record
    assert out.with_suffix(".png").stat().st_size > 0
    from common import portable  # benchmarks/ is importable once a benchmark is loaded

    assert record["command"] == portable("python benchmarks/graft_acceptance.py " + " ".join(argv))
    assert record["pair"] == "committed small pair" and not record["stops_at_eos"]
    assert record["complete"]
    [row] = record["results"]
    assert row["unified_warm_up_batch_steps"] > 0  # unified starts from a training warm-up
    cell = row["domains"]["copy-edit"]
    assert set(cell) == {*graft_benchmark.METHODS, "tau_ratio_95ci"}
    for method in graft_benchmark.METHODS:
        result = cell[method]
        assert len(result["per_prompt_steps"]) == 3
        assert result["tokens"] == 3 * 8  # no stop token for the small pair
        assert result["tau"] == pytest.approx(
            sum(result["per_prompt_committed"]) / sum(result["per_prompt_steps"]), abs=1e-4
        )
        assert result["tok_s"] > 0
    assert cell["chain"]["speedup_vs_chain"] == 1.0
    for low, high in cell["tau_ratio_95ci"].values():
        assert 0 < low <= high


def test_chat_domains_need_a_chat_target(graft_benchmark):
    with pytest.raises(SystemExit):
        graft_benchmark.main(["--domains", "chat-2turn", "--prompts", "1"])


def test_resume_measures_only_the_cells_an_interrupted_run_left(graft_benchmark, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "graft.json"
    common = ["--prompts", "2", "--new-tokens", "6", "--train-prompts", "2", "--batch-size", "2"]
    common += ["--out", str(out)]
    first = graft_benchmark.main([*common, "--budgets", "8", "--domains", "copy-edit"])
    first_cell = first["results"][0]["domains"]["copy-edit"]

    argv = [*common, "--budgets", "8", "--domains", "copy-edit", "code", "--resume"]
    record = graft_benchmark.main(argv)
    [row] = record["results"]
    assert row["domains"]["copy-edit"] == first_cell  # kept, wall times and all
    assert set(row["domains"]) == {"copy-edit", "code"}
    assert row["domains"]["code"]["chain"]["tokens"] == 2 * 6
    assert set(record["domains"]) == {"copy-edit", "code"}
    assert record["command"] == first["command"] and record["complete"]
    from common import portable

    assert record["resumed_by"] == [
        portable("python benchmarks/graft_acceptance.py " + " ".join(argv))
    ]

    other = [*common, "--new-tokens", "7", "--budgets", "8", "--domains", "code", "--resume"]
    with pytest.raises(ValueError, match=r"other new_tokens$"):
        graft_benchmark.main(other)  # argparse: the later --new-tokens wins
