"""flake8-kvguard: static checks for the block ids of paged KV-cache allocators.

`flake8 --select KVG` and `kvguard lint` run the same rules (KVG101-KVG106,
KVG201-KVG202). Importing this package is cheap: libcst is loaded only when a file
passes the textual pre-filter.
"""

__version__ = "0.1.0"
