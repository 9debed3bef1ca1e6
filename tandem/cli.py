"""The `tandem` command: one sub-command per service, plus serve and bench."""

from __future__ import annotations

import sys

USAGE = """usage: tandem <command> [options]

commands:
  target    serve a Llama-family target model over gRPC (one process per TP rank)
  draft     serve an EAGLE-3 draft head over gRPC, with its own KV cache
  gateway   serve the OpenAI-compatible REST API and gRPC Generation, deciding speculation per step
  serve     start target, draft and gateway together on this machine
  bench     sweep throughput against concurrency for never/always/auto; table, JSON and PNG
  train-draft  train an EAGLE-3 draft head for a Llama-family target (SGLang checkpoint format)

Run `tandem <command> --help` for a command's options.
Logging: TANDEM_LOG_LEVEL (default INFO), TANDEM_LOG_FORMAT=text|json (json lines carry trace ids).
"""


def _target(argv: list[str]) -> int:
    from target_service.server import main
    return main(argv)


def _draft(argv: list[str]) -> int:
    from draft_service.server import main
    return main(argv)


def _gateway(argv: list[str]) -> int:
    from gateway.main import main
    return main(argv)


def _train_draft(argv: list[str]) -> int:
    from draft_service.training.main import main
    return main(argv)


def _serve(argv: list[str]) -> int:
    from gateway.serve import main
    return main(argv)


def _bench(argv: list[str]) -> int:
    from tandem.bench import main
    return main(argv)


COMMANDS = {"target": _target, "draft": _draft, "gateway": _gateway, "serve": _serve, "bench": _bench,
            "train-draft": _train_draft}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"tandem: '{command}' is not available in this build.\n\n{USAGE}", file=sys.stderr)
        return 2
    from tandem.logging_setup import setup_logging

    setup_logging(command)  # the one logging setup: TANDEM_LOG_LEVEL, TANDEM_LOG_FORMAT
    return COMMANDS[command](rest) or 0


if __name__ == "__main__":
    sys.exit(main())
