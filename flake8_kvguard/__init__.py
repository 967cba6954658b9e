"""flake8-kvguard: static checks for the block ids of paged KV-cache allocators.

`flake8 --select KVG` and `kvguard lint` run the same rules (KVG101-KVG106,
KVG201-KVG202). Importing this package is cheap: libcst is loaded only when a file
passes the textual pre-filter.

PYTEST_DONT_REWRITE: pytest marks an installed plugin's packages for assertion rewriting and
warns when they are already imported (a pytester run inside a session that imported them);
this is library code, not test code, so it is never rewritten and never warned about.
"""

__version__ = "0.1.0"
