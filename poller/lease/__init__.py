"""The poller's lease: who owns a poller, for how long, and its life in a process."""
