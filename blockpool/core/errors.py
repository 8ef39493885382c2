"""The exception hierarchy of :mod:`blockpool`.

Every error the package raises on bad input derives from
:class:`BlockPoolError` and from the matching builtin, so callers can catch
either ``blockpool.BlockPoolError`` or e.g. ``ValueError``. A call that raises
one of these leaves the pool exactly as it was before the call, except that
pending completions (``complete``/``fail`` from other threads) are applied at
the start of every call, as documented in ``docs/threading.md``.
"""

from __future__ import annotations

from blockpool.core._mypyc import mypyc_attr

__all__ = [
    "BlockNotAllocatedError",
    "BlockPoolError",
    "ClusterUnavailableError",
    "FenceFailedError",
    "ForeignBlockError",
    "ForeignTokenError",
    "HashConflictError",
    "InvalidArgumentError",
    "InvalidContentError",
    "InvalidTokenError",
    "InvariantError",
    "LeaseExpiredWarning",
    "MissingDependencyError",
    "NoFreeBlocksError",
    "NullBlockError",
    "RefCountError",
    "SharedBlockError",
    "StaleBlockError",
    "UnknownStreamError",
    "UnknownTokenError",
    "UnsafeTransferError",
]


@mypyc_attr(native_class=False)
class BlockPoolError(Exception):
    """Root of every error raised by :mod:`blockpool`."""


@mypyc_attr(native_class=False)
class InvalidArgumentError(BlockPoolError, ValueError):
    """An argument has the wrong type, sign or shape (e.g. a negative count)."""


@mypyc_attr(native_class=False)
class NoFreeBlocksError(BlockPoolError, ValueError):
    """More blocks were asked for than are allocatable.

    Subclasses ``ValueError`` because vLLM's ``BlockPool.get_new_blocks``
    raises ``ValueError`` in the same situation.
    """


@mypyc_attr(native_class=False)
class ForeignBlockError(BlockPoolError, ValueError):
    """A block record that does not belong to this pool was passed in."""


@mypyc_attr(native_class=False)
class NullBlockError(BlockPoolError, ValueError):
    """The null block was used where a data block is required (a copy)."""


@mypyc_attr(native_class=False)
class RefCountError(BlockPoolError, ValueError):
    """A free would take a ref count below zero (e.g. a block repeated in one
    ``free_blocks`` call more times than it is referenced)."""


@mypyc_attr(native_class=False)
class BlockNotAllocatedError(BlockPoolError, ValueError):
    """A transfer or copy named a block that nobody holds (ref count 0)."""


@mypyc_attr(native_class=False)
class StaleBlockError(BlockPoolError, ValueError):
    """A block table taken earlier names a block that was freed and
    allocated again since: the block now holds another request's data. Raised
    by the transfer and publishing calls given the table's ``generations``
    (see :meth:`HazardAwareBlockPool.generations`); nothing changes.

    Attributes:
        block_id: The first stale block of the table.
        generation: The block's generation now.
        table_generation: The generation the table recorded for it.
    """

    def __init__(
        self, message: str, block_id: int = -1, generation: int = 0, table_generation: int = 0
    ) -> None:
        super().__init__(message)
        self.block_id = block_id
        self.generation = generation
        self.table_generation = table_generation

    def __reduce__(self) -> tuple[object, ...]:
        """Pickle with the attributes (an exception pickles its ``args``
        only). O(1)."""
        return (type(self), (self.args[0], self.block_id, self.generation, self.table_generation))


@mypyc_attr(native_class=False)
class UnsafeTransferError(BlockPoolError, ValueError):
    """A transfer the pool refuses because no fence could make it safe (its
    subclasses say why). Raised before anything changes; a connector
    reports the transfer failed (or leaves it to its own path) instead of
    starting it.

    Attributes:
        block_id: The first block of the call that is refused.
    """

    def __init__(self, message: str, block_id: int = -1) -> None:
        super().__init__(message)
        self.block_id = block_id

    def __reduce__(self) -> tuple[object, ...]:
        """Pickle with the attributes. O(1)."""
        return (type(self), (self.args[0], self.block_id))


@mypyc_attr(native_class=False)
class SharedBlockError(UnsafeTransferError):
    """A write that would replace the content of a cached block (it holds a
    key) that more than one holder holds (ref count above 1): a load into
    a prefix-hit block a running request uses, a copy into such a
    destination. That holder's
    reads are recorded only when it frees the block, so no fence can order
    the write before its next read (LMCache #2206: a chunk-aligned load
    rewrote prefix-hit blocks a running request was reading).

    Attributes:
        block_id: The first shared block.
        ref_cnt: Its ref count.
    """

    def __init__(self, message: str, block_id: int = -1, ref_cnt: int = 0) -> None:
        super().__init__(message, block_id)
        self.ref_cnt = ref_cnt

    def __reduce__(self) -> tuple[object, ...]:
        """Pickle with the attributes. O(1)."""
        return (type(self), (self.args[0], self.block_id, self.ref_cnt))


