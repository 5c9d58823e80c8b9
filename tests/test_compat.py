"""Release detection and the declared SGLang internals (``sglang_tree_spec.plugin.compat``),
against the real installed SGLang (0.5.17 in ``.venv``, 0.5.23 in ``.venv-0.5.23``).

An untested release is simulated by replacing the plugin's own ``installed_version`` (never
SGLang): the tables of the nearest tested release are then checked against the installed
SGLang's real modules, which is what happens on 0.5.18-0.5.22.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from sglang_tree_spec.plugin import compat
from sglang_tree_spec.plugin.hooks import HOOKS_BY_RELEASE
from sglang_tree_spec.plugin.worker import PIN_PARAM

INSTALLED = compat.check_release()
OTHER = next(release for release in compat.RELEASES if release != INSTALLED)
# A release whose table is OTHER's: between the two for 0.5.17's table, after both for 0.5.23's.
UNKNOWN_WITH_OTHER_TABLE = {"0.5.17": "0.5.20", "0.5.23": "0.6.0"}[OTHER]
UNKNOWN_WITH_OWN_TABLE = {"0.5.17": "0.5.20", "0.5.23": "0.6.0"}[INSTALLED]


@pytest.fixture
def pretend(monkeypatch):
    """Make the plugin see another SGLang version string (its own lookup, not SGLang's)."""

    def set_version(version: str) -> None:
        monkeypatch.setattr(compat, "installed_version", lambda: version)
        compat.check_release.cache_clear()

    yield set_version
    compat.check_release.cache_clear()


def test_the_installed_release_is_a_tested_one_with_its_own_tables():
    assert INSTALLED in compat.RELEASES
    assert set(HOOKS_BY_RELEASE) == set(compat.RELEASES) == set(compat.INTERNALS)
    assert compat.table_release(INSTALLED) == INSTALLED


def test_every_declared_sglang_name_exists_in_the_installed_release():
    """Hook targets, internals and moved names of the installed release all resolve."""
    targets = compat.declared_targets(INSTALLED)
    assert len(targets) > 30
    assert compat.missing_targets(targets) == []


def test_the_step_accounting_hooks_are_declared():
    """``plugin/accounting.py``'s targets are SGLang names like the others: declared, so the
    release check covers them."""
    from sglang_tree_spec.plugin.accounting import TARGETS

    declared = set(compat.declared_targets(compat.release()))
    assert set(TARGETS) <= declared, set(TARGETS) - declared


def test_the_other_release_tables_do_not_fit_the_installed_one():
    """The per-release tables differ where SGLang did: the other release misses something."""
    missing = compat.missing_targets(compat.declared_targets(OTHER))
    assert missing, OTHER
    expected = {
        "0.5.17": "sglang.srt.speculative.draft_worker_common."
        "_resolve_draft_attention_backend_fallback",
        "0.5.23": "sglang.srt.speculative.draft_worker_common."
        "resolve_draft_worker_attention_backend",
    }[OTHER]
    assert expected in missing


@pytest.mark.parametrize(
    ("version", "table"),
    [
        ("0.5.17", "0.5.17"),
        ("0.5.18", "0.5.17"),
        ("0.5.20", "0.5.17"),
        ("0.5.22.post1", "0.5.17"),
        ("0.5.23", "0.5.23"),
        ("0.5.24", "0.5.23"),
        ("0.6.0rc1", "0.5.23"),
        ("0.5.16", None),
    ],
)
def test_table_release_is_the_newest_tested_release_not_newer(version, table):
    assert compat.table_release(version) == table


def test_an_untested_release_missing_a_target_is_refused_in_one_line(pretend):
    pretend(UNKNOWN_WITH_OTHER_TABLE)
    with pytest.raises(compat.UnsupportedSGLang) as error:
        compat.check_release()
    message = str(error.value)
    assert message.startswith(
        f"DDTREE: SGLang {UNKNOWN_WITH_OTHER_TABLE} is not supported by sglang-tree-spec "
        "(tested: 0.5.17, 0.5.23): sglang."
    )
    assert f"which the plugin's SGLang {OTHER} support needs, is missing" in message
    assert "\n" not in message


def test_an_untested_release_with_every_target_runs_with_a_warning(pretend, caplog):
    pretend(UNKNOWN_WITH_OWN_TABLE)
    assert compat.check_release() == INSTALLED
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"SGLang {UNKNOWN_WITH_OWN_TABLE} is untested" in w for w in warnings), warnings


