"""Database URLs for tests. SQLite always; PostgreSQL / MariaDB when a server answers.

Override with DBFANOUT_TEST_PG_URL / DBFANOUT_TEST_MYSQL_URL. When a server is absent the
tests that need it skip with the reason (CI starts both servers, so it runs them).
"""

from __future__ import annotations

import os
import uuid

import sqlalchemy as sa

PG_URL = os.environ.get("DBFANOUT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("DBFANOUT_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test")

_reachable: dict[str, str | None] = {}


def unreachable_reason(url: str) -> str | None:
    """None when the server answers, else why not (cached per URL)."""
    if url not in _reachable:
        try:
            engine = sa.create_engine(url, connect_args={"connect_timeout": 3})
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
            engine.dispose()
            _reachable[url] = None
        except Exception as exc:  # any driver error means: not available here
            _reachable[url] = (
                f"{url.split('://')[0]} server not reachable ({type(exc).__name__}); start it or set the URL"
            )
    return _reachable[url]


def unique_name(prefix: str = "t") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"
