"""Secrets never reach a log line, a raised error's text or a failure record (issue 24)."""

from __future__ import annotations

import io
import logging

import pytest

from shared.logs import JsonFormatter, TextFormatter, get_logger
from shared.models import HandlerContext, RowChange
from shared.scrub import ScrubbedError, describe_error, safe_cause, scrub, scrubbed_errors
from tests.worker.support import Handler, batch, delivery, make_worker

SB = "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=root;SharedAccessKey=S3CRETsb+key/=="
STORAGE = "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=S3CRETacct==;EndpointSuffix=core.windows.net"
SECRETS = ("S3CRETsb+key/==", "S3CRETacct==", "S3CRETpw", "S3CRETsig", "S3CRETodbc")


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        (SB, "SharedAccessKeyName=root"),
        (STORAGE, "AccountName=acct"),
        ("postgresql+psycopg://app:S3CRETpw@db.example:5432/shop", "app:***@db.example"),
        ("https://acct.blob.core.windows.net/c/b?sv=2024-01-01&se=2026&sig=S3CRETsig", "sv=2024-01-01"),
        ("Server=tcp:x;Database=y;Uid=u;Pwd=S3CRETodbc;", "Uid=u"),
        ("{'password': 'S3CRETpw', 'user': 'u'}", "'user': 'u'"),
    ],
)
def test_scrub_masks_the_secret_value_and_keeps_the_rest(text: str, kept: str) -> None:
    # Given a text holding a credential; When scrubbed; Then the value is gone, the context stays
    out = scrub(text)
    assert not any(secret in out for secret in SECRETS)
    assert kept in out and "***" in out
    assert scrub(out) == out  # idempotent


def test_scrub_leaves_plain_text_alone() -> None:
    text = "ValueError: poison rows ['ev-1'] at key=42; cursor=2026-01-01T00:00:00+00:00"
    assert scrub(text) == text


def test_describe_error_is_bounded_and_scrubbed() -> None:
    text = describe_error(RuntimeError(f"cannot connect with {SB} " + "x" * 5000), limit=200)
    assert text.startswith("RuntimeError: cannot connect with Endpoint=sb://")
    assert len(text) == 200 and text.endswith("…")
    assert "S3CRET" not in text


def test_safe_cause_refuses_a_chain_holding_a_secret() -> None:
    clean = ValueError("bad row")
    try:
        try:
            raise KeyError(SB)
        except KeyError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        dirty = outer
    assert safe_cause(clean) is clean
    assert safe_cause(dirty) is None


def test_scrubbed_errors_reraises_a_secret_free_copy_and_clean_errors_untouched() -> None:
    with pytest.raises(ScrubbedError) as caught, scrubbed_errors():
        raise ConnectionError(f"refused: {STORAGE}")
    assert "S3CRET" not in str(caught.value) and "ConnectionError" in str(caught.value)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    with pytest.raises(ValueError, match="plain"), scrubbed_errors():
        raise ValueError("plain")


@pytest.mark.parametrize("formatter", [TextFormatter(), JsonFormatter()])
def test_a_dbfanout_log_line_never_holds_the_secret(formatter: logging.Formatter) -> None:
    # Given a handler on a dbfanout logger; When an exception with a connection string is logged
    # (message argument, extra field and traceback); Then the line holds no secret
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    log = get_logger("test.scrub")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        try:
            raise RuntimeError(f"send failed: {SB}")
        except RuntimeError as exc:
            log.warning("failed with %s", exc, extra={"error": repr(exc)}, exc_info=exc)
    finally:
        log.removeHandler(handler)
    out = stream.getvalue()
    assert "RuntimeError" in out and "SharedAccessKey=***" in out
    assert "S3CRET" not in out


class _LeakyHandler(Handler):
    def __call__(self, events: list[RowChange], context: HandlerContext) -> None:
        raise ConnectionError(f"cannot reach the bus: {SB}")


def test_a_handler_failure_with_a_connection_string_reaches_no_log_and_no_raised_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a handler raising with a connection string in its message, on every retry and on the split
    from tests.worker.support import Sent

    sent = Sent()
    worker = make_worker(_LeakyHandler(), sent=sent)
    texts: list[str] = []
    with caplog.at_level(logging.INFO, logger="dbfanout"):
        for count in (1,):  # retried whole first
            with pytest.raises(Exception) as caught:
                worker.process(delivery(batch(3), delivery_count=count))
            texts.append(str(caught.value))
            assert caught.value.__cause__ is None  # the original (with the key) is not chained
        worker.process(delivery(batch(3), delivery_count=2))  # then split (split_after_deliveries)
        for count in (1, 2):  # a single fails on its own deliveries
            with pytest.raises(Exception) as caught:
                worker.process(delivery(batch(1), delivery_count=count))
            texts.append(str(caught.value))
    # Then: the raised texts and every log record (message, fields, traceback) are clean
    lines = [caplog.handler.format(r) for r in caplog.records]
    assert len(lines) >= 3 and any("SharedAccessKey=***" in line for line in lines)
    assert all("S3CRET" not in text for text in texts + lines), texts + lines
    assert all("ConnectionError" in text for text in texts)
