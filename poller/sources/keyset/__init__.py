"""The keyset source: a table or query read in ``(cursor, pk)`` order."""
