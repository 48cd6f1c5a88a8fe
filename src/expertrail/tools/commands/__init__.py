"""One module per `expertrail` subcommand, each with ``add_parser(subparsers)`` and
``run(args) -> exit status`` (the registry is `tools.cli.COMMANDS`). Nothing heavy is imported
at module level: the planner's commands run without torch."""
