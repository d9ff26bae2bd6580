"""``lplugins ft``: torchft's lighthouse, and N replica groups of a training script restarted when lost."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

EPILOG = """\
one machine, 3 replica groups (a lighthouse is started too):
  lplugins ft run --replicas 3 --min-replicas 2 -- python train.py

several hosts (host A runs the lighthouse; each host starts its own range of ids):
  hostA$ lplugins ft lighthouse --min-replicas 2 --port 29510
  hostA$ lplugins ft run --lighthouse http://hostA:29510 --replicas 2 \\
           --first-replica 0 --total-replicas 4 -- python train.py
  hostB$ lplugins ft run --lighthouse http://hostA:29510 --replicas 2 \\
           --first-replica 2 --total-replicas 4 -- python train.py

train.py builds Trainer(**lplugins.compose(strategy="ft_ddp", accelerator="cpu", ...)); see docs/ft.md.
"""


def _run(args: argparse.Namespace) -> int:
    from lplugins._cli.ft_launch import Launcher

    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    launcher = Launcher(
        command,
        args.replicas,
        lighthouse=args.lighthouse,
        min_replicas=args.min_replicas,
        first_replica=args.first_replica,
        total_replicas=args.total_replicas,
        max_restarts=args.max_restarts,
        port=args.port,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        spare=not args.no_spare,
        log_dir=args.log_dir,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return launcher.run()


def _lighthouse(args: argparse.Namespace) -> int:
    from lplugins._cli.ft_launch import start_lighthouse

    server = start_lighthouse(
        min_replicas=args.min_replicas,
        port=args.port,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
    )
    print(f"lplugins ft: lighthouse at {server.address()} (min_replicas={args.min_replicas})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0


def _common(p: Any, port_default: int) -> None:
    p.add_argument(
        "--min-replicas", type=int, default=1, help="the fewest replica groups a step commits with (default 1)"
    )
    p.add_argument("--port", type=int, default=port_default, help="the lighthouse's port (0: any free port)")
    p.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=1000,
        help="how long without a heartbeat before the lighthouse drops a replica group (default 1000); "
        "groups started by `run` heartbeat every quarter of it",
    )
    p.add_argument(
        "--quorum-tick-ms",
        type=int,
        default=10,
        help="how often the lighthouse checks whether a quorum can form (default 10; torchft's is 100)",
    )


def add_parser(sub: Any) -> None:
    """Add the ``ft`` subcommand (``run``, ``lighthouse``) to the ``lplugins`` command's subparsers."""
    p = sub.add_parser(
        "ft",
        help="fault-tolerant training with torchft (ft_ddp): lighthouse and replica groups",
        description="Start torchft's lighthouse and replica groups for the ft_ddp strategy. "
        'Needs the ft extra: pip install "lplugins[ft]".',
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ft_sub = p.add_subparsers(dest="ft_command", metavar="{run,lighthouse}", required=True)
    run = ft_sub.add_parser(
        "run",
        help="a lighthouse (unless --lighthouse) and N replica groups, each restarted when it dies",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--replicas", type=int, required=True, help="replica groups to start on this host")
    run.add_argument("--lighthouse", help="a running lighthouse (http://HOST:PORT); default: start one here")
    run.add_argument("--first-replica", type=int, default=0, help="the id of the first group started here")
    run.add_argument("--total-replicas", type=int, help="the job's replica groups (default: first + replicas)")
    run.add_argument("--max-restarts", type=int, default=10, help="restarts in all (default 10)")
    run.add_argument(
        "--no-spare", action="store_true", help="no fork server: each group (and restart) is a fresh process"
    )
    run.add_argument("--log-dir", help="write each process's output to LOG_DIR/replica_<id>.<n>.log")
    _common(run, 0)
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command each group runs")
    run.set_defaults(func=_run)
    lighthouse = ft_sub.add_parser("lighthouse", help="run torchft's lighthouse until interrupted")
    _common(lighthouse, 29510)
    lighthouse.set_defaults(func=_lighthouse)
