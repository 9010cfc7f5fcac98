"""The logic behind the operator commands (``dbfanout validate|status|checkpoint|snapshot|notify``; the
dead-letter commands are in :mod:`dbfanout.dlq`).

Commands in :mod:`dbfanout.commands` parse flags and render; everything they decide or write
lives here, in small modules that tests call directly.
"""
