"""The state store port's adapters: the blob (ETag CAS) and the in-memory fake."""
