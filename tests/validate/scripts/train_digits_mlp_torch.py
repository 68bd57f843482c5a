"""A plain PyTorch training script, as a user writes one: the MLP on scikit-learn's digits,
SGD with momentum 0.9, lr 0.05, batch 64, 200 steps, PyTorch's own initialisation and its
own random batches; it logs refdl's JSONL format (docs/validation.md).

    python train_digits_mlp_torch.py --out log.jsonl                  # a healthy run
    python train_digits_mlp_torch.py --out log.jsonl --bug no-zero-grad
    python train_digits_mlp_torch.py --out log.jsonl --start DIR      # refdl's exported start
"""

import argparse
import json
import sys
import time

import torch
from sklearn.datasets import load_digits
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--bug", choices=["no-zero-grad"])
ap.add_argument("--start", help="a folder written by refdl validate --export-start")
args = ap.parse_args()

torch.manual_seed(args.seed)
torch.set_num_threads(1)
model = nn.Sequential(
    nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
)
batch = 64

if args.start:
    sys.path.insert(0, args.start)
    import load_torch

    load_torch.load_start(model)
    batches = load_torch.batches()
    x_test, y_test = load_torch.test_set()
else:
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x))
    train, test = perm[:1437], perm[1437:]
    x_test, y_test = x[test], y[test]

    def random_batches():
        for _ in range(args.steps):
            rows = train[torch.randint(len(train), (batch,))]
            yield x[rows], y[rows]

    batches = random_batches()

opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()
rows = []
for step, (xb, yb) in enumerate(batches):
    t0 = time.perf_counter()
    if args.bug != "no-zero-grad":
        opt.zero_grad()
    loss = loss_fn(model(xb.reshape(len(xb), -1)), yb)
    loss.backward()
    opt.step()
    rows.append(
        {"step": step, "loss": loss.item(), "samples_per_s": batch / (time.perf_counter() - t0)}
    )
    if step + 1 == args.steps:
        break

with torch.no_grad():
    accuracy = (model(x_test.reshape(len(x_test), -1)).argmax(-1) == y_test).float().mean()
config = {
    "framework": "torch",
    "framework_version": torch.__version__,
    "model": "mlp",
    "dataset": "digits",
    "preprocessing": "pixels / 16, flattened",
    "init": "refdl" if args.start else "torch_default",
    "data_order": "refdl" if args.start else "random with replacement",
    "optimizer": "momentum",
    "momentum": 0.9,
    "nesterov": False,
    "weight_decay": 0.0,
    "lr": 0.05,
    "lr_schedule": "constant",
    "loss": "cross_entropy",
    "loss_reduction": "mean",
    "dtype": "float32",
    "batch_size": batch,
    "steps": args.steps,
    "hw": "local",
    "final_test_accuracy": float(accuracy),
}
if args.start:
    config["start"] = load_torch.FINGERPRINT
    final = args.out.rsplit(".", 1)[0] + "-final.npz"
    load_torch.save_params(model, final)
    config["final_params"] = final.rsplit("/", 1)[-1]  # beside the log
with open(args.out, "w") as f:
    f.write(json.dumps({"config": config}) + "\n")
    for row in rows:
        f.write(json.dumps(row) + "\n")
print(f"{args.steps} steps, final loss {rows[-1]['loss']:.4f}, test accuracy {accuracy:.4f}")
