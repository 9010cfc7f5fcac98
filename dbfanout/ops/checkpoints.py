"""Checkpoint export, reset and clone with guardrails (seed 002 §10).

A reset or clone is planned first (pure reads; nothing written), shown to the operator, and then
applied in this order:

1. backup: the previous state blob, verbatim, to ``backups/{app}/{poller}/{timestamp}.json``;
2. the CAS write (If-Match on the ETag the plan read; If-None-Match ``*`` for a new blob), so a
   poller that took the lease in between makes the write fail instead of being overwritten;
3. the audit record, appended to ``audit/{app}.jsonl`` (an append blob in the state container).

Refusals raise :class:`Refused` (exit 3); nothing is written before every guardrail passed.
"""

from __future__ import annotations

import datetime as dt
import getpass
import socket
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Literal

from azure.core.exceptions import ResourceExistsError

from poller.lease.protocol import default_skew_margin
from poller.ports import Snapshot
from poller.state.blob import BlobStateStore, blob_errors
from poller.tick.epochs import ORDER
from shared.codec import decode_position, decode_snapshot, dumps, encode_state, loads
from shared.errors import DbFanoutError, LostLeaseError
from shared.logs import get_logger, ids
from shared.models import Checkpoint, Lease, Position, StateDoc

__all__ = [
    "LeaseState",
    "Plan",
    "Refused",
    "apply",
    "lease_state",
    "plan_clone",
    "plan_reset",
    "position_from_export",
    "state_json",
]

log = get_logger("cli.checkpoint")

LeaseState = Literal["free", "live", "expired"]
TargetKind = Literal["beginning", "cursor", "file", "keep"]


class Refused(DbFanoutError):
    """A guardrail said no (exit 3). Nothing was written."""


def state_json(doc: StateDoc) -> dict[str, Any]:
    """The state document exactly as the blob holds it (seed 002 §4 layout)."""
    result: dict[str, Any] = loads(encode_state(doc))
    return result


def lease_state(lease: Lease, now: dt.datetime, ttl_seconds: int) -> LeaseState:
    """``live`` until ``expires_at`` plus the poller's skew margin; ``expired`` if an owner let it lapse."""
    if lease.owner_id is None or lease.expires_at is None:
        return "free"
    margin = default_skew_margin(dt.timedelta(seconds=ttl_seconds))
    return "live" if now < lease.expires_at + margin else "expired"


