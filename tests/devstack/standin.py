"""A stand-in child for the supervisor tests: behaves like one of our services at the command line.

python tests/devstack/standin.py [--ready JSON] [--stderr TEXT] [--exit-before N] [--silent]
                              [--bad-ready] [--exit-after N] [--ignore-term] [--config FILE]
                              [--say-pid]   (first stderr line: "pid N")
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import tomllib


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ready", default='{"ok": true}')
    p.add_argument("--stderr", default="")
    p.add_argument("--exit-before", type=int)
    p.add_argument("--silent", action="store_true")
    p.add_argument("--bad-ready", action="store_true")
    p.add_argument("--exit-after", type=int)
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--config")
    p.add_argument("--say-pid", action="store_true")
    args, _ = p.parse_known_args()
    if args.say_pid:
        print(f"pid {os.getpid()}", file=sys.stderr, flush=True)
    if args.stderr:
        print(args.stderr, file=sys.stderr, flush=True)
    if args.exit_before is not None:
        return int(args.exit_before)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_term else (lambda *_: sys.exit(0)))
    if args.silent:
        while True:
            time.sleep(3600)
    ready = json.loads(args.ready)
    if args.config:  # the gateway stand-in: prove the config parses and lists the workers
        with open(args.config, "rb") as fh:
            config = tomllib.load(fh)
        ready["workers"] = len(config["workers"])
        ready["decision"] = config["decision"]["address"]
    print("not json" if args.bad_ready else json.dumps(ready), flush=True)
    if args.exit_after is not None:
        print("bye", file=sys.stderr, flush=True)
        return int(args.exit_after)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
