"""A plain Keras (TensorFlow) training script, as a user writes one, run many times in one
process: the digits (scikit-learn, pixels / 16) with the MLP or LeNet-5, SGD with momentum
0.9, lr 0.05, batch 64, Keras' own initialisation (Glorot-uniform kernels, zero biases),
its own train/test split and its own batches (``tf.data``: reshuffled epochs, or random
batches drawn with replacement), a ``GradientTape`` loop. Each run is logged as JSON lines
in refdl's format, a CSV with a header, or TensorBoard events written by ``tf.summary``
(the configuration in the JSONL or in a TOML file beside the CSV / event folder).

``--bug`` plants one of the mistakes `scripts/bench_validate.py` must catch; the log still
declares the documented configuration.

    python scripts/user_runs/keras_digits.py --out DIR --model lenet5 --seeds 1,2,3
    python scripts/user_runs/keras_digits.py --out DIR --bug sorted --formats tb --seeds 4
"""

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import logfiles  # beside this script
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

BUGS = ("no-zero-grad", "lr-x10", "lr-x0.1", "label-noise", "sorted", "init-x10", "no-momentum")
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True, help="folder for the logs")
ap.add_argument("--model", default="mlp", choices=["mlp", "lenet5"])
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--seeds", default="1", help="comma-separated seeds, one run each")
ap.add_argument("--sampler", default="shuffle", choices=["shuffle", "replacement"])
ap.add_argument("--bug", choices=BUGS)
ap.add_argument("--formats", default="jsonl", help="any of jsonl, csv, tb (comma-separated)")
args = ap.parse_args()
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
BATCH, LR, MOMENTUM = logfiles.BATCH, logfiles.LR, logfiles.MOMENTUM


def make_model(name: str) -> keras.Model:
    if name == "mlp":
        layers = [
            keras.layers.Flatten(),
            keras.layers.Dense(256, "relu"),
            keras.layers.Dense(256, "relu"),
            keras.layers.Dense(10),
        ]
    else:  # LeNet-5 as refdl's: 8 and 16 maps, tanh, average pooling
        layers = [
            keras.layers.Conv2D(8, 5, padding="same", activation="tanh"),
            keras.layers.AveragePooling2D(2),
            keras.layers.Conv2D(16, 5, padding="same", activation="tanh"),
            keras.layers.AveragePooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(120, "tanh"),
            keras.layers.Dense(84, "tanh"),
            keras.layers.Dense(10),
        ]
    model = keras.Sequential([keras.Input((8, 8, 1)), *layers])
    return model


def batches(x, y, seed: int):
    """The run's batches: the user's sampler, or the planted data-order bug."""
    if args.bug == "sorted":  # data left sorted by class and read in order
        order = np.argsort(y, kind="stable")
        ds = tf.data.Dataset.from_tensor_slices((x[order], y[order])).batch(BATCH).repeat()
    elif args.sampler == "replacement":
        rows = np.random.default_rng(seed).integers(len(x), size=(args.steps, BATCH))
        ds = tf.data.Dataset.from_tensor_slices((x[rows], y[rows]))
    else:
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shuffle(len(x), seed=seed, reshuffle_each_iteration=True).batch(BATCH).repeat()
    return iter(ds)


def one_run(seed: int) -> None:
    keras.utils.set_random_seed(seed)
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    y = digits.target.astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(x))  # the user's own 80/20 split
    tr, te = perm[:1437], perm[1437:]
    x_train, y_train = x[tr], y[tr].copy()
    rng = np.random.default_rng(seed + 1)
    if args.bug == "label-noise":  # 20 % of the labels replaced at random
        noisy = rng.random(len(y_train)) < 0.2
        y_train[noisy] = rng.integers(10, size=int(noisy.sum()))
    model = make_model(args.model)
    if args.bug == "init-x10":
        for v in model.trainable_variables:
            if len(v.shape) > 1:
                v.assign(v * 10.0)
    lr = {"lr-x10": LR * 10, "lr-x0.1": LR * 0.1}.get(args.bug, LR)
    momentum = 0.0 if args.bug == "no-momentum" else MOMENTUM
    opt = keras.optimizers.SGD(learning_rate=lr, momentum=momentum)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    acc = [tf.Variable(tf.zeros_like(v), trainable=False) for v in model.trainable_variables]

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        if args.bug == "no-zero-grad":  # gradients summed into buffers never cleared
            for a, g in zip(acc, grads, strict=True):
                a.assign_add(g)
            grads = [a.read_value() for a in acc]
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    train = batches(x_train, y_train, seed)
    rows = []
    for t in range(args.steps):
        xb, yb = next(train)
        t0 = time.perf_counter()
        loss = float(step(xb, yb))
        rows.append(
            {
                "step": t,
                "loss": loss,
                "samples_per_s": int(xb.shape[0]) / (time.perf_counter() - t0),
            }
        )
    logits = model(x[te], training=False)
    accuracy = float(np.mean(np.argmax(logits, -1) == y[te]))
    rows[-1]["test_accuracy"] = accuracy
    config = logfiles.declared(
        "tensorflow", tf.__version__, args.model, "keras_default", args.sampler, args.steps, seed
    )
    name = f"keras-{args.model}-{args.sampler}-{args.bug or 'healthy'}-s{seed}"
    out = Path(args.out)
    formats = args.formats.split(",")
    logfiles.write(out, name, config, rows, formats)
    if "tb" in formats:
        writer = tf.summary.create_file_writer(str(out / f"{name}.tb"))
        with writer.as_default():
            for r in rows:
                tf.summary.scalar("loss", r["loss"], step=r["step"])
                tf.summary.scalar("samples_per_s", r["samples_per_s"], step=r["step"])
            tf.summary.scalar("accuracy", accuracy, step=args.steps - 1)
        writer.close()
    print(f"{name}: final loss {rows[-1]['loss']:.4f}, test accuracy {accuracy:.4f}", flush=True)


Path(args.out).mkdir(parents=True, exist_ok=True)
for s in args.seeds.split(","):
    one_run(int(s))
