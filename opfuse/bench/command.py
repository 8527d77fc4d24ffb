"""``opfuse bench`` (placeholder until the bench lands)."""


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="the chapter's ablation table for a model (not yet implemented)")
    p.add_argument("model", nargs="?")


def run(args) -> int:
    from opfuse.errors import BadInputError

    raise BadInputError("opfuse bench is not implemented yet")
