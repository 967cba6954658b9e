"""The build's one part pyproject.toml cannot say: kvguard's optional compiled fast path.

``kvguard/_fastpath.c`` is the guard's wrappers in C (see ``kvguard/guard/shadowing.py``). It is
``optional``: without a C compiler (or Python headers) the build warns and goes on, and kvguard
uses the same wrappers written in Python. ``KVGUARD_PURE=1`` picks those at run time too.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvguard._fastpath", ["kvguard/_fastpath.c"], optional=True)])
