"""The scheduler-side core: the pool and the parts it is built from.

Imports neither torch nor vLLM. :mod:`blockpool` re-exports the public
names; each module here owns one piece of state and changes it only through
its own methods (``docs/architecture.md`` has the table):

- :mod:`~blockpool.core.pool`: :class:`HazardAwareBlockPool` — argument
  checks, the order in which completions are applied, ref counts, events;
  its calls are grouped by concern in one line of single inheritance
  (``_base`` coordinates the parts, then ``_introspection``, ``_caching``,
  ``_fences``, ``_tokens``, ``_refcounts``), so that the compiled build
  makes the pool one native class;
- :mod:`~blockpool.core.block`: block records and the LRU free queue;
  :mod:`~blockpool.core.eviction`: the other eviction policies' queues;
- :mod:`~blockpool.core.prefix_cache`: the key map (publish, evict, promote);
- :mod:`~blockpool.core.holdback`: blocks held back for host-engine
  accesses, and their leases;
- :mod:`~blockpool.core.pending_writes`: writes in flight, invalid marks,
  the undo of failed writes;
- :mod:`~blockpool.core.shadows`: fence computation and access recording
  over the blocks' shadows; :mod:`~blockpool.core.tracker`: streams, tokens
  and their clocks; :mod:`~blockpool.core.hazards`: the value types
  (``Token``, ``Fence``, ...);
- :mod:`~blockpool.core.placement`: which free blocks ``allocate_for`` hands
  out; :mod:`~blockpool.core.generations`: block generations;
- :mod:`~blockpool.core.completions`, :mod:`~blockpool.core.events`,
  :mod:`~blockpool.core.stats`, :mod:`~blockpool.core.errors`.
"""
