"""``dbfanout validate`` and ``status`` for the snapshots of a ``pg_logical`` or ``mysql_binlog`` poller.

Who may write the signal table (a request is read and run by the poller with its own role), what
concurrent workers need to apply a snapshot's reads in order, and an initial snapshot configured
too late to run (a binlog poller's signal table and commit order: dbfanout/ops/binlog_checks.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import sqlalchemy as sa

from dbfanout.ops.checks import Check
from poller.snapshot.postgres import quote_table
from poller.sources.engines import source_engine
from shared.config import PollerConfig
from shared.models import Position

__all__ = ["initial_too_late", "ordering_check", "signal_grant_checks"]

_SNAPSHOT_KINDS = ("pg_logical", "mysql_binlog")

# Roles other than the poller's own (current_user) and superusers that may write the signal table,
# through a grant to them, to a role they are members of, or to PUBLIC. pg_* roles are built in.
_WRITERS = sa.text(
    "SELECT r.rolname FROM pg_roles r WHERE NOT r.rolsuper AND r.rolname <> current_user"
    " AND r.rolname NOT LIKE 'pg\\_%' AND r.rolcanlogin"
    " AND has_table_privilege(r.oid, to_regclass(:t), 'INSERT, UPDATE')"
    " ORDER BY r.rolname"
)
_PUBLIC = sa.text(
    "SELECT EXISTS (SELECT 1 FROM pg_class c, aclexplode(COALESCE(c.relacl, acldefault('r', c.relowner))) a"
    " WHERE c.oid = to_regclass(:t) AND a.grantee = 0 AND a.privilege_type IN ('INSERT', 'UPDATE'))"
)


def signal_grant_checks(cfg: PollerConfig) -> Iterator[Check]:
    """Warn when PUBLIC or other login roles may write the signal table: whoever can insert a request
    makes the poller read its tables (a condition is parsed, never run as SQL, but a snapshot costs)."""
    table = quote_table(cfg.signal_table)
    try:
        with source_engine(cfg).connect() as conn:
            if conn.execute(sa.text("SELECT to_regclass(:t)"), {"t": table}).scalar() is None:
                return  # reported by the signal table check
            public = bool(conn.execute(_PUBLIC, {"t": table}).scalar())
            writers = list(conn.execute(_WRITERS, {"t": table}).scalars())
    except Exception as exc:  # a database error is a failed check, never a crash of validate
        yield Check(cfg.name, "signal grants", "warn", f"cannot check who may write {cfg.signal_table}: {exc}")
        return
    if public:
        yield Check(cfg.name, "signal grants", "warn",
                    f"PUBLIC may write {cfg.signal_table}: anyone who can connect can request snapshots; "
                    f"REVOKE INSERT, UPDATE, DELETE ON {table} FROM PUBLIC (see docs/operations.md)")  # fmt: skip
    elif writers:
        shown = ", ".join(writers[:5]) + (f" and {len(writers) - 5} more" if len(writers) > 5 else "")
        yield Check(cfg.name, "signal grants", "warn",
                    f"{shown} may write {cfg.signal_table} besides the poller's role: keep it to operators "
                    f"(REVOKE INSERT, UPDATE, DELETE ON {table} FROM ...; see docs/operations.md)")  # fmt: skip
    else:
        yield Check(cfg.name, "signal grants", "ok", f"only the poller's role and superusers may write {table}")


def ordering_check(cfg: PollerConfig) -> Iterator[Check]:
    """A snapshot's reads are ordered with the stream's changes on the queue; concurrent workers
    without sessions can apply them out of order."""
    if cfg.kind not in _SNAPSHOT_KINDS or cfg.sessions or cfg.snapshot != "initial":
        return
    yield Check(cfg.name, "snapshot order", "warn",
                "snapshot = \"initial\" delivers to a queue without sessions: concurrent workers may apply a "
                "row's read after a newer change of it; apply with worker.ordering.LatestVersions (apply only "
                "if newer; the example handler does) or set sessions = true")  # fmt: skip


def initial_too_late(cfg: PollerConfig, position: Position | None) -> str | None:
    """What to do when ``snapshot = "initial"`` was added to a poller that already has a checkpoint
    (the initial snapshot runs on a first start only): None when it does not apply."""
    if (
        cfg.kind not in _SNAPSHOT_KINDS
        or cfg.snapshot != "initial"
        or position is None
        or position.snapshot is not None
    ):
        return None
    return (f'snapshot = "initial" runs on a first start only, and poller {cfg.name} has a checkpoint: no snapshot '
            f"ran; run `dbfanout snapshot {cfg.name}` to read its tables now")  # fmt: skip
