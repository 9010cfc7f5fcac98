"""Helpers for tests: real servers (Azurite, databases) started or found, never mocked."""
