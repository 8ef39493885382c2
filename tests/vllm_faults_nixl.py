"""Simulated workers for the seeded fault harness (:mod:`tests.vllm_faults`):
vLLM's ``NixlConnector``, and ``MultiConnector([NixlConnector,
MooncakeStoreConnector])`` with NIXL's post-receive kernels.

Importing this module registers two :class:`~tests.vllm_faults.ConnectorSim`
classes in :data:`~tests.vllm_faults.SIMS`:

- ``nixl`` (:class:`NixlSim`): vLLM's NIXL connector, pull mode, in one
  engine that is both a decode instance (requests whose prompt a remote
  prefill computed: ``do_remote_prefill``) and a prefill instance (requests
  a remote decode will read: ``do_remote_decode``). A decode-side read is
  posted by the worker when the step's metadata names it
  (``reqs_to_recv`` with ``awaiting_kvs``) and reported in
  ``finished_recving``; a failed read also in ``failed_recving``, with the
  blocks of its first KV cache group in ``invalid_block_ids`` (NIXL's
  worker reports every block of a failed read, never a part). A
  prefill-side send starts when the finished request's blocks are named in
  ``reqs_to_send`` and is reported in ``finished_sending`` once the remote
  decode read them; when it never reads (the ``never`` fault), NIXL's
  worker reaps the blocks once the lease (``kv_lease_duration``) expires,
  modelled as ``lease_steps`` steps. A read that never reports stays in
  flight: NIXL's decode worker has no timeout of its own for a posted READ,
  so stock vLLM waits for it forever too (a stock-only schedule).
- ``nixl_mooncake`` (:class:`NixlMooncakeSim`): the MultiConnector pair a
  disaggregated decode instance runs, NIXL loading the remote prefill and
  MooncakeStore storing (and loading) prefixes, over the harness's
  MooncakeStore worker. When NIXL's worker reports a read finished it also
  enqueues kernels on the compute stream that rewrite the received blocks
  (``post_process_device_kv_on_receive``: block size or layout conversion,
  zeroing of clipped sub-blocks; the heterogeneous-attention pack), after
  the forward of the step whose output reports it. The simulated worker
  records that write, and the harness checks every MooncakeStore PUT of
  such a block against it: stock's PUT waits on an event recorded after
  its own step's forward, which runs behind those kernels; the plugin's
  PUT must name a compute-stream token issued after them, keep vLLM's own
  wait (``blockpool_stock_waits``), or come after a step whose output
  showed them done. A PUT that does none of these raises
  :class:`UnorderedRead` in the simulated worker, which fails that mode's
  run.

Replay one schedule (from the repository root, in vLLM's venv)::

    python -m tests.vllm_faults_nixl --connector nixl --seed 17 --schedules 1 -v
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
from types import SimpleNamespace
from typing import Any

from tests import vllm_faults as vf

ROLES = ("prefill", "prefill", "decode", None)
"""What a request without a fault is, drawn per request: its prompt computed
by a remote prefill (``prefill``), computed here for a remote decode
(``decode``), or neither."""


class UnorderedRead(AssertionError):
    """A transfer reads a block before a write the worker enqueued on it
    (NIXL's post-receive kernels) is ordered before the read."""


def remote_prefill(spec: vf.RequestSpec) -> dict[str, Any]:
    """``kv_transfer_params`` of a decode-side request whose prompt a remote
    prefill instance computed (as vLLM's proxy forwards them). O(blocks)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-engine",
        "remote_request_id": f"prefill-{spec.req_id}",
        "remote_block_ids": list(range(-(-len(spec.prompt) // vf.BS))),
        "remote_host": "127.0.0.1",
        "remote_port": 1234,
        "tp_size": 1,
    }


def holds_blocks_for_a_transfer(scheduler: Any) -> bool:
    """A request of ``scheduler`` holds blocks that no reset can take: it
    waits for an asynchronous load (``WAITING_FOR_REMOTE_KVS``), or it
    finished and its blocks wait for the connector (a send, a store).
    O(requests)."""
    from vllm.v1.request import RequestStatus

    return any(
        r.is_finished() or r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        for r in scheduler.requests.values()
    )


def _is_nixl(t: vf.SimTransfer) -> bool:
    return isinstance(t.job, tuple) and t.job[0] in ("nixl", "nixl_send")


class NixlWorker:
    """NIXL's worker ranks (pull mode), mixed into a
    :class:`~tests.vllm_faults.ConnectorSim`: the requests' roles, the reads
    and sends a step's metadata starts, their reports, and the compute-stream
    writes of the post-receive kernels (:attr:`rewritten`)."""

    nixl_roles: tuple[str, ...] = ("prefill", "decode")

    # -- schedule ------------------------------------------------------------

    @classmethod
    def nixl_options(cls, rng: random.Random, schedule: vf.Schedule) -> dict[str, Any]:
        """The NIXL knobs of ``schedule``: each request's role (a request with
        a load fault is a remote prefill's, one with a store fault a remote
        decode's where this engine serves both), the read and send delays,
        the lease in steps, and whether the decode instance rewrites what it
        receives. O(requests)."""
        faulted = {}
        for f in schedule.faults:
            faulted.setdefault(f.req_id, "prefill" if f.kind == "load" else "decode")
        roles = {}
        for r in schedule.requests:
            role = faulted.get(r.req_id) or rng.choice(ROLES)
            roles[r.req_id] = role if role in cls.nixl_roles else None
        return {
            "roles": roles,
            "read_delay": rng.choice((0, 1, 1, 2)),
            "send_delay": rng.choice((1, 2, 3)),
            "lease_steps": rng.randint(4, 8),
            "post_receive": rng.random() < 0.75,
        }

    def nixl_params(self, spec: vf.RequestSpec) -> dict[str, Any] | None:
        role = self.schedule.options["roles"].get(spec.req_id)
        if role == "prefill":
            return remote_prefill(spec)
        if role == "decode":
            return {"do_remote_decode": True}
        return None

    def may_reset(self) -> bool:
        # vLLM refuses a reset (RuntimeError, plugin or not) while a read's
        # request holds its blocks in WAITING_FOR_REMOTE_KVS (until the step
        # after its report) or a finished request's blocks wait for a send.
        return not holds_blocks_for_a_transfer(self.scheduler) and super().may_reset()  # type: ignore[misc]

    # -- the worker ----------------------------------------------------------

    def nixl_prepare(self) -> None:
        self.compute_seq: dict[int, int] = {0: 0}  # step -> newest compute token seq issued up to it
        self.rewritten: dict[int, tuple[int, int, str]] = {}  # block -> (compute seq before, step, request)

    def note_step(self, step: int, meta: Any) -> None:
        """Record the compute-stream tokens the scheduler issued for ``step``
        (the wiring's step record on ``meta``; none with the plugin off)."""
        from blockpool.integrations.vllm import connectors as vc
        from blockpool.integrations.vllm.hazards import StepRecord

        seq = self.compute_seq.get(step - 1, 0)
        wire = getattr(meta, vc.META_STEP, None)
        if wire is not None:
            rec = StepRecord.from_wire(wire[0])
            seq = max([seq, rec.forward.seq] + ([rec.copies.seq] if rec.copies is not None else []))
        self.compute_seq[step] = max(seq, self.compute_seq.get(step, 0))

    def nixl_plan(self, step: int, meta: Any) -> None:
        """Start the reads and sends ``meta`` (NIXL's metadata) names."""
        self.note_step(step, meta)
        for req_id, rm in meta.reqs_to_recv.items():
            if not rm.awaiting_kvs:  # a full local hit or an abort: the worker only notifies the remote
                continue
            blocks = [b for group in rm.local_block_ids for b in group]
            t = self.begin(
                req_id, "load", ("nixl", req_id, step), blocks, step, self.schedule.options["read_delay"]
            )
            t.first_group = tuple(rm.local_block_ids[0]) if rm.local_block_ids else ()
        for req_id in meta.reqs_to_send or {}:
            blocks = [b for group in self.scheduler.kv_cache_manager.get_block_ids(req_id) for b in group]
            self.begin(
                req_id, "store", ("nixl_send", req_id), blocks, step, self.schedule.options["send_delay"]
            )

    def begin(
        self, req_id: str, kind: str, job: Any, block_ids: Any, step: int, delay: int = 1, **kw: Any
    ) -> Any:
        t = super().begin(req_id, kind, job, block_ids, step, delay, **kw)  # type: ignore[misc]
        t.delay = delay
        if (
            isinstance(job, tuple)
            and job[0] == "nixl_send"
            and t.fault is not None
            and t.fault.fault == "never"
        ):
            # The remote decode never reads: NIXL's worker reaps the blocks when the lease expires.
            t.due = [step + self.schedule.options["lease_steps"]] * self.ranks
            t.reaped = True
        return t

    def _fired_on_report(self, t: vf.SimTransfer, rank: int, step: int) -> None:
        f = t.fault
        if (
            rank == 0
            and f is not None
            and (
                getattr(t, "reaped", False)
                or f.fault == "late"
                and t.flushed_at is None
                and step > t.planned + t.delay
            )
        ):
            self._fire(f)  # reaped at the lease's end; reported later than this transfer's own delay
            return
        super()._fired_on_report(t, rank, step)  # type: ignore[misc]

    def nixl_fields(self, step: int, ts: list[vf.SimTransfer]) -> dict[str, Any]:
        """The ``KVConnectorOutput`` fields one rank reports for NIXL
        transfers ``ts`` in ``step``; a finished read's blocks get the
        post-receive write (after this step's forward) where the schedule
        says the decode instance rewrites what it receives."""
        recving: set[str] = set()
        failed: set[str] = set()
        invalid: set[int] = set()
        sending: set[str] = set()
        for t in ts:
            if t.kind == "store":
                sending.add(t.req_id)
                continue
            recving.add(t.req_id)
            if t.failed:
                failed.add(t.req_id)
                invalid.update(getattr(t, "first_group", t.block_ids))
            elif self.schedule.options["post_receive"]:
                for b in t.block_ids:
                    self.rewritten[b] = (self.compute_seq.get(step, 0), step, t.req_id)
        return {"finished_recving": recving, "failed_recving": failed, "invalid_block_ids": invalid,
                "finished_sending": sending}  # fmt: skip

    def check_read_after_rewrites(
        self, step: int, req_id: str, block_ids: Any, fence: Any, stock_waits: bool
    ) -> None:
        """Raise :class:`UnorderedRead` when a read of ``block_ids`` planned in
        ``step`` with ``fence`` may run before a post-receive write of one
        of them: the write is not shown done by an earlier step's output
        (a compute token issued after it, in a step before ``step``), the
        fence names no compute token issued after it, and vLLM's own wait is
        not kept (``stock_waits``). O(blocks + fence)."""
        if stock_waits:
            return
        fenced = max((tok.seq for tok in fence if tok.stream == "compute"), default=0)
        done = self.compute_seq.get(step - 1, 0)
        for b in block_ids:
            w = self.rewritten.get(b)
            if w is None:
                continue
            seq, at, writer = w
            if done > seq:  # a later step's output came back: the write ran
                continue
            if fenced > seq:
                continue
            raise UnorderedRead(
                f"step {step}: {req_id}'s store reads block {b} unordered after NIXL's post-receive write "
                f"of {writer}'s read (reported in step {at}, after compute token {seq}; the store's fence "
                f"names compute token {fenced or 'none'})"
            )


def _kv_output(fields: dict[str, Any], worker_meta: Any = None) -> Any:
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(
        finished_recving=fields["finished_recving"] or None,
        finished_sending=fields["finished_sending"] or None,
        failed_recving=fields["failed_recving"],
        invalid_block_ids=fields["invalid_block_ids"],
        kv_connector_worker_meta=worker_meta,
    )


@vf.register_sim
class NixlSim(NixlWorker, vf.ConnectorSim):
    """vLLM's ``NixlConnector`` (pull mode) in an engine serving both remote
    prefills and remote decodes (module docstring)."""

    name = "nixl"
    connector = "NixlConnector"
    # Not "twice": vLLM's own scheduler takes a read reported twice for an
    # AssertionError (finished_recving of a request no longer waiting), and
    # NIXL reports a failed read whole, never in part.
    fault_kinds = ("fail", "late", "never", "reorder", "skew")

    @classmethod
    def kinds_for(cls, transfer_kind: str) -> tuple[str, ...]:
        return cls.fault_kinds

    @classmethod
    def scheduler_kwargs(cls, schedule: vf.Schedule) -> dict[str, Any]:
        return {"role": "kv_both"}

    @classmethod
    def draw_options(cls, rng: random.Random, schedule: vf.Schedule) -> dict[str, Any]:
        # NIXL moves a request's prompt once (one read, or one send): a
        # fault on a later transfer of the request would never fire.
        once = [f if f.req_id == "*" else dataclasses.replace(f, ordinal=0) for f in schedule.faults]
        schedule.faults[:] = list({f.key: f for f in once}.values())
        return cls.nixl_options(rng, schedule)

    def prepare(self) -> None:
        self.nixl_prepare()

    def request_params(self, spec: vf.RequestSpec) -> dict[str, Any] | None:
        return self.nixl_params(spec)

    def plan(self, step: int, out: Any) -> None:
        self.nixl_plan(step, out.kv_connector_metadata)

    def encode(
        self, step: int, due: list[list[vf.SimTransfer]], twice: list[list[vf.SimTransfer]]
    ) -> list[Any]:
        return [_kv_output(self.nixl_fields(step, due[rank])) for rank in range(self.ranks)]


_MooncakeStoreSim: Any = getattr(vf, "MooncakeStoreSim", None)

if _MooncakeStoreSim is not None:

    @vf.register_sim
    class NixlMooncakeSim(NixlWorker, _MooncakeStoreSim):  # type: ignore[misc,valid-type]
        """``MultiConnector([NixlConnector, MooncakeStoreConnector])`` on a
        decode instance: NIXL loads the prompts remote prefills computed,
        MooncakeStore stores and loads prefixes; NIXL's worker rewrites what
        it receives (module docstring), and every PUT is checked against
        those writes (:meth:`NixlWorker.check_read_after_rewrites`)."""

        name = "nixl_mooncake"
        connector = "MultiConnector"
        nixl_roles = ("prefill",)

        @classmethod
        def scheduler_kwargs(cls, schedule: vf.Schedule) -> dict[str, Any]:
            connectors = [
                {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
                {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"},
            ]
            return {"extra": {"connectors": connectors}, "role": "kv_both"}

        @classmethod
        def draw_options(cls, rng: random.Random, schedule: vf.Schedule) -> dict[str, Any]:
            return {**_MooncakeStoreSim.draw_options(rng, schedule), **cls.nixl_options(rng, schedule)}

        def prepare(self) -> None:
            self.nixl_prepare()
            scheduler = self.scheduler
            # MooncakeStore's worker sees its own connector, as in a MultiConnector's worker.
            self.scheduler = SimpleNamespace(connector=scheduler.connector._connectors[1])
            try:
                super().prepare()
            finally:
                self.scheduler = scheduler

        def request_params(self, spec: vf.RequestSpec) -> dict[str, Any] | None:
            return self.nixl_params(spec)

        def plan(self, step: int, out: Any) -> None:
            from blockpool.integrations.vllm import connectors as vc
            from blockpool.integrations.vllm.hazards import Transfer

            nixl_meta, store_meta = out.kv_connector_metadata.metadata
            self.nixl_plan(step, nixl_meta)
            super().plan(step, SimpleNamespace(kv_connector_metadata=store_meta))
            audit = os.environ.get("BLOCKPOOL_VLLM_HAZARDS") == "audit"  # no wait replaced: vLLM's own run
            stock_waits = audit or bool(getattr(store_meta, vc.META_STOCK, False))
            for rm in store_meta.requests:
                wire = getattr(rm, vc.META_STORE, None)
                if wire is not None:
                    put = Transfer.from_wire(wire)
                    self.check_read_after_rewrites(step, rm.req_id, put.block_ids, put.fence, stock_waits)

        def encode(
            self, step: int, due: list[list[vf.SimTransfer]], twice: list[list[vf.SimTransfer]]
        ) -> list[Any]:
            from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
                MultiKVConnectorWorkerMetadata,
            )

            store_due = [[t for t in ts if not _is_nixl(t)] for ts in due]
            store_twice = [[t for t in ts if not _is_nixl(t)] for ts in twice]
            outs = []
            for rank, store_out in enumerate(super().encode(step, store_due, store_twice)):
                fields = self.nixl_fields(step, [t for t in due[rank] if _is_nixl(t)])
                fields["finished_recving"] |= set(store_out.finished_recving or ())
                fields["invalid_block_ids"] |= set(store_out.invalid_block_ids or ())
                fields["failed_recving"] |= set(store_out.failed_recving or ())
                inner = store_out.kv_connector_worker_meta
                meta = None if inner is None else MultiKVConnectorWorkerMetadata(metadata=(None, inner))
                outs.append(_kv_output(fields, meta))
            return outs


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    sys.path.insert(0, os.getcwd())
    import conftest  # noqa: F401  (the shape-only model configs, offline)

    vf._quiet_logs()
    sys.exit(vf.main())
