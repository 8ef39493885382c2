"""Radix-node tags on SGLang's real ``UnifiedRadixCache``, on the CPU.

SGLang 0.5.23's ``UnifiedRadixCache`` (its Rust and its Python tree core)
over the real ``PagedTokenToKVPoolAllocator`` (4-token pages) and
``TokenToKVPoolAllocator`` on ``device="cpu"``, with the plugin registered
and SGLang's ``HookRegistry`` hooks applied. A driver plays a serving loop
at random: requests match a prefix, lock it, run forwards that read the
matched pages and write new ones, insert their sequence and unlock;
evictions make room; loads allocate pages. An oracle reads the page ids
(CPU tensors) and keeps each page's last forward, counted in positions of
a fake forward stream. Every allocation's fence must cover the last forward
of every page it got (never weaker); node tags must make some fences older
than the stream tail (the gain); a negative control (a path left untagged
at unlock) must be caught.

Runs in .venv-sglang (scripts/sglang_setup.sh); skipped where SGLang is not
installed.
"""

from __future__ import annotations

import random
from array import array
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.unified_radix_cache")

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from blockpool.integrations.sglang import hooks, tree
from tests.test_sglang_field_cases import TARGETS, installed  # noqa: F401  (the plugin, registered once)

PAGES = 48


class Event:
    def __init__(self, pos: int) -> None:
        self.pos = pos

    def query(self) -> bool:
        return False  # nothing completes: every fence is compared by position


class Stream:
    """The forward stream: ``pos`` counts the forwards enqueued on it."""

    def __init__(self) -> None:
        self.pos = 0

    def record_event(self, event: Any = None) -> Event:
        return Event(self.pos)


def runtime() -> tuple[hooks.Runtime, Stream]:
    rt = hooks.Runtime("audit")
    rt.targets = tuple(TARGETS)
    rt.launch_hooked = True  # as in SGLang's scheduler process
    hooks.set_runtime(rt)
    stream = Stream()
    rt.bind(stream)
    return rt, stream


