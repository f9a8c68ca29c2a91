"""Starts sglang-router with its own argument parser, then applies what its CLI refuses.

`python -m engine.router_main [sglang-router options] [--then-policy NAME]`: every option goes to
sglang-router's parser unchanged; `--then-policy` is set on the parsed arguments afterwards,
because the router library supports `consistent_hashing` (sticky sessions by the
`X-SMG-Routing-Key` header) while its command line rejects it.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from sglang_router.launch_router import launch_router, parse_router_args

    policy = None
    if "--then-policy" in argv:
        i = argv.index("--then-policy")
        policy = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    args = parse_router_args(argv)
    if policy:
        args.policy = policy
    launch_router(args)


if __name__ == "__main__":
    main(sys.argv[1:])
