"""The record of one change the plugin makes to a library's behaviour (:mod:`.hooks`,
:mod:`.interpreter`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Hook:
    """One ``HookRegistry`` registration and the diff that makes it unnecessary upstream."""

    target: str  # dotted path in SGLang
    kind: str  # HookType member name: BEFORE / AFTER / AROUND / REPLACE
    make: Callable[[], Any]  # returns the hook callable or class (imported lazily)
    patch: str  # file name under patches/<library>-<release>/
    reason: str
