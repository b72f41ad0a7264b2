"""The bitcoll launcher: ``python -m launch -n N script.py`` or ``bitcoll-run -n N script.py``.

Its manual is the docstring of :mod:`launch.__main__` (``python -m launch --help`` shows the
options and the same manual). :mod:`launch.supervise` holds the process supervision that the
launcher and the emulated testbed (``bench/netbed.py``) share.
"""
