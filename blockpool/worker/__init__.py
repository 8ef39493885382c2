"""The worker side: waiting on fences with real (or stand-in) events.

- :mod:`~blockpool.worker.torch_events`: :class:`EventLedger`, which records
  a torch event per token on its stream and turns a fence into
  ``stream.wait_event`` calls (device tokens) or host waits (host tokens);
  imports torch only when a backend is asked for;
- :mod:`~blockpool.worker.standins`: CPU stand-ins for
  ``torch.cuda.Stream`` / ``Event`` with CUDA's ordering semantics, for
  tests and examples on machines without an accelerator.
"""

from __future__ import annotations

from blockpool._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "BackendUnavailableError": "torch_events",
    "EventFactory": "torch_events",
    "EventLedger": "torch_events",
    "EventLike": "torch_events",
    "EventNotRecordedError": "torch_events",
    "FenceFailedError": "torch_events",
    "FenceTimeoutError": "torch_events",
    "HostWaitRequiredError": "torch_events",
    "StreamLike": "torch_events",
    "TokenOrderError": "torch_events",
    "event_factory": "torch_events",
    "StandInDeadlock": "standins",
    "StandInDevice": "standins",
    "StandInEvent": "standins",
    "StandInStream": "standins",
}
"""Public name -> the module of this sub-package that defines it (imported
on first use: importing the sub-package imports none of them)."""

__all__ = [
    "BackendUnavailableError",
    "EventFactory",
    "EventLedger",
    "EventLike",
    "EventNotRecordedError",
    "FenceFailedError",
    "FenceTimeoutError",
    "HostWaitRequiredError",
    "StandInDeadlock",
    "StandInDevice",
    "StandInEvent",
    "StandInStream",
    "StreamLike",
    "TokenOrderError",
    "event_factory",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)
