"""Benchmark: per-step cost of DFlash drafter training, today's recipe vs cached target features
(+ the shortlist loss), on the same batches, and how faithful the shortlist gradient is.

Three modes, each with its own drafter (random init, same seed), run in interleaved rounds
(round ``i`` runs step ``i`` of every mode, the order rotating) so that the load of a shared
machine hits them alike:

* ``today``     -- the recipe as the shipped drafter was trained: a target forward per step
  (``output_hidden_states``), full-vocabulary cross-entropy;
* ``cache``     -- features read from the on-disk feature cache, full-vocabulary loss;
* ``shortlist`` -- cached features and the shortlist loss (labels + cached target top-k +
  ``--negatives`` sampled negatives);
* ``shortlist_wide`` -- the same with ``--wide-negatives`` negatives.

A step is everything the training loop does per step: sample the batch (and read the cache),
forward, loss, backward, clip, AdamW. The cache build (one target forward per record, once) is
timed separately. Data: ``--records`` records of ``--prompt-tokens`` + ``--response-tokens``
tokens of Python standard-library source tokenised by the target, loss mask on the response
(the shape of the regenerated training records: prompt <= 384, response <= 96).

Gradient fidelity: on the same cached batches, the cosine between the drafter-parameter
gradient of the full loss and that of the shortlist loss (both negative counts), for a
random-init drafter and for ``--drafter`` (the shipped trained one); for scale, the cosine
between the full gradients of two different batches (the minibatch noise itself).

    OMP_NUM_THREADS=1 python benchmarks/train_step_cost.py \\
        --target ~/.cache/sglang-tree-spec/models/smollm2-135m-instruct --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import RESULTS, command_line, environment, portable_record
from torch.nn.functional import cosine_similarity as cosine
from transformers import AutoTokenizer

from sglang_tree_spec.drafters.dflash import DFlashDrafter
from sglang_tree_spec.models import train_dflash as recipe
from sglang_tree_spec.models.feature_cache import build_feature_cache

MODES = ("today", "cache", "shortlist", "shortlist_wide")


def make_records(target: str, count: int, prompt: int, response: int) -> list[dict]:
    """``count`` records of stdlib source: ``prompt`` context tokens + ``response`` labelled."""
    tokenizer = AutoTokenizer.from_pretrained(target)
    text = "".join(
        path.read_text(errors="replace")
        for path in sorted(Path(json.__file__).parent.parent.glob("*.py"))[:40]
    )
    ids = tokenizer(text[:2_000_000], add_special_tokens=False)["input_ids"]
    length = prompt + response
    if len(ids) < count * length:
        raise SystemExit(f"only {len(ids)} tokens of text for {count} x {length}")
    return [
        {
            "input_ids": ids[i * length : (i + 1) * length],
            "loss_mask": [0] * prompt + [1] * response,
        }
        for i in range(count)
    ]


def run_step(drafter, optimizer, target, sequences, cache, cfg, step) -> tuple[float, float]:
    """One full training-loop step; returns ``(seconds, loss)``."""
    began = time.perf_counter()
    generator = recipe._step_generator(cfg.seed, step)
    batch = recipe.sample_batch(sequences, cfg.batch_size, cfg.seq_len, generator, cache)
    loss, _, _ = recipe.train_step(drafter, target, batch, cfg, generator)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
    optimizer.step()
    return time.perf_counter() - began, loss.item()


def gradient(drafter, target, batch, cfg, step) -> torch.Tensor:
    drafter.zero_grad(set_to_none=True)
    loss, _, _ = recipe.train_step(drafter, target, batch, cfg, recipe._step_generator(9, step))
    loss.backward()
    return torch.cat([p.grad.flatten() for p in drafter.parameters() if p.grad is not None])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", default="sglang_tree_spec/assets/smollm2-135m-instruct-dflash")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps per mode")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--anchors", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--records", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=384)
    parser.add_argument("--response-tokens", type=int, default=96)
    parser.add_argument("--negatives", type=int, default=2048)
    parser.add_argument("--wide-negatives", type=int, default=8192)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--grad-batches", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "train_step_cost_cpu.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment("cpu")

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        records = make_records(args.target, args.records, args.prompt_tokens, args.response_tokens)
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        base = dict(
            target=args.target, data=str(data), block_size=16, num_layers=args.num_layers,
            steps=1000, batch_size=args.batch_size, seq_len=args.seq_len, lr=2e-3, gamma=7.0,
            anchors_per_seq=args.anchors, seed=0, device="cpu",
        )  # fmt: skip
        configs = {
            "today": recipe.TrainConfig(out_dir=tmp, **base),
            "cache": recipe.TrainConfig(out_dir=tmp, feature_cache=f"{tmp}/cache", **base),
            "shortlist": recipe.TrainConfig(
                out_dir=tmp,
                feature_cache=f"{tmp}/cache",
                shortlist_negatives=args.negatives,
                cache_topk=args.topk,
                **base,
            ),
            "shortlist_wide": recipe.TrainConfig(
                out_dir=tmp,
                feature_cache=f"{tmp}/cache",
                shortlist_negatives=args.wide_negatives,
                cache_topk=args.topk,
                **base,
            ),
        }
        target = recipe.load_target(args.target, torch.device("cpu"))
        sequences = recipe.load_sequences(configs["today"])
        drafters, optimizers = {}, {}
        for mode in MODES:
            drafters[mode] = DFlashDrafter.random_init(
                target.config, num_layers=args.num_layers, block_size=16, seed=0
            ).train()
            optimizers[mode] = torch.optim.AdamW(
                drafters[mode].parameters(), lr=2e-3, betas=(0.9, 0.95)
            )
        layer_ids = drafters["today"].target_layer_ids
        began = time.perf_counter()
        cache = build_feature_cache(
            f"{tmp}/cache", sequences, target, args.target, layer_ids, topk=args.topk
        )
        build_s = time.perf_counter() - began
        caches = {mode: None if mode == "today" else cache for mode in MODES}

        times: dict[str, list[float]] = {m: [] for m in MODES}
        losses: dict[str, list[float]] = {m: [] for m in MODES}
        for step in range(args.warmup + args.steps):
            order = MODES[step % len(MODES) :] + MODES[: step % len(MODES)]
            for mode in order:
                seconds, loss = run_step(
                    drafters[mode], optimizers[mode], target, sequences, caches[mode],
                    configs[mode], step,
                )  # fmt: skip
                if step >= args.warmup:
                    times[mode].append(seconds)
                losses[mode].append(loss)
            print(f"round {step}: " + ", ".join(f"{m} {times[m][-1:]}" for m in MODES))

        fidelity = {}
        trained = DFlashDrafter.from_pretrained(args.drafter, dtype=torch.float32).train()
        fresh = DFlashDrafter.random_init(target.config, num_layers=2, block_size=16, seed=1)
        for name, drafter in (("random_init", fresh.train()), ("shipped", trained)):
            if drafter.target_layer_ids != layer_ids:
                continue
            cosines: dict[str, list[float]] = {"shortlist": [], "shortlist_wide": [], "batches": []}
            previous = None
            for i in range(args.grad_batches):
                batch = recipe.sample_batch(
                    sequences, args.batch_size, args.seq_len, recipe._step_generator(5, i), cache
                )
                full = gradient(drafter, target, batch, configs["cache"], i)
                for mode in ("shortlist", "shortlist_wide"):
                    short = gradient(drafter, target, batch, configs[mode], i)
                    cosines[mode].append(float(cosine(full, short, dim=0)))
                if previous is not None:
                    cosines["batches"].append(float(cosine(full, previous, dim=0)))
                previous = full
            fidelity[name] = cosines
        cache_bytes = cache.bytes_on_disk

    tokens = cache.offsets[-1]
    median = {m: statistics.median(times[m]) for m in MODES}
    result = {
        "command": command_line("benchmarks/train_step_cost.py", argv),
        "environment": env,
        "load_average_after": [round(x, 2) for x in __import__("os").getloadavg()],
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "target_layer_ids": layer_ids,
        "step_seconds": times,
        "median_step_seconds": median,
        "speedup_vs_today": {m: median["today"] / median[m] for m in MODES},
        "first_losses": {m: losses[m][:3] for m in MODES},
        "cache": {
            "records": cache.num_records,
            "tokens": tokens,
            "bytes": cache_bytes,
            "bytes_per_token": cache_bytes / tokens,
            "build_seconds": build_s,
            "build_seconds_per_1k_tokens": 1000 * build_s / tokens,
        },
        "grad_cosine_shortlist_vs_full": fidelity,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = portable_record(result)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_step_seconds", "speedup_vs_today")}))
    print(json.dumps(result["cache"]), json.dumps(fidelity))
    return 0


if __name__ == "__main__":
    sys.exit(main())
