"""The sources a poller reads, a folder per kind; ``factory.open_source`` picks one."""
