"""Annotations of the pool's public parameters that the pool checks itself.

Type checkers see the real types (``ArgInt`` is ``int``, ``ArgToken`` is
:class:`~blockpool.core.hazards.Token`, ...). The compiled build's own type
check sees ``Any``: ``setup.py`` passes ``--platform=mypyc`` to mypyc, and
mypy reads the branch below for that platform alone. Only for type
checking: the modules import these names under ``TYPE_CHECKING``. mypyc then does not
check these arguments' types when the call begins (it would raise its own
``TypeError``), so the pool's checks raise the package's typed errors, in
both builds alike (``docs/performance.md``, "The compiled core").
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: nothing here runs
    if sys.platform == "mypyc":  # the compiled build's type check only
        ArgInt = Any
        ArgStr = Any
        ArgBool = Any
        ArgFloat = Any
        ArgAccess = Any
        ArgStreamKind = Any
        ArgToken = Any
        ArgBlock = Any
    else:
        from blockpool.core.block import KVCacheBlock
        from blockpool.core.hazards import AccessKind, StreamKind, Token

        ArgInt = int
        ArgStr = str
        ArgBool = bool
        ArgFloat = float
        ArgAccess = AccessKind
        ArgStreamKind = StreamKind
        ArgToken = Token
        ArgBlock = KVCacheBlock

__all__ = ["ArgAccess", "ArgBlock", "ArgBool", "ArgFloat", "ArgInt", "ArgStr", "ArgStreamKind", "ArgToken"]
