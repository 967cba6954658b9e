"""The kinds of annotation the project index stores, shared by the index (index.py)
and the textual scan it is built from (indexscan.py)."""

TENSOR = "t"
BOOL_TENSOR = "b"
OPTIONAL_TENSOR = "o"
OTHER = "n"
