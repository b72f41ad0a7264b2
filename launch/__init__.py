"""The bitcoll launcher: ``python -m launch -n N script.py`` or ``bitcoll-run -n N script.py``.

Its manual is the docstring of :mod:`launch.__main__` (``python -m launch --help`` for the
options).
"""
