"""Only the compiled core's extension modules; everything else is in
pyproject.toml. ``BLOCKPOOL_MYPYC=1`` (read here and by the build backend,
``_build/blockpool_build.py``) compiles every module of ``blockpool/core``
with mypyc; without a C compiler (or Python's headers) the build warns in
one line and stays pure Python.
"""

from __future__ import annotations

import glob
import os
import sys
import sysconfig

from setuptools import setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build"))
from blockpool_build import compiling


def _no_compiler() -> str | None:
    """Why a C extension cannot be built here, or None if it can."""
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.errors import CompileError, DistutilsPlatformError
    from setuptools._distutils.sysconfig import customize_compiler

    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        return "Python.h not found"
    import tempfile

    try:
        cc = new_compiler()
        customize_compiler(cc)
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "probe.c")
            with open(src, "w") as f:
                f.write("#include <Python.h>\nint main(void) { return 0; }\n")
            cc.compile([src], output_dir=tmp, include_dirs=[sysconfig.get_paths()["include"]])
    except (CompileError, DistutilsPlatformError, OSError) as e:
        return f"no working C compiler ({type(e).__name__})"
    return None


def _ext_modules() -> list:
    if not compiling():
        return []
    why = _no_compiler()
    if why is not None:
        print(f"blockpool: BLOCKPOOL_MYPYC=1 but {why}: building the pure-Python core", file=sys.stderr)
        return []
    from mypyc.build import mypycify

    here = os.path.dirname(os.path.abspath(__file__))
    paths = sorted(
        os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "blockpool", "core", "*.py"))
    )
    # --platform=mypyc: the compiled build's view of blockpool/core/_args.py
    return mypycify(["--platform=mypyc", *paths], opt_level="3", group_name="blockpool_core")


setup(ext_modules=_ext_modules())
