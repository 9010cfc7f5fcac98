"""Handlers of the example app: ``module:function`` names that ``dbfanout.toml`` points at."""
