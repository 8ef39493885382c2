"""Radix-node tags: the pages an eviction frees carry their node's last use.

A load's device pages come, under SGLang's LIFO page allocator, from the
eviction that made room for it. Tagged at free time, those pages carry a
token at the stream tail (the forward in flight), and the load's fence is
no finer than SGLang's ``wait_stream``. The last forward that touched an
evicted node's pages is usually much older: this module keeps it.

Every forward that reads a node's pages runs for a request holding a lock
on that node or on a node below it (a request locks its matched prefix,
the root-to-node path of its lock's anchor, and drops it with
``UnifiedRadixCache.dec_lock_ref``), and every node a request writes is put
in the tree by ``insert`` after those forwards were enqueued. So:

* ``dec_lock_ref(node_id)``: a token at the forward stream's tail tags every
  node on the root-to-node path (``tree_core.collect_path_info``), after the
  lock is dropped;
* ``insert``: a token tags every node on the path to the insert's
  ``last_device_node`` (every node the insert created or refilled is on it);
* ``_evict_device_leaf`` / ``_demote`` (the device pages of one leaf freed,
  with a host copy kept or not): while they run, the leaf's tag is the tag
  of the first release by the cache's allocator if that release frees
  exactly the leaf's own pages (``full_value_len`` tokens); any other
  release gets a token at the tail, as without node tags.

A node's tag is never older than the last forward enqueued for it: each
lock's release and each insert tags the whole path with a token recorded
after it (and a fence stands for the token's launch token, which also
covers a batch built before the release and launched after it:
:mod:`~blockpool.integrations.sglang.hooks`). A node with no tag (created
by a split, or before the hooks were armed) is freed with a token at the
tail. Node handles are never re-minted (SGLang's Rust tree core says so;
the Python one counts them), so a tag never outlives its node's meaning.

Node tags are kept only where the radix cache's locks are the whole story:
a ``UnifiedRadixCache`` with the FULL component alone, no buffer-mode
pipeline (its pins bypass the cache's locks), no session radix cache, an
allocator the accounts shadow, and no free group open at the eviction.
Elsewhere every free is tagged at the tail (never weaker either way). A
path that cannot be read turns node tags off for that cache, for good.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from blockpool.integrations.sglang import hooks as _h

logger = logging.getLogger("blockpool.integrations.sglang")

__all__ = ["hook_dec_lock_ref", "hook_evict_leaf", "hook_insert", "node_tags_of"]

_UNSET = object()
_SWEEP = 2  # tags checked for deleted nodes per path tagged


class _Tags(dict[int, int]):
    """Node id → token of its last use, least recently written or checked
    first."""


def _plain(rt: _h.Runtime, cache: Any) -> bool:
    try:
        alloc = cache.token_to_kv_pool_allocator
        return (
            not cache.disable
            and [getattr(c, "name", None) for c in cache.tree_components] == ["FULL"]  # ComponentType.FULL
            and cache.buffer_pipeline is None
            and not cache.enable_session_radix_cache
            and (type(alloc) is rt._paged_cls or type(alloc) is rt._token_cls)
        )
    except Exception:  # noqa: BLE001  (a cache built without its __init__: no node tags)
        return False


def node_tags_of(rt: _h.Runtime, cache: Any) -> dict[int, int] | None:
    """The node tags of ``cache`` (node id → token), ``None`` where node tags
    are off for it (decided at its first hook call: see the module's
    docstring). O(1)."""
    tags = rt.node_tags.get(cache, _UNSET)
    if tags is _UNSET:
        tags = _Tags() if _plain(rt, cache) else None
        rt.node_tags[cache] = tags
    return tags  # type: ignore[return-value]


def _off(rt: _h.Runtime, cache: Any, why: str) -> None:
    rt.node_tags[cache] = None
    logger.warning(
        "blockpool: radix-node tags off for this cache (%s); frees are tagged at the stream tail", why
    )


def _tag_path(rt: _h.Runtime, cache: Any, tags: _Tags, node_id: Any) -> None:
    try:
        (path,) = cache.tree_core.collect_path_info([node_id])
        ids = [int(info.node_id) for info in path]
        if not ids:
            return  # the root: no pages
        token = rt.record()
    except Exception as exc:  # noqa: BLE001  (a path not tagged leaves older tags: stop trusting them)
        _off(rt, cache, f"the path of node {node_id!r} could not be tagged: {exc!r}")
        return
    for i in ids:
        tags.pop(i, None)
        tags[i] = token
    _sweep(rt, cache, tags, _SWEEP)


def _tag_unlock(rt: _h.Runtime, cache: Any, tags: _Tags, node_id: Any) -> None:
    # A lock released: its root-to-node path (a name of its own, so a test
    # can take the unlock's tagging away and see the oracle catch it).
    _tag_path(rt, cache, tags, node_id)


def _sweep(rt: _h.Runtime, cache: Any, tags: _Tags, n: int) -> None:
    # Check the n least recently written or checked tags: a node no longer
    # in the tree loses its tag, a live one goes to the back. O(n) per
    # call, so the table holds the live nodes plus the deleted ones not yet
    # reached, with no pause to sweep it whole.
    try:
        for _ in range(min(n, len(tags))):
            i = next(iter(tags))
            token = tags.pop(i)
            try:
                cache.tree_core.collect_path_info([i])
            except KeyError:
                continue
            tags[i] = token
    except Exception as exc:  # noqa: BLE001  (never out of the tree cache: node tags go off)
        _off(rt, cache, f"a sweep of deleted nodes failed: {exc!r}")


def hook_dec_lock_ref(
    original: Callable[..., Any], self: Any, node_id: Any, *args: Any, **kwargs: Any
) -> Any:
    """``UnifiedRadixCache.dec_lock_ref``: after the lock is dropped (or the
    call failed part way), tag the root-to-node path."""
    try:
        return original(self, node_id, *args, **kwargs)
    finally:
        rt = _h._armed()
        tags = None if rt is None else node_tags_of(rt, self)
        if tags is not None:
            _tag_unlock(rt, self, tags, node_id)  # type: ignore[arg-type]


def hook_insert(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """``UnifiedRadixCache.insert``: tag the path to the insert's
    ``last_device_node``. An insert that raises turns node tags off for the
    cache (the nodes it created are not known)."""
    rt = _h._armed()
    tags = None if rt is None else node_tags_of(rt, self)
    if tags is None:
        return original(self, *args, **kwargs)
    try:
        result = original(self, *args, **kwargs)
    except BaseException:
        _off(rt, self, "an insert raised")  # type: ignore[arg-type]
        raise
    node = getattr(result, "last_device_node", None)
    if node is not None:
        _tag_path(rt, self, tags, node)  # type: ignore[arg-type]
    return result


def hook_evict_leaf(original: Callable[..., Any], self: Any, node_id: Any, *args: Any, **kwargs: Any) -> Any:
    """``UnifiedRadixCache._evict_device_leaf`` and ``_demote``: the leaf's
    own pages are released tagged with its last use (see the module's
    docstring)."""
    rt = _h._armed()
    tags = None if rt is None else node_tags_of(rt, self)
    tag = None if tags is None else tags.get(node_id)
    alloc = self.token_to_kv_pool_allocator
    if tag is None or tag == _h.UNBOUND or rt.account_of(alloc) is None or alloc.free_group is not None:  # type: ignore[union-attr]
        return original(self, node_id, *args, **kwargs)
    try:
        (path,) = self.tree_core.collect_path_info([node_id])
        tokens = path[-1].full_value_len if path and int(path[-1].node_id) == int(node_id) else None
    except Exception as exc:  # noqa: BLE001  (never out of the tree cache: node tags go off)
        _off(rt, self, f"the path of node {node_id!r} could not be read: {exc!r}")  # type: ignore[arg-type]
        return original(self, node_id, *args, **kwargs)
    page = int(getattr(alloc, "page_size", 1))
    if not tokens or tokens % page:
        return original(self, node_id, *args, **kwargs)
    rt.free_ctx = (alloc, tag, tokens // page)  # type: ignore[union-attr]
    try:
        return original(self, node_id, *args, **kwargs)
    finally:
        rt.free_ctx = None  # type: ignore[union-attr]