def test_a_release_older_than_every_tested_one_is_refused(pretend):
    pretend("0.5.14")
    with pytest.raises(compat.UnsupportedSGLang, match=r"^DDTREE: SGLang 0.5.14 is older than"):
        compat.check_release()


def test_moved_names_come_from_the_installed_release():
    import pkgutil

    for name, paths in compat.MOVED.items():
        assert compat.moved(name) is pkgutil.resolve_name(paths[INSTALLED])
    assert callable(compat.moved("verify_tree_greedy_func"))


def test_launch_server_on_an_unsupported_release_exits_with_the_one_line_error(tmp_path):
    """A real ``sglang.launch_server`` in a child process that sees an untested release missing
    a target: no hooks are registered and ``--speculative-algorithm DDTREE`` fails at start-up
    with the plugin's one line."""
    from transformers import Qwen3Config

    Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        architectures=["Qwen3ForCausalLM"],
    ).save_pretrained(tmp_path)
    script = textwrap.dedent(
        f"""
        import runpy, sys
        from sglang_tree_spec.plugin import compat
        compat.installed_version = lambda: {UNKNOWN_WITH_OTHER_TABLE!r}
        sys.argv = ["sglang.launch_server", "--model-path", {str(tmp_path)!r},
                    "--device", "cpu", "--attention-backend", "torch_native",
                    "--speculative-algorithm", "DDTREE",
                    "--speculative-draft-model-path", {str(tmp_path)!r}]
        runpy.run_module("sglang.launch_server", run_name="__main__")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode != 0
    expected = f"DDTREE: SGLang {UNKNOWN_WITH_OTHER_TABLE} is not supported by sglang-tree-spec"
    lines = [line for line in result.stderr.splitlines() if expected in line]
    assert lines, result.stderr[-4000:]
    assert "Failed to execute general plugin" not in result.stderr  # no traceback from us


def test_a_worker_missing_a_private_member_is_refused_in_one_line():
    from types import SimpleNamespace

    from sglang_tree_spec.plugin.compat import (
        WORKER_ATTRIBUTES,
        UnsupportedSGLang,
        check_worker_attributes,
    )

    complete = SimpleNamespace(**dict.fromkeys(WORKER_ATTRIBUTES))
    check_worker_attributes(complete)
    del complete._mask_token_id
    with pytest.raises(UnsupportedSGLang, match=r"^DDTREE: SGLang .* no _mask_token_id, which"):
        check_worker_attributes(complete)


def test_a_real_req_has_the_attributes_the_worker_reads():
    """The scheduler's ``Req`` of the installed release carries every declared attribute, and
    its prefix-cache key (``extra_key``, and ``cache_salt`` where SGLang keeps it apart) is the
    isolation key of ``--speculative-ddtree-table per-key``; an empty key is no key."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    salted = {"cache_salt": "tenant-b"} if "cache_salt" in compat.ISOLATION_KEY[INSTALLED] else {}
    req = Req("rid-1", "", [1, 2, 3], SamplingParams(), extra_key="tenant-a", **salted)
    for name in (*compat.REQ_ATTRIBUTES, *compat.ISOLATION_KEY[INSTALLED]):
        assert hasattr(req, name), name
    for name in compat.SAMPLING_PARAMS_ATTRIBUTES:
        assert hasattr(req.sampling_params, name), name  # the budget pin
    pinned = SamplingParams(custom_params={PIN_PARAM: 8})  # what a pinned request sends
    assert pinned.custom_params == {PIN_PARAM: 8}
    assert compat.isolation_key(req) == ("tenant-a", *salted.values())
    assert compat.req_rows([req]) == [None]  # the release's row attribute, not yet assigned
    plain = Req("rid-2", "", [1, 2, 3], SamplingParams(), extra_key="")
    assert compat.isolation_key(plain) == (None,) * len(compat.ISOLATION_KEY[INSTALLED])
    assert compat.isolation_key(plain) != compat.isolation_key(req)
