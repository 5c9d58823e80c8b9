"""``sglang-tree-spec`` command line.

Subcommands import their dependencies lazily, so ``tree-demo`` needs only torch.
"""

from __future__ import annotations

import argparse
import sys


def _tree_demo(args: argparse.Namespace) -> int:
    from sglang_tree_spec import tree_demo

    tree_demo.run(budgets=tuple(args.budgets), samples=args.samples, seed=args.seed)
    return 0


def _train_drafter(args: argparse.Namespace) -> int:
    from sglang_tree_spec.models.train_dflash import run_train_drafter

    return run_train_drafter(args)


def build_parser(with_models: bool = True) -> argparse.ArgumentParser:
    """The argument parser; ``with_models=False`` skips the options of the ``models``
    commands, whose module imports transformers (seconds of start-up)."""
    parser = argparse.ArgumentParser(
        prog="sglang-tree-spec",
        description="Tree speculative decoding (DDTree) for SGLang: tools and demos.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "tree-demo", help="optimal DDTree trees vs the DFlash chain on embedded marginals"
    )
    demo.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    demo.add_argument("--samples", type=int, default=4000, help="simulated verify steps")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(handler=_tree_demo)

    models = commands.add_parser("models", help="model zoo: drafter training")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    train = model_commands.add_parser("train-drafter", help="train a DFlash drafter")
    if with_models:
        from sglang_tree_spec.models.train_dflash import add_train_drafter_args

        add_train_drafter_args(train)
    train.set_defaults(handler=_train_drafter)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(with_models="models" in argv).parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"sglang-tree-spec: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
