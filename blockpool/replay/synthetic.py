"""A seeded synthetic chat workload (the default when no trace is given).

Shape, chosen to exercise what real chat traces exercise (the Mooncake
conversation trace: long shared prefixes, multi-turn reuse) at a size that
replays in seconds:

- a few long **system prompts**, shared by many conversations (picked with
  Zipf-like weights ``1/k``);
- **conversations** starting as a Poisson process; each has a geometric
  number of turns; turn ``t``'s prompt is the system prompt, every earlier
  user message and answer, then the new user message, so consecutive turns
  share everything but the new message (prefix-cache hits, loads of stored
  blocks, and copy-on-write of the previous turn's partial tail block);
- user messages and answers with log-normal lengths; the next turn arrives
  after the answer's expected decode time plus an exponential think time.

Every figure below is an assumption chosen for shape, not a measurement.

>>> tr = synthetic_trace(SyntheticSpec(num_requests=5), seed=1)
>>> len(tr.requests), tr.format, tr.requests == synthetic_trace(SyntheticSpec(num_requests=5), seed=1).requests
(5, 'synthetic', True)
"""

from __future__ import annotations

import math
import random

import attrs

from blockpool.core.errors import InvalidArgumentError
from blockpool.replay.traces import Trace, TraceRequest

__all__ = ["SyntheticSpec", "synthetic_trace"]


def _positive(_: object, a: attrs.Attribute, v: float) -> None:  # type: ignore[type-arg]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise InvalidArgumentError(f"{a.name} must be > 0, got {v!r}")


@attrs.frozen(slots=True)
class SyntheticSpec:
    """Parameters of :func:`synthetic_trace` (token counts in tokens, times
    in seconds; all assumptions).

    Attributes:
        num_requests: Requests generated (``>= 1``).
        num_system_prompts: Distinct system prompts.
        system_prompt_tokens: ``(low, high)``: uniform length range.
        conversation_rate: New conversations per second (Poisson).
        mean_turns: Mean turns per conversation (geometric, ``>= 1``).
        user_tokens: Median user-message length (log-normal, sigma 0.8).
        output_tokens: Median answer length (log-normal, sigma 0.7), capped
            at ``max_output_tokens``.
        max_output_tokens: Cap on an answer.
        think_time_s: Mean think time between an answer and the next turn.
        decode_s_per_token: Expected decode time per answer token, used only
            to space turns.

    Raises:
        InvalidArgumentError: a count or rate that is not positive, or a bad
            range.
    """

    num_requests: int = attrs.field(default=500, validator=_positive)
    num_system_prompts: int = attrs.field(default=4, validator=_positive)
    system_prompt_tokens: tuple[int, int] = (1500, 4000)
    conversation_rate: float = attrs.field(default=3.0, validator=_positive)
    mean_turns: float = attrs.field(default=3.0, validator=_positive)
    user_tokens: int = attrs.field(default=300, validator=_positive)
    output_tokens: int = attrs.field(default=220, validator=_positive)
    max_output_tokens: int = attrs.field(default=1500, validator=_positive)
    think_time_s: float = attrs.field(default=8.0, validator=_positive)
    decode_s_per_token: float = attrs.field(default=0.02, validator=_positive)

    def __attrs_post_init__(self) -> None:
        lo, hi = self.system_prompt_tokens
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise InvalidArgumentError(f"system_prompt_tokens must be 1 <= low <= high, got {(lo, hi)}")
        if self.mean_turns < 1:
            raise InvalidArgumentError(f"mean_turns must be >= 1, got {self.mean_turns}")


def _lognormal(rng: random.Random, median: int, sigma: float, cap: int | None = None) -> int:
    n = max(1, round(median * math.exp(rng.gauss(0.0, sigma))))
    return min(n, cap) if cap is not None else n


def synthetic_trace(spec: SyntheticSpec | None = None, *, seed: int = 0) -> Trace:
    """Generate a chat workload (see the module docstring). Deterministic in
    ``(spec, seed)``. Content ids: system prompt ``k`` is ``k``; every user
    message and answer gets a fresh id above them.

    Returns:
        A :class:`~blockpool.replay.traces.Trace` (``format="synthetic"``)
        sorted by arrival; ``request_id`` = position.

    Raises:
        InvalidArgumentError: ``seed`` is not an int.

    Runtime complexity: O(num_requests * mean_turns) segments.
    """
    spec = spec if spec is not None else SyntheticSpec()
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise InvalidArgumentError(f"seed must be an int, got {seed!r}")
    rng = random.Random(seed)
    lo, hi = spec.system_prompt_tokens
    systems = [rng.randint(lo, hi) for _ in range(spec.num_system_prompts)]
    weights = [1.0 / (k + 1) for k in range(spec.num_system_prompts)]
    next_id = spec.num_system_prompts
    p_stop = 1.0 / spec.mean_turns
    raw: list[tuple[float, int, tuple[tuple[int, int], ...], int, int]] = []
    t_conv = 0.0
    conv = 0
    while len(raw) < spec.num_requests:
        t_conv += rng.expovariate(spec.conversation_rate)
        k = rng.choices(range(spec.num_system_prompts), weights)[0]
        history: list[tuple[int, int]] = [(k, systems[k])]
        t = t_conv
        while True:
            user = (next_id, _lognormal(rng, spec.user_tokens, 0.8))
            out_id, n_out = next_id + 1, _lognormal(rng, spec.output_tokens, 0.7, spec.max_output_tokens)
            next_id += 2
            history.append(user)
            raw.append((t, conv, tuple(history), out_id, n_out))
            history.append((out_id, n_out))
            if rng.random() < p_stop:
                break
            t += n_out * spec.decode_s_per_token + rng.expovariate(1.0 / spec.think_time_s)
        conv += 1
    raw.sort(key=lambda r: (r[0], r[1]))
    reqs = tuple(
        TraceRequest(i, round(t, 6), sum(n for _, n in segs), n_out, segs, out_id)
        for i, (t, _, segs, out_id, n_out) in enumerate(raw[: spec.num_requests])
    )
    return Trace("synthetic", "synthetic", reqs)
