"""The vLLM names the plugin depends on, declared once per release line.

Every vLLM function, method or class the plugin replaces, wraps, borrows or
reads by name is declared here, in one :class:`Surface` per supported
release line (:data:`SURFACES`). :func:`blockpool.integrations.vllm.register`
chooses the line once (:func:`select`), checks the running vLLM against it
(:func:`check`) and makes it the process's :func:`active` surface; the
plugin's code asks the active surface what differs between lines (the
switches of :class:`Surface`) instead of probing vLLM for names.

A line is recognised by the presence of its own names (its
:attr:`Surface.markers`, each with its signature), never by the absence of
another line's.

One table, and each later line as its changes: the first declared line
(0.32) is written out whole, one :class:`Name` per row; every later line
is :func:`derive` of the line before it with only what its release
changed: the rows whose signature, body fingerprint or use changed (each
replacing the row of the same target in place), the rows it added (after
a named row), the targets it removed, and the switches that differ. A
row, a switch or a connector not named in a line's delta is inherited
unchanged. Adding the next vLLM line is therefore::

    _LINE_035 = derive(
        _LINE_034,
        "0.35",
        changed=(_n(f"{_SCHED}:Scheduler.schedule", "self, throttle_prefills", fp="...", use="wrapped"),),
        removed=(f"{_MGR}:KVCacheManager.get_blocks",),
        offloading_sync_loads=False,
    )

plus the code for what really changed; ``blockpool check-vllm --surface``
against the new release prints every drifted row (the rows to put in
``changed``), and ``derive`` refuses a delta row that changes nothing or
names a row the line before does not have.

Reads, too, go through the table: an instance attribute of a vLLM object
the plugin reads by name is a ``field`` row of each line that has it
(checked in the class's source), read plainly; one only some lines have
is read behind the switch :data:`SWITCHED` ties it to. The attributes
the plugin still reads with a default, because an instance may lack them
or be ``None`` on any line, are listed in :data:`OPTIONAL_READS`.

What a drift does (:func:`check`, at ``register()``):

- a name missing, or a callable whose parameters differ from the declared
  ones: the install is refused whole (one line naming each drifted name;
  vLLM keeps its own pool, as stock);
- a function whose body the wiring depends on line by line (declared with
  :attr:`Name.fingerprints`) whose body changed: the connector it belongs
  to (:attr:`Name.connector`) is left unwired with one WARNING until the
  wiring is reviewed (its transfers keep vLLM's own waits, as stock). This
  covers the bodies around a wait the wiring replaces: MooncakeStore's
  send thread (``KVCacheStoreSendingThread._handle_request`` and
  ``_maybe_offload_boundary_states``) synchronizes on the event the wiring
  substitutes and reads the token range the wiring copies as the store's
  read set;
- a changed body of a core name (no connector) refuses the install whole:
  the pool's own methods that the plugin re-implements, vLLM's event
  helpers it borrows, and the scheduler's step methods the plugin wraps
  (``Scheduler.schedule``, ``Scheduler.update_from_output``,
  ``Scheduler._drain_deferred_frees``,
  ``KVCacheManager.take_kv_cache_block_copies``). Every fence hangs on
  those (the step's record after ``schedule``, the step's end before
  ``update_from_output``, the deferred frees tagged with their steps, the
  copies as a flat ``[src, dst, ...]`` list),
  and so does the preemption deferral (``schedule``'s allocation loop
  asking ``has_pending_block_frees``); a fingerprint cannot tell which part
  changed, so only vLLM's own pool (stock) is known safe.

A fingerprint is the first 16 hex digits of the SHA-256 of the function's
syntax tree (:func:`fingerprint`: comments, docstrings and formatting do
not count), so a release that only reformats keeps it.

The module imports neither vLLM nor torch at import time; :func:`check`
imports the declared modules.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import textwrap
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from blockpool.core.errors import BlockPoolError, InvalidArgumentError

__all__ = [
    "CONNECTOR_NAMES",
    "OPTIONAL_READS",
    "SURFACES",
    "SWITCHED",
    "WORKER_HALF",
    "WORKER_HOOKS",
    "Drift",
    "Name",
    "Surface",
    "SurfaceError",
    "active",
    "check",
    "derive",
    "fingerprint",
    "fingerprint_source",
    "report",
    "resolve",
    "select",
    "set_active",
]


class SurfaceError(BlockPoolError, LookupError):
    """The running vLLM is not one the plugin has a declared surface for
    (no line's markers are present, or its version's line lacks them)."""


@attrs.frozen
class Name:
    """One vLLM name the plugin depends on.

    Attributes:
        target: ``"module:Qualified.name"`` (``"vllm.v1.core.block_pool:BlockPool.free_blocks"``).
        params: The callable's parameter names in order (``self`` included
            for methods); for a class declared with ``use="members"``, the
            sorted names of the methods and properties it defines itself (a
            method vLLM adds to its ``BlockPool`` is a drift: the plugin's
            pool would lack it); ``None`` to check presence only.
        fingerprints: The accepted :func:`fingerprint` s of its body; empty:
            the body is not checked.
        connector: The KV connector this name belongs to (a drift leaves
            that connector unwired), :data:`WORKER_HOOKS` (a drift leaves
            every connector with a worker half unwired), or ``None`` (a
            drift refuses the install).
        use: How the plugin uses it: ``replaced`` (re-implemented by
            ``VllmBlockPool``), ``wrapped``, ``borrowed`` (called as
            vLLM's own), ``members`` (a class whose surface the plugin's
            types imitate), ``read``, ``field`` (an instance attribute the
            plugin reads by name: :attr:`params` and :attr:`fingerprints`
            unused; present when the class or a base defines it, declares
            it as a dataclass field or annotation, or assigns
            ``self.<name>`` in its source) or ``marker``.
    """

    target: str
    params: tuple[str, ...] | None = None
    fingerprints: tuple[str, ...] = ()
    connector: str | None = None
    use: str = "read"

    @property
    def module(self) -> str:
        """The module part of :attr:`target`."""
        return self.target.partition(":")[0]

    @property
    def qualname(self) -> str:
        """The attribute path part of :attr:`target`."""
        return self.target.partition(":")[2]


@attrs.frozen
class Surface:
    """The vLLM names of one release line, and the switches for what
    differs between lines.

    A line is one table of rows (:attr:`rows`, one :class:`Name` per
    target); its rows whose ``use`` is ``"marker"`` are its
    :attr:`markers`, the others its :attr:`names`. The first declared line
    is written out whole; :func:`derive` builds each later one from the
    line before it and the rows that changed.

    Attributes:
        line: ``"major.minor"`` (``"0.34"``).
        rows: Every name the plugin depends on in this line, markers
            included, in table order.
        event_extra_keys: ``BlockPool``'s method computing a block's event
            extra keys (``"generate_event_extra_keys"``), or ``None`` where
            the pool has none and ``kv_cache_utils.generate_block_hash_extra_keys``
            computes them (0.32).
        lookahead_token_ids: ``BlockPool``'s method giving the tokens of a
            block's lookahead window, or ``None``: the line has no
            lookahead hashing (its ``_build_block_stored_event`` takes no
            ``lookahead_token_ids``).
        access_hook_on_null: ``BlockPool.touch`` calls the metrics
            collector's ``on_block_accessed`` for the null block too.
        weak_pool_ref: ``KVCacheBlock.pool`` is a ``weakref.ref`` to the
            pool (else the pool itself).
        evict_first: ``BlockPool.free_blocks`` takes ``evict_first``.
        v1_model_runner: The line has Model Runner V1's
            ``KVConnectorModelRunnerMixin`` (the worker hooks wrap it beside
            Model Runner V2's ``ActiveKVConnector``).
        offloading_failed_jobs: The Offloading connector reports failed
            copies in ``failed_jobs``.
        offloading_sync_loads: The Offloading connector's load jobs say
            whether they complete before the step's forward
            (``TransferJob.sync``).
        connectors: The KV connectors whose wiring was reviewed against
            this line; the plugin leaves any other connector unwired here.
        markers: The rows whose ``use`` is ``"marker"``, in table order:
            names (with signatures) only this line has, by whose presence
            it is recognised (computed from :attr:`rows`).
        names: The other rows, in table order (computed).

    Raises:
        InvalidArgumentError: two rows name one target, or no row is a
            marker (a line nothing would recognise).
    """

    line: str
    rows: tuple[Name, ...]
    event_extra_keys: str | None
    lookahead_token_ids: str | None
    access_hook_on_null: bool
    weak_pool_ref: bool
    evict_first: bool
    v1_model_runner: bool
    offloading_failed_jobs: bool
    offloading_sync_loads: bool
    connectors: tuple[str, ...] = ()
    markers: tuple[Name, ...] = attrs.field(init=False, default=(), eq=False, repr=False)
    names: tuple[Name, ...] = attrs.field(init=False, default=(), eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        counts = Counter(n.target for n in self.rows)
        twice = sorted(t for t, c in counts.items() if c > 1)
        if twice:
            raise InvalidArgumentError(f"vLLM {self.line}: rows declared twice: {', '.join(twice)}")
        markers = tuple(n for n in self.rows if n.use == "marker")
        if not markers:
            raise InvalidArgumentError(f"vLLM {self.line}: no marker row (nothing would recognise the line)")
        object.__setattr__(self, "markers", markers)
        object.__setattr__(self, "names", tuple(n for n in self.rows if n.use != "marker"))

    def all_names(self) -> tuple[Name, ...]:
        """Markers then names (the order :func:`check` and the printed
        table use). O(names)."""
        return self.markers + self.names

    def row(self, target: str) -> Name | None:
        """The row declaring ``target`` (``"module:Qualified.name"``), or
        ``None``. O(names)."""
        return next((n for n in self.rows if n.target == target), None)

    def declares(self, module: str, qualname: str) -> bool:
        """Whether ``module:qualname`` is declared (a marker or a name). O(names)."""
        return self.row(f"{module}:{qualname}") is not None

    def connector_names(self, connector: str) -> tuple[Name, ...]:
        """The names that belong to ``connector``. O(names)."""
        return tuple(n for n in self.names if n.connector == connector)


@attrs.frozen
class Drift:
    """One row of :func:`check`'s table.

    Attributes:
        name: The declared name.
        status: ``"ok"``, ``"missing"`` (not importable or no such
            attribute), ``"unavailable"`` (its module needs a third-party
            package that is not installed), ``"signature"`` (other
            parameters or members) or ``"body"`` (an unknown fingerprint).
        expected: What the declaration says (parameters or fingerprints).
        found: What the running vLLM has.
    """

    name: Name
    status: str
    expected: str
    found: str

    @property
    def ok(self) -> bool:
        """No drift."""
        return self.status == "ok"

    @property
    def refuses_install(self) -> bool:
        """A drift that refuses the install whole (not a connector's)."""
        return not self.ok and self.name.connector is None


# ----------------------------------------------------------------------
# looking names up
# ----------------------------------------------------------------------


def resolve(target: str) -> Any:
    """Import ``target``'s module and walk its attribute path; the object
    as found in the class's ``__dict__`` for the last step when that is a
    ``staticmethod`` / ``classmethod`` (unwrapped). O(path length) plus
    the import.

    Raises:
        ImportError: the module does not import.
        AttributeError: an attribute of the path is missing.
    """
    module, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        owner = obj
        obj = getattr(owner, part)
        raw = owner.__dict__.get(part) if isinstance(owner, type) else None
        if isinstance(raw, (staticmethod, classmethod)):
            obj = raw.__func__
    return obj


def _params(obj: Any) -> tuple[str, ...] | None:
    fn = inspect.unwrap(obj)
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


# The connector API's base class: its default hooks (``bind_gpu_block_pool``)
# are what a connector that does not override them has, and what the plugin
# wraps on the connector's class.
_HOOK_BASE = ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1")


def _inherited_from(name: Name) -> str | None:
    """For a class attribute that the class does not define itself, the
    base class that does (``module.Qualname``), unless that base is vLLM's
    connector base class; else ``None``. A method vLLM dropped from a
    class resolves to a base class's (``Scheduler.schedule`` to the
    abstract ``SchedulerInterface.schedule``): a drift."""
    module, _, qualname = name.target.partition(":")
    owner_path, _, attr = qualname.rpartition(".")
    if not owner_path:
        return None
    owner = resolve(f"{module}:{owner_path}")
    if not isinstance(owner, type) or attr in owner.__dict__:
        return None
    base = next((c for c in owner.__mro__ if attr in c.__dict__), None)
    if base is None or (base.__module__, base.__qualname__) == _HOOK_BASE:
        return None
    return f"{base.__module__}.{base.__qualname__}"


def _members(cls: Any) -> tuple[str, ...]:
    """The methods and properties ``cls`` defines itself, sorted."""
    return tuple(
        sorted(
            k
            for k, v in vars(cls).items()
            if inspect.isfunction(v) or isinstance(v, (property, staticmethod, classmethod))
        )
    )


def fingerprint(obj: Any) -> str | None:
    """First 16 hex digits of the SHA-256 of ``obj``'s syntax tree without
    docstrings (``ast.dump`` of its dedented source), or ``None`` when its
    source is not available. A function the plugin wrapped is fingerprinted
    as vLLM wrote it (through ``__wrapped__``). O(size of the source).
    """
    fn = inspect.unwrap(obj)
    try:
        return _digest(inspect.getsource(fn))
    except (OSError, TypeError, SyntaxError):
        return None


def fingerprint_source(source: str, qualname: str) -> str | None:
    """:func:`fingerprint` of the function ``qualname`` (``"Class.method"``)
    defined in the module text ``source``, without importing it: how a
    release line that is not installed is fingerprinted from its release's
    source distribution. The same digest as :func:`fingerprint` of the
    imported function (its decorators included, as ``inspect.getsource``
    gives them); ``None`` when ``source`` defines no such function (or
    the class only inherits it). O(size of ``source``).

    Raises:
        InvalidArgumentError: ``source`` is not Python.
    """
    try:
        node: Any = ast.parse(source)
    except SyntaxError as exc:
        raise InvalidArgumentError(f"not Python source: {exc}") from exc
    for part in qualname.split("."):
        found = [
            n
            for n in getattr(node, "body", ())
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part
        ]
        if not found:
            return None
        node = found[-1]  # the last definition wins, as at import
    if isinstance(node, ast.ClassDef):
        return None
    first = min([d.lineno for d in node.decorator_list] + [node.lineno])
    return _digest("".join(source.splitlines(keepends=True)[first - 1 : node.end_lineno]))


def _digest(source: str) -> str:
    """The fingerprint of one function's source text (dedented here)."""
    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree, include_attributes=False).encode()).hexdigest()[:16]


