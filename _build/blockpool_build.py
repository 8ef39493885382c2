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


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):  # type: ignore[no-untyped-def]
    if compiled_requested():
        print(f"blockpool: {SWITCH} is ignored by editable installs (pure-Python core)", file=sys.stderr)
    os.environ[SWITCH] = "0"
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
