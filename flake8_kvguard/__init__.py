"""flake8-kvguard: static checks for the block ids of paged KV-cache allocators.

`flake8 --select KVG` and `kvguard lint` run the same rules (KVG101-KVG106,
KVG201-KVG204). Importing this package is cheap: the analysis is loaded only when a
file passes the textual pre-filter, and it reads Python's own `ast`; libcst is loaded
only to rewrite code (`kvguard lint --fix`).

PYTEST_DONT_REWRITE: pytest marks an installed plugin's packages for assertion rewriting and
warns when they are already imported (a pytester run inside a session that imported them);
this is library code, not test code, so it is never rewritten and never warned about.
"""

__version__ = "0.1.0"
