"""``loraplex-engine plugins``: what a spec may name, without starting a server.

The built-in rewards (tasks/rewards.py) and the installed reward and environment plug-ins
(entry points ``loraplex.rewards`` and ``loraplex.environments``, skyrl-gym ids, verifiers
environments), listed the way a serving engine lists them on /v1/capacity: in a child
process (discovery.installed), so a broken plug-in package cannot hang this command.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from loraplex_engine.plugins.discovery import installed


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plugins",
        help="list the built-in rewards and the installed reward and environment plug-ins",
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Here, not at the top: every command's parser (`--help` too) builds this one, and the
    # tasks package imports every built-in task.
    from loraplex_engine.tasks.rewards import BUILTIN_REWARDS

    found = installed()
    listing = {"builtinRewards": sorted(BUILTIN_REWARDS), **found.to_json()}
    if args.json:
        print(json.dumps({**listing, "problems": list(found.problems)}))
    else:
        for title, key in (
            ("built-in rewards (task.reward)", "builtinRewards"),
            ("reward plug-ins (task.reward; entry points loraplex.rewards)", "rewards"),
            (
                "environments (task.environment.name; loraplex.environments, skyrl-gym, verifiers)",
                "environments",
            ),
        ):
            print(f"{title}:")
            print("\n".join(f"  {name}" for name in listing[key]) or "  (none)")
    for problem in found.problems:  # a partial listing says why, on stderr
        print(f"warning: {problem}", file=sys.stderr)
    return 0
