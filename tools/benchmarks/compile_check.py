"""`prunepipe bench compile`: what `cuda.compile` (torch.compile of each DiT block, inductor) costs and
whether a compiled run keeps the project's resume promise, side by side with eager in one process.

For eager and compiled alike: a DiT trained N AdamW steps from a fixed start, the same again (is a
compiled run repeatable, bit for bit?), and the first N/2 steps then a fresh process's rebuild from their
state (weights and AdamW) for the rest (does a resume end bitwise where the straight run ends?). Prints
the first step's time (compilation), the median step time after it, their ratio, and the largest weight
difference between compiled and eager. Runs on CPU (inductor's C++ backend) or on CUDA.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from prunepipe.pipelines.tasks.diffusion.dit import build_dit, compile_blocks


def build(args, device):
    torch.manual_seed(0)
    model = build_dit(
        args.preset,
        sample_size=args.latent,
        in_channels=4,
        num_classes=10,
        depth=args.depth,
        width=args.width,
        heads=args.heads,
    )
    return model.to(device)


def batch(step: int, args, device):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(args.batch, 4, args.latent, args.latent, generator=generator)
    t = torch.rand(args.batch, generator=generator) * 999
    y = torch.randint(0, 10, (args.batch,), generator=generator)
    return x.to(device), t.to(device), y.to(device)


def train(args, device, compiled: bool, steps: range, start=None):
    """The model and AdamW after `steps`, from `start` (their state dicts) or the seed; and each step's time."""
    model = build(args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if start is not None:
        model.load_state_dict(start[0])
        optimizer.load_state_dict(start[1])
    if compiled:
        compile_blocks(model)  # as place_model does for cuda.compile
    times = []
    for step in steps:
        began = time.perf_counter()
        x, t, y = batch(step, args, device)
        loss = model(x, timestep=t, class_labels=y).sample[:, :4].float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return model, optimizer, times


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def check(args) -> dict:
    device = torch.device(args.device)
    half = args.steps // 2
    out = {}
    for compiled in (False, True):
        straight, _, times = train(args, device, compiled, range(args.steps))
        again, _, _ = train(args, device, compiled, range(args.steps))
        first, optimizer, _ = train(args, device, compiled, range(half))
        start = (copy.deepcopy(first.state_dict()), copy.deepcopy(optimizer.state_dict()))
        resumed, _, _ = train(args, device, compiled, range(half, args.steps), start=start)
        out["compiled" if compiled else "eager"] = {
            "first_step_s": times[0],
            "median_step_s": statistics.median(times[1:]),
            "repeat_bitwise": same(straight, again),
            "resume_bitwise": same(straight, resumed),
            "model": straight,
        }
    eager, compiled = out["eager"].pop("model"), out["compiled"].pop("model")
    out["max_weight_difference"] = max(
        float((x.float() - y.float()).abs().max())
        for x, y in zip(eager.state_dict().values(), compiled.state_dict().values())
    )
    out["speedup"] = out["eager"]["median_step_s"] / out["compiled"]["median_step_s"]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="DiT-S/2")
    parser.add_argument("--depth", type=int, default=2, help="blocks (0: the preset's)")
    parser.add_argument("--width", type=int, default=64, help="hidden size (0: the preset's)")
    parser.add_argument("--heads", type=int, default=2, help="attention heads (0: the preset's)")
    parser.add_argument("--latent", type=int, default=16, help="latent side")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="AdamW steps of each run (the resume splits them in half)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run_from_args(args) -> int:
    result = check(args)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(
        f"cuda.compile check: DiT {args.preset} depth {args.depth} width {args.width}, {args.steps} steps on {args.device}"
    )
    for name in ("eager", "compiled"):
        r = result[name]
        print(
            f"  {name:8s} first step {r['first_step_s']:7.2f} s, then {r['median_step_s'] * 1e3:8.2f} ms a step; "
            f"repeat bitwise {r['repeat_bitwise']}, resume bitwise {r['resume_bitwise']}"
        )
    print(
        f"  compiled / eager step time: {1 / result['speedup']:.2f} (speedup {result['speedup']:.2f}x); "
        f"largest weight difference compiled vs eager {result['max_weight_difference']:.2e}"
    )
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
