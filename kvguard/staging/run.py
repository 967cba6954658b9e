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


DEFAULT_LOGS = "kvguard-logs"


def ignored_by_git(directory: str) -> None:
    """``kvguard-logs/``, made when it does not exist yet, with a ``.gitignore`` that ignores
    all of it (as pytest's cache and kvguard lint's cache do), so that a run's logs are not
    committed by accident. A directory named otherwise is the user's to decide about."""
    if os.path.basename(directory) != DEFAULT_LOGS or os.path.isdir(directory):
        return
    try:
        os.makedirs(directory)
        with open(os.path.join(directory, ".gitignore"), "w", encoding="utf-8") as f:
            f.write("# created by kvguard run\n*\n")
    except OSError:  # the sink makes it at the first line, and says what stops it
        pass


def run_command(argv) -> int:
    """``kvguard run [options] -- COMMAND...``: run one command with staging on."""
    import signal
    import subprocess

    from ..cli import Parser, UsageError
    parser = Parser(prog="kvguard run", description=(
        "Run COMMAND with kvguard staging on (KVGUARD=1): every registered allocator in every "
        "Python process it starts is guarded, and each process appends its violations as JSON "
        "lines under --log. Then: kvguard report DIR."),
        epilog="Environment variables (the options above set some of them):\n\n"
               + "\n\n".join(f"{k}: {v}" for k, v in VARIABLES.items()))
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
    log = args.log or env.get("KVGUARD_LOG") or DEFAULT_LOGS
    if names_directory(log):
        log = os.path.join(log, "kvguard-{pid}.jsonl")
    env["KVGUARD_LOG"] = os.path.abspath(log)
    for name, value in (("KVGUARD_MODE", args.mode), ("KVGUARD_STACKS", args.stacks),
                        ("KVGUARD_SAMPLE", args.sample), ("KVGUARD_HISTORY", args.history)):
        if value is not None:
            env[name] = str(value)
    from ..projectconfig import find
    from ..specgrammar import SpecSyntaxError
    try:  # the project's own specs ([tool.kvguard], the pytest ini option), then the options'
        project = find()
    except SpecSyntaxError as exc:
        raise UsageError(f"kvguard run: error: {exc}") from None
    entries = (project.texts if project is not None else []) + args.register
    if entries:
        env["KVGUARD_REGISTER"] = "\n".join(filter(None, [env.get("KVGUARD_REGISTER", "")]
                                                   + entries))
    try:
        config = config_from_env(env)
    except ValueError as exc:
        raise UsageError(f"kvguard run: error: {exc}") from None
    from ..registry import registered
    from ..spec import DEFAULT_SPEC
    from ..specsource import source_misfit
    for name, spec in config.register:  # read from the source: the command's code not imported
        problem = source_misfit(name, spec or registered().get(name) or DEFAULT_SPEC)
        if problem is not None:
            raise UsageError(f"kvguard run: error: {problem}")
    ignored_by_git(os.path.dirname(env["KVGUARD_LOG"]))
    # A Ray cluster the command did not start runs its workers from its own raylets: Ray's
    # runtime-env hook gives every ray.init() of the command this run's settings for them.
    hook = "kvguard.ray.runtime_env_hook"
    if env.get("RAY_RUNTIME_ENV_HOOK", hook) != hook:
        env["KVGUARD_RAY_HOOK"] = env["RAY_RUNTIME_ENV_HOOK"]
    env["RAY_RUNTIME_ENV_HOOK"] = hook
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


def _not_of_run(records, run: str, where: str, since: float):
    """When processes this run did not start (workers of a Ray cluster started outside it,
    with KVGUARD in its own environment) wrote into its log directory while it ran: a line
    that says so; else None."""
    from .summary import Records, summarize
    if records is None:
        return None
    recent = [r for r in (*records.starts, *records.violations, *records.stats)
              if r.get("time", 0) >= since - 1]
    foreign = {r["process"] for r in recent if r["event"] != "start" or r.get("run") != run}
    foreign -= {r["process"] for r in records.starts if r.get("run") == run}
    if not foreign:
        return None
    theirs = Records(violations=[r for r in records.violations if r["process"] in foreign],
                     stats=[r for r in records.stats if r["process"] in foreign],
                     starts=[r for r in records.starts if r["process"] in foreign])
    n = summarize(theirs)["violations"]
    found = f"{n} violation(s)" if n else "no violations"
    return (f"kvguard: none of the processes this run started reported, but {len(foreign)} "
            f"process(es) it did not start wrote {found} under {where} meanwhile (workers of a "
            "cluster started outside this run with kvguard settings of its own, such as a Ray "
            f"cluster started with KVGUARD=1?); see: kvguard report {where}")


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
    everything = load(files) if files else None
    records = of_run(everything, run) if files else None
    if records is None or not records.starts:
        others = _not_of_run(everything, run, where, since)
        if others is not None:
            print(others, file=sys.stderr)
            return
        ray_address = os.environ.get("RAY_ADDRESS", "").strip()
        if ray_address and not code:
            print(f"kvguard: no process of this run wrote under {where}, and RAY_ADDRESS names "
                  f"a Ray cluster kvguard run did not start ({ray_address}): the workers the "
                  "command used there got this run's settings through ray.init()'s "
                  "runtime_env, but those on other hosts write under the same path on their "
                  "own disks, and a worker whose Python lacks kvguard is not guarded: run "
                  "kvguard report on each host's directory", file=sys.stderr)
            return
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
