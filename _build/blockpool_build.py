"""The PEP 517 build backend of blockpool: setuptools', plus one switch.

``BLOCKPOOL_MYPYC=1 pip wheel .`` builds the compiled core: mypy (mypyc) is
added to the build requirements and ``setup.py`` compiles every module of
``blockpool/core`` to a C extension. Unset (or ``0``), the wheel is pure
Python, as is every editable install whatever the switch says (a compiled
module in a source tree would shadow the ``.py`` beside it).
"""

from __future__ import annotations

import os
import sys

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *

SWITCH = "BLOCKPOOL_MYPYC"
# mypyc (part of mypy) at the version the compiled build is tested with, and
# what mypy must import to type-check the core before compiling it.
MYPYC_REQUIRES = ["mypy>=2.4,<3", "attrs>=23.1", "sortedcontainers>=2.4"]


_ASKING = "_BLOCKPOOL_BUILD_ASKING_REQUIRES"


def compiled_requested() -> bool:
    """Whether the switch asks for the compiled core (``1``, ``true``, ``yes``)."""
    return os.environ.get(SWITCH, "").strip().lower() in ("1", "true", "yes")


def compiling() -> bool:
    """Whether setup.py should compile now: asked for, and not while the
    backend only collects the build requirements."""
    return compiled_requested() and not os.environ.get(_ASKING)


def get_requires_for_build_wheel(config_settings=None):  # type: ignore[no-untyped-def]
    # setuptools runs setup.py to answer: mypyc is not installed yet then.
    os.environ[_ASKING] = "1"
    try:
        reqs = list(_setuptools.get_requires_for_build_wheel(config_settings))
    finally:
        del os.environ[_ASKING]
    return reqs + MYPYC_REQUIRES if compiled_requested() else reqs


def _pure(hook):  # type: ignore[no-untyped-def]
    """``hook`` with the switch off: editable installs and sdists are pure
    (an sdist carries the sources; the switch is read when a wheel is built)."""

    def run(*args, **kwargs):  # type: ignore[no-untyped-def]
        if compiled_requested() and hook.__name__.startswith("build_editable"):
            print(f"blockpool: {SWITCH} is ignored by editable installs (pure-Python core)", file=sys.stderr)
        saved = os.environ.get(SWITCH)
        os.environ[SWITCH] = "0"
        try:
            return hook(*args, **kwargs)
        finally:
            if saved is None:
                del os.environ[SWITCH]
            else:
                os.environ[SWITCH] = saved

    run.__name__ = hook.__name__
    return run


build_editable = _pure(_setuptools.build_editable)
get_requires_for_build_editable = _pure(_setuptools.get_requires_for_build_editable)
prepare_metadata_for_build_editable = _pure(_setuptools.prepare_metadata_for_build_editable)
build_sdist = _pure(_setuptools.build_sdist)
get_requires_for_build_sdist = _pure(_setuptools.get_requires_for_build_sdist)
