"""dbfanout's operator side: the ``dbfanout`` console script, the local host and the demo."""
