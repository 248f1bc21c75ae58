"""``gpudecode prepare``: a standard decoder step export rewritten into the form the fast path uses.

The package imports nothing on import (``prepare.detect`` is read at model load by the session
layer); the entry point is :func:`gpudecode.prepare.api.prepare_model`.
"""
