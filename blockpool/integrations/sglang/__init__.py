"""The SGLang integration of :mod:`blockpool` (HiCache's load and write-back
fences).

- :mod:`blockpool.integrations.sglang.account`: the host-side page account
  beside SGLang's KV page allocator (no torch or SGLang import).
"""
