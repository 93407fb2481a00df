"""``ridgeline cupti reclaim [--pid N]``: ask the running agent to have served processes
take CUPTI back from another tool (torch.profiler) that took it over.

Run it once that tool is done: a reclaim while it still collects takes its buffers
(docs/cupti.md, "Sharing CUPTI"). The request goes through a file beside the agent's
CUPTI socket (:mod:`agent.reclaim_request`), which only the agent's user may write. Exit
0 once the agent answered (it prints the pids it asked; none when no process was taken
over), 1 when the agent did not answer within ``--timeout`` or the request could not be
written, 2 for bad input.
"""
from __future__ import annotations

import json
import secrets
import time

from ridgeline.agent.commands import description
from ridgeline.probes.errors import InputError, RuntimeFailure


def register(sub) -> None:
    p = sub.add_parser("cupti", help="act on the CUPTI probe of the running agent",
                       description=description(__doc__))
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    r = verbs.add_parser("reclaim", help="ask taken-over processes to take CUPTI back (after torch.profiler)")
    r.add_argument("--pid", type=int, default=None, metavar="N", help="only this process (default: every one)")
    r.add_argument("--config", metavar="FILE", help="config file (default: /etc/ridgeline/agent.toml if present)")
    r.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="wait at most S seconds for the agent's answer (default: two windows and a second)")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.set_defaults(func=run)


def run(args) -> int:
    from ridgeline.agent import config, reclaim_request
    if args.pid is not None and not 1 <= args.pid <= config.PID_MAX:
        raise InputError(f"--pid must be a process id (1..{config.PID_MAX}), got {args.pid}")
    if args.timeout is not None and not 0 < args.timeout <= 3600:
        raise InputError("--timeout must be above 0 and at most 3600")
    cfg = config.load(args.config, missing_ok=args.config is None)
    sock = cfg.probes.cupti.socket
    timeout_s = args.timeout or 2 * cfg.agent.window_s + 1.0
    req_id = secrets.token_hex(8)
    try:
        path = reclaim_request.write_request(sock, req_id, args.pid)
    except FileNotFoundError:
        raise RuntimeFailure(f"cupti reclaim: no agent CUPTI socket folder for {sock} (is `ridgeline agent` "
                             "running with the cupti probe?)") from None
    except OSError as exc:
        raise RuntimeFailure(f"cupti reclaim: cannot write {reclaim_request.paths(sock)[0]}: "
                             f"{exc.strerror or exc} (run it as the agent's user)") from None
    end = time.monotonic() + timeout_s
    while (pids := reclaim_request.read_done(sock, req_id)) is None:
        if time.monotonic() >= end:
            reclaim_request.take_request(sock)      # withdraw it: no stale request for a later agent
            raise RuntimeFailure(f"cupti reclaim: the agent did not take {path} within {timeout_s:g} s "
                                 "(is `ridgeline agent` running with the cupti probe?)")
        time.sleep(0.05)
    if args.json:
        print(json.dumps({"asked_pids": pids}))
    elif pids:
        print(f"asked pid(s) {', '.join(map(str, pids))} to reclaim CUPTI; `ridgeline check` shows when "
              "they resumed", flush=True)
    else:
        print("no served process " + (f"{args.pid} " if args.pid else "") + "had its CUPTI taken over",
              flush=True)
    return 0
