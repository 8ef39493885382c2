"""Integrations of :mod:`blockpool` with engines and runtimes.

Each submodule depends on the core and on its own third-party package; the
core never imports them. Importing this package imports nothing else:

- :mod:`blockpool.integrations.vllm`: the vLLM general plugin (``register``).
- :mod:`blockpool.integrations.vllm.pool`: vLLM's ``BlockPool`` surface over
  :class:`~blockpool.HazardAwareBlockPool` (needs vLLM).
- :mod:`blockpool.integrations.vllm.hazards`: scheduler-side hazard wiring
  (step tokens, CoW copies, connector loads and stores; no vLLM import).
- :mod:`blockpool.integrations.vllm.connectors`: the scheduler half of the
  KV connector wiring (fences on the connectors' metadata);
  :mod:`blockpool.integrations.vllm.worker`: the worker half (waits on
  them; needs torch).
- :mod:`blockpool.integrations.vllm.pytest_plugin`: a pytest plugin that
  installs the pool before collection (vLLM's own tests, "plugin on").
"""
