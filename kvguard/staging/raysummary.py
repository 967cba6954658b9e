"""``kvguard report``'s view of processes: which Ray actor each one was, and which ended
without a final record.

A Ray worker's records carry its Ray context (``ray``: node, job, worker, actor class, id and
name, task), and its file is opened when its first guard attaches, so a worker that Ray killed
leaves a ``start`` line and no final ``stats`` line (at most checkpoints, ``"final": false``).
The report groups by actor as it does by host, and says of a process whose file has no final
line that it was killed (or is still running).
"""

from __future__ import annotations

from collections import Counter

PROCESS_FIELDS = ("node_id", "job_id", "worker_id", "actor_id", "actor_class", "actor_name")
"""The fields of a record's ``ray`` object that hold for its whole process (``task`` does not)."""


def contexts(records) -> dict:
    """``{process: Ray context}`` for every process whose records carry one; a field first seen
    on a later record (a pooled worker that became an actor) is added."""
    out: dict = {}
    for rec in (*records.starts, *records.violations, *records.stats):
        found = rec.get("ray")
        if found:
            merged = out.setdefault(rec["process"], {})
            for name in PROCESS_FIELDS:
                if name in found:
                    merged.setdefault(name, found[name])
    return out


def endings(records) -> dict:
    """``{process: True}`` for a process that wrote its final ``stats`` lines, False for one
    with a ``start`` line and none (killed, or still running), None where ``--since`` cut its
    final lines off (it started earlier)."""
    final = {rec["process"] for rec in records.stats if rec.get("final") is not False}
    out = {proc: True for proc in final}
    for rec in records.starts:
        proc = rec["process"]
        if proc not in final:
            cut = records.since is not None and proc[2] < records.since
            out[proc] = None if cut else False
    return out


def by_actor(contexts_: dict, ended: dict, calls: Counter, violations: dict) -> dict:
    """``{actor id: entry}``: its class, name, node, job, last process, calls checked and
    violations found, and whether it ended with a final record (an actor restarted by Ray is
    one entry over its processes)."""
    actors: dict = {}
    for proc in sorted(contexts_, key=lambda p: p[2]):
        found = contexts_[proc]
        actor = found.get("actor_id")
        if not actor:
            continue
        entry = actors.setdefault(actor, {
            "actor_id": actor, "class": "", "name": "", "node_id": "", "job_id": "",
            "processes": 0, "calls": 0, "violations": Counter()})
        for field, name in (("class", "actor_class"), ("name", "actor_name"),
                            ("node_id", "node_id"), ("job_id", "job_id")):
            entry[field] = found.get(name, entry[field])
        entry.update(host=proc[0], pid=proc[1], file=proc[3], final=ended.get(proc))
        entry["processes"] += 1
        entry["calls"] += calls[proc]
        entry["violations"].update(violations.get(proc, {}))
    return {actor: {**e, "violations": dict(e["violations"])} for actor, e in
            sorted(actors.items(), key=lambda kv: (kv[1]["class"], kv[1]["name"], kv[0]))}


def by_node(contexts_: dict, violations: dict) -> dict:
    """``{node id: {"processes", "violations"}}`` over the Ray processes."""
    nodes: dict = {}
    for proc, found in contexts_.items():
        entry = nodes.setdefault(found.get("node_id", ""), {"processes": 0, "violations": 0})
        entry["processes"] += 1
        entry["violations"] += sum(violations.get(proc, {}).values())
    return dict(sorted(nodes.items()))


def actor_label(found: dict) -> str:
    """``module.Class "name" 0123456789ab``: an actor as the report names it."""
    name = f' "{found["actor_name"]}"' if found.get("actor_name") else ""
    return f"{found.get('actor_class') or '?'}{name} {found.get('actor_id', '')[:12]}"


def render(summary: dict) -> list:
    """The report's "by Ray actor" (and, with several nodes, "by Ray node") lines."""
    lines = []
    nodes = summary.get("by_ray_node") or {}
    if len(nodes) > 1:
        lines += ["", "by Ray node:"]
        for node, e in nodes.items():
            lines.append(f"  {node[:12] or '?'}  {e['violations']:>7,}  in {e['processes']} "
                         "process(es)")
    actors = summary.get("by_ray_actor") or {}
    if actors:
        lines += ["", "by Ray actor:"]
    for a in actors.values():
        label = actor_label({"actor_class": a["class"], "actor_name": a["name"],
                             "actor_id": a["actor_id"]})
        where = f"node {a['node_id'][:8] or '?'}, pid {a['pid']}"
        if a["processes"] > 1:
            where += f", {a['processes']} processes"
        ranked = sorted(a["violations"].items(), key=lambda kv: (-kv[1], kv[0]))
        found = ", ".join(f"{k} {c:,}" for k, c in ranked)
        if a["final"] is False:
            found = f"{found} at least" if found else "no violations logged"
            calls = f", {a['calls']:,} calls by its last checkpoint" if a["calls"] else ""
            lines.append(f"  {label} ({where}): {found}{calls}; ended without a final record: "
                         "killed?")
        else:
            lines.append(f"  {label} ({where}): {found or 'no violations'}, {a['calls']:,} calls")
    return lines


def unfinished_note(summary: dict, listed: int = 5):
    """The note on processes without a final record, or None."""
    unfinished = [p for p in summary["processes"] if p.get("final") is False]
    if not unfinished:
        return None
    named = ", ".join(f"pid {p['pid']} ({p['file']})" for p in unfinished[:listed])
    more = f" and {len(unfinished) - listed} more" if len(unfinished) > listed else ""
    return (f"{len(unfinished)} process(es) ended without a final record: killed? (or still "
            f"running): {named}{more}")


def first_label(found: dict | None) -> str:
    """What the header of a kind's first report says of its Ray actor and task."""
    if not found:
        return ""
    text = f", Ray actor {actor_label(found)}" if found.get("actor_id") else ""
    if found.get("task"):
        text += f", task {found['task']}"
    return text
