"""The tick: fetch a page, send it, commit the checkpoint; linger, read-ahead, wake-ups."""
