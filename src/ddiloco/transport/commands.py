"""`ddiloco token`: a learner's own token, for a learner started by hand on another machine.

`ddiloco run` gives each learner process only its own token (`DIR/learners/N/token`); a learner started
by hand (`ddiloco learner --token-file F`) may be given the run token, from which it derives its own, but
then it could derive any learner's: give it `ddiloco token --token-file DIR/token --learner N > F` instead.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "token", help="print a learner's own token, derived from the run token",
        description="Print learner N's own token (it proves that learner id and no other), derived from the run "
                    "token in --token-file. Give it to a learner started by hand instead of the run token.")
    parser.add_argument("--token-file", required=True, metavar="PATH", help="file holding the run token")
    parser.add_argument("--learner", type=int, required=True, metavar="N", help="the learner id")


def run(args: argparse.Namespace) -> int:
    from ddiloco.transport.auth import MAX_LEARNER_ID, learner_token, read_token_file, require_run_token

    if not 0 <= args.learner <= MAX_LEARNER_ID:  # a larger one printed a token no syncer accepts
        raise ValueError(f"--learner {args.learner} is invalid: expected a learner id in 0..{MAX_LEARNER_ID}")
    token = require_run_token(read_token_file(args.token_file), f"--token-file {args.token_file}")
    print(learner_token(token, args.learner))
    return 0