def position_from_export(doc: Any) -> tuple[Position | None, str | None]:
    """(position, source_fingerprint) from a ``checkpoint export`` file (or a backup blob)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("checkpoint"), dict):
        raise ValueError("not a checkpoint export: expected an object with a checkpoint field")
    fingerprint = doc.get("source_fingerprint")
    checkpoint = doc["checkpoint"]
    position = decode_position(checkpoint.get("cursor"))
    snapshot = decode_snapshot(checkpoint.get("snapshot"))  # a pg_logical snapshot running at the export
    if position is not None and snapshot is not None:
        position = Position(position.cursor, position.pk, snapshot)
    return position, fingerprint if isinstance(fingerprint, str) else None


@dataclass
class Plan:
    """A write that passed the guardrails, with what it will change."""

    action: Literal["reset", "clone"]
    poller: str
    blob_name: str
    before: StateDoc | None
    after: StateDoc
    snapshot: Snapshot | None  # what the CAS write is conditional on (None: create)
    notes: list[str] = field(default_factory=list)
    backup_blob: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "poller": self.poller,
            "blob": self.blob_name,
            "before": state_json(self.before) if self.before else None,
            "after": state_json(self.after),
            "backup": self.backup_blob,
            "notes": self.notes,
        }


def _guard_lease(snap: Snapshot, now: dt.datetime, ttl_seconds: int, force: bool, take_over: bool) -> list[str]:
    lease = snap.doc.lease
    state = lease_state(lease, now, ttl_seconds)
    if state == "live" and take_over:
        # The write bumps the fencing token and frees the lease in one CAS: the holder's next
        # write (commit or renewal) fails on the ETag, and it reloads from this checkpoint.
        return [
            f"taking over the live lease of {lease.owner_id} (fencing token {lease.fencing_token} -> "
            f"{lease.fencing_token + 1}); its next write fails and it reloads from the new checkpoint "
            "(a batch it is sending may arrive once more)"
        ]
    if state == "live":
        raise Refused(
            f"poller {snap.doc.poller_name}: a live lease is held by {lease.owner_id} (fencing token "
            f"{lease.fencing_token}, expires {lease.expires_at:%Y-%m-%d %H:%M:%S} UTC); "
            "refusing to move its checkpoint",
            hint="a running app keeps its lease between ticks: re-run with --take-over to move the checkpoint "
            "under it (its owner reloads the new state), or stop the app and retry after the lease is released",
        )
    if state == "expired" and not (force or take_over):
        raise Refused(
            f"poller {snap.doc.poller_name}: the lease of {lease.owner_id} expired at "
            f"{lease.expires_at:%Y-%m-%d %H:%M:%S} UTC but was never released (a crashed tick?)",
            hint="make sure no tick of this poller is still running, then re-run with --force",
        )
    return [f"overriding the expired lease of {lease.owner_id}"] if state == "expired" else []


def plan_reset(
    store: BlobStateStore,
    *,
    kind: TargetKind,
    position: Position | None,
    current_fingerprint: str,
    file_fingerprint: str | None = None,
    accept_fingerprint: bool = False,
    force: bool = False,
    take_over: bool = False,
    ttl_seconds: int,
    now: dt.datetime,
    operator: str,
) -> Plan:
    """Check the guardrails and build the reset. Raises Refused; writes nothing."""
    snap = store.load()
    notes: list[str] = []
    if snap is not None:
        notes += _guard_lease(snap, now, ttl_seconds, force, take_over)
        stored = snap.doc.source_fingerprint
        if stored != current_fingerprint and not accept_fingerprint:
            raise Refused(
                f"poller {store.poller_name}: the checkpoint was written for source {stored} but the configured "
                f"source is {current_fingerprint} (fingerprint mismatch)",
                hint="if the source change is intended, re-run with --accept-fingerprint (consider a new poller name "
                "and a backfill instead); otherwise restore the old source settings",
            )
        if stored != current_fingerprint:
            notes.append(f"adopting the new source fingerprint {current_fingerprint}")
    elif kind == "keep":
        raise Refused(f"poller {store.poller_name}: it has no state yet; there is no checkpoint to keep")
    if file_fingerprint and file_fingerprint != current_fingerprint and not accept_fingerprint:
        raise Refused(
            f"the file's checkpoint belongs to source {file_fingerprint}, not the configured {current_fingerprint}",
            hint="re-run with --accept-fingerprint if its position is valid for the current source",
        )
    if kind == "keep":
        assert snap is not None
        position = snap.doc.checkpoint.position
    checkpoint = Checkpoint(
        position=position,
        last_successful_batch_id=snap.doc.checkpoint.last_successful_batch_id if snap and kind == "keep" else None,
        updated_at=now,
        metadata={"reset": kind, "reset_at": now.isoformat(), "reset_by": operator, **_order_of(snap)},
    )
    # The lease is left free, with the fencing token bumped: the operator's write counts as an owner.
    token = snap.doc.lease.fencing_token + 1 if snap else 0
    after = StateDoc(
        poller_name=store.poller_name,
        source_fingerprint=current_fingerprint,
        checkpoint=checkpoint,
        lease=Lease(owner_id=None, fencing_token=token),
    )
    return Plan("reset", store.poller_name, store.blob_name, snap.doc if snap else None, after, snap, notes)


def _order_of(snap: Snapshot | None) -> dict[str, Any]:
    """The order epoch the reset keeps: events after it must not sort before those sent already
    (a position moved back starts the next epoch; see poller/tick/epochs.py)."""
    order = snap.doc.checkpoint.metadata.get(ORDER) if snap is not None else None
    return {ORDER: order} if order is not None else {}


def plan_clone(
    source: BlobStateStore,
    target: BlobStateStore,
    *,
    now: dt.datetime,
    operator: str,
    from_beginning: bool = False,
) -> Plan:
    """A new poller's state blob with the source poller's checkpoint (or none). Raises Refused."""
    snap = source.load()
    if snap is None:
        raise Refused(
            f"poller {source.poller_name} has no state blob ({source.blob_name}); nothing to clone",
            hint="check the poller name and the app's state container",
        )
    if target.load() is not None:
        raise Refused(
            f"poller {target.poller_name} already has state ({target.blob_name}); clone never overwrites",
            hint=f"pick another name, or move it with `dbfanout checkpoint reset {target.poller_name}`",
        )
    cp = snap.doc.checkpoint
    checkpoint = Checkpoint(
        position=None if from_beginning else cp.position,
        last_successful_batch_id=None if from_beginning else cp.last_successful_batch_id,
        updated_at=now,
        metadata={"cloned_from": source.poller_name, "cloned_at": now.isoformat(), "cloned_by": operator},
    )
    after = StateDoc(
        poller_name=target.poller_name,
        source_fingerprint=snap.doc.source_fingerprint,
        checkpoint=checkpoint,
        lease=Lease(owner_id=None, fencing_token=0),
    )
    return Plan("clone", target.poller_name, target.blob_name, None, after, None)


def apply(plan: Plan, store: BlobStateStore, app_name: str, *, now: Callable[[], dt.datetime]) -> Plan:
    """Backup, CAS write, audit — in that order. A concurrent change raises Refused, nothing overwritten."""
    container = store.container_client
    if plan.before is not None:
        stamp = now().strftime("%Y%m%dT%H%M%S%fZ")
        plan.backup_blob = f"backups/{app_name}/{plan.poller}/{stamp}.json"
        with blob_errors("backup"):
            container.upload_blob(plan.backup_blob, encode_state(plan.before), overwrite=False)
    try:
        store.replace(plan.snapshot, plan.after)
    except LostLeaseError as exc:
        raise Refused(
            f"poller {plan.poller}: the state blob changed between reading and writing (a tick ran, or another "
            "operator); nothing was overwritten",
            hint="re-run the command to see the new state and decide again",
        ) from exc
    audit(store, app_name, {**plan.to_json(), "time": now().isoformat(), "operator": operator_id()})
    return plan


def audit(store: BlobStateStore, app_name: str, record: dict[str, Any]) -> str:
    """Append one JSON line to ``audit/{app}.jsonl`` (append blob) and log it; returns the blob name."""
    name = f"audit/{app_name}.jsonl"
    blob = store.container_client.get_blob_client(name)
    with blob_errors("audit"):
        with suppress(ResourceExistsError):
            blob.create_append_blob(if_none_match="*")
        blob.append_block(dumps(record) + b"\n")
    log.info("operator %s of poller %s", record.get("action"), record.get("poller"), extra=ids(audit_blob=name))
    return name


def operator_id() -> str:
    """Who ran the command (user@host), for the audit trail."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"