def _defines_field(cls: type, attr: str) -> bool:
    """Whether instances of ``cls`` carry ``attr``: a class attribute, a
    dataclass field or an annotation of ``cls`` or a base, or a
    ``self.<attr>`` assignment in the source of one. O(source of the
    MRO)."""
    for c in cls.__mro__:
        if c is object:
            continue
        if attr in vars(c) or attr in vars(c).get("__annotations__", {}):
            return True
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(c)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and node.attr == attr
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                return True
    return False


def _check_one(name: Name) -> Drift:
    if name.use == "field":
        owner_path, _, attr = name.target.rpartition(".")
        owner = _check_one(Name(owner_path))
        if not owner.ok:
            return Drift(name, owner.status, _expected(name), owner.found)
        cls = resolve(owner_path)
        if not isinstance(cls, type) or not _defines_field(cls, attr):
            return Drift(
                name,
                "missing",
                _expected(name),
                f"no attribute {attr} in {cls.__module__}.{cls.__qualname__} or its bases",
            )
        return Drift(name, "ok", _expected(name), _expected(name))
    try:
        obj = resolve(name.target)
    except ModuleNotFoundError as exc:
        # A third-party package a connector needs is not installed: that
        # connector cannot run here at all (not a drift of vLLM's).
        third_party = exc.name is not None and exc.name.split(".")[0] != "vllm"
        status = "unavailable" if third_party else "missing"
        return Drift(name, status, _expected(name), f"{type(exc).__name__}: {exc}")
    except ImportError as exc:
        # A connector's own third-party package that does not import here
        # (LMCache without its compute backend): it cannot run here either.
        status = "missing" if name.module.split(".")[0] == "vllm" else "unavailable"
        return Drift(name, status, _expected(name), f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001  (any failure to find it is a drift)
        return Drift(name, "missing", _expected(name), f"{type(exc).__name__}: {exc}")
    inherited = _inherited_from(name)
    if inherited is not None:
        return Drift(name, "missing", _expected(name), f"only inherited from {inherited}")
    if name.use == "members":
        members = _members(obj)
        if members != name.params:
            return Drift(name, "signature", _expected(name), "members (" + ", ".join(members) + ")")
    elif name.params is not None:
        found = _params(obj)
        if found != name.params:
            return Drift(name, "signature", _expected(name), "(" + ", ".join(found or ("?",)) + ")")
    if name.fingerprints:
        fp = fingerprint(obj)
        if fp not in name.fingerprints:
            return Drift(name, "body", _expected(name), f"body {fp}")
    return Drift(name, "ok", _expected(name), _expected(name))


def _expected(name: Name) -> str:
    if name.use == "field":
        return "attribute"
    parts = []
    if name.params is not None:
        parts.append("(" + ", ".join(name.params) + ")")
    if name.fingerprints:
        parts.append("body " + "|".join(name.fingerprints))
    return " ".join(parts) or "present"


def check(surface: Surface, names: Iterable[Name] | None = None) -> list[Drift]:
    """Check every declared name of ``surface`` (or ``names``) against the
    running vLLM: one :class:`Drift` per name, in declaration order.
    Imports the declared modules; changes nothing. A module that does not
    import for want of a third-party package gives ``"unavailable"`` (a
    connector that cannot run here; ``register()`` skips it quietly).
    O(names) imports, signature reads and, for fingerprinted names, source
    parses (about 45 ms for vLLM 0.34's table once its modules are
    imported).
    """
    return [_check_one(n) for n in (surface.all_names() if names is None else names)]


# ----------------------------------------------------------------------
# deriving a line from the one before
# ----------------------------------------------------------------------


def derive(
    base: Surface,
    line: str,
    *,
    changed: Iterable[Name] = (),
    added: Mapping[str, Iterable[Name]] | None = None,
    removed: Iterable[str] = (),
    **switches: Any,
) -> Surface:
    """The release line ``line`` as the rows its release changed from
    ``base``'s: every other row, and every switch not given, is
    ``base``'s.

    - each row of ``changed`` replaces ``base``'s row of the same target,
      in its place in the table (a marker of ``base`` that is a plain name
      in ``line`` is a changed row, and so is a name that becomes a
      marker);
    - ``added`` maps the target of a row to the new rows that follow it in
      the table, in order (the anchor may be a changed or an added row);
    - each target of ``removed`` leaves the table;
    - ``switches`` are :class:`Surface` fields other than ``line`` and
      ``rows`` (``evict_first=True``, ``connectors=(...)``), each set to a
      value other than ``base``'s.

    ``base`` is not changed. O(rows + delta).

    >>> old = Surface("9.0", (Name("m:f", ("x",), use="marker"), Name("m:g")), None, None,
    ...               False, False, False, False, False, False)
    >>> new = derive(old, "9.1", changed=(Name("m:f", ("x", "y"), use="marker"),),
    ...              added={"m:f": (Name("m:h"),)}, removed=("m:g",), evict_first=True)
    >>> [(n.target, n.params) for n in new.rows], new.evict_first, len(old.rows)
    ([('m:f', ('x', 'y')), ('m:h', None)], True, 2)

    Raises:
        InvalidArgumentError: a changed row names a target ``base`` does
            not declare, or is the same as ``base``'s row, or two changed
            rows name one target; a switch is given the value ``base``
            has; an added row
            names a target the line already declares; an anchor of
            ``added`` or a removed target is not in the table; a target is
            both changed and removed; a switch is not a :class:`Surface`
            field (or is ``line`` or ``rows``); or the line would declare
            no marker.
    """
    changed, gone = tuple(changed), set(removed)
    twice = sorted(t for t, c in Counter(n.target for n in changed).items() if c > 1)
    if twice:
        raise InvalidArgumentError(f"vLLM {line}: rows changed twice: {', '.join(twice)}")
    table = list(base.rows)
    where = {n.target: i for i, n in enumerate(table)}
    for row in changed:
        i = where.get(row.target)
        if i is None:
            raise InvalidArgumentError(
                f"vLLM {line}: changed row {row.target} is not declared in {base.line}"
            )
        if table[i] == row:
            raise InvalidArgumentError(f"vLLM {line}: changed row {row.target} is as {base.line} declares it")
        table[i] = row
    for anchor, rows in (added or {}).items():
        targets = [n.target for n in table]
        if anchor not in targets:
            raise InvalidArgumentError(f"vLLM {line}: rows added after {anchor}, which is not in the table")
        i = targets.index(anchor)
        for row in rows:
            if any(n.target == row.target for n in table):
                raise InvalidArgumentError(f"vLLM {line}: added row {row.target} is already declared")
            i += 1
            table.insert(i, row)
    missing = sorted(gone - {n.target for n in table})
    if missing:
        raise InvalidArgumentError(f"vLLM {line}: removed rows not in the table: {', '.join(missing)}")
    both = sorted(gone & {n.target for n in changed})
    if both:
        raise InvalidArgumentError(f"vLLM {line}: rows both changed and removed: {', '.join(both)}")
    fields = {f.name for f in attrs.fields(Surface) if f.init} - {"line", "rows"}
    unknown = sorted(set(switches) - fields)
    if unknown:
        raise InvalidArgumentError(f"vLLM {line}: not switches of a surface: {', '.join(unknown)}")
    same = sorted(k for k, v in switches.items() if getattr(base, k) == v)
    if same:
        raise InvalidArgumentError(f"vLLM {line}: switches as {base.line} sets them: {', '.join(same)}")
    return attrs.evolve(base, line=line, rows=tuple(n for n in table if n.target not in gone), **switches)


# ----------------------------------------------------------------------
# the declarations
# ----------------------------------------------------------------------

_BP = "vllm.v1.core.block_pool"
_UTILS = "vllm.v1.core.kv_cache_utils"
_COORD = "vllm.v1.core.kv_cache_coordinator"
_SCHED = "vllm.v1.core.sched.scheduler"
_OUTPUT = "vllm.v1.core.sched.output"
_MGR = "vllm.v1.core.kv_cache_manager"
_EVENTS = "vllm.distributed.kv_events"
_MM = "vllm.multimodal.utils"
_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_V2 = "vllm.v1.worker.gpu.kv_connector"
_MIXIN = "vllm.v1.worker.kv_connector_model_runner_mixin"
_MOONCAKE_S = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler"
_MOONCAKE_W = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker"
_OFFLOAD = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"
_OFFLOAD_S = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
_OFFLOAD_W = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"
_OFFLOAD_G = "vllm.v1.kv_offload.cpu.gpu_worker"
_SIMPLE = "vllm.v1.simple_kv_offload.manager"
_NIXL_C = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector"
_NIXL_S = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler"
_NIXL_W = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"
_SINGLE = "vllm.v1.core.single_type_kv_cache_manager"
_MOONCAKE_C = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator"
_OFFLOAD_C = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common"
_NIXL_BW = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
_KV_UTILS = "vllm.distributed.kv_transfer.kv_connector.utils"
_LMC = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector"
_LMC_A = "lmcache.integration.vllm.vllm_v1_adapter"
_LMC_G = "lmcache.v1.gpu_connector.gpu_connectors"
_LMC_E = "lmcache.v1.cache_engine"
_LMC_B = "lmcache.v1.compute.blend.blender"
_LMP = "lmcache.integration.vllm.lmcache_mp_connector"
_LMP_A = "lmcache.integration.vllm.vllm_multi_process_adapter"
_LMP_M = "lmcache.integration.vllm.lmcache_mp_metadata"
_OUTPUTS = "vllm.v1.outputs"
_CONFIG = "vllm.config"
_KV_IFACE = "vllm.v1.kv_cache_interface"
_OFFLOAD_BASE = "vllm.v1.kv_offload.base"

# Connector names (as blockpool.integrations.vllm.connectors names them).
MOONCAKE, OFFLOADING, SIMPLE, NIXL = "mooncake_store", "offloading", "simple_cpu_offload", "nixl"
LMCACHE, LMCACHE_MP = "lmcache", "lmcache_mp"
CONNECTOR_NAMES: tuple[str, ...] = (MOONCAKE, OFFLOADING, SIMPLE, NIXL, LMCACHE, LMCACHE_MP)
"""Every KV connector the plugin can wire (``blockpool.integrations.vllm.connectors``' names)."""
WORKER_HOOKS = "worker hooks"
"""The :attr:`Name.connector` of the model runners' hooks every worker half
shares (the step record on ``bind_connector_metadata``, ``eN`` after the
forward): a drift there leaves every connector of :data:`WORKER_HALF` unwired."""
WORKER_HALF: tuple[str, ...] = (MOONCAKE, OFFLOADING, NIXL, LMCACHE, LMCACHE_MP)
"""The connectors with a worker half (SimpleCPUOffload's wiring is the
scheduler's alone)."""


def _n(
    target: str,
    params: str | None = None,
    *,
    fp: str | tuple[str, ...] = (),
    connector: str | None = None,
    use: str = "read",
) -> Name:
    """One row: ``params`` as the table prints them, comma-separated
    (``"self, blocks"``; for ``use="members"`` the class's sorted member
    names), ``None`` to check presence only; ``fp`` one accepted
    fingerprint or a tuple of them."""
    names = None if params is None else tuple(p.strip() for p in params.split(","))
    return Name(target, names, (fp,) if isinstance(fp, str) else fp, connector, use)


# The first declared line (0.32) is written out whole; each later line is
# derive()d from the one before it as the rows its release changed, added
# and removed, and the switches that changed. Every row is as found in
# that line's release (x.y.0); its markers are the rows with use="marker".
# ``blockpool check-vllm --surface`` against a new release prints every
# drifted row: the new line is derive(newest, ...) with those rows, each
# reviewed. The fingerprints of a line not installed are computed from its
# release's source distribution (``fingerprint_source`` of the module's
# file).

_ROWS_032 = (
    # vLLM's BlockPool: the class VllmBlockPool stands in for (its members),
    # the methods it re-implements (replaced) and vLLM's own it calls (borrowed).
    _n(
        f"{_BP}:BlockPool",
        (
            "__init__, _build_block_stored_event, _emit_block_removed_events, "
            "_get_partial_block_hash, _get_partial_block_parent_hash_and_start, "
            "_insert_block_hash, _maybe_evict_cached_block, _notify_reuse, "
            "_remove_cached_block_hashes, cache_full_blocks, cache_partial_block, "
            "emit_cached_block_events, evict_blocks, free_blocks, "
            "get_cached_block, get_new_blocks, get_num_free_blocks, get_usage, "
            "is_block_writable, move_block_hashes, reset_prefix_cache, "
            "take_events, touch, unpin_blocks"
        ),
        use="members",
    ),
    _n(
        f"{_BP}:BlockPool.__init__",
        (
            "self, num_gpu_blocks, enable_caching, hash_block_size, "
            "enable_kv_cache_events, metrics_collector, medium"
        ),
        fp="9b457db81707a9fc",
        use="marker",
    ),
    _n(
        f"{_BP}:BlockPool.get_cached_block",
        "self, block_hash, kv_cache_group_ids",
        fp="de1e3e8b42ddd5d1",
        use="replaced",
    ),
    _n(
        f"{_BP}:BlockPool.cache_full_blocks",
        (
            "self, request, blocks, num_cached_blocks, num_full_blocks, "
            "block_size, kv_cache_group_id, block_mask"
        ),
        fp="d57e464beb120a40",
        use="replaced",
    ),
    _n(
        f"{_BP}:BlockPool.cache_partial_block",
        "self, request, block, num_tokens, kv_cache_group_id, block_size, replace_existing_hashes",
        fp="ef199acb5469078a",
        use="replaced",
    ),
    _n(
        f"{_BP}:BlockPool.move_block_hashes",
        "self, src_block, dst_block",
        fp="e4e86dfd60be9c9e",
        use="replaced",
    ),
    _n(f"{_BP}:BlockPool.get_new_blocks", "self, num_blocks", fp="4b0fc9dc5c4cf82e", use="replaced"),
    _n(f"{_BP}:BlockPool.touch", "self, blocks", fp="9b2bd2b42fe426d1", use="replaced"),
    _n(f"{_BP}:BlockPool.free_blocks", "self, ordered_blocks", fp="6644c0be8fd3622e", use="replaced"),
    _n(f"{_BP}:BlockPool.unpin_blocks", "self, blocks, on_reuse", fp="640aa817f449b2a7", use="replaced"),
    _n(f"{_BP}:BlockPool._notify_reuse", "self, blocks", fp="d4fb5c649b8c5f97", use="replaced"),
    _n(f"{_BP}:BlockPool._maybe_evict_cached_block", "self, block", fp="38134b1632e83780", use="replaced"),
    _n(
        f"{_BP}:BlockPool._insert_block_hash",
        "self, block_hash_with_group_id, block, num_tokens",
        fp="29610decbb687a0d",
        use="replaced",
    ),
    _n(f"{_BP}:BlockPool._remove_cached_block_hashes", "self, block", fp="2c1eb6c998f16c1c", use="borrowed"),
    _n(f"{_BP}:BlockPool.evict_blocks", "self, block_ids", fp="4e2fa1ea0ee7bc4f", use="replaced"),
    _n(f"{_BP}:BlockPool.reset_prefix_cache", "self", fp="370db751132705c8", use="replaced"),
    _n(f"{_BP}:BlockPool.get_num_free_blocks", "self", fp="0f3938274139b325", use="replaced"),
    _n(f"{_BP}:BlockPool.get_usage", "self", fp="a85da63d3960a71d", use="replaced"),
    _n(f"{_BP}:BlockPool.is_block_writable", "self, block", fp="7b038e005a83fee4", use="replaced"),
    _n(f"{_BP}:BlockPool.take_events", "self", fp="7276bc809ee5bac5", use="replaced"),
    _n(
        f"{_BP}:BlockPool.emit_cached_block_events",
        "self, request, num_cached_blocks, block_size, kv_cache_group_id",
        fp="2291ee685e9d22c6",
        use="borrowed",
    ),
    _n(
        f"{_BP}:BlockPool._build_block_stored_event",
        (
            "self, request, block_hashes, parent_block_hash, start_token_idx, "
            "end_token_idx, block_size, kv_cache_group_id, extra_keys_list"
        ),
        fp="e82af77fc0cb240d",
        use="marker",
    ),
    _n(
        f"{_BP}:BlockPool._get_partial_block_hash",
        "self, request, num_tokens",
        fp="9bbd0cf8ce66be27",
        use="borrowed",
    ),
    _n(
        f"{_BP}:BlockPool._get_partial_block_parent_hash_and_start",
        "self, request, num_tokens",
        fp="b1077769e7f0c9d4",
        use="borrowed",
    ),
    _n(
        f"{_BP}:BlockPool._emit_block_removed_events",
        "self, block_hashes",
        fp="ea9d8b3515952d80",
        use="borrowed",
    ),
    # The block types and helpers the pool imitates, borrows or reads.
    _n(
        f"{_BP}:BlockHashToBlockMap",
        "__init__, __len__, _unexpected_blocks_type, contain, get_one_block, insert, pop",
        use="members",
    ),
    _n(
        f"{_UTILS}:KVCacheBlock",
        "__eq__, __init__, __repr__, block_hash, block_hash_num_tokens, reset_hash, set_block_hash",
        use="members",
    ),
    _n(
        f"{_UTILS}:FreeKVCacheBlockQueue",
        (
            "__init__, append, append_n, get_all_free_blocks, iter_blocks_after, "
            "popleft, popleft_n, prepend_n, remove"
        ),
        use="members",
    ),
    _n(f"{_UTILS}:make_block_hash_with_group_id", "block_hash, group_id", use="borrowed"),
    _n(
        f"{_UTILS}:resolve_block_hashes",
        "block_hashes, hash_block_size, block_size, supports_fine_grained_hash_lookup, alignment_tokens",
        use="borrowed",
    ),
    _n(f"{_UTILS}:maybe_convert_block_hash", "hash_bytes", use="borrowed"),
    _n(
        f"{_UTILS}:generate_block_hash_extra_keys",
        "request, start_token_idx, end_token_idx, start_mm_idx",
        use="borrowed",
    ),
    _n(f"{_COORD}:BlockPool"),
    _n(f"{_EVENTS}:MEDIUM_GPU"),
    _n(f"{_EVENTS}:AllBlocksCleared"),
    _n(f"{_EVENTS}:KVCacheEvent"),
    _n(f"{_MM}:get_mm_features_in_window", "mm_features, start, end", use="borrowed"),
    # The scheduler's step and the KV cache manager's reads the plugin wraps
    # or reads (the step record, the deferred frees, the copies).
    _n(
        f"{_SCHED}:Scheduler.__init__",
        (
            "self, vllm_config, kv_cache_config, structured_output_manager, "
            "block_size, hash_block_size, mm_registry, include_finished_set, "
            "log_stats"
        ),
        use="wrapped",
    ),
    _n(f"{_SCHED}:Scheduler.schedule", "self, throttle_prefills", fp="3d1ad516a1a934a0", use="wrapped"),
    _n(
        f"{_SCHED}:Scheduler.update_from_output",
        "self, scheduler_output, model_runner_output",
        fp="e3a4efe6c229edab",
        use="wrapped",
    ),
    _n(f"{_SCHED}:Scheduler._drain_deferred_frees", "self", fp="557dac6fbad8c6de", use="wrapped"),
    _n(f"{_MGR}:KVCacheManager.take_kv_cache_block_copies", "self", fp="695efba83268cacb", use="wrapped"),
    _n(f"{_MGR}:KVCacheManager.get_block_ids", "self, request_id", fp="6928ce6c9df05c51"),
    _n(f"{_MGR}:KVCacheManager.get_blocks", "self, request_id", fp="d71378a6efe7f144"),
    _n(f"{_COORD}:KVCacheCoordinator.get_blocks", "self, request_id", fp="c0ed00f8684b9a2d"),
    _n(f"{_BASE}:KVConnectorBase_V1.has_pending_block_frees", "self", use="wrapped"),
    _n(
        f"{_COORD}:KVCacheCoordinator.get_num_blocks_to_allocate",
        (
            "self, request_id, num_tokens, new_computed_blocks, "
            "num_encoder_tokens, total_computed_tokens, num_local_computed_tokens, "
            "num_tokens_main_model, apply_admission_cap, prefill_end"
        ),
        use="wrapped",
    ),
    _n(f"{_SCHED}:Scheduler._handle_invalid_blocks", "self, invalid_block_ids, num_scheduled_tokens"),
    _n(f"{_OUTPUT}:SchedulerOutput.new_block_ids_to_zero"),
    _n(f"{_OUTPUT}:SchedulerOutput.total_num_scheduled_tokens", use="field"),
    # The managers' block sizes (the block-table index of a token), read
    # once the scheduler is built.
    _n(f"{_SCHED}:Scheduler.kv_cache_manager", use="field"),
    _n(f"{_MGR}:KVCacheManager.coordinator", use="field"),
    _n(f"{_COORD}:KVCacheCoordinator.single_type_managers", use="field"),
    _n(f"{_SINGLE}:SingleTypeKVCacheManager.block_size", use="field"),
    # The step's written blocks: the tails of the live tables that vLLM's
    # own KVCacheCoordinator.get_blocks (declared with its body) reads.
    _n(f"{_SINGLE}:SingleTypeKVCacheManager.req_to_blocks", use="field"),
    # The scheduler's connector and pools, the step's outputs, and the
    # connectors' configuration the wrappers read (the pool's hazards, the
    # connector reports, the block size and the ranks a store waits for).
    _n(f"{_SCHED}:Scheduler.connector", use="field"),
    _n(f"{_MGR}:KVCacheManager.block_pool", use="field"),
    _n(f"{_COORD}:KVCacheCoordinator.block_pool", use="field"),
    _n(f"{_OUTPUTS}:ModelRunnerOutput.kv_connector_output", use="field"),
    _n(f"{_OUTPUTS}:KVConnectorOutput.kv_connector_worker_meta", use="field"),
    _n(f"{_CONFIG}:VllmConfig.cache_config", use="field"),
    _n(f"{_CONFIG}:VllmConfig.parallel_config", use="field"),
    _n(f"{_CONFIG}:CacheConfig.block_size", use="field"),
    _n(f"{_CONFIG}:ParallelConfig.world_size", use="field"),
    _n(f"{_SCHED}:Scheduler.vllm_config", use="field"),
    _n(f"{_CONFIG}:VllmConfig.speculative_config", use="field"),
    _n(f"{_CONFIG}:ParallelConfig.prefill_context_parallel_size", use="field"),
    _n(f"{_KV_IFACE}:KVCacheConfig.kv_cache_groups", use="field"),
    _n(f"{_KV_IFACE}:KVCacheGroupSpec.kv_cache_spec", use="field"),
    _n(f"{_KV_IFACE}:KVCacheSpec.block_size", use="field"),
    # The step's scheduled requests and block tables (the step's writes).
    _n(f"{_OUTPUT}:SchedulerOutput.kv_connector_block_state", use="field"),
    _n(f"{_OUTPUT}:SchedulerOutput.num_scheduled_tokens", use="field"),
    _n(f"{_OUTPUT}:SchedulerOutput.scheduled_new_reqs", use="field"),
    _n(f"{_OUTPUT}:SchedulerOutput.scheduled_cached_reqs", use="field"),
    _n(f"{_OUTPUT}:KVConnectorBlockState.req_ids", use="field"),
    _n(f"{_OUTPUT}:KVConnectorBlockState.resolve_block_ids", use="field"),
    # A GPU transfer spec's blocks (an Offloading job's GPU side) and a
    # SimpleCPUOffload load's block ids.
    _n(f"{_OFFLOAD_BASE}:GPULoadStoreSpec.block_ids", connector=OFFLOADING, use="field"),
    _n(f"{_SIMPLE}:LoadRequestState.transfer_meta", connector=SIMPLE, use="field"),
    _n(f"{_LMP_A}:LMCacheMPSchedulerAdapter._mq_timeout", connector=LMCACHE_MP, use="field"),
    # The model runners' hooks every worker half shares, and the connector API's
    # default hooks.
    _n(
        f"{_BASE}:KVConnectorBase_V1.bind_connector_metadata",
        "self, connector_metadata",
        connector=WORKER_HOOKS,
        use="wrapped",
    ),
    _n(f"{_BASE}:KVConnectorBase_V1.bind_gpu_block_pool", "self, gpu_block_pool", use="wrapped"),
    _n(
        f"{_V2}:ActiveKVConnector.post_forward",
        "self, finished_req_ids",
        connector=WORKER_HOOKS,
        use="wrapped",
    ),
    _n(
        f"{_MIXIN}:KVConnectorModelRunnerMixin._get_kv_connector_output",
        "scheduler_output, defer_finalize",
        connector=WORKER_HOOKS,
        use="wrapped",
    ),
    _n(f"{_MIXIN}:KVConnectorModelRunnerMixin.finalize_kv_connector", connector=WORKER_HOOKS, use="wrapped"),
    _n(f"{_MIXIN}:has_kv_transfer_group", connector=WORKER_HOOKS, use="borrowed"),
    _n(f"{_MIXIN}:get_kv_transfer_group", connector=WORKER_HOOKS, use="borrowed"),
    # The step's connector metadata the worker hooks read (eN on the compute
    # stream, before the connectors' loads).
    _n(f"{_OUTPUT}:SchedulerOutput.kv_connector_metadata", connector=WORKER_HOOKS, use="field"),
    _n(f"{_V2}:ActiveKVConnector.kv_connector", connector=WORKER_HOOKS, use="field"),
    _n(f"{_V2}:ActiveKVConnector._disabled", connector=WORKER_HOOKS, use="field"),
    _n(f"{_BASE}:KVConnectorBase_V1._connector_metadata", connector=WORKER_HOOKS, use="field"),
    # MooncakeStore.
    _n(
        f"{_MOONCAKE_S}:MooncakeStoreScheduler.bind_gpu_block_pool",
        "self, gpu_block_pool",
        fp="ca4c2f4892d5ac82",
        connector=MOONCAKE,
        use="wrapped",
    ),
    _n(
        f"{_MOONCAKE_S}:MooncakeStoreScheduler.build_connector_meta",
        "self, scheduler_output",
        fp="e69ab5087a2f8380",
        connector=MOONCAKE,
        use="wrapped",
    ),
    _n(
        f"{_MOONCAKE_S}:MooncakeStoreScheduler.update_connector_output",
        "self, connector_output",
        fp="d254be99c5247f89",
        connector=MOONCAKE,
        use="wrapped",
    ),
    _n(
        f"{_MOONCAKE_W}:MooncakeStoreWorker.wait_for_save",
        "self, metadata",
        fp="3cc967d6118c7bd9",
        connector=MOONCAKE,
        use="wrapped",
    ),
    _n(
        f"{_MOONCAKE_W}:KVCacheStoreRecvingThread._handle_request",
        "self, req_meta",
        fp="3750f3c99d7e065e",
        connector=MOONCAKE,
        use="wrapped",
    ),
    _n(
        f"{_MOONCAKE_W}:KVCacheStoreSendingThread.finish_store_job",
        "self, req_meta",
        fp="a99457c4ac716926",
        connector=MOONCAKE,
        use="wrapped",
    ),
    _n(
        f"{_MOONCAKE_W}:KVCacheStoreSendingThread._handle_request",
        "self, req_meta",
        fp="bc97d42c6b1ff698",
        connector=MOONCAKE,
    ),
    _n(
        f"{_MOONCAKE_W}:KVCacheStoreSendingThread._maybe_offload_boundary_states",
        "self, req_meta",
        fp="8d8e4c0791c337a5",
        connector=MOONCAKE,
    ),
    # The store groups and the aligned length a store job reads (as the send
    # thread computes them).
    _n(f"{_MOONCAKE_S}:MooncakeStoreScheduler._store_group_ids", connector=MOONCAKE, use="field"),
    _n(f"{_MOONCAKE_S}:MooncakeStoreScheduler._boundary_state_group_ids", connector=MOONCAKE, use="field"),
    _n(f"{_MOONCAKE_S}:MooncakeStoreScheduler._store_coord", connector=MOONCAKE, use="field"),
    _n(f"{_MOONCAKE_C}:MooncakeStoreCoordinator.lcm_block_size", connector=MOONCAKE, use="field"),
    _n(f"{_MOONCAKE_S}:MooncakeStoreScheduler._block_size", connector=MOONCAKE, use="field"),
    _n(f"{_MOONCAKE_S}:MooncakeStoreScheduler._pinned_saves", connector=MOONCAKE, use="field"),
    # Offloading.
    _n(
        f"{_OFFLOAD}:OffloadingConnector.bind_gpu_block_pool",
        "self, gpu_block_pool",
        fp="36e91e17b6e93b72",
        connector=OFFLOADING,
        use="wrapped",
    ),
    _n(
        f"{_OFFLOAD_S}:OffloadingConnectorScheduler.build_connector_meta",
        "self, scheduler_output",
        fp="eace7e2e380dd8c0",
        connector=OFFLOADING,
        use="wrapped",
    ),
    _n(
        f"{_OFFLOAD_S}:OffloadingConnectorScheduler.update_connector_output",
        "self, connector_output",
        fp="bd7652774ed007c1",
        connector=OFFLOADING,
        use="wrapped",
    ),
    _n(
        f"{_OFFLOAD_W}:OffloadingConnectorWorker.prepare_store_kv",
        "self, metadata",
        fp="8c23977f2dce31e3",
        connector=OFFLOADING,
        use="wrapped",
    ),
    _n(
        f"{_OFFLOAD_W}:OffloadingConnectorWorker.start_kv_transfers",
        "self, metadata",
        fp="5477f719fe5cf381",
        connector=OFFLOADING,
        use="wrapped",
    ),
    _n(
        f"{_OFFLOAD_W}:OffloadingConnectorWorker.handle_preemptions",
        "self, kv_connector_metadata",
        fp="3948e8cba6be742c",
        connector=OFFLOADING,
        use="wrapped",
    ),
    _n(
        f"{_OFFLOAD_G}:SingleDirectionOffloadingHandler.transfer_async",
        "self, job_id, src_spec, dst_spec",
        fp="0ba31dc604c3b292",
        connector=OFFLOADING,
        use="wrapped",
    ),
    # SimpleCPUOffload (its wiring is the scheduler's alone).
    _n(
        f"{_SIMPLE}:SimpleCPUOffloadScheduler.bind_gpu_block_pool",
        "self, gpu_block_pool",
        fp="ca4c2f4892d5ac82",
        connector=SIMPLE,
        use="wrapped",
    ),
    _n(
        f"{_SIMPLE}:SimpleCPUOffloadScheduler.build_connector_meta",
        "self, scheduler_output",
        fp="65ac902ac80d9029",
        connector=SIMPLE,
        use="wrapped",
    ),
    _n(
        f"{_SIMPLE}:SimpleCPUOffloadScheduler.update_connector_output",
        "self, connector_output",
        fp="f820b6bb35ddaa3b",
        connector=SIMPLE,
        use="wrapped",
    ),
    # NIXL.
    _n(
        f"{_NIXL_C}:NixlBaseConnector.bind_gpu_block_pool",
        "self, gpu_block_pool",
        fp="36e91e17b6e93b72",
        connector=NIXL,
        use="wrapped",
    ),
    _n(
        f"{_NIXL_S}:NixlBaseConnectorScheduler.build_connector_meta",
        "self, scheduler_output",
        fp="3e806cb82525955a",
        connector=NIXL,
        use="wrapped",
    ),
    _n(
        f"{_NIXL_W}:NixlPullConnectorWorker._read_blocks_for_req",
        "self, req_id, meta",
        fp="34ba39252dd0c963",
        connector=NIXL,
        use="wrapped",
    ),
    _n(
        f"{_NIXL_W}:NixlPullConnectorWorker.start_load_kv",
        "self, metadata",
        fp="788cda9715142780",
        connector=NIXL,
        use="wrapped",
    ),
    # vLLM methods the connector wrappers call on vLLM's own objects (to report
    # a load the wiring declined as vLLM reports a failed one), declared on the
    # class that defines them.
    _n(
        f"{_NIXL_BW}:NixlBaseConnectorWorker._handle_failed_transfer",
        "self, req_id, handle, failed_req_ids, record_failed_transfer",
        connector=NIXL,
        use="borrowed",
    ),
    _n(f"{_NIXL_BW}:NixlBaseConnectorWorker._recv_failures", connector=NIXL, use="field"),
    _n(
        f"{_MOONCAKE_W}:KVCacheStoreRecvingThread._report_load_error",
        "self, req_id, block_ids",
        connector=MOONCAKE,
        use="borrowed",
    ),
    _n(
        f"{_MOONCAKE_W}:KVTransferThread.set_finished_request",
        "self, req_id",
        connector=MOONCAKE,
        use="borrowed",
    ),
    _n(
        f"{_MOONCAKE_W}:KVCacheStoreSendingThread.add_request",
        "self, request",
        connector=MOONCAKE,
        use="borrowed",
    ),
    # The load thread's failed GETs (a load that ran but failed).
    _n(f"{_MOONCAKE_W}:KVCacheStoreRecvingThread.request_queue", connector=MOONCAKE, use="field"),
    _n(f"{_MOONCAKE_W}:KVCacheStoreRecvingThread.done_task_lock", connector=MOONCAKE, use="field"),
    _n(f"{_MOONCAKE_W}:KVCacheStoreRecvingThread._failed_requests", connector=MOONCAKE, use="field"),
    # Whether an Offloading worker copies its node's stores.
    _n(f"{_OFFLOAD_W}:OffloadingConnectorWorker._is_store_writer", connector=OFFLOADING, use="field"),
    # The store worker's state its wait_for_save wrapper reads, and the
    # Offloading handler's copy kernel and transfers its wrapper orders.
    _n(f"{_MOONCAKE_W}:MooncakeStoreWorker._capacity_only", connector=MOONCAKE, use="field"),
    _n(f"{_MOONCAKE_W}:MooncakeStoreWorker.can_put", connector=MOONCAKE, use="field"),
    _n(f"{_MOONCAKE_W}:MooncakeStoreWorker.kv_send_thread", connector=MOONCAKE, use="field"),
    _n(
        f"{_OFFLOAD_G}:SingleDirectionOffloadingHandler._swap_blocks_batch", connector=OFFLOADING, use="field"
    ),
    _n(f"{_OFFLOAD_G}:SingleDirectionOffloadingHandler._transfers", connector=OFFLOADING, use="field"),
    # The schedulers' state the Offloading and SimpleCPUOffload planners and
    # reporters read.
    _n(f"{_OFFLOAD_S}:OffloadingConnectorScheduler.config", connector=OFFLOADING, use="field"),
    _n(f"{_SIMPLE}:SimpleCPUOffloadScheduler.block_size", connector=SIMPLE, use="field"),
    _n(f"{_SIMPLE}:SimpleCPUOffloadScheduler._reqs_to_load", connector=SIMPLE, use="field"),
    _n(f"{_SIMPLE}:SimpleCPUOffloadScheduler._expected_worker_count", connector=SIMPLE, use="field"),
    _n(f"{_SIMPLE}:SimpleCPUOffloadScheduler._store_event_pending_counts", connector=SIMPLE, use="field"),
    # LMCache's in-process connector: vLLM's LMCacheConnectorV1 (the same module
    # in 0.32, 0.33 and 0.34) and the names of LMCache's own adapter the wiring
    # reads (lmcache 0.5.6; "unavailable" where LMCache is not installed).
    _n(
        f"{_LMC}:LMCacheConnectorV1.bind_gpu_block_pool",
        "self, gpu_block_pool",
        fp="36e91e17b6e93b72",
        connector=LMCACHE,
        use="wrapped",
    ),
    _n(
        f"{_LMC}:LMCacheConnectorV1.build_connector_meta",
        "self, scheduler_output",
        fp="94dd6b634b34adb7",
        connector=LMCACHE,
        use="wrapped",
    ),
    _n(
        f"{_LMC}:LMCacheConnectorV1.start_load_kv",
        "self, forward_context, kwargs",
        fp="c57cffb60a9cd174",
        connector=LMCACHE,
        use="wrapped",
    ),
    _n(
        f"{_LMC}:LMCacheConnectorV1.save_kv_layer",
        "self, layer_name, kv_layer, attn_metadata, kwargs",
        fp="0dce499015c55c33",
        connector=LMCACHE,
        use="wrapped",
    ),
    _n(
        f"{_LMC}:LMCacheConnectorV1.wait_for_save",
        "self",
        fp="f252ae9f9347efbc",
        connector=LMCACHE,
        use="wrapped",
    ),
    _n(
        f"{_LMC}:LMCacheConnectorV1.get_block_ids_with_load_errors",
        "self",
        fp="9402bb21703d56b7",
        connector=LMCACHE,
    ),
    _n(
        f"{_LMC_A}:LMCacheConnectorV1Impl.build_connector_meta",
        "self, scheduler_output",
        fp="261050ea1784932e",
        connector=LMCACHE,
    ),
    _n(
        f"{_LMC_A}:LMCacheConnectorV1Impl.start_load_kv",
        "self, forward_context, kwargs",
        fp="cc08572a4a047b92",
        connector=LMCACHE,
    ),
    _n(
        f"{_LMC_A}:LMCacheConnectorV1Impl.save_kv_layer",
        "self, layer_name, kv_layer, attn_metadata, kwargs",
        fp="061473ba3aedde0a",
        connector=LMCACHE,
    ),
    _n(f"{_LMC_A}:LMCacheConnectorV1Impl.wait_for_save", "self", fp="e582cbeb2706b8a4", connector=LMCACHE),
    _n(
        f"{_LMC_A}:LMCacheConnectorV1Impl.get_block_ids_with_load_errors",
        "self",
        fp="1ced966fd707c01b",
        connector=LMCACHE,
    ),
    _n(
        f"{_LMC_A}:ReqMeta.from_request_tracker",
        "tracker, block_size, lmcache_chunk_size, load_spec, discard_partial_chunks, save_decode_cache",
        fp="ec84d264a1412faf",
        connector=LMCACHE,
    ),
    _n(
        f"{_LMC_G}:VLLMPagedMemGPUConnectorV2.to_gpu",
        "self, memory_obj, start, end, kwargs",
        fp="c1e349de06b0aba9",
        connector=LMCACHE,
    ),
    _n(
        f"{_LMC_G}:VLLMPagedMemGPUConnectorV3.to_gpu",
        "self, memory_obj, start, end, kwargs",
        fp="89b388286d9631a9",
        connector=LMCACHE,
    ),
    _n(f"{_LMC_E}:LMCacheEngine.retrieve", "self, tokens, mask, kwargs", connector=LMCACHE),
    _n(f"{_LMC_E}:LMCacheEngine.retrieve_layer", "self, tokens, mask, kwargs", connector=LMCACHE),
    _n(f"{_LMC_E}:LMCacheEngine.store", "self, tokens, hashes, offsets, mask, kwargs", connector=LMCACHE),
    _n(f"{_LMC_E}:LMCacheEngine.store_layer", "self, tokens, mask, kwargs", connector=LMCACHE),
    # The layerwise and blending loads' tokens are recorded once the forward's
    # wait_for_layer_load calls enqueued every layer: on the load stream
    # (paged layerwise) or the current stream (the blending buffer).
    _n(
        f"{_LMC_A}:LMCacheConnectorV1Impl.wait_for_layer_load",
        "self, layer_name",
        fp="ef0fa44731100bf6",
        connector=LMCACHE,
    ),
    _n(
        f"{_LMC_G}:VLLMPagedMemLayerwiseGPUConnector.batched_to_gpu",
        "self, starts, ends, kwargs",
        fp="d778447f8522dae1",
        connector=LMCACHE,
    ),
    _n(
        f"{_LMC_G}:VLLMBufferLayerwiseGPUConnector.batched_to_gpu",
        "self, starts, ends, kwargs",
        fp="b8a2c07a65ca6324",
        connector=LMCACHE,
    ),
    _n(f"{_LMC_B}:LMCBlender.blend", "self, tokens, mask, kwargs", fp="fe660f0e3f0122ec", connector=LMCACHE),
    # The adapter, its engine and its plan the wiring reads.
    _n(f"{_LMC}:LMCacheConnectorV1._lmcache_engine", connector=LMCACHE, use="field"),
    _n(f"{_LMC_A}:LMCacheConnectorV1Impl.lmcache_engine", connector=LMCACHE, use="field"),
    _n(f"{_LMC_A}:LMCacheConnectorV1Impl.kv_role", connector=LMCACHE, use="field"),
    _n(f"{_LMC_A}:LMCacheConnectorMetadata.requests", connector=LMCACHE, use="field"),
    _n(f"{_LMC_E}:LMCacheEngine.gpu_connector", connector=LMCACHE, use="field"),
    # LMCache's multi-process connector: LMCache's own LMCacheMPConnector (the
    # class vLLM's lmcache_mp_connector module resolves to when LMCache's module
    # imports; the same resolver in 0.32, 0.33 and 0.34), the names of LMCache's
    # worker adapter and metadata the wiring reads (lmcache 0.5.6; "unavailable"
    # where LMCache is not installed), and vLLM's aggregation of the ranks'
    # worker metadata (0.33 and 0.34 share a body; 0.32's differs).
    _n(
        f"{_KV_UTILS}:KVOutputAggregator.aggregate",
        "self, outputs, output_rank",
        fp=("cee1e9e583b8e868", "cd11f4198cd8d6c1"),
        connector=LMCACHE_MP,
    ),
    _n(
        f"{_LMP}:LMCacheMPConnector.bind_gpu_block_pool",
        "self, gpu_block_pool",
        fp="9d12429363979d47",
        connector=LMCACHE_MP,
        use="wrapped",
    ),
    _n(
        f"{_LMP}:LMCacheMPConnector.build_connector_meta",
        "self, scheduler_output",
        fp="032068cd8ff02e16",
        connector=LMCACHE_MP,
        use="wrapped",
    ),
    _n(
        f"{_LMP}:LMCacheMPConnector.update_connector_output",
        "self, connector_output",
        fp="50ffa15f6539417d",
        connector=LMCACHE_MP,
        use="wrapped",
    ),
    _n(
        f"{_LMP}:LMCacheMPConnector.start_load_kv",
        "self, forward_context, kwargs",
        fp="33d7f920110758d5",
        connector=LMCACHE_MP,
        use="wrapped",
    ),
    _n(
        f"{_LMP}:LMCacheMPConnector.wait_for_save",
        "self",
        fp="e2a2c871ca9cd70b",
        connector=LMCACHE_MP,
        use="wrapped",
    ),
    _n(
        f"{_LMP}:LMCacheMPConnector.build_connector_worker_meta",
        "self",
        fp="5d31dff0cb8cedb5",
        connector=LMCACHE_MP,
        use="wrapped",
    ),
    _n(
        f"{_LMP}:LMCacheMPConnector.get_finished",
        "self, finished_req_ids",
        fp="69043433cd297f09",
        connector=LMCACHE_MP,
    ),
    _n(
        f"{_LMP_A}:LMCacheMPWorkerAdapter.create_recorded_event",
        "self",
        fp="b115e94a140ed019",
        connector=LMCACHE_MP,
    ),
    _n(
        f"{_LMP_A}:LMCacheMPWorkerAdapter.submit_store_request",
        "self, request_id, op, event, cache_salt, request_configs",
        fp="e6d866102ce8a049",
        connector=LMCACHE_MP,
    ),
    _n(
        f"{_LMP_A}:LMCacheMPWorkerAdapter.submit_retrieve_request",
        "self, request_id, op, event, cache_salt, request_configs",
        fp="397eb8c4823873dd",
        connector=LMCACHE_MP,
    ),
    _n(
        f"{_LMP_A}:LMCacheMPWorkerAdapter.batched_submit_store_requests",
        "self, request_ids, ops, event, cache_salts, request_configs_list",
        fp="9905b67f38926ba1",
        connector=LMCACHE_MP,
    ),
    _n(
        f"{_LMP_A}:LMCacheMPWorkerAdapter.get_finished",
        "self, finished_req_ids_from_engine",
        fp="440f0a0cace1872a",
        connector=LMCACHE_MP,
    ),
    _n(
        f"{_LMP_A}:LMCacheMPWorkerAdapter.get_block_ids_with_load_errors",
        "self",
        fp="f32e581af07bc329",
        connector=LMCACHE_MP,
    ),
    _n(
        f"{_LMP_M}:LMCacheMPRequestMetadata.GetRetrieveMetadata",
        "tracker, lmcache_tokens_per_chunk, group_tokens_per_block",
        fp="fc857529b712d3bb",
        connector=LMCACHE_MP,
    ),
    _n(
        f"{_LMP_M}:LMCacheMPRequestMetadata.GetStoreMetadata",
        "tracker, lmcache_tokens_per_chunk, group_tokens_per_block, save_decode_cache",
        fp="1b424374b3e67274",
        connector=LMCACHE_MP,
    ),
    _n(
        f"{_LMP_M}:LMCacheMPWorkerMetadata.aggregate",
        "self, other",
        fp="08c978f3605893fb",
        connector=LMCACHE_MP,
    ),
    # The connector's group sizes, its plan and the adapter's health the
    # wiring reads.
    _n(f"{_LMP}:LMCacheMPConnector._group_tokens_per_block", connector=LMCACHE_MP, use="field"),
    _n(f"{_LMP}:LMCacheMPConnector.worker_adapter", connector=LMCACHE_MP, use="field"),
    _n(f"{_LMP_M}:LMCacheMPConnectorMetadata.requests", connector=LMCACHE_MP, use="field"),
    _n(f"{_LMP_A}:LoadStoreOp.skip_first_n_tokens", connector=LMCACHE_MP, use="field"),
    _n(f"{_LMP_A}:LMCacheMPWorkerAdapter.is_healthy", connector=LMCACHE_MP, use="field"),
)

_LINE_032 = Surface(
    "0.32",
    _ROWS_032,
    event_extra_keys=None,
    lookahead_token_ids=None,
    access_hook_on_null=True,
    weak_pool_ref=False,
    evict_first=False,
    v1_model_runner=True,
    offloading_failed_jobs=False,
    offloading_sync_loads=False,
    connectors=(MOONCAKE, OFFLOADING, SIMPLE, NIXL, LMCACHE, LMCACHE_MP),
)

_LINE_033 = derive(
    _LINE_032,
    "0.33",
    changed=(
        _n(
            f"{_BP}:BlockPool.__init__",
            (
                "self, num_gpu_blocks, enable_caching, hash_block_size, "
                "enable_kv_cache_events, metrics_collector, num_hash_lookahead_tokens, "
                "medium"
            ),
            fp="fc317efbf6234df8",
            use="replaced",
        ),
        _n(
            f"{_BP}:BlockPool._build_block_stored_event",
            (
                "self, request, block_hashes, parent_block_hash, start_token_idx, "
                "end_token_idx, block_size, kv_cache_group_id, extra_keys_list, "
                "lookahead_token_ids"
            ),
            fp="57c61e53c5f59685",
            use="borrowed",
        ),
        _n(
            f"{_BP}:BlockPool",
            (
                "__init__, _build_block_stored_event, _emit_block_removed_events, "
                "_generate_event_extra_keys, _get_partial_block_hash, "
                "_get_partial_block_parent_hash_and_start, _insert_block_hash, "
                "_lookahead_token_ids, _maybe_evict_cached_block, _notify_reuse, "
                "_remove_cached_block_hashes, cache_full_blocks, cache_partial_block, "
                "emit_cached_block_events, evict_blocks, free_blocks, "
                "get_cached_block, get_new_blocks, get_num_free_blocks, get_usage, "
                "is_block_writable, move_block_hashes, reset_prefix_cache, "
                "take_events, touch, unpin_blocks"
            ),
            use="members",
        ),
        _n(
            f"{_BP}:BlockPool.cache_full_blocks",
            (
                "self, request, blocks, num_cached_blocks, num_full_blocks, "
                "block_size, kv_cache_group_id, block_mask"
            ),
            fp="47a332f43abaf880",
            use="replaced",
        ),
        _n(
            f"{_BP}:BlockPool.cache_partial_block",
            "self, request, block, num_tokens, kv_cache_group_id, block_size, replace_existing_hashes",
            fp="ebcb0bb27f660872",
            use="replaced",
        ),
        _n(f"{_BP}:BlockPool.touch", "self, blocks", fp="d32cef0e56cf75a8", use="replaced"),
        _n(f"{_BP}:BlockPool.free_blocks", "self, ordered_blocks", fp="542e366ba81c97e2", use="replaced"),
        _n(
            f"{_BP}:BlockPool.emit_cached_block_events",
            "self, request, num_cached_blocks, block_size, kv_cache_group_id",
            fp="118749cb764ade41",
            use="borrowed",
        ),
        _n(f"{_SCHED}:Scheduler.schedule", "self, throttle_prefills", fp="a06fe15f3877ca46", use="wrapped"),
        _n(
            f"{_SCHED}:Scheduler.update_from_output",
            "self, scheduler_output, model_runner_output",
            fp="86a181d2629fabf9",
            use="wrapped",
        ),
        _n(
            f"{_V2}:ActiveKVConnector.post_forward",
            "self, finished_req_ids, defer_finalize",
            connector=WORKER_HOOKS,
            use="wrapped",
        ),
        _n(
            f"{_MOONCAKE_S}:MooncakeStoreScheduler.build_connector_meta",
            "self, scheduler_output",
            fp="5730ac619503740b",
            connector=MOONCAKE,
            use="wrapped",
        ),
        _n(
            f"{_OFFLOAD_S}:OffloadingConnectorScheduler.build_connector_meta",
            "self, scheduler_output",
            fp="bb449517240a5fca",
            connector=OFFLOADING,
            use="wrapped",
        ),
        _n(
            f"{_OFFLOAD_S}:OffloadingConnectorScheduler.update_connector_output",
            "self, connector_output",
            fp="a4641f3bddf5988d",
            connector=OFFLOADING,
            use="wrapped",
        ),
        _n(
            f"{_OFFLOAD_W}:OffloadingConnectorWorker.start_kv_transfers",
            "self, metadata",
            fp="b5bc037f472c249f",
            connector=OFFLOADING,
            use="wrapped",
        ),
        _n(
            f"{_NIXL_W}:NixlPullConnectorWorker._read_blocks_for_req",
            "self, req_id, meta",
            fp="09422f641d0382dc",
            connector=NIXL,
            use="wrapped",
        ),
    ),
    added={
        f"{_OFFLOAD_W}:OffloadingConnectorWorker.handle_preemptions": (
            _n(f"{_OFFLOAD_C}:TransferJob.sync", connector=OFFLOADING, use="field"),
        ),
        f"{_BP}:BlockPool._build_block_stored_event": (
            _n(
                f"{_BP}:BlockPool._generate_event_extra_keys",
                "self, request, start, end, start_mm_idx",
                fp="467fe54fa5b323ec",
                use="marker",
            ),
            _n(
                f"{_BP}:BlockPool._lookahead_token_ids",
                "self, request, block_end",
                fp="8618a8e5d36a96e8",
                use="marker",
            ),
        ),
        f"{_V2}:ActiveKVConnector.post_forward": (
            _n(f"{_V2}:ActiveKVConnector.finalize_step", "self", connector=WORKER_HOOKS, use="wrapped"),
        ),
    },
    event_extra_keys="_generate_event_extra_keys",
    lookahead_token_ids="_lookahead_token_ids",
    access_hook_on_null=False,
    offloading_sync_loads=True,
)

_LINE_034 = derive(
    _LINE_033,
    "0.34",
    changed=(
        _n(
            f"{_BP}:BlockPool",
            (
                "__init__, _build_block_stored_event, _emit_block_removed_events, "
                "_get_partial_block_hash, _get_partial_block_parent_hash_and_start, "
                "_insert_block_hash, _maybe_evict_cached_block, _notify_reuse, "
                "_remove_cached_block_hashes, cache_full_blocks, cache_partial_block, "
                "emit_cached_block_events, evict_blocks, free_blocks, "
                "generate_event_extra_keys, get_cached_block, get_lookahead_token_ids, "
                "get_new_blocks, get_num_free_blocks, get_usage, is_block_writable, "
                "move_block_hashes, reset_prefix_cache, take_events, touch, "
                "unpin_blocks"
            ),
            use="members",
        ),
        _n(
            f"{_BP}:BlockPool.__init__",
            (
                "self, num_gpu_blocks, enable_caching, hash_block_size, "
                "enable_kv_cache_events, metrics_collector, num_hash_lookahead_tokens, "
                "medium"
            ),
            fp="448ea9998c8f186b",
            use="replaced",
        ),
        _n(
            f"{_BP}:BlockPool.cache_full_blocks",
            (
                "self, request, blocks, num_cached_blocks, num_full_blocks, "
                "block_size, kv_cache_group_id, block_mask"
            ),
            fp="d0d34ef1559b67aa",
            use="replaced",
        ),
        _n(
            f"{_BP}:BlockPool.cache_partial_block",
            "self, request, block, num_tokens, kv_cache_group_id, block_size, replace_existing_hashes",
            fp="4f2bea79a1c3bb76",
            use="replaced",
        ),
        _n(f"{_BP}:BlockPool.get_new_blocks", "self, num_blocks", fp="e6401d853861ae79", use="replaced"),
        _n(
            f"{_BP}:BlockPool.free_blocks",
            "self, ordered_blocks, evict_first",
            fp="7a4577e6de63b30a",
            use="marker",
        ),
        _n(
            f"{_BP}:BlockPool._insert_block_hash",
            "self, block_hash_with_group_id, block, num_tokens",
            fp="796306a5db5de74c",
            use="replaced",
        ),
        _n(
            f"{_BP}:BlockPool._remove_cached_block_hashes",
            "self, block",
            fp="82216b0804ab682e",
            use="borrowed",
        ),
        _n(f"{_BP}:BlockPool.reset_prefix_cache", "self", fp="a0184a93e0886a07", use="replaced"),
        _n(
            f"{_BP}:BlockPool.emit_cached_block_events",
            "self, request, num_cached_blocks, block_size, kv_cache_group_id",
            fp="a816d9eaab44064a",
            use="borrowed",
        ),
        _n(
            f"{_BP}:BlockHashToBlockMap",
            "__init__, __len__, clear, contain, get_one_block, insert, pop",
            use="members",
        ),
        _n(f"{_UTILS}:KVCacheBlock", "__eq__, __init__, __repr__, reset_hash, set_block_hash", use="members"),
        _n(f"{_SCHED}:Scheduler.schedule", "self, throttle_prefills", fp="5c4e10402898dae9", use="wrapped"),
        _n(
            f"{_SCHED}:Scheduler.update_from_output",
            "self, scheduler_output, model_runner_output",
            fp="ce6fa954711728d1",
            use="wrapped",
        ),
        _n(
            f"{_MOONCAKE_S}:MooncakeStoreScheduler.build_connector_meta",
            "self, scheduler_output",
            fp="886c4b176dbf48e5",
            connector=MOONCAKE,
            use="wrapped",
        ),
        _n(
            f"{_MOONCAKE_W}:KVCacheStoreRecvingThread._handle_request",
            "self, req_meta",
            fp="58c0dd832f14e5cb",
            connector=MOONCAKE,
            use="wrapped",
        ),
        _n(
            f"{_MOONCAKE_W}:KVCacheStoreSendingThread._handle_request",
            "self, req_meta",
            fp="5a33471e54f07878",
            connector=MOONCAKE,
        ),
        _n(
            f"{_OFFLOAD_W}:OffloadingConnectorWorker.start_kv_transfers",
            "self, metadata",
            fp="49c5c32f4e50c850",
            connector=OFFLOADING,
            use="wrapped",
        ),
        _n(
            f"{_OFFLOAD_W}:OffloadingConnectorWorker.handle_preemptions",
            "self, kv_connector_metadata",
            fp="d9ac12066d1cfd5f",
            connector=OFFLOADING,
            use="wrapped",
        ),
        _n(
            f"{_OFFLOAD_G}:SingleDirectionOffloadingHandler.transfer_async",
            "self, job_id, device_ptrs, cpu_spec",
            fp="72c78c053398e29f",
            connector=OFFLOADING,
            use="wrapped",
        ),
        _n(
            f"{_NIXL_W}:NixlPullConnectorWorker._read_blocks_for_req",
            "self, req_id, meta",
            fp="cb2d7ff8a36f593b",
            connector=NIXL,
            use="wrapped",
        ),
    ),
    added={
        f"{_OFFLOAD_W}:OffloadingConnectorWorker.handle_preemptions": (
            _n(f"{_OFFLOAD_C}:OffloadingWorkerMetadata.failed_jobs", connector=OFFLOADING, use="field"),
        ),
        f"{_BP}:BlockPool._build_block_stored_event": (
            _n(
                f"{_BP}:BlockPool.generate_event_extra_keys",
                "self, request, start, end, start_mm_idx",
                fp="b01e3a90f2564d70",
                use="marker",
            ),
            _n(
                f"{_BP}:BlockPool.get_lookahead_token_ids",
                "self, request, block_end",
                fp="50d458a614065f1c",
                use="marker",
            ),
        ),
    },
    removed=(
        f"{_BP}:BlockPool._generate_event_extra_keys",
        f"{_BP}:BlockPool._lookahead_token_ids",
        f"{_MIXIN}:KVConnectorModelRunnerMixin._get_kv_connector_output",
        f"{_MIXIN}:KVConnectorModelRunnerMixin.finalize_kv_connector",
        f"{_MIXIN}:has_kv_transfer_group",
        f"{_MIXIN}:get_kv_transfer_group",
    ),
    event_extra_keys="generate_event_extra_keys",
    lookahead_token_ids="get_lookahead_token_ids",
    weak_pool_ref=True,
    evict_first=True,
    v1_model_runner=False,
    offloading_failed_jobs=True,
)

SURFACES: dict[str, Surface] = {s.line: s for s in (_LINE_032, _LINE_033, _LINE_034)}
"""The declared release lines, oldest first."""

SWITCHED: dict[str, tuple[str, ...]] = {
    "offloading_failed_jobs": ("failed_jobs",),
    "offloading_sync_loads": ("sync",),
}
"""For a switch of :class:`Surface`, the instance attributes (``field``
rows) the plugin reads only where the switch is on: a line with it on
declares them, a line with it off does not (``tests/test_vllm_surface_reads.py``
holds the table to that)."""

OPTIONAL_READS: frozenset[str] = frozenset(
    {
        # Modules that may bind BlockPool (the plugin rebinds each vLLM
        # module that does; parity swaps it back).
        "BlockPool",
        # Only a MultiConnector holds connectors, and only its metadata holds
        # per-connector metadata.
        "_connectors",
        "metadata",
        # A connector's scheduler half is its connector_scheduler (NIXL,
        # Offloading) or scheduler_manager (SimpleCPUOffload), None on a
        # worker-side instance, or absent (another connector class).
        "connector_scheduler",
        "scheduler_manager",
        # LMCacheMPConnector builds its scheduler adapter on the scheduler
        # side only, its worker adapter on the worker side only.
        "scheduler_adapter",
        "worker_adapter",
        # LMCache's adapter sets use_layerwise and enable_blending on its
        # worker-side instances only (its config always has them).
        "use_layerwise",
        "enable_blending",
        # Only some of LMCache's GPU connectors have a load stream.
        "load_stream",
        # A slot mapping given as a tensor or a list.
        "tolist",
        # A connector built without a config (vLLM's own tests build some
        # with object.__new__); the plugin then keeps its default block size.
        "_vllm_config",
    }
)
"""Attributes of vLLM's and LMCache's objects that the plugin reads with a
default (``getattr(obj, name, default)``, ``hasattr``) because an instance
may lack them or be ``None`` whatever the release; every other read of a
vLLM name is plain, of a name its line declares, or behind a switch
(:data:`SWITCHED`)."""

_ACTIVE: Surface | None = None


def set_active(surface: Surface | None) -> None:
    """Make ``surface`` the process's active surface (``register()`` does;
    ``None`` forgets it). O(1)."""
    global _ACTIVE
    _ACTIVE = surface


def select(version: str | None, *, any_version: bool = False) -> Surface:
    """The declared surface for the running vLLM.

    The line of ``version`` (``"0.34.0"``: ``"0.34"``) when declared, if
    its markers are present; otherwise, with ``any_version``, the newest
    declared line whose markers are all present. Imports the markers'
    modules. O(lines * markers).

    Raises:
        SurfaceError: the version's line is declared but its markers are
            not present (a doctored or mislabelled vLLM), or (with
            ``any_version``) no line's markers are all present, or
            (without) the version's line is not declared.
    """
    from blockpool.integrations.vllm.wiring import release_line

    rl = release_line(version)
    line = None if rl is None else f"{rl[0]}.{rl[1]}"
    if line in SURFACES:
        surface = SURFACES[line]
        bad = [d for d in check(surface, surface.markers) if not d.ok]
        if bad:
            raise SurfaceError(
                f"vLLM {version} lacks the names of its release line {line}: "
                + "; ".join(f"{d.name.target} ({d.status}: {d.found})" for d in bad)
            )
        return surface
    if not any_version:
        raise SurfaceError(
            f"vLLM {version or '(version unknown)'}: no declared surface (lines: {', '.join(SURFACES)})"
        )
    for surface in sorted(SURFACES.values(), key=lambda s: tuple(map(int, s.line.split("."))), reverse=True):
        if all(d.ok for d in check(surface, surface.markers)):
            return surface
    raise SurfaceError(f"vLLM {version or '(version unknown)'}: no declared line's names are present")


def active() -> Surface:
    """The process's surface: the one ``register()`` chose, else (a pool
    built without the plugin, in tests) :func:`select` of the installed
    vLLM's version, remembered. O(1) once chosen.

    Raises:
        SurfaceError: as :func:`select`, when none was chosen yet.
    """
    global _ACTIVE
    if _ACTIVE is None:
        from blockpool.integrations.vllm.wiring import vllm_version

        _ACTIVE = select(vllm_version(), any_version=True)
    return _ACTIVE


def report(version: str | None = None) -> tuple[int, list[str]]:
    """The surface table of the installed vLLM (``blockpool check-vllm
    --surface``): the line chosen for ``version`` (default: the installed
    vLLM's, as :func:`select` with ``any_version``), then one row per
    declared name: status, use, connector, name, expected, found. Imports
    the declared modules; changes nothing in vLLM. O(names).

    Returns ``(status, lines)``: 0 every name as declared (a connector
    whose third-party package is not installed here reads
    ``unavailable``: it cannot run here, nothing drifted), 1 a drift
    (:func:`check`: the install would be refused or a connector left
    unwired) or a ``BLOCKPOOL_VLLM_UNWIRED`` naming an unknown connector
    (every connector would be left unwired; the last line says so, as it
    names the connectors a valid setting leaves unwired), 2 no vLLM
    installed or no declared line fits.
    """
    from blockpool.integrations.vllm.wiring import vllm_version

    version = version if version is not None else vllm_version()
    if version is None:
        return 2, ["vLLM is not installed here"]
    try:
        surface = select(version, any_version=True)
    except SurfaceError as exc:
        return 2, [str(exc)]
    rows = check(surface)
    marked = {n.target for n in surface.markers}
    lines = [f"vLLM {version}: declared surface of vLLM {surface.line} ({len(rows)} names)"]
    lines.append("status       use       connector       name | expected | found")
    for d in rows:
        use = "marker" if d.name.target in marked else d.name.use
        group = d.name.connector or "-"
        lines.append(f"{d.status:<12} {use:<9} {group:<15} {d.name.target} | {d.expected} | {d.found}")
    bad = [d for d in rows if not d.ok and d.status != "unavailable"]
    refusing = [d for d in bad if d.refuses_install]
    absent = sorted({d.name.connector or "" for d in rows if d.status == "unavailable"} - {""})
    if absent:
        lines.append(f"unavailable here (a package they need is not installed): {', '.join(absent)}")
    if not bad:
        wired = "every reviewed connector that can run here" if absent else "every reviewed connector"
        lines.append(f"every name as declared: the plugin installs with {wired} wired")
    elif refusing:
        lines.append(f"{len(refusing)} drifted core names: the plugin refuses to install on this vLLM")
    else:
        groups = sorted({d.name.connector or "" for d in bad})
        lines.append(f"drifted names of {', '.join(groups)}: left unwired, the rest installs")
    refused, setting = _unwired_setting()
    if setting is not None:
        lines.append(setting)
    return (1 if bad or refused else 0), lines


def _unwired_setting() -> tuple[bool, str | None]:
    """What ``BLOCKPOOL_VLLM_UNWIRED`` makes the plugin leave unwired, as
    one line of :func:`report` (``None`` when it is unset or empty), and
    whether the setting is refused (it names an unknown connector: every
    connector is left unwired). O(len of the setting)."""
    import os

    from blockpool.core.errors import InvalidArgumentError
    from blockpool.integrations.vllm import wiring as connectors

    raw = os.environ.get(connectors.ENV_UNWIRED, "").strip()
    try:
        off = connectors._unwired_by_env()
    except InvalidArgumentError as exc:
        return True, f"{exc}: the plugin leaves every KV connector as vLLM built it"
    if not raw:
        return False, None
    names = ", ".join(n for n in connectors.CONNECTORS if n in off) or "no connector"
    return False, f"{connectors.ENV_UNWIRED}={raw}: the plugin leaves {names} as vLLM built them"
