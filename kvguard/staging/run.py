"""``kvguard run [options] -- COMMAND...``: run one command with staging on, then say in one
line what its processes reported.
"""

from __future__ import annotations

import os
import socket
import sys
import time

from .config import MODES, STACKS, VARIABLES, config_from_env
from .sink import names_directory


def run_command(argv) -> int:
    """``kvguard run [options] -- COMMAND...``: run one command with staging on."""
    import signal
    import subprocess

    from ..cli import Parser, UsageError
    parser = Parser(prog="kvguard run", description=(
        "Run COMMAND with kvguard staging on (KVGUARD=1): every registered allocator in every "
        "Python process it starts is guarded, and each process appends its violations as JSON "
        "lines under --log. Then: kvguard report DIR."),
        epilog="environment variables: " + "; ".join(f"{k}: {v}" for k, v in VARIABLES.items()))
    parser.add_argument("--mode", choices=MODES, default=None,
                        help="log (default): record and forward; repair: forward a sanitized "
                             "call; raise: reject the bad call")
    parser.add_argument("--log", metavar="DIR|FILE.jsonl|TEMPLATE", default=None,
                        help="a directory (default ./kvguard-logs, one file per process), one "
                             "file for all processes, or a path template with {pid}")
    parser.add_argument("--stacks", choices=STACKS, default=None)
    parser.add_argument("--sample", type=int, metavar="N", default=None,
                        help="keep the call site of one call in N")
    parser.add_argument("--history", type=int, metavar="N", default=None,
                        help="operations in each report's flight recorder (default 32)")
    parser.add_argument("--register", action="append", default=[], metavar="ENTRY",
                        help="an allocator class to guard (KVGUARD_REGISTER syntax); repeatable")
    parser.add_argument("command", nargs="...", help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("kvguard run: error: no command given (kvguard run -- python "
                         "serve.py ...)")
    env = dict(os.environ)
    env["KVGUARD"] = "1"
    env["KVGUARD_RUN"] = run = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
    log = args.log or env.get("KVGUARD_LOG") or "kvguard-logs"
    if names_directory(log):
        log = os.path.join(log, "kvguard-{pid}.jsonl")
    env["KVGUARD_LOG"] = os.path.abspath(log)
    for name, value in (("KVGUARD_MODE", args.mode), ("KVGUARD_STACKS", args.stacks),
                        ("KVGUARD_SAMPLE", args.sample), ("KVGUARD_HISTORY", args.history)):
        if value is not None:
            env[name] = str(value)
    if args.register:
        env["KVGUARD_REGISTER"] = ",".join(filter(None, [env.get("KVGUARD_REGISTER", "")]
                                                  + args.register))
    try:
        config_from_env(env)
    except ValueError as exc:
        raise UsageError(f"kvguard run: error: {exc}") from None
    started = time.time()
    # Ctrl-C reaches the whole foreground process group: the command gets it from the terminal
    # (a second copy from here would look like a double Ctrl-C). A supervisor's SIGTERM or
    # SIGHUP comes to this process alone: pass it on. The handlers go in before the command
    # starts, so a signal that comes while it is starting is held and passed on, never lost
    # with this process (which would leave the command running on its own).
    child = None
    held = []

    def forward(signum, _frame):
        if child is None:
            held.append(signum)
        else:
            child.send_signal(signum)

    previous = {}

    def install(sig, handler):
        try:
            previous.setdefault(sig, signal.signal(sig, handler))
        except (OSError, ValueError):
            pass

    install(signal.SIGTERM, forward)
    install(signal.SIGHUP, forward)
    try:
        try:
            child = subprocess.Popen(command, env=env)
        except OSError as exc:
            print(f"kvguard run: error: cannot run {command[0]!r}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 127
        install(signal.SIGINT, signal.SIG_IGN)  # after the start: an ignored signal is inherited
        for signum in held:
            child.send_signal(signum)
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        _run_summary(env["KVGUARD_LOG"], started, run, code)
    except Exception as exc:  # the summary is a courtesy: the command's status is what counts
        print(f"kvguard: no summary of this run: {exc!r}", file=sys.stderr)
    return code if code >= 0 else 128 - code


def _exit_text(code: int) -> str:
    if code < 0:
        import signal
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _run_summary(template: str, since: float, run: str, code: int = 0) -> None:
    """One line on stderr after the command: what the processes it ran reported (only those:
    the directory may hold earlier runs' files, or one file shared by every run)."""
    from .summary import collect_files, load, of_run, summarize
    if "{pid}" in template or "{host}" in template:
        where = os.path.dirname(template)
        try:
            files = [f for f in collect_files([where]) if os.path.getmtime(f) >= since - 1]
        except (OSError, ValueError):
            files = []
    else:
        where = template
        files = [template] if os.path.isfile(template) else []
    records = of_run(load(files), run) if files else None
    if records is None or not records.starts:
        if code:
            # The command failed before any guarded allocator wrote a line: its own error
            # (above, on its stderr) is the news, not kvguard's silence.
            print(f"kvguard: the command {_exit_text(code)} and reported nothing under {where}: "
                  "see its own error output above", file=sys.stderr)
        else:
            print(f"kvguard: nothing reported under {where}: no registered allocator was used, "
                  "or the command's Python does not have kvguard installed", file=sys.stderr)
        return
    summary = summarize(records)
    n = summary["violations"]
    found = f"{n} violation(s)" if n else "no violations"
    print(f"kvguard: {found} in {len(summary['processes'])} guarded process(es); see: "
          f"kvguard report {where}", file=sys.stderr)
