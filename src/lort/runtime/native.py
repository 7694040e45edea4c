"""lort's C++ part: the frozen-weight check (weight_check.cpp), built against the torch
it runs with, and loaded where it was built; Python does the same check where not.

``python -m lort.runtime.build_native`` builds it (about a minute: a C++ compiler, ninja
and torch's headers, which torch's wheel holds; ``make install`` runs it). It is kept under
``$LORT_NATIVE_DIR``, by default ``$XDG_CACHE_HOME/lort/native`` (``~/.cache/...``), in
a folder named by a hash of the source, the torch build and the Python ABI: another torch
needs its own build. ``LORT_NATIVE=0`` turns it off. Nothing is compiled on import."""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("lort")

ENV_NATIVE = "LORT_NATIVE"
ENV_NATIVE_DIR = "LORT_NATIVE_DIR"
NAME = "lort_weight_check"
SOURCE = Path(__file__).with_name("weight_check.cpp")
#: The module's ABI attribute this Python side expects.
ABI = 4

_loaded: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    return os.environ.get(ENV_NATIVE, "").strip().lower() not in ("0", "false", "no", "off")


def build_dir() -> Path:
    """Where the build for this source, torch build and Python lives."""
    root = os.environ.get(ENV_NATIVE_DIR)
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "lort", "native")
    return Path(root) / _key()


@functools.lru_cache(maxsize=1)
def _key() -> str:
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), str(torch.version.git_version).encode(),
                 str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(), sys.implementation.cache_tag.encode(),
                 platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return key.hexdigest()[:20]


def _library(folder: Path) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES + [".so", ".pyd"]:
        path = folder / f"{NAME}{suffix}"
        if path.is_file():
            return path
    return None


def load() -> ModuleType | None:
    """The built module, or None (not built, turned off, or failing to load: the reason
    is logged once, at INFO)."""
    if not enabled():
        return None
    folder = build_dir()
    key = str(folder)
    if key not in _loaded:
        _loaded[key] = _import(folder)
    return _loaded[key]


def _import(folder: Path) -> ModuleType | None:
    path = _library(folder)
    if path is None:
        logger.info("lort: the C++ frozen-weight check is not built for this torch (python -m lort.runtime.build_native "
                    "builds it); frozen weights are checked in Python, which is slower")
        return None
    try:
        spec = importlib.util.spec_from_file_location(NAME, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - a broken build: the Python check serves
        logger.info("lort: the C++ frozen-weight check at %s does not load (%s); frozen weights are checked in Python",
                    path, e)
        return None
    if getattr(module, "ABI", None) != ABI:
        logger.info("lort: the C++ frozen-weight check at %s is of another version; frozen weights are checked in "
                    "Python", path)
        return None
    return module


def build(verbose: bool = False) -> Path:
    """Compile the module into ``build_dir()`` (where it is not there yet) and load it;
    returns the library's path. Raises where it cannot (no compiler, say)."""
    from torch.utils import cpp_extension

    folder = build_dir()
    if _library(folder) is None:
        folder.mkdir(parents=True, exist_ok=True)
        # ninja from the environment's own bin (pip's ninja package) where PATH lacks it.
        path = os.environ.get("PATH", "")
        os.environ["PATH"] = os.pathsep.join([path, os.path.dirname(sys.executable)])
        try:
            cpp_extension.load(NAME, sources=[str(SOURCE)], extra_cflags=["-O2"], build_directory=str(folder),
                               verbose=verbose)
        finally:
            os.environ["PATH"] = path
    _loaded.pop(str(folder), None)
    if load() is None:
        raise RuntimeError(f"lort: the C++ frozen-weight check was built in {folder} but does not load")
    return _library(folder)
