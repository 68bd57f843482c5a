"""A plain PyTorch training script, as a user writes one, run many times in one process:
the digits (scikit-learn, pixels / 16) with the MLP or LeNet-5, SGD with momentum 0.9,
lr 0.05, batch 64, PyTorch's own initialisation, its own train/test split and its own
batches (``DataLoader``: reshuffled epochs, or random batches drawn with replacement).
Each run is logged as a user logs it: JSON lines in refdl's format (docs/validation.md),
a CSV with a header, or a TensorBoard event file (``torch.utils.tensorboard``), the
configuration in the JSONL or in a TOML file beside the CSV / event folder.

``--bug`` plants one of the mistakes `scripts/bench_validate.py` must catch; the log
still declares the documented configuration, as a buggy script's log would.

    python scripts/user_runs/torch_digits.py --out DIR --model mlp --seeds 1,2,3
    python scripts/user_runs/torch_digits.py --out DIR --model lenet5 --bug lr-x10 --seeds 1
    python scripts/user_runs/torch_digits.py --out DIR --formats jsonl,csv,tb --seeds 7
    python scripts/user_runs/torch_digits.py --out DIR --start START --seeds 1  # refdl's start
"""

import argparse
import sys
import time
from pathlib import Path

import logfiles  # beside this script
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

BUGS = ("no-zero-grad", "lr-x10", "lr-x0.1", "label-noise", "sorted", "init-x10", "no-momentum")
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True, help="folder for the logs")
ap.add_argument("--model", default="mlp", choices=["mlp", "lenet5"])
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--seeds", default="1", help="comma-separated seeds, one run each")
ap.add_argument("--sampler", default="shuffle", choices=["shuffle", "replacement"])
ap.add_argument(
    "--train-on-all",
    action="store_true",
    help="train on all 1,797 digits, the test rows included (a healthy variant)",
)
ap.add_argument("--bug", choices=BUGS)
ap.add_argument("--formats", default="jsonl", help="any of jsonl, csv, tb (comma-separated)")
ap.add_argument("--start", help="a folder written by refdl validate --export-start")
args = ap.parse_args()
torch.set_num_threads(1)
BATCH, LR, MOMENTUM = logfiles.BATCH, logfiles.LR, logfiles.MOMENTUM


def make_model(name: str) -> nn.Module:
    if name == "mlp":
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, 256),
            nn.ReLU(),
            nn.Linear(256, 256),
            nn.ReLU(),
            nn.Linear(256, 10),
        )
    return nn.Sequential(  # LeNet-5 as refdl's: 8 and 16 maps, tanh, average pooling
        nn.Conv2d(1, 8, 5, padding=2),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Conv2d(8, 16, 5, padding=2),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(64, 120),
        nn.Tanh(),
        nn.Linear(120, 84),
        nn.Tanh(),
        nn.Linear(84, 10),
    )


def batches(x, y, seed: int):
    """The run's batches: the user's sampler, or the planted data-order bug."""
    g = torch.Generator().manual_seed(seed)
    if args.bug == "sorted":  # data left sorted by class and read in order
        order = torch.argsort(y, stable=True)
        x, y = x[order], y[order]
        while True:
            yield from DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    if args.sampler == "replacement":
        sampler = RandomSampler(
            range(len(x)), replacement=True, num_samples=args.steps * BATCH, generator=g
        )
        yield from DataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=sampler)
    while True:
        yield from DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=g)


def one_run(seed: int) -> None:
    torch.manual_seed(seed)
    model = make_model(args.model)
    if args.start:
        sys.path.insert(0, args.start)
        import load_torch

        load_torch.load_start(model)
        train = iter(load_torch.batches())
        x_test, y_test = load_torch.test_set()
        x_test = x_test.reshape(-1, 1, 8, 8) if args.model == "lenet5" else x_test
    else:
        digits = load_digits()
        x = torch.tensor(digits.data / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
        y = torch.tensor(digits.target, dtype=torch.long)
        perm = torch.randperm(len(x))  # the user's own 80/20 split
        tr, te = perm[:1437], perm[1437:]
        tr = perm if args.train_on_all else tr  # the test split included in training
        x_train, y_train = x[tr], y[tr].clone()
        if args.bug == "label-noise":  # 20 % of the labels replaced at random
            noisy = torch.rand(len(y_train)) < 0.2
            y_train[noisy] = torch.randint(10, (int(noisy.sum()),))
        x_test, y_test = x[te], y[te]
        train = batches(x_train, y_train, seed)
    if args.bug == "init-x10":
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(10.0)
    lr = {"lr-x10": LR * 10, "lr-x0.1": LR * 0.1}.get(args.bug, LR)
    momentum = 0.0 if args.bug == "no-momentum" else MOMENTUM
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    rows = []
    for step in range(args.steps):
        xb, yb = next(train)
        xb = xb.reshape(len(xb), 1, 8, 8) if args.model == "lenet5" else xb
        t0 = time.perf_counter()
        if args.bug != "no-zero-grad":
            opt.zero_grad()
        loss = loss_fn(model(xb), yb)
        loss.backward()
        opt.step()
        rows.append(
            {
                "step": step,
                "loss": loss.item(),
                "samples_per_s": len(xb) / (time.perf_counter() - t0),
            }
        )
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(-1) == y_test).float().mean())
    rows[-1]["test_accuracy"] = accuracy
    config = logfiles.declared(
        "torch",
        torch.__version__,
        args.model,
        "refdl" if args.start else "torch_default",
        args.sampler,
        args.steps,
        seed,
    )
    sampler = args.sampler + ("-all" if args.train_on_all else "")
    name = f"torch-{args.model}-{sampler}-{args.bug or 'healthy'}-s{seed}"
    out = Path(args.out)
    formats = args.formats.split(",")
    if args.start:  # the start's own seed and refdl's split
        del config["seed"]
        config["split"] = "refdl"
        config["data_order"] = "refdl"
        config["start"] = load_torch.FINGERPRINT
        load_torch.save_params(model, str(out / f"{name}-final.npz"))
        config["final_params"] = f"{name}-final.npz"  # beside the log
    logfiles.write(out, name, config, rows, formats)
    if "tb" in formats:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(out / f"{name}.tb")) as tb:
            for r in rows:
                tb.add_scalar("loss", r["loss"], r["step"])
                tb.add_scalar("samples_per_s", r["samples_per_s"], r["step"])
            tb.add_scalar("accuracy", accuracy, args.steps - 1)
    print(f"{name}: final loss {rows[-1]['loss']:.4f}, test accuracy {accuracy:.4f}", flush=True)


Path(args.out).mkdir(parents=True, exist_ok=True)
for s in args.seeds.split(","):
    one_run(int(s))
