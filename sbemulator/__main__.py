"""``python -m sbemulator servicebus --config Config.json``."""

from sbemulator.cli import main

main()
