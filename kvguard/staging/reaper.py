"""Multi-process metrics files of staged processes that were killed outright.

``prometheus_client``'s multi-process mode sums each live gauge over the files of the processes
alive; a process is taken out of the sums by ``mark_process_dead``, which a supervisor calls
when a child exits (gunicorn's ``child_exit``). A worker killed outright (a Ray worker at
``ray.kill``, the OOM killer) has no supervisor doing that: its last gauges would stay in every
sum. Each staged process's metrics writer marks such files dead, those of staged processes only.
"""

from __future__ import annotations

import os


def reap_dead(reaped: set, directory: str | None = None) -> list:
    """Mark dead (``prometheus_client.multiprocess.mark_process_dead``) the live gauge files of
    staged processes that are gone without doing it themselves: a worker killed outright (a
    Ray worker at ``ray.kill``, the OOM killer) would otherwise keep its last gauges in the
    sums. A file counts as a staged process's when it holds kvguard's metrics and its pid is no
    process of this host (the directory is one host's, as ``prometheus_client`` requires).
    Returns the pids marked; ``reaped`` remembers them."""
    directory = directory or os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        return []
    from prometheus_client import multiprocess
    from prometheus_client.mmap_dict import MmapedDict
    marked = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if not (name.startswith("gauge_live") and name.endswith(".db")):
            continue
        pid_text = name[:-3].rpartition("_")[2]
        if not pid_text.isdigit() or int(pid_text) in reaped or _alive(int(pid_text)):
            continue
        pid = int(pid_text)
        try:
            ours = any(entry[0].startswith('["kvguard_') for entry in
                       MmapedDict.read_all_values_from_file(os.path.join(directory, name)))
        except (OSError, ValueError, IndexError):
            continue
        if ours:
            multiprocess.mark_process_dead(pid, directory)
            reaped.add(pid)
            marked.append(pid)
    return marked


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's: alive
    return True
