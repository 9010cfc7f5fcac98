"""The one scrubber on the secret shapes real clients print (issue 32): each shape a test, a
property over generated secrets, and log ``extra`` values of any type.

Every case states the exact expected text: the secret is gone *and* everything around it stays
(a scrubber that masks too little leaks; one that masks the key or the rest hides what failed).
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.logs import JsonFormatter, TextFormatter, get_logger
from shared.scrub import describe_error, scrub
from shared.settings import fingerprint_url, redact_url

# (text, expected): each shape the issue lists, in the forms clients really print it.
SHAPES = {
    "libpq quoted": ("host=db user=app password='S3CRET' dbname=shop", "host=db user=app password='***' dbname=shop"),
    "libpq quoted, spaces and escaped quotes": (
        r"host=db password='a S3CRET \'quoted\' \\ x' port=5432",
        "host=db password='***' port=5432",
    ),
    "libpq bare": ("host=db password=S3CRET dbname=shop", "host=db password=*** dbname=shop"),
    "libpq spaces around =": ("host=db password = S3CRET dbname=shop", "host=db password = *** dbname=shop"),
    "PGPASSWORD env": ("PGPASSWORD=S3CRET psql -h db", "PGPASSWORD=*** psql -h db"),
    "Authorization Bearer": (
        "GET /x Authorization: Bearer eyJhbGciOi.S3CRET-_x.sig== failed",
        "GET /x Authorization: Bearer *** failed",
    ),
    "Bearer in a header dict": (
        "{'Authorization': 'Bearer S3CRET.abc', 'Accept': 'json'}",
        "{'Authorization': 'Bearer ***', 'Accept': 'json'}",
    ),
    "Authorization Basic": ("Authorization: Basic dXNlcjpTM0NSRVQ=", "Authorization: Basic ***"),
    "access_token query": ("https://api/x?access_token=S3CRET&page=2", "https://api/x?access_token=***&page=2"),
    "refresh_token query": ("grant=1&refresh_token=S3CRET&scope=all", "grant=1&refresh_token=***&scope=all"),
    "client_secret form": ("client_id=abc&client_secret=S3CRET", "client_id=abc&client_secret=***"),
    "ClientSecret connection string": (
        "Server=x;ClientId=abc;ClientSecret=S3CRET;Tenant=t",
        "Server=x;ClientId=abc;ClientSecret=***;Tenant=t",
    ),
    "YAML key: value": ("user: app\npassword: my S3CRET pass\nhost: db", "user: app\npassword: ***\nhost: db"),
    "YAML quoted": ("password: 'S3CRET x'\nhost: db", "password: '***'\nhost: db"),
    "header key: value": ("X-Api-Key: S3CRET\nAccept: json", "X-Api-Key: ***\nAccept: json"),
    "JSON": ('{"user": "app", "password": "S3\\"CRET", "port": 5}', '{"user": "app", "password": "***", "port": 5}'),
    "JSON client_secret": ('{"client_secret": "S3CRET"}', '{"client_secret": "***"}'),
    "Python repr with bytes": ("{'token': b'S3CRET', 'n': 1}", "{'token': b'***', 'n': 1}"),
    "URL password with /": (
        "postgresql+psycopg://app:S3/CRET@db.example:5432/shop",
        "postgresql+psycopg://app:***@db.example:5432/shop",
    ),
    "URL password with @": (
        "connect postgresql://app:S3@CRET@db.example/shop failed",
        "connect postgresql://app:***@db.example/shop failed",
    ),
    "URL password with / and @ and :": ("amqps://u:S3:C/R@ET@host/x", "amqps://u:***@host/x"),
    "ODBC braced": ("Driver={ODBC 18};Server=x;PWD={S3CRET};UID=u", "Driver={ODBC 18};Server=x;PWD={***};UID=u"),
    "ODBC braced with ; and }}": (
        "Driver={ODBC 18};Server=x;PWD={S3;CR}}ET};UID=u",
        "Driver={ODBC 18};Server=x;PWD={***};UID=u",
    ),
    "ADO.NET quoted": ('Server=x;Password="S3;CR""ET";User Id=u', 'Server=x;Password="***";User Id=u'),
    "SharedKey": (
        "Authorization: SharedKey myaccount:S3CRETc2lnbmF0dXJl= x-ms-date: today",
        "Authorization: SharedKey *** x-ms-date: today",
    ),
    "SharedKey without the header name": (
        "signed with SharedKey myaccount:S3CRET/sig= at 10:00",
        "signed with SharedKey myaccount:*** at 10:00",
    ),
    "SharedAccessSignature": (
        "SharedAccessSignature sr=https%3A%2F%2Fns.servicebus.windows.net%2Fq&sig=S3CRET%2Bx%3D&se=1767225600&skn=send",
        "SharedAccessSignature sr=https%3A%2F%2Fns.servicebus.windows.net%2Fq&sig=***&se=1767225600&skn=send",
    ),
    "Service Bus connection string": (
        "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=root;SharedAccessKey=S3CRET+k/==",
        "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=root;SharedAccessKey=***",
    ),
    "storage connection string": (
        "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=S3CRET==;EndpointSuffix=core.windows.net",
        "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=***;EndpointSuffix=core.windows.net",
    ),
    # Issue 39: the shapes that leaked before.
    "URL password with a quote, a double quote and a space": (
        "connect postgresql+psycopg://app:S3 C'R\"ET@db.example:5432/shop failed",
        "connect postgresql+psycopg://app:***@db.example:5432/shop failed",
    ),
    "two URLs on one line": (
        "postgresql://a:S3CRET@h1/db then mysql://b:S3CRET2@h2/db",
        "postgresql://a:***@h1/db then mysql://b:***@h2/db",
    ),
    "URL-encoded sig": ("?sr=x&sv=1%26sig%3DS3CRET%2Bx%26se%3D1", "?sr=x&sv=1%26sig%3D***%26se%3D1"),
    "URL-encoded password": ("next=%2Fx%3Fpassword%3DS3CRET%26a%3D1", "next=%2Fx%3Fpassword%3D***%26a%3D1"),
    "triple-quoted Python literal": ("client_secret='''S3CRET''' x", "client_secret='''***''' x"),
    "bare value holding a quote": ("host=db password=S3'CRET port=1", "host=db password=*** port=1"),
    "tuple repr": ("[('user', 'u'), ('password', 'S3CRET')]", "[('user', 'u'), ('password', '***')]"),
    "SAS URL": (
        "https://acct.blob.core.windows.net/c/b?sv=2024-01-01&se=2026&sig=S3CRET",
        "https://acct.blob.core.windows.net/c/b?sv=2024-01-01&se=2026&sig=***",
    ),
}


@pytest.mark.parametrize(("text", "expected"), SHAPES.values(), ids=SHAPES.keys())
def test_each_secret_shape_is_masked_and_its_context_kept(text: str, expected: str) -> None:
    # Given a text with a credential in one of the shapes clients print; When scrubbed
    out = scrub(text)
    # Then exactly the value is masked (the key, the scheme and the rest stay), idempotently
    assert out == expected
    assert "S3" not in out and "CRET" not in out
    assert scrub(out) == out


@pytest.mark.parametrize(("text", "expected"), SHAPES.values(), ids=SHAPES.keys())
def test_settings_redact_url_is_the_same_scrubber(text: str, expected: str) -> None:
    assert redact_url(text) == expected


def test_fingerprint_url_is_frozen() -> None:
    # The fingerprint hashes this form: it must never change, or every poller stops on upgrade
    # (FingerprintMismatchError). These are the outputs of the function before issue 32.
    cases = {
        "postgresql+psycopg://app:pw@db:5432/shop": "postgresql+psycopg://app:***@db:5432/shop",
        "postgresql://db/shop?user=u&password=pw&sslkey=/k": "postgresql://db/shop?user=u&password=***&sslkey=***",
        "sqlite:///tmp/x.db": "sqlite:///tmp/x.db",
        "mysql+pymysql://root@127.0.0.1:3306/test": "mysql+pymysql://root@127.0.0.1:3306/test",
    }
    assert {url: fingerprint_url(url) for url in cases} == cases


NEAR_MISSES = [
    "key=42",
    "pk=1",
    "keys=3",
    "monkey=banana",
    "SharedAccessKeyName=root",
    "AccountName=acct",
    "EndpointSuffix=core.windows.net",
    "Endpoint=sb://ns.servicebus.windows.net/",
    "ClientId=0000-1111",
    "fencing_token=5",
    "cursor=2026-01-01T00:00:00+00:00",
    "https://acct.blob.core.windows.net:443/state/app/orders.json",
    "postgresql+psycopg://app@db:5432/shop",
    "password authentication failed for user app",
    "token count",
    "signal=request",
    "design=final",
    "[sig]",
    "max_tokens=100",
    "passed",
    "(Bearer)",
    "secrets",
    "key_count:",
    "batch_id=7f3a",
    "{'poller': 'orders', 'rows': 3}",
    '{"keys": [1, 2]}',
]


@given(st.lists(st.one_of(st.sampled_from(NEAR_MISSES), st.from_regex(r"[A-Za-z0-9 ._-]{1,12}", fullmatch=True))))
@settings(max_examples=300, deadline=None)
def test_property_text_without_secrets_is_unchanged(words: list[str]) -> None:
    # Given log text made of words that look like credentials but hold none; Then nothing changes
    text = " ".join(words)
    assert scrub(text) == text


# Each shape as a function of the secret: (the text holding it, what scrubbing must give).
_ANY = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=40)
_NO_SPACE = st.from_regex(r"[A-Za-z0-9!#$%()*+,\-./:;<=>?@\[\]^_`{|}~]{1,40}", fullmatch=True)
_BARE = st.from_regex(r"[A-Za-z0-9!#$%()*+,\-./:=?@\[\]^_`{|}~]{1,40}", fullmatch=True)  # no ; & < > quotes
_B64 = st.from_regex(r"[A-Za-z0-9+/]{4,40}={0,2}", fullmatch=True)
_TOKEN = st.from_regex(r"[A-Za-z0-9\-._~+/]{1,60}={0,2}", fullmatch=True)
_URLENC = st.from_regex(r"[A-Za-z0-9%]{1,40}", fullmatch=True)
_LINE = st.from_regex(r"[A-Za-z0-9!#$%()*+\-./:;<=>?@\[\]^_`{|}~][A-Za-z0-9 !#$%()*+\-./:;<=>?@\[\]^_`{|}~'\"]{0,40}",
                      fullmatch=True)  # fmt: skip


def _libpq_quote(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


EMBEDDINGS: dict[str, tuple[st.SearchStrategy[str], Callable[[str], tuple[str, str]]]] = {
    "libpq quoted": (_ANY, lambda s: (f"host=db password={_libpq_quote(s)} port=1", "host=db password='***' port=1")),
    # A value opening with '{' is ODBC's braced form, not a bare one (hypothesis found '{}')
    "libpq bare": (
        _BARE.filter(lambda s: not s.startswith("{")),
        lambda s: (f"host=db password={s} port=1", "host=db password=*** port=1"),
    ),
    "URL password": (
        _NO_SPACE.filter(lambda s: "'" not in s and '"' not in s),
        lambda s: (f"postgresql://app:{s}@db/x failed", "postgresql://app:***@db/x failed"),
    ),
    # SQLAlchemy takes quotes and spaces unencoded: anything but a line break and '://' (issue 39)
    "URL password, any printable": (
        _ANY.filter(lambda s: "://" not in s and "\n" not in s and "\r" not in s),
        lambda s: (f"postgresql://app:{s}@db/x failed", "postgresql://app:***@db/x failed"),
    ),
    "ODBC braced": (_ANY, lambda s: ("Server=x;PWD={" + s.replace("}", "}}") + "};UID=u", "Server=x;PWD={***};UID=u")),
    "JSON": (_ANY, lambda s: (json.dumps({"password": s, "n": 1}), '{"password": "***", "n": 1}')),
    "YAML": (_LINE, lambda s: (f"user: u\nclient_secret: {s}\nport: 1", "user: u\nclient_secret: ***\nport: 1")),
    "Bearer": (_TOKEN, lambda s: (f"Authorization: Bearer {s} failed", "Authorization: Bearer *** failed")),
    "SharedKey": (_B64, lambda s: (f"SharedKey acct:{s} failed", "SharedKey acct:*** failed")),
    "SAS sig": (_URLENC, lambda s: (f"SharedAccessSignature sr=x&sig={s}&se=1",
                                    "SharedAccessSignature sr=x&sig=***&se=1")),
    "access_token": (_BARE, lambda s: (f"get ?access_token={s}&x=1", "get ?access_token=***&x=1")),
    "AccountKey": (_B64, lambda s: (f"AccountName=a;AccountKey={s};EndpointSuffix=e",
                                    "AccountName=a;AccountKey=***;EndpointSuffix=e")),
}  # fmt: skip


@pytest.mark.parametrize("shape", EMBEDDINGS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_property_a_generated_secret_never_survives(shape: str, data: st.DataObject) -> None:
    # Given any secret the shape can carry, embedded in it; When scrubbed; Then the text is exactly
    # the shape with the value masked: nothing of the secret is left, nothing around it is lost
    strategy, embed = EMBEDDINGS[shape]
    secret = data.draw(strategy, label="secret")
    text, expected = embed(secret)
    assert scrub(text) == expected
    assert scrub(expected) == expected


class _Unprintable:
    def __str__(self) -> str:
        return "Pwd=S3CRETobj;Server=x"


@pytest.mark.parametrize("formatter", [TextFormatter(), JsonFormatter()], ids=["text", "json"])
def test_non_string_extra_values_are_scrubbed(formatter: logging.Formatter) -> None:
    # Given extra fields that are not strings (a dict, a list, an exception, bytes, any object)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    log = get_logger("test.scrub_shapes")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        log.warning(
            "connect failed",
            extra={
                "params": {"host": "db", "password": "S3CRETdict", "opts": {"token": 12345678}},
                "urls": ["postgresql://app:S3CRETlist@db/x", "plain"],
                "error": ConnectionError("refused: AccountKey=S3CRETexc=="),
                "raw": b"Authorization: Bearer S3CRETbytes",
                "obj": _Unprintable(),
                "count": 3,
            },
        )
    finally:
        log.removeHandler(handler)
    out = stream.getvalue()
    # Then none of the secrets is in the line, and the rest of each field is
    assert "S3CRET" not in out and "12345678" not in out, out
    assert "connect failed" in out and "'host': 'db'" in out and "plain" in out and "count" in out
    assert "ConnectionError" in out and "AccountKey=***" in out


def test_describe_error_masks_every_shape() -> None:
    # Failure records and span events carry describe_error's text
    for text, expected in SHAPES.values():
        assert describe_error(RuntimeError(text)) == f"RuntimeError: {expected}"
