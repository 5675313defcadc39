"""The machinery of the vLLM patch registry: what a patch is, how one set is chosen and the one loop that
applies it. The table itself (which patches each platform and vLLM release needs) lives beside the
patches, in `rl.generation.vllm_patches.PATCH_SETS`.

A patch set is chosen by (platform, vLLM version), never by platform alone: a release nobody has read
against the patches (or refused after reading) stops the engine at start-up with a `PatchError` that
names what to do, instead of serving a model that computes something else. CPU patches are listed
only under "cpu", so they never load on a GPU (where the CUDA kernels they replace exist, and the
qk-norm fallback would refuse M3's sparse layers).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import sys
from typing import Callable, Mapping

log = logging.getLogger(__name__)

MARK = "_m3jax_patch"  # set on every replacement, so a second apply sees its own work


class PatchError(RuntimeError):
    """vLLM is not a version these patches were reviewed for, or a patched symbol changed."""


def _always() -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    reason: str
    module: str  # where the patched symbol lives
    attr: str  # "Class.method" or "function"
    params: tuple[str, ...]  # the replaced callable's parameter names, checked before patching
    make: Callable[[Callable], Callable]  # original -> replacement
    targets: str  # the vLLM release whose source the patch was checked against
    needed: Callable[[], bool] = _always  # False: the gap it fills is absent in this install

    def check_version(self) -> None:
        import vllm
        if vllm.__version__ != self.targets:
            raise PatchError(f"vLLM patch {self.name!r} was written for vllm {self.targets}, vllm "
                             f"{vllm.__version__} is installed: check it against the new source first")

    def installed(self) -> bool:
        return getattr(resolve(self)[2], MARK, None) == self.name

    def apply(self) -> bool:
        """Install the replacement; False when it is already installed."""
        self.check_version()
        owner, leaf, current = resolve(self)
        if getattr(current, MARK, None) == self.name:
            return False
        got = tuple(inspect.signature(current).parameters)
        if got != self.params:
            raise PatchError(f"vLLM patch {self.name!r}: {self.module}.{self.attr} now takes {got}, the patch "
                             f"was written for {self.params} (vllm {self.targets}); review the patch")
        new = self.make(current)
        setattr(new, MARK, self.name)
        setattr(owner, leaf, new)
        return True


class ImportPatch(Patch):
    """A patch that imports `module` once under `make()`'s set-up instead of replacing a symbol."""

    def installed(self) -> bool:
        return self.module in sys.modules

    def apply(self) -> bool:
        self.check_version()
        if self.module in sys.modules:
            return False
        self.make(None)
        return True


class ValuePatch(Patch):
    """A patch that sets a plain attribute (a class constant, not a callable) to `make(original)`; `params`
    is empty. Installed means the attribute holds that value already."""

    def installed(self) -> bool:
        current = resolve(self)[2]
        return current == self.make(current)

    def apply(self) -> bool:
        self.check_version()
        owner, leaf, current = resolve(self)
        value = self.make(current)
        if current == value:
            return False
        setattr(owner, leaf, value)
        return True


def resolve(p: Patch):
    """(owner, attribute name, current value) of the symbol `p` replaces."""
    try:
        obj = importlib.import_module(p.module)
    except ImportError as e:
        raise PatchError(f"vLLM patch {p.name!r}: cannot import {p.module} ({e}); written for vllm "
                         f"{p.targets}") from e
    owner, path = obj, p.attr.split(".")
    for part in path:
        owner, obj = obj, getattr(obj, part, None)
        if obj is None:
            raise PatchError(f"vLLM patch {p.name!r}: {p.module}.{p.attr} does not exist in this vLLM; "
                             f"written for vllm {p.targets}")
    return owner, path[-1], obj


@dataclasses.dataclass(frozen=True)
class Refused:
    """A table entry for a release that was read and must not serve M3 on that platform."""
    reason: str


PatchSets = Mapping[str, Mapping[str, "tuple[Patch, ...] | Refused"]]


def platform_name() -> str:
    """The running vLLM platform as the table names it: "cpu", "cuda", "rocm", or the class name."""
    from vllm.platforms import current_platform
    for name in ("cpu", "cuda", "rocm"):
        if getattr(current_platform, f"is_{name}")():
            return name
    return type(current_platform).__name__


def select(sets: PatchSets, platform: str, version: str) -> tuple[Patch, ...]:
    """The patches `version` of vLLM needs on `platform`; PatchError for a pair the table does not list."""
    releases = sets.get(platform)
    if releases is None:
        raise PatchError(f"no vLLM patch set for platform {platform!r} (the table lists {sorted(sets)}): "
                         "M3 has not been checked on it")
    entry = releases.get(version)
    reviewed = sorted(v for v, e in releases.items() if not isinstance(e, Refused))
    if entry is None:
        raise PatchError(f"vllm {version} on {platform}: no patch set was reviewed for this release (reviewed: "
                         f"{', '.join(reviewed)}); check the patches against its source and add it to PATCH_SETS")
    if isinstance(entry, Refused):
        raise PatchError(f"vllm {version} on {platform} is refused: {entry.reason} (reviewed: {', '.join(reviewed)})")
    stale = [p.name for p in entry if p.targets != version]
    if stale:  # a table edit that lists a patch under a release its source was not checked against
        raise PatchError(f"vllm {version} on {platform}: patches {stale} were written for another release")
    return entry


def apply(sets: PatchSets, platform: str | None = None, version: str | None = None) -> list[str]:
    """Apply every patch of the selected set that is needed and not applied yet (idempotent).

    platform / version: None = the running vLLM's. Returns the names this call applied.
    """
    if version is None:
        import vllm
        version = vllm.__version__
    platform = platform or platform_name()
    applied = [p.name for p in select(sets, platform, version) if p.needed() and p.apply()]
    if applied:
        log.info("vLLM %s patches applied for vllm %s: %s", platform, version, ", ".join(applied))
    return applied
