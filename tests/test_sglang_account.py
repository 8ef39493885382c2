"""The page account beside SGLang's KV page allocators.

Unit tests of :class:`PageAccount`, then a property test: random alloc /
alloc_extend / alloc_decode / free / free_segment / free_group / merge /
clear sequences run on an allocator while the account follows it, driven
either by wrappers written here or by the plugin's own allocator hooks
(:mod:`blockpool.integrations.sglang.hooks`), with an oracle that reads the
page ids (host lists, or CPU tensors) and keeps per-page tags.
Every allocation's fence must be exactly the release tags of the pages it
got (never weaker than their last use, naming nothing else), or unknown
exactly where a sorted merge scrambled the order. Two negative controls (a
dropped run, a padded token) must be caught.

The allocator is SGLang 0.5.23's own ``PagedTokenToKVPoolAllocator`` and
``TokenToKVPoolAllocator`` on ``device="cpu"`` where SGLang is installed
(``.venv-sglang``), and everywhere a list model of them written from their
source (``sglang/srt/mem_cache/allocator/paged.py``, ``token.py``,
``base.py``), which the same wrappers drive.
"""

from __future__ import annotations

import functools
import logging
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from blockpool.core.errors import InvalidArgumentError, InvariantError
from blockpool.core.hazards import Token
from blockpool.integrations.sglang.account import UNKNOWN, PageAccount, as_fence

# ----------------------------------------------------------------------
# unit tests
# ----------------------------------------------------------------------


def test_lifo_release_is_prepended_and_taken_first() -> None:
    acct: PageAccount[int] = PageAccount(4)
    assert acct.release(2, 1) and acct.release(3, 2)
    assert acct.runs() == [(3, 2), (2, 1), (4, None)]
    assert acct.take(3) == frozenset({2})
    assert acct.take(3) == frozenset({1})  # 2 of run 1, then 1 untagged page
    assert acct.free_len == 3
    acct.check_invariants()


def test_fifo_release_is_appended() -> None:
    acct: PageAccount[int] = PageAccount(2, order="fifo")
    acct.release(1, 5)
    assert acct.runs() == [(2, None), (1, 5)]
    assert acct.take(2) == frozenset()
    assert acct.take(1) == frozenset({5})


def test_adjacent_equal_tags_coalesce() -> None:
    acct: PageAccount[int] = PageAccount(0)
    acct.release(1, 7)
    acct.release(2, 7)
    assert acct.runs() == [(3, 7)]
    acct.check_invariants()


def test_need_sort_stages_and_merge_is_unknown() -> None:
    acct: PageAccount[int] = PageAccount(4, need_sort=True)
    assert acct.release(2, 1, free_len=4, staged_len=2)
    assert acct.runs() == [(4, None)]
    assert acct.take(1, free_len=3) == frozenset()  # staged pages are not in the list
    assert acct.merge(free_len=5, staged_len=0)
    assert acct.runs() == [(5, UNKNOWN)]
    assert acct.take(1) is None
    assert acct.armed  # unknown is not a mismatch


def test_merge_with_nothing_staged_keeps_runs() -> None:
    acct: PageAccount[int] = PageAccount(3, need_sort=True)
    acct.merge()
    assert acct.runs() == [(3, None)]


def test_take_to_consumes_down_to_the_allocator_length() -> None:
    acct: PageAccount[int] = PageAccount(6)
    acct.release(2, 9)
    assert acct.take_to(5) == frozenset({9})
    assert acct.free_len == 5


def test_length_mismatch_disarms_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    acct: PageAccount[int] = PageAccount(4, name="paged")
    with caplog.at_level(logging.WARNING, logger="blockpool.integrations.sglang"):
        assert not acct.release(1, 3, free_len=4)  # the account has 5
        assert not acct.check(5)
        acct.disarm("again")
    assert not acct.armed and acct.disarm_reason is not None and "mismatch" in acct.disarm_reason
    assert [r.getMessage().count("disarmed") for r in caplog.records] == [1]
    assert acct.take(1) is None and acct.peek(1) is None and acct.take_to(0) is None


def test_take_past_the_end_disarms() -> None:
    acct: PageAccount[int] = PageAccount(2)
    assert acct.take(3) is None
    assert not acct.armed


def test_take_to_a_longer_list_disarms() -> None:
    acct: PageAccount[int] = PageAccount(2)
    assert acct.take_to(3) is None
    assert not acct.armed


