"""Experiments that reproduce the Twine paper's figures (``ropewalk experiment ...``)."""
