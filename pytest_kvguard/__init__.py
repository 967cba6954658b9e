"""pytest face of kvguard: ``pytest -p kvguard`` guards every registered allocator.

PYTEST_DONT_REWRITE: pytest marks an installed plugin's packages for assertion rewriting and
warns when they are already imported (a pytester run inside a session that imported them);
this is library code, not test code, so it is never rewritten and never warned about.
"""