def build(page: int, backend: str) -> tuple[UnifiedRadixCache, Any]:
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page))
    size = PAGES * page
    kv = MHATokenToKVPool(
        size=size,
        page_size=page,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=4,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    if page == 1:
        alloc: Any = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", kv, False)
    else:
        alloc = PagedTokenToKVPoolAllocator(size, page, torch.bfloat16, "cpu", kv, False)
    rtp = ReqToTokenPool(size=4, max_context_len=512, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(
        req_to_token_pool=rtp,
        token_to_kv_pool_allocator=alloc,
        page_size=page,
        disable=False,
        tree_components=(ComponentType.FULL,),
        tree_core_backend=backend,
    )
    return UnifiedRadixCache(params=params), alloc


class Driver:
    """A serving loop over one cache, with the per-page oracle."""

    def __init__(self, page: int, backend: str, rng: random.Random) -> None:
        self.rt, self.stream = runtime()
        self.cache, self.alloc = build(page, backend)
        self.page, self.rng = page, rng
        self.last_use: dict[int, int] = {}  # page id -> position of its last forward
        self.running: list[tuple[Any, list[int], torch.Tensor]] = []  # (lock, tokens, kv indices)
        self.history: list[list[int]] = []  # finished sequences, continued as later turns
        # Pages of requests released while the next batch was built but not
        # launched (overlap disabled for it): that batch still holds their rows.
        self.overshoot: set[int] = set()
        self.fences = 0
        self.unknown = 0
        self.early = 0
        # a few shared prefixes, so requests share (and split) nodes
        self.prefixes = [[rng.randrange(1, 500) for _ in range(page * rng.randrange(1, 4))] for _ in range(4)]

    # -- oracle -------------------------------------------------------
    def pages_of(self, indices: torch.Tensor) -> set[int]:
        return {int(i) // self.page for i in indices.tolist()}

    def forward(self, pages: set[int]) -> None:
        """Launch one forward that reads or writes ``pages`` (and the rows a
        released request still has in the batch built before its release),
        then ``run_batch`` returns: the plugin's launch hook."""
        self.stream.pos += 1
        for p in pages | self.overshoot:
            self.last_use[p] = self.stream.pos
        self.overshoot = set()
        hooks.hook_run_batch(lambda _scheduler: None, None)

    def path_pages(self, node: Any) -> set[int]:
        (path,) = self.cache.tree_core.collect_path_info([node])
        out: set[int] = set()
        for info in path:
            value = self.cache.tree_core.get_component_device_value(info.node_id, ComponentType.FULL)
            if value is not None:
                out |= self.pages_of(value)
        return out

    def check_fence(self, got: torch.Tensor) -> None:
        fence = self.rt.last_take
        if fence is None or isinstance(fence, hooks._NotTaken):
            return
        assert hooks.fence_known(fence), fence
        fence = self.rt.effective_fence(fence)  # what start_loading waits on
        if fence is None:
            self.unknown += 1  # a token no forward was launched after: wait_stream
            return
        covered = max((self.rt._by_seq[t][0].pos for t in fence), default=0)
        need = max((self.last_use.get(p, 0) for p in self.pages_of(got)), default=0)
        assert need <= covered, f"fence covers forward {covered}, a page was last used by forward {need}"
        self.fences += 1
        self.early += covered < self.stream.pos

    # -- steps ---------------------------------------------------------
    def make_room(self, tokens: int) -> None:
        if self.alloc.available_size() < tokens:
            self.cache.evict(EvictParams(num_tokens=tokens - self.alloc.available_size()))

    def allocate(self, tokens: int) -> torch.Tensor | None:
        self.make_room(tokens)
        if self.alloc.available_size() < tokens:
            return None
        got = self.alloc.alloc(tokens)
        if got is not None:
            self.check_fence(got)
        return got

    def start(self) -> None:
        # a new conversation on a shared prefix, or the next turn of one
        base = self.history if self.history and self.rng.random() < 0.5 else self.prefixes
        toks = list(self.rng.choice(base))
        toks += [self.rng.randrange(1, 500) for _ in range(self.page * self.rng.randrange(1, 4))]
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks))))
        node = match.last_device_node
        lock = self.cache.lock(node)
        matched = match.device_prefix_len
        prefix = self.path_indices(node)[:matched]
        new = self.allocate(len(toks) - matched)
        if new is None:
            self.cache.unlock(lock)
            return
        kv = torch.cat([prefix, new])
        self.forward(self.pages_of(kv))  # reads the prefix, writes the new pages
        self.running.append((lock, toks, kv))

    def path_indices(self, node: Any) -> torch.Tensor:
        (path,) = self.cache.tree_core.collect_path_info([node])
        parts = [self.cache.tree_core.get_component_device_value(i.node_id, ComponentType.FULL) for i in path]
        return torch.cat([p for p in parts if p is not None] or [torch.zeros(0, dtype=torch.int64)])

    def step(self) -> None:
        # one decode-like forward over every running request
        pages: set[int] = set()
        for _, _, kv in self.running:
            pages |= self.pages_of(kv)
        if pages:
            self.forward(pages)

    def release_rows(self, kv: torch.Tensor) -> None:
        # Half the time the release happens after the next batch was built
        # with the request's row (overlap disabled for that batch).
        if self.rng.random() < 0.5:
            self.overshoot |= self.pages_of(kv)

    def abort(self) -> None:
        """A request released without an insert (aborted or retracted): its
        new pages go back, its lock is dropped."""
        lock, _toks, kv = self.running.pop(self.rng.randrange(len(self.running)))
        protected = self.path_len(lock.node if lock is not None else None)
        self.release_rows(kv)
        if len(kv) > protected:
            self.alloc.free(kv[protected:])
        self.cache.unlock(lock)

    def finish(self) -> None:
        lock, toks, kv = self.running.pop(self.rng.randrange(len(self.running)))
        self.release_rows(kv)
        # As SGLang's cache_finished_req: the matched prefix is the tree's
        # own (prev_prefix_len); the insert frees the request's duplicates of
        # what other requests inserted meanwhile.
        protected = self.path_len(lock.node if lock is not None else None)
        self.cache.insert(InsertParams(key=RadixKey(array("q", toks)), value=kv, prev_prefix_len=protected))
        self.history = (self.history + [toks])[-8:]
        self.cache.unlock(lock)

    def path_len(self, node: Any) -> int:
        if node is None:
            return 0
        (path,) = self.cache.tree_core.collect_path_info([node])
        return path[-1].path_end if path else 0

    def load(self) -> None:
        n = self.page * self.rng.randrange(1, 6)
        got = self.allocate(n)
        if got is not None:
            self.forward(self.pages_of(got))  # the loaded pages are read
            self.alloc.free(got)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            r = self.rng.random()
            if r < 0.35 and len(self.running) < 4:
                self.start()
            elif r < 0.55 and self.running:
                self.finish()
            elif r < 0.62 and self.running:
                self.abort()
            elif r < 0.8:
                self.load()
            else:
                self.step()


@pytest.mark.parametrize("backend", ["rust", "python"])
@pytest.mark.parametrize("page", [4, 1])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_node_tags_never_weaker_than_the_pages_last_forward(page: int, backend: str, seed: int) -> None:
    d = Driver(page, backend, random.Random(seed))
    d.run(160)
    assert d.rt.node_tags.get(d.cache) is not None  # node tags stayed on
    assert d.fences > 0  # not vacuous: exact fences were checked