def test_peek_and_take_back() -> None:
    acct: PageAccount[int] = PageAccount(2, token=1)
    acct.release(2, 4)
    assert acct.peek(3) == frozenset({1, 4}) and acct.free_len == 4
    assert acct.peek(2, back=True) == frozenset({1})
    assert acct.take_back(2) == frozenset({1})
    assert acct.runs() == [(2, 4)]
    assert acct.peek(3) is None  # more than the list holds: no answer, no disarm
    assert acct.armed


def test_clear_retags_everything() -> None:
    acct: PageAccount[int] = PageAccount(4, need_sort=True)
    acct.release(3, 1)
    assert acct.clear(token=8)
    assert acct.runs() == [(7, 8)] and acct.staged_len == 0
    acct.clear(2)
    assert acct.runs() == [(2, None)]


def test_forget_marks_the_list_unknown() -> None:
    acct: PageAccount[int] = PageAccount(3)
    acct.forget()
    assert acct.runs() == [(3, UNKNOWN)]
    assert acct.take(1) is None and acct.armed


@pytest.mark.parametrize(
    "call",
    [
        lambda a: a.release(-1, 1),
        lambda a: a.release(True, 1),
        lambda a: a.release(1, [1]),
        lambda a: a.release(1, UNKNOWN),
        lambda a: a.release(1, 1, free_len=-2),
        lambda a: a.take(-1),
        lambda a: a.take(1.0),
        lambda a: a.take_to(-1),
        lambda a: a.take_back(None),
        lambda a: a.peek("1"),
        lambda a: a.check(-1),
        lambda a: a.check(1, -1),
        lambda a: a.clear(-1),
        lambda a: a.clear(1, {}),
        lambda a: a.merge(staged_len=-1),
    ],
)
def test_bad_input_raises_and_changes_nothing(call: Any) -> None:
    acct: PageAccount[int] = PageAccount(3, token=2)
    acct.release(1, 5)
    before = (acct.runs(), acct.free_len, acct.staged_len, acct.armed)
    with pytest.raises(InvalidArgumentError):
        call(acct)
    assert (acct.runs(), acct.free_len, acct.staged_len, acct.armed) == before


@pytest.mark.parametrize(
    "kwargs",
    [{"num_pages": -1}, {"num_pages": 1, "order": "lru"}, {"num_pages": 1, "token": []}],
)
def test_bad_constructor_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        PageAccount(**kwargs)


def test_check_invariants_catches_a_corrupt_run_list() -> None:
    acct: PageAccount[int] = PageAccount(3)
    acct._runs.append([1, None])  # the runs now hold 4 pages, free_len says 3
    with pytest.raises(InvariantError):
        acct.check_invariants()


def test_as_fence_keeps_the_newest_token_per_stream() -> None:
    f = as_fence([Token("forward", 3), Token("forward", 5), Token("h2d", 1)])
    assert [str(t) for t in f] == ["forward:5", "h2d:1"]


# ----------------------------------------------------------------------
# a list model of SGLang 0.5.23's allocators (from allocator/paged.py,
# token.py, base.py); method names and bodies follow the source so the same
# wrappers drive it and the real classes
# ----------------------------------------------------------------------


class L(list[int]):
    """A host list with ``numel()``, the one tensor method the plugin's
    hooks call on page ids."""

    def numel(self) -> int:
        return len(self)


def _cat(parts: list[list[int]]) -> L:
    return L(x for p in parts for x in p)