@mypyc_attr(native_class=False)
class InvalidContentError(UnsafeTransferError):
    """A store (or a copy) would read a block whose content is known bad: a
    load or copy into it failed and nothing has written it since. It would
    file garbage under valid keys in the other tier (vLLM PR #35092: the
    offloader stored blocks whose NIXL load had failed).

    Attributes:
        block_id: The first block whose content is bad.
    """


@mypyc_attr(native_class=False)
class UnknownStreamError(BlockPoolError, LookupError):
    """A stream name that was never registered with the pool."""


@mypyc_attr(native_class=False)
class UnknownTokenError(BlockPoolError, LookupError):
    """A token the pool never issued (its ``seq`` is beyond the stream's counter)."""


@mypyc_attr(native_class=False)
class ForeignTokenError(BlockPoolError, ValueError):
    """A token issued by another pool (its ``Token.pool`` names another
    pool): completing, failing or tagging with it would act on this pool's
    unrelated token of the same ``(stream, seq)``."""


@mypyc_attr(native_class=False)
class InvalidTokenError(InvalidArgumentError, TypeError):
    """A :class:`~blockpool.core.hazards.Token` built from bad fields (an
    empty or non-str stream, a ``seq`` that is not an int ``>= 1``, a bad
    ``pool``) or decoded from malformed wire data. Both a ``ValueError``
    and a ``TypeError``, the builtins these checks raised before it."""


@mypyc_attr(native_class=False)
class HashConflictError(BlockPoolError, ValueError):
    """A block already cached under a full-block key was claimed by another
    key for the same (or a shorter) prefix: the two keys name different
    content, which vLLM's key model forbids (vLLM asserts)."""


@mypyc_attr(native_class=False)
class FenceFailedError(BlockPoolError, RuntimeError):
    """A fence the caller waited on names tokens that *failed* (their
    transfer ended without doing its job). Raised by the worker ledger's
    ``wait_host`` / ``wait_device`` after the wait, before anything was
    enqueued: the consumer must not run (the data it would read never
    arrived, and a failed token may have failed before its own waits, so
    nothing orders the consumer after them); it reports its own token
    failed instead. See ``docs/hazard-model.md``, "Failure and coverage".

    Attributes:
        tokens: The failed tokens of the fence, in fence order.
        waited: The tokens actually waited on before raising.
    """

    def __init__(
        self, message: str, tokens: tuple[object, ...] = (), waited: tuple[object, ...] = ()
    ) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.waited = waited


@mypyc_attr(native_class=False)
class MissingDependencyError(BlockPoolError, ImportError):
    """An optional feature was asked for whose package is not installed
    (e.g. ``blockpool sweep --ray`` without Ray). Raised when the feature is
    used, never at ``import blockpool``.

    Attributes:
        package: The missing distribution (e.g. ``"ray"``).
        extra: The ``blockpool`` extra that installs it (e.g. ``"ray"``:
            ``pip install 'blockpool[ray]'``).
    """

    def __init__(self, message: str, package: str = "", extra: str = "") -> None:
        super().__init__(message, name=package or None)
        self.package = package
        self.extra = extra

    def __reduce__(self) -> tuple[object, ...]:
        """Pickle with the attributes. O(1)."""
        return (type(self), (self.msg, self.package, self.extra))


@mypyc_attr(native_class=False)
class ClusterUnavailableError(BlockPoolError, ConnectionError):
    """A compute cluster (e.g. the Ray cluster of ``blockpool sweep --ray
    ADDRESS``) could not be joined or started. ``__cause__`` holds the
    cluster client's own error.

    Attributes:
        address: The address that was asked for.
    """

    def __init__(self, message: str, address: str = "") -> None:
        super().__init__(message)
        self.address = address

    def __reduce__(self) -> tuple[object, ...]:
        """Pickle with the attributes. O(1)."""
        return (type(self), (self.args[0], self.address))


@mypyc_attr(native_class=False)
class InvariantError(BlockPoolError, AssertionError):
    """Raised by :meth:`HazardAwareBlockPool.check` when an internal invariant
    does not hold. This is always a bug in the pool (or in code that mutated
    block records directly)."""


@mypyc_attr(native_class=False)
class LeaseExpiredWarning(UserWarning):
    """Held blocks whose host-engine transfer outlived its lease.

    The blocks stay quarantined until :meth:`HazardAwareBlockPool.abandon`
    says the engine stopped; a warning is a report, never a release.
    """