@pytest.mark.parametrize("backend", ["rust", "python"])
def test_node_tags_let_eviction_fed_allocations_start_before_the_tail(backend: str) -> None:
    d = Driver(4, backend, random.Random(7))
    d.run(400)
    assert d.rt.counters.node_tagged > 0
    assert d.fences > 0 and d.early > 0, (d.fences, d.early)


def caught(runs: int = 16, steps: int = 300) -> int:
    """How many seeded driver runs the oracle stops."""
    n = 0
    for seed in range(runs):
        try:
            Driver(4, "rust", random.Random(seed)).run(steps)
        except AssertionError:
            n += 1
    return n


def test_tags_on_the_anchor_alone_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # Negative control: a lock's release that tags its anchor node but not
    # the ancestors the request also read leaves older tags on them.
    def anchor_only(rt: hooks.Runtime, cache: Any, tags: Any, node_id: Any) -> None:
        tags[int(node_id)] = rt.record()

    monkeypatch.setattr(tree, "_tag_unlock", anchor_only)
    assert caught() > 0


def test_an_unlock_that_tags_nothing_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # Negative control: the inserts still tag their paths; an aborted
    # request's prefix (no insert) keeps the tag from before it was read.
    monkeypatch.setattr(tree, "_tag_unlock", lambda *args: None)
    assert caught() > 0


def test_a_release_taken_as_final_before_the_next_launch_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # Negative control: without launch tokens, a release recorded before
    # the batch built ahead of it is launched misses that batch's rows.
    monkeypatch.setattr(hooks.Runtime, "effective_fence", lambda self, fence: fence)
    assert caught() > 0


@pytest.mark.parametrize(
    ("attr", "value"),
    [
        ("buffer_pipeline", object()),  # buffer mode pins bypass the cache's locks
        ("enable_session_radix_cache", True),
        ("disable", True),
        ("tree_components", (ComponentType.FULL, ComponentType.SWA)),
        ("token_to_kv_pool_allocator", object()),  # an allocator the accounts do not shadow
    ],
)
def test_node_tags_are_off_where_the_cache_is_not_plain(attr: str, value: Any) -> None:
    rt, _ = runtime()
    rt._paged_cls, rt._token_cls = PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # as arm() sets
    plain, _ = build(4, "rust")
    assert tree.node_tags_of(rt, plain) is not None
    cache, _ = build(4, "rust")
    setattr(cache, attr, value)
    assert tree.node_tags_of(rt, cache) is None


def test_a_cache_built_without_its_init_gets_no_node_tags() -> None:
    rt, _ = runtime()
    assert tree.node_tags_of(rt, object.__new__(UnifiedRadixCache)) is None


class _BrokenCore:
    def collect_path_info(self, ids: Any) -> Any:
        raise RuntimeError("binding gone")


def test_an_unreadable_path_turns_node_tags_off_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    rt, _ = runtime()
    cache, _ = build(4, "rust")
    tags = tree.node_tags_of(rt, cache)
    assert tags is not None
    tags[5] = 1
    cache.tree_core = _BrokenCore()
    with caplog.at_level("WARNING", logger="blockpool.integrations.sglang"):
        tree._tag_path(rt, cache, tags, 5)  # type: ignore[arg-type]
    assert rt.node_tags[cache] is None  # off for good: no older tag is trusted again
    want = (
        "blockpool: radix-node tags off for this cache (the path of node 5 could not be tagged: "
        "RuntimeError('binding gone')); frees are tagged at the stream tail"
    )
    assert [r.getMessage() for r in caplog.records if "radix-node tags off" in r.getMessage()] == [want]


def test_the_sweep_drops_the_tags_of_deleted_nodes_only() -> None:
    rt, _ = runtime()
    cache, alloc = build(4, "rust")
    tags = tree.node_tags_of(rt, cache)
    assert tags is not None
    toks = list(range(1, 9))
    result = cache.insert(InsertParams(key=RadixKey(array("q", toks)), value=alloc.alloc(8)))
    live = int(result.last_device_node)
    assert tags.get(live) is not None  # the insert tagged its path
    tags[10**9] = 1  # a node that is not in the tree, checked last
    before = dict(tags)
    tree._sweep(rt, cache, tags, len(tags) - 1)  # type: ignore[arg-type]
    assert tags == before  # the live ones checked and kept
    tree._sweep(rt, cache, tags, 1)  # type: ignore[arg-type]
    assert 10**9 not in tags and tags == {k: v for k, v in before.items() if k != 10**9}
    assert live in tags
