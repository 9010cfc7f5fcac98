"""Snapshots of a log source: one coordinator over every log reader, and each database's chunk SQL."""
