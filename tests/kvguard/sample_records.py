"""Records as a staging log holds them, for the report and fleet-log tests."""


def violation(kind="double-free", site=("serve.py", 10, "finish"), pid=11, t=1.0):
    """A violation record as ``Violation.to_dict()`` writes it."""
    return {"kind": kind, "block_ids": [3], "message": "m", "allocator": {
        "class": "eng.Pool", "name": "Pool#1", "address": "0x1"}, "method": "free",
        "pool": None, "call_stack": [{"file": site[0], "line": site[1], "function": site[2]}],
        "blocks": [], "owner": None, "history": [], "thread": "MainThread", "pid": pid,
        "time": t, "expected": False, "extra": {},
        "summary": f"SUMMARY: kvguard: {kind} {site[0]}:{site[1]} in {site[2]}"}