class ModelPaged:
    """``PagedTokenToKVPoolAllocator`` over lists (naive kernels' page order)."""

    def __init__(self, size: int, page_size: int, need_sort: bool) -> None:
        self.size, self.page_size, self.need_sort = size, page_size, need_sort
        self.num_pages = size // page_size
        self.clear()

    def clear(self) -> None:
        self.free_pages = list(range(1, self.num_pages + 1))
        self.free_group: list[list[int]] | None = None
        self.free_page_ids_group: list[list[int]] = []
        self.staged_pages: list[list[int]] = []
        self.num_staged_pages = 0

    def merge_and_sort_free(self) -> None:
        if not self.staged_pages:
            return
        self.free_pages = sorted(self.free_pages + _cat(self.staged_pages))
        self.staged_pages = []
        self.num_staged_pages = 0

    def alloc(self, need_size: int) -> list[int] | None:
        num_pages = need_size // self.page_size
        if num_pages > len(self.free_pages):
            self.merge_and_sort_free()
        if num_pages > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:num_pages], self.free_pages[num_pages:]
        return [p * self.page_size + i for p in out for i in range(self.page_size)]

    def alloc_extend(
        self, prefix_lens: list[int], seq_lens: list[int], last_loc: list[int], extend_num_tokens: int
    ) -> list[int] | None:
        ps, bs = self.page_size, len(prefix_lens)
        max_new_pages = extend_num_tokens // ps + bs + 1
        if max_new_pages > len(self.free_pages):
            self.merge_and_sort_free()
        num_new_pages = sum(-(-s // ps) - -(-p // ps) for p, s in zip(prefix_lens, seq_lens, strict=True))
        if max_new_pages > len(self.free_pages) and num_new_pages > len(self.free_pages):
            return None
        out: list[int] = []
        nxt = 0
        for p, s, last in zip(prefix_lens, seq_lens, last_loc, strict=True):
            ceil_prefix = -(-p // ps) * ps
            num1 = min(s, ceil_prefix) - p
            out += [last + 1 + j for j in range(num1)]
            if p + num1 == s:
                continue
            floor_seq = s // ps * ps
            for j in range(floor_seq - ceil_prefix):
                out.append(self.free_pages[nxt + j // ps] * ps + j % ps)
            nxt += (floor_seq - ceil_prefix) // ps
            if s - floor_seq:
                out += [self.free_pages[nxt] * ps + j for j in range(s - floor_seq)]
                nxt += 1
        self.free_pages = self.free_pages[num_new_pages:]
        return out

    def alloc_decode(self, seq_lens: list[int], last_loc: list[int]) -> list[int] | None:
        ps, bs = self.page_size, len(seq_lens)
        if bs > len(self.free_pages):
            self.merge_and_sort_free()
        num_new_pages = sum(1 for s in seq_lens if s % ps == 1)
        if num_new_pages > len(self.free_pages):
            return None
        out, rank = [], 0
        for s, last in zip(seq_lens, last_loc, strict=True):
            if (s - 1) % ps == 0:
                out.append(self.free_pages[rank] * ps)
                rank += 1
            else:
                out.append(last + 1)
        self.free_pages = self.free_pages[num_new_pages:]
        return out

    def free(self, free_index: list[int]) -> None:
        if not free_index:
            return
        if self.free_group is None:
            self._release_page_ids(L(sorted({i // self.page_size for i in free_index})))
        else:
            self.free_group.append(list(free_index))

    def free_segment(self, free_index: list[int], *, start_pos: int) -> None:
        if not free_index:
            return
        assert start_pos % self.page_size == 0
        self.free_page_ids(L(i // self.page_size for i in free_index[:: self.page_size]))

    def free_page_ids(self, page_ids: list[int]) -> None:
        if not page_ids:
            return
        if self.free_group is None:
            self._release_page_ids(L(page_ids))
        else:
            self.free_page_ids_group.append(list(page_ids))

    def _release_page_ids(self, *page_ids: list[int]) -> None:
        if self.need_sort:
            self.staged_pages.extend(page_ids)
            self.num_staged_pages += sum(len(p) for p in page_ids)
        else:
            self.free_pages = _cat(list(page_ids)) + self.free_pages

    def free_group_begin(self) -> None:
        assert self.free_group is None
        self.free_group = []
        self.free_page_ids_group = []

    def free_group_end(self) -> None:
        pending, self.free_group = self.free_group, None
        if pending:
            self.free(_cat(pending))
        if self.free_page_ids_group:
            self._release_page_ids(_cat(self.free_page_ids_group))
            self.free_page_ids_group = []


class ModelToken:
    """``TokenToKVPoolAllocator`` over lists (page size 1, FIFO)."""

    page_size = 1

    def __init__(self, size: int, need_sort: bool) -> None:
        self.size, self.need_sort = size, need_sort
        self.clear()

    def clear(self) -> None:
        self.free_pages = list(range(1, self.size + 1))
        self.free_group: list[list[int]] | None = None
        self.release_pages: list[int] = []

    def merge_and_sort_free(self) -> None:
        if self.release_pages:
            self.free_pages = sorted(self.free_pages + self.release_pages)
            self.release_pages = []

    def alloc(self, need_size: int) -> list[int] | None:
        if self.need_sort and need_size > len(self.free_pages):
            self.merge_and_sort_free()
        if need_size > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:need_size], self.free_pages[need_size:]
        return out

    def free(self, free_index: list[int]) -> None:
        if not free_index:
            return
        if self.free_group is None:
            if self.need_sort:
                self.release_pages = self.release_pages + list(free_index)
            else:
                self.free_pages = self.free_pages + list(free_index)
        else:
            self.free_group.append(list(free_index))

    def free_segment(self, free_index: list[int], *, start_pos: int) -> None:
        self.free(free_index)

    def free_group_begin(self) -> None:
        assert self.free_group is None
        self.free_group = []

    def free_group_end(self) -> None:
        pending, self.free_group = self.free_group, None
        if pending:
            self.free(_cat(pending))


# ----------------------------------------------------------------------
# the wrappers (what the plugin's hooks do around the allocator's methods)
# ----------------------------------------------------------------------


def _n(x: Any) -> int:
    return int(x.numel()) if hasattr(x, "numel") else len(x)


def _staged(a: Any) -> int:
    if hasattr(a, "num_staged_pages"):
        return int(a.num_staged_pages)
    return _n(a.release_pages) if a.release_pages is not None else 0


class Shadow:
    """Wraps an allocator's methods on the instance: releases, merges and
    clears feed the account with the current token; allocations take their
    fence (``last_fence``), with the lengths checked on every call."""

    def __init__(self, alloc: Any, account: PageAccount[int]) -> None:
        self.alloc, self.account = alloc, account
        self.token = 0  # the forward tick: this driver's tags are ticks
        self.last_fence: frozenset[int] | None | str = "none yet"
        paged = hasattr(alloc, "num_staged_pages")
        names = ["alloc", "merge_and_sort_free", "clear"]
        names += ["_release_page_ids", "alloc_extend", "alloc_decode"] if paged else ["free"]
        for name in names:
            setattr(alloc, name, getattr(self, "_" + name.lstrip("_"))(getattr(alloc, name)))

    def _lens(self) -> dict[str, int]:
        return {"free_len": _n(self.alloc.free_pages), "staged_len": _staged(self.alloc)}

    def _taking(self, orig: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            self.last_fence = self.account.take_to(_n(self.alloc.free_pages))
            self.account.check(**self._lens())
            return out

        return wrapper

    _alloc = _alloc_extend = _alloc_decode = _taking

    def _release_page_ids(self, orig: Any) -> Any:
        def wrapper(*page_ids: Any) -> Any:
            orig(*page_ids)
            self.account.release(sum(_n(p) for p in page_ids), self.token, **self._lens())

        return wrapper

    def _free(self, orig: Any) -> Any:  # TokenToKVPoolAllocator: every effective free releases
        def wrapper(free_index: Any) -> Any:
            deferred = self.alloc.free_group is not None
            orig(free_index)
            if not deferred and _n(free_index):
                self.account.release(_n(free_index), self.token, **self._lens())

        return wrapper

    def _merge_and_sort_free(self, orig: Any) -> Any:
        def wrapper() -> Any:
            orig()
            self.account.merge(**self._lens())

        return wrapper

    def _clear(self, orig: Any) -> Any:
        def wrapper() -> Any:
            orig()
            self.account.clear(_n(self.alloc.free_pages), self.token)
            self.account.check(**self._lens())

        return wrapper

    def tick_of(self, tag: int) -> int:
        return tag

    def close(self) -> None:
        pass


class PluginShadow:
    """The plugin's own allocator hooks (:mod:`blockpool.integrations.sglang.hooks`)
    bound on the instance, as SGLang's ``HookRegistry`` binds them on the
    class, with a runtime armed for this allocator's class and a forward
    stream whose events never complete. The hooks' tags are the runtime's
    token numbers; ``tick_of`` maps each to the forward tick it was recorded
    at (the oracle's time)."""

    def __init__(self, alloc: Any, account: PageAccount[int]) -> None:
        from blockpool.integrations.sglang import hooks

        self.alloc, self.account, self.hooks = alloc, account, hooks
        self.token = 0
        self.ticks: dict[int, int] = {}
        rt = self.rt = hooks.Runtime("audit")
        rt.armed = True
        paged = hasattr(alloc, "num_staged_pages")
        rt._paged_cls, rt._token_cls = (type(alloc), None) if paged else (None, type(alloc))
        shadow = self

        class Event:
            def query(self) -> bool:
                return False

        class Stream:
            def record_event(self) -> Event:
                shadow.ticks[rt._seq + 1] = shadow.token
                return Event()

        rt.bind(Stream())
        rt.accounts[alloc] = account
        hooks.set_runtime(rt)
        cls = type(alloc)
        names = {
            "alloc": hooks.hook_alloc,
            "merge_and_sort_free": hooks.hook_merge,
            "clear": hooks.hook_clear,
        }
        if paged:
            names |= {
                "_release_page_ids": hooks.hook_release,
                "alloc_extend": hooks.hook_alloc,
                "alloc_decode": hooks.hook_alloc,
            }
        else:
            names["free"] = hooks.hook_token_free
        for name, hook in names.items():
            # SGLang's own method: unwrapped when HookRegistry has already
            # patched the class in this process (the controller tests do).
            method = getattr(cls, name)
            method = getattr(method, "__wrapped__", method)
            setattr(alloc, name, functools.partial(hook, method, alloc))

    @property
    def last_fence(self) -> frozenset[int] | None | str:
        take = self.rt.last_take
        return "none yet" if take is self.hooks.NOT_TAKEN else take  # type: ignore[return-value]

    def tick_of(self, tag: int) -> int:
        return self.ticks[tag]

    def close(self) -> None:
        self.hooks.set_runtime(None)


# ----------------------------------------------------------------------
# backends: the list model, and SGLang's classes on the CPU
# ----------------------------------------------------------------------


class ListBackend:
    """Calls the list model with host lists."""

    def __init__(self, kind: str, page_size: int, need_sort: bool, num_pages: int) -> None:
        self.page_size = page_size
        self.paged = kind == "paged"
        size = num_pages * page_size
        self.alloc = ModelPaged(size, page_size, need_sort) if self.paged else ModelToken(size, need_sort)

    def pages(self, slots: Any) -> list[int]:
        return list(slots)

    def call_alloc(self, need: int) -> list[int] | None:
        out = self.alloc.alloc(need)
        return None if out is None else self.pages(out)

    def call_extend(self, prefix: list[int], seq: list[int], last: list[int]) -> list[int] | None:
        out = self.alloc.alloc_extend(prefix, seq, last, sum(seq) - sum(prefix))
        return None if out is None else self.pages(out)

    def call_decode(self, seq: list[int], last: list[int]) -> list[int] | None:
        out = self.alloc.alloc_decode(seq, last)
        return None if out is None else self.pages(out)

    def call_free(self, slots: list[int]) -> None:
        self.alloc.free(L(slots))

    def call_free_segment(self, slots: list[int], start_pos: int) -> None:
        self.alloc.free_segment(L(slots), start_pos=start_pos)

    def free_page_ids(self) -> list[int]:
        return list(self.alloc.free_pages)


class TorchBackend(ListBackend):
    """Calls SGLang's own allocator on ``device="cpu"`` with tensors."""

    def __init__(self, kind: str, page_size: int, need_sort: bool, num_pages: int) -> None:
        from unittest.mock import MagicMock

        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        self.torch = torch
        self.page_size = page_size
        self.paged = kind == "paged"
        size = num_pages * page_size
        if self.paged:
            self.alloc = PagedTokenToKVPoolAllocator(
                size, page_size, torch.int64, "cpu", MagicMock(), need_sort
            )
        else:
            self.alloc = TokenToKVPoolAllocator(size, torch.int64, "cpu", MagicMock(), need_sort)

    def pages(self, slots: Any) -> list[int]:
        return [int(x) for x in slots.tolist()]

    def _t(self, xs: list[int]) -> Any:
        return self.torch.tensor(xs, dtype=self.torch.int64)

    def call_extend(self, prefix: list[int], seq: list[int], last: list[int]) -> list[int] | None:
        p, s = self._t(prefix), self._t(seq)
        out = self.alloc.alloc_extend(p, p.clone(), s, s.clone(), self._t(last), sum(seq) - sum(prefix))
        return None if out is None else self.pages(out)

    def call_decode(self, seq: list[int], last: list[int]) -> list[int] | None:
        s = self._t(seq)
        out = self.alloc.alloc_decode(s, s.clone(), self._t(last))
        return None if out is None else self.pages(out)

    def call_free(self, slots: list[int]) -> None:
        self.alloc.free(self._t(slots))

    def call_free_segment(self, slots: list[int], start_pos: int) -> None:
        self.alloc.free_segment(self._t(slots), start_pos=start_pos)

    def free_page_ids(self) -> list[int]:
        return [int(x) for x in self.alloc.free_pages.tolist()]


# ----------------------------------------------------------------------
# the state machine
# ----------------------------------------------------------------------

NUM_PAGES = 12


def make_machine(
    backend_cls: type[ListBackend],
    kind: str,
    page_size: int,
    need_sort: bool,
    account_cls: type[PageAccount[int]] = PageAccount,
    driver: str = "wrappers",
) -> type[RuleBasedStateMachine]:
    class AllocatorRun(RuleBasedStateMachine):
        """Requests hold slots; forwards touch them; the oracle keeps, per
        page, the tick of its last forward, the tag of its release, and
        whether a sorted merge scrambled its place in the list."""

        def __init__(self) -> None:
            super().__init__()
            self.b = backend_cls(kind, page_size, need_sort, NUM_PAGES)
            self.ps = page_size
            order = "lifo" if kind == "paged" else "fifo"
            self.account = account_cls(NUM_PAGES, order=order, need_sort=need_sort, name=kind)
            self.shadow = (Shadow if driver == "wrappers" else PluginShadow)(self.b.alloc, self.account)
            self.reqs: dict[int, list[int]] = {}
            self.next_req = 0
            self.tick = 0
            self.last_use: dict[int, int] = {}
            self.free_tag: dict[int, int | None] = dict.fromkeys(range(1, NUM_PAGES + 1))
            self.unknown: set[int] = set()
            self.seen_fences = 0

        # --- helpers -------------------------------------------------
        def _pages_of(self, slots: list[int]) -> set[int]:
            return {s // self.ps for s in slots}

        def _check_fence(self, new_pages: set[int]) -> None:
            fence = self.shadow.last_fence
            assert self.account.armed, self.account.disarm_reason
            if new_pages & self.unknown:
                assert fence is None, (
                    f"pages {sorted(new_pages & self.unknown)} came out of a sorted merge, fence {fence}"
                )
            else:
                assert fence is not None, f"known pages {sorted(new_pages)} got an unknown fence"
                for p in new_pages:  # never weaker: the fence covers each page's last use
                    used = self.last_use.get(p)
                    assert used is None or any(self.shadow.tick_of(t) >= used for t in fence), (
                        f"fence {sorted(fence)} does not cover page {p}'s last use {used}"
                    )
                exact = {self.free_tag[p] for p in new_pages} - {None}
                assert {self.shadow.tick_of(t) for t in fence} == exact, (
                    f"fence {sorted(fence)} != release tags {sorted(exact)} of pages {sorted(new_pages)}"
                )
            self.seen_fences += 1
            for p in new_pages:
                self.unknown.discard(p)
                self.free_tag[p] = None

        def _call(self, owned_before: set[int], call: Any) -> list[int] | None:
            """Run an allocation; a merge inside it (staged pages gone) makes
            every page of the sorted list, those handed out included, unknown."""
            staged = _staged(self.b.alloc)
            slots = call()
            new = set() if slots is None else self._pages_of(slots) - owned_before
            if staged and not _staged(self.b.alloc):
                self.unknown = set(self.b.free_page_ids()) | new
            if slots is not None:
                self._check_fence(new)
            return slots

        def _release(self, slots: list[int]) -> None:
            for p in self._pages_of(slots):
                self.free_tag[p] = self.tick
                self.unknown.discard(p)

        # --- rules ---------------------------------------------------
        @rule(n=st.integers(1, 3 * 16))
        def new_request(self, n: int) -> None:
            if kind == "paged":
                slots = self._call(set(), lambda: self.b.call_extend([0], [n], [-1]))
            else:
                slots = self._call(set(), lambda: self.b.call_alloc(n))
            if slots is not None:
                self.reqs[self.next_req] = slots
                self.next_req += 1

        @rule(n=st.integers(1, 4))
        def alloc_pages(self, n: int) -> None:
            slots = self._call(set(), lambda: self.b.call_alloc(n * self.ps))
            if slots is not None:
                self.reqs[self.next_req] = slots
                self.next_req += 1

        @precondition(lambda self: self.reqs)
        @rule(data=st.data(), n=st.integers(1, 20))
        def extend(self, data: st.DataObject, n: int) -> None:
            picked = data.draw(
                st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, max_size=3, unique=True)
            )
            owned = set().union(*(self._pages_of(self.reqs[r]) for r in picked))
            if kind == "paged":
                prefix = [len(self.reqs[r]) for r in picked]
                seq, last = [p + n for p in prefix], [self.reqs[r][-1] for r in picked]
                out = self._call(owned, lambda: self.b.call_extend(prefix, seq, last))
            else:
                out = self._call(owned, lambda: self.b.call_alloc(n * len(picked)))
            if out is not None:
                for i, r in enumerate(picked):
                    self.reqs[r] = self.reqs[r] + out[i * n : (i + 1) * n]

        @precondition(lambda self: self.reqs)
        @rule(data=st.data())
        def decode(self, data: st.DataObject) -> None:
            picked = data.draw(
                st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, max_size=4, unique=True)
            )
            owned = set().union(*(self._pages_of(self.reqs[r]) for r in picked))
            if kind == "paged" and self.ps > 1:
                seq, last = [len(self.reqs[r]) + 1 for r in picked], [self.reqs[r][-1] for r in picked]
                out = self._call(owned, lambda: self.b.call_decode(seq, last))
            else:  # SGLang decodes page size 1 with alloc()
                out = self._call(owned, lambda: self.b.call_alloc(len(picked)))
            if out is not None:
                for r, slot in zip(picked, out, strict=True):
                    self.reqs[r] = [*self.reqs[r], slot]

        @precondition(lambda self: self.reqs)
        @rule(data=st.data())
        def forward(self, data: st.DataObject) -> None:
            picked = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), max_size=4, unique=True))
            self.tick += 1
            self.shadow.token = self.tick
            for r in picked:
                for p in self._pages_of(self.reqs[r]):
                    self.last_use[p] = self.tick

        @rule()
        def tick_only(self) -> None:  # a forward of requests outside this pool's view
            self.tick += 1
            self.shadow.token = self.tick

        @precondition(lambda self: self.reqs)
        @rule(data=st.data())
        def free(self, data: st.DataObject) -> None:
            r = data.draw(st.sampled_from(sorted(self.reqs)))
            slots = self.reqs.pop(r)
            self.b.call_free(slots)
            self._release(slots)

        @precondition(lambda self: self.reqs)
        @rule(data=st.data())
        def free_group(self, data: st.DataObject) -> None:
            picked = data.draw(
                st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, max_size=3, unique=True)
            )
            self.b.alloc.free_group_begin()
            for r in picked:
                self.b.call_free(self.reqs[r])
            self.b.alloc.free_group_end()
            for r in picked:
                self._release(self.reqs.pop(r))

        @precondition(lambda self: any(len(s) > self.ps for s in self.reqs.values()))
        @rule(data=st.data(), grouped=st.booleans())
        def free_tail(self, data: st.DataObject, grouped: bool) -> None:
            """``free_segment`` of a request's last pages (a tail free), alone
            or inside a free group (the paged allocator's page-id group)."""
            r = data.draw(st.sampled_from(sorted(r for r, s in self.reqs.items() if len(s) > self.ps)))
            k = data.draw(st.integers(1, (len(self.reqs[r]) - 1) // self.ps)) * self.ps
            tail = self.reqs[r][k:]
            if grouped:
                self.b.alloc.free_group_begin()
            self.b.call_free_segment(tail, k)
            if grouped:
                self.b.alloc.free_group_end()
            self.reqs[r] = self.reqs[r][:k]
            self._release(tail)

        @rule()
        def merge(self) -> None:
            staged = _staged(self.b.alloc)
            self.b.alloc.merge_and_sort_free()
            if staged:
                self.unknown = set(self.b.free_page_ids())

        @rule()
        def clear(self) -> None:  # SGLang clears an idle pool: free everything first
            for r in sorted(self.reqs):
                slots = self.reqs.pop(r)
                self.b.call_free(slots)
                self._release(slots)
            self.b.alloc.clear()
            self.unknown = set()
            self.free_tag = dict.fromkeys(range(1, NUM_PAGES + 1), self.tick)

        def teardown(self) -> None:
            self.shadow.close()

        @invariant()
        def account_follows(self) -> None:
            assert self.account.armed, self.account.disarm_reason
            self.account.check_invariants()
            assert self.account.free_len == _n(self.b.alloc.free_pages)
            assert self.account.staged_len == _staged(self.b.alloc)

    return AllocatorRun


CASES = [("paged", ps, ns) for ps in (1, 4, 16) for ns in (False, True)] + [
    ("token", 1, ns) for ns in (False, True)
]
IDS = [f"{k}-ps{ps}-{'sort' if ns else 'lifo' if k == 'paged' else 'fifo'}" for k, ps, ns in CASES]
RUN = settings(
    max_examples=25,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def _torch_backend() -> type[ListBackend]:
    pytest.importorskip("torch")
    pytest.importorskip("sglang.srt.mem_cache.allocator.paged")
    return TorchBackend


@pytest.mark.parametrize("driver", ["wrappers", "plugin"])
@pytest.mark.parametrize(("kind", "page_size", "need_sort"), CASES, ids=IDS)
def test_fences_are_exact_on_the_list_model(kind: str, page_size: int, need_sort: bool, driver: str) -> None:
    run_state_machine_as_test(
        make_machine(ListBackend, kind, page_size, need_sort, driver=driver), settings=RUN
    )


@pytest.mark.parametrize("driver", ["wrappers", "plugin"])
@pytest.mark.parametrize(("kind", "page_size", "need_sort"), CASES, ids=IDS)
def test_fences_are_exact_on_sglang_allocators(
    kind: str, page_size: int, need_sort: bool, driver: str
) -> None:
    machine = make_machine(_torch_backend(), kind, page_size, need_sort, driver=driver)
    run_state_machine_as_test(machine, settings=RUN)


class DroppedRun(PageAccount[int]):
    """Negative control: an allocation's fence leaves out its first run."""

    def _pop(self, n: int, *, front: bool) -> frozenset[int] | None:
        first = self._runs[0][1] if front and self._runs else None
        fence = super()._pop(n, front=front)
        return None if fence is None else fence - {first}  # type: ignore[operator]


class PaddedToken(PageAccount[int]):
    """Negative control: an allocation's fence also names the run after it."""

    def _pop(self, n: int, *, front: bool) -> frozenset[int] | None:
        fence = super()._pop(n, front=front)
        nxt = self._runs[0][1] if self._runs else None
        if fence is None or not isinstance(nxt, int):
            return fence
        return fence | {nxt}


class AlwaysUnknown(PageAccount[int]):
    """Negative control: every fence unknown (sound, but it gains nothing)."""

    def _pop(self, n: int, *, front: bool) -> frozenset[int] | None:
        super()._pop(n, front=front)
        return None


@pytest.mark.parametrize(
    ("backend", "driver"), [("list", "wrappers"), ("list", "plugin"), ("sglang", "plugin")]
)
@pytest.mark.parametrize(
    ("control", "caught_by"),
    [
        (DroppedRun, "does not cover|!= release tags"),
        (PaddedToken, "!= release tags"),
        (AlwaysUnknown, "got an unknown fence"),
    ],
    ids=["dropped-run", "padded-token", "always-unknown"],
)
def test_negative_controls_are_caught(
    backend: str, driver: str, control: type[PageAccount[int]], caught_by: str
) -> None:
    backend_cls = ListBackend if backend == "list" else _torch_backend()
    machine = make_machine(backend_cls, "paged", 4, False, account_cls=control, driver=driver)
    find = settings(RUN, max_examples=200, phases=[Phase.generate])
    with pytest.raises(AssertionError, match=caught_by):
        run_state_machine_as_test(machine, settings=find)


@pytest.mark.parametrize(("kind", "page_size", "need_sort"), CASES, ids=IDS)
def test_the_list_model_hands_out_what_sglang_does(kind: str, page_size: int, need_sort: bool) -> None:
    """The list model is SGLang's allocator: the same random calls give the
    same indices and leave the same free list (and staged pages)."""
    real_cls = _torch_backend()
    rng = random.Random(f"{kind}-{page_size}-{need_sort}")
    model, real = (
        ListBackend(kind, page_size, need_sort, NUM_PAGES),
        real_cls(kind, page_size, need_sort, NUM_PAGES),
    )
    reqs: dict[int, list[int]] = {}
    for i in range(400):
        op = rng.choice(["new", "extend", "decode", "free", "tail", "group", "merge"])
        picked = rng.sample(sorted(reqs), min(len(reqs), rng.randint(1, 3)))
        if op == "new" or not reqs:
            n = rng.randint(1, 3 * page_size + 2)
            if kind == "paged":
                outs = [b.call_extend([0], [n], [-1]) for b in (model, real)]
            else:
                outs = [b.call_alloc(n) for b in (model, real)]
            if outs[0] is not None:
                reqs[i] = outs[0]
        elif op == "extend" and kind == "paged":
            prefix = [len(reqs[r]) for r in picked]
            n = rng.randint(1, 2 * page_size)
            args = (prefix, [p + n for p in prefix], [reqs[r][-1] for r in picked])
            outs = [b.call_extend(*args) for b in (model, real)]
            if outs[0] is not None:
                for j, r in enumerate(picked):
                    reqs[r] = reqs[r] + outs[0][j * n : (j + 1) * n]
        elif op == "decode" and kind == "paged" and page_size > 1:
            args2 = ([len(reqs[r]) + 1 for r in picked], [reqs[r][-1] for r in picked])
            outs = [b.call_decode(*args2) for b in (model, real)]
            if outs[0] is not None:
                for r, slot in zip(picked, outs[0], strict=True):
                    reqs[r] = [*reqs[r], slot]
        elif op in ("free", "group"):
            for b in (model, real):
                if op == "group":
                    b.alloc.free_group_begin()
                for r in picked:
                    b.call_free(reqs[r])
                if op == "group":
                    b.alloc.free_group_end()
            outs = [None, None]
            for r in picked:
                del reqs[r]
        elif op == "tail" and any(len(s) > page_size for s in reqs.values()):
            r = rng.choice(sorted(r for r, s in reqs.items() if len(s) > page_size))
            k = rng.randint(1, (len(reqs[r]) - 1) // page_size) * page_size
            for b in (model, real):
                b.call_free_segment(reqs[r][k:], k)
            reqs[r] = reqs[r][:k]
            outs = [None, None]
        else:
            for b in (model, real):
                b.alloc.merge_and_sort_free()
            outs = [None, None]
        assert outs[0] == outs[1], (i, op)
        assert model.free_page_ids() == real.free_page_ids(), (i, op)
        assert _staged(model.alloc) == _staged(real.alloc), (i, op)
