"""refdl's single-device training step on a lent accelerator (issues 20 and 21).

On synthetic inputs already on the device (nothing read per step), times the
whole training step (forward, backward, optimizer update) of

- refdl's own models at batch 64 on their default data shapes (``own``),
- the shape-only paper models at their papers' batch sizes (``paper``),
- refdl's transformer at GPT-2 small shape and larger ones (``gpt``): tokens/s
  and model FLOP utilisation against the card's bf16 peak,
- refdl's transformer at two shapes over every batch of ``SWEEP``, sequence 2,048
  (``sweep``, issue 52: the price of a microbatch's size), and one microbatch of a
  gradient-accumulated step over ``MICROBATCH``'s (``microbatch``: no optimizer update),

in fp32 and in bf16 (fp32 master weights; parameters and inputs cast to bf16 for
the forward and backward passes; the loss in fp32). Memory is XLA's compiled plan
(arguments + outputs + temporaries - aliases) and the allocator's peak.

    python scripts/bench_gpu.py --out DIR [--only own,paper,gpt,sweep,microbatch] [--quick]
        [--append docs/bench/gpu/gpu_steps-DATE.json]

Writes ``DIR/gpu_steps.json`` after every case, so a run cut short keeps what it
measured. ``--append FILE`` continues an earlier call's results (the same card):
its cases are kept and the new ones numbered as the next run, so a session's
600-second calls make one file. ``scripts/gpu_rows.py`` turns that file into the
data set's measured-here rows; ``python -m refdl.bench published`` predicts them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from refdl.assemble import load_data, make_task, resolve
from refdl.config.spec import RunSpec
from refdl.core.losses import LOSSES
from refdl.perf.zoo import SHAPE_MODELS

OWN = ("mlp", "lenet5", "resnet", "lstm_lm", "transformer")
# The batch sizes the papers and benchmark pages used (per GPU).
PAPER = {
    "alexnet": 128,
    "vgg16": 64,
    "googlenet": 128,
    "inception_v3": 64,
    "resnet50": 64,
    "resnet101": 64,
    "lstm_lm_medium": 20,
    "gpt2": 8,
}
# refdl's transformer at GPT-2 shapes (Radford et al. 2019): layers, width, heads.
GPT = {
    "gpt2-small": (12, 768, 12, (16,)),
    "gpt2-medium": (24, 1024, 16, (16,)),
    "gpt2-large": (36, 1280, 20, (16, 8)),
    "gpt2-xl": (48, 1600, 25, (8, 4)),
}
# Micro-batch sweeps (issue 52: a microbatch's size has a price): every batch of each
# shape is timed at sequence 2,048, so the per-sequence time's fall with the batch can be
# set beside ``refdl predict --model-shape``'s.
SWEEP = {
    "d2048-l8": (8, 2048, 16, (1, 2, 4, 8, 16)),
    "d4096-l4": (4, 4096, 32, (1, 2, 4, 8)),
}
SWEEP_SEQ = 2048
# The same, one microbatch of a gradient-accumulated step (``microbatch``): no optimizer.
MICROBATCH = {
    "d2048-l8": (8, 2048, 16, (1, 2, 4, 8)),
    "d1024-l8": (8, 1024, 16, (1, 4)),
}
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def cast_floats(tree, dtype):
    """Every floating array of ``tree`` as ``dtype``; integer arrays unchanged."""
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


def gradients(task, dtype):
    """``(params, model state, batch) -> ((loss, new model state), gradients)`` with the
    forward and backward in ``dtype`` (fp32 master weights; the loss in fp32)."""
    loss_of = LOSSES.get(task.loss)

    def loss_fn(params, model_state, batch):
        x = cast_floats(batch["x"], dtype)
        out, new_state = task.model.apply(cast_floats(params, dtype), model_state, x, train=True)
        return loss_of(out.astype(jnp.float32), batch["y"]), new_state

    def grads_of(params, model_state, batch):
        (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, model_state, batch
        )
        new_state = jax.tree.map(lambda n, o: n.astype(o.dtype), new_state, model_state)
        return (loss, new_state), grads

    return grads_of


def own_step(task, dtype):
    """Task's step with the forward/backward in ``dtype`` (fp32 master weights)."""
    grads_of = gradients(task, dtype)

    def step(state, batch):
        (loss, new_state), grads = grads_of(state.params, state.model_state, batch)
        return task.apply_gradients(state, grads, new_state), loss

    return step


def accumulate_step(task, dtype):
    """One microbatch of a gradient-accumulated step: forward, backward and the
    gradients added to an fp32 buffer, no optimizer update (state: params, model
    state, buffer)."""
    grads_of = gradients(task, dtype)

    def step(state, batch):
        params, model_state, acc = state
        (loss, new_state), grads = grads_of(params, model_state, batch)
        return (params, new_state, jax.tree.map(jnp.add, acc, grads)), loss

    return step


def paper_step(module, outputs, dtype, lr=0.01):
    """Forward, backward and an SGD update of a shape-only model under cross entropy."""

    def loss_fn(params, other, x, y):
        v = {"params": cast_floats(params, dtype), **other}
        if "batch_stats" in other:
            logits = module.apply(v, cast_floats(x, dtype), mutable=["batch_stats"])[0]
        else:
            logits = module.apply(v, cast_floats(x, dtype))
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.reshape(-1, outputs).astype(jnp.float32), y.reshape(-1)
        ).mean()

    def step(state, batch):
        params, other = state
        loss, grads = jax.value_and_grad(loss_fn)(params, other, batch["x"], batch["y"])
        return (jax.tree.map(lambda p, g: p - lr * g, params, grads), other), loss

    return step


def memory_plan(compiled) -> int | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def flops_of(compiled) -> float | None:
    a = compiled.cost_analysis()
    if isinstance(a, list):
        a = a[0] if a else {}
    return float(a["flops"]) if a and "flops" in a else None


def time_steps(step, state, batch, min_seconds: float, repeats: int) -> tuple[dict, object]:
    """Compile, warm up, then time ``repeats`` runs of n steps (n so one run >= min_seconds)."""
    jitted = jax.jit(step, donate_argnums=0)
    t0 = time.perf_counter()
    compiled = jitted.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    state, loss = compiled(state, batch)
    state, loss = compiled(state, batch)
    jax.block_until_ready((state, loss))
    t0 = time.perf_counter()
    state, loss = compiled(state, batch)
    jax.block_until_ready((state, loss))
    one = max(time.perf_counter() - t0, 1e-6)
    n = max(3, min(200, math.ceil(min_seconds / one)))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            state, loss = compiled(state, batch)
        jax.block_until_ready((state, loss))
        runs.append((time.perf_counter() - t0) / n)
    loss = float(loss)
    out = {
        "step_time_s": float(np.median(runs)),
        "step_time_spread": float((max(runs) - min(runs)) / np.median(runs)),
        "steps_timed": n * repeats,
        "compile_s": compile_s,
        "memory_plan_bytes": memory_plan(compiled),
        "xla_flops_per_step": flops_of(compiled),
        "final_loss": loss,
        "finite": bool(np.isfinite(loss)),
    }
    return out, state


def own_case(name: str, dtype, batch_size: int, model_opts=(), data_opts=(), dataset=None):
    spec = resolve(
        RunSpec(
            model=name,
            batch_size=batch_size,
            model_opts=model_opts,
            data_opts=data_opts,
            dataset=dataset,
        )
    )
    data = load_data(spec)
    task = make_task(spec, data)
    batch = jax.device_put(data.train_batch(np.arange(batch_size)))
    state = task.init_state(0)
    n_params = sum(int(a.size) for a in jax.tree.leaves(state.params))
    return own_step(task, dtype), state, batch, n_params, data.info, task


def paper_case(name: str, dtype, batch_size: int):
    m = SHAPE_MODELS.get(name)
    module = m.build()
    key = jax.random.key(0)
    if m.input_dtype == jnp.int32:
        x = jax.random.randint(key, (batch_size, *m.input_shape), 0, m.outputs, jnp.int32)
        y = jax.random.randint(jax.random.fold_in(key, 1), x.shape, 0, m.outputs, jnp.int32)
    else:
        x = jax.random.normal(key, (batch_size, *m.input_shape), jnp.float32)
        y = jax.random.randint(jax.random.fold_in(key, 1), (batch_size,), 0, m.outputs)
    v = jax.jit(module.init)(jax.random.key(1), x[:1])
    params = v["params"]
    other = {k: w for k, w in v.items() if k != "params"}
    n_params = sum(int(a.size) for a in jax.tree.leaves(params))
    return paper_step(module, m.outputs, dtype), (params, other), {"x": x, "y": y}, n_params


def gpt_flops_per_token(n_matmul: int, layers: int, d: int, seq: int) -> float:
    """PaLM's count (Chowdhery et al. 2022, App. B): 6 N + 12 L d T per token, N the
    parameters in matrix products (the input embedding is a lookup, not counted)."""
    return 6.0 * n_matmul + 12.0 * layers * d * seq


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="own,paper,gpt")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--models", default=None, help="comma-separated subset of the models")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, for a CPU dry run")
    ap.add_argument("--min-seconds", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--append", default=None, help="an earlier gpu_steps.json to continue")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", str(dev))
    peak = next((v for k, v in BF16_PEAK.items() if k in kind), None)
    doc = {
        "date": datetime.date.today().isoformat(),
        "command": "python scripts/bench_gpu.py " + " ".join(sys.argv[1:]),
        "device": kind,
        "platform": dev.platform,
        "jax": jax.__version__,
        "bf16_peak_flops": peak,
        "quick": args.quick,
        "cases": [],
    }
    run = 1
    if args.append:
        old = json.loads(Path(args.append).read_text(encoding="utf-8"))
        if old["device"] != kind:
            raise SystemExit(f"--append {args.append}: measured on {old['device']}, not {kind}")
        if old.get("quick", False) != args.quick:
            raise SystemExit(f"--append {args.append}: --quick and measurements do not mix")
        old.setdefault("commands", [old.pop("command", "")])
        old["commands"].append(doc["command"])
        run = 1 + max((c.get("run", 1) for c in old["cases"]), default=0)
        doc = old
    dtypes = {
        k: v
        for k, v in {"fp32": jnp.float32, "bf16": jnp.bfloat16}.items()
        if k in args.dtypes.split(",")
    }
    wanted = set(args.models.split(",")) if args.models else None
    only = args.only.split(",")
    min_s = 0.05 if args.quick else args.min_seconds
    reps = 2 if args.quick else args.repeats

    def record(row):
        row["run"] = run
        doc["cases"].append(row)
        (out / "gpu_steps.json").write_text(json.dumps(doc, indent=1))
        t = row.get("step_time_s")
        extra = f" mfu={row['mfu']:.3f}" if row.get("mfu") else ""
        mem = row.get("memory_plan_bytes") or 0
        print(
            f"{row['group']:5s} {row['model']:15s} {row['dtype']} b={row['batch']:<4d} "
            + (f"{t * 1e3:9.3f} ms  {mem / 2**30:6.2f} GiB{extra}" if t else row.get("error", "")),
            flush=True,
        )

    def measure(group: str, name: str, dn: str, b: int, make) -> None:
        """Time one case; a failure (out of memory, say) is recorded and the rest go on."""
        row = {"group": group, "model": name, "dtype": dn, "batch": b}
        try:
            step, state, batch, n = make()
            r, _ = time_steps(step, state, batch, min_s, reps)
            row.update(params=n, **r)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        record(row)
        jax.clear_caches()

    def run_own():
        b = 8 if args.quick else 64
        for name in OWN:
            for dn, dt in dtypes.items():
                measure("own", name, dn, b,
                        lambda name=name, dt=dt: own_case(name, dt, b)[:4])  # fmt: skip

    def run_paper():
        for name, b in PAPER.items():
            if (wanted and name not in wanted) or (
                args.quick and name not in ("alexnet", "lstm_lm_medium")
            ):
                continue
            b = 2 if args.quick else b
            for dn, dt in dtypes.items():
                measure("paper", name, dn, b,
                        lambda name=name, dt=dt, b=b: paper_case(name, dt, b))  # fmt: skip

    def run_gpt(group="gpt"):
        sweep = group in ("sweep", "microbatch")
        seq, vocab = (64, 512) if args.quick else (SWEEP_SEQ if sweep else 1024, 50257)
        tiny = {"tiny": (2, 64, 4, (2, 1) if sweep else (2,))}
        table = {"sweep": SWEEP, "microbatch": MICROBATCH}.get(group, GPT)
        shapes = tiny if args.quick else table
        fits = {}
        for shape, (layers, d, heads, batches) in shapes.items():
            for b in batches:
                if fits.get(shape) and not sweep:
                    break
                opts = (
                    ("d_model", str(d)),
                    ("heads", str(heads)),
                    ("layers", str(layers)),
                    ("mlp_dim", str(4 * d)),
                )
                dopts = (
                    ("shape", "tokens"),
                    ("seq_len", str(seq)),
                    ("vocab", str(vocab)),
                    ("size", "64"),
                )
                row = {"group": group, "model": shape, "dtype": "bf16", "batch": b, "seq_len": seq}
                row.update(layers=layers, d_model=d, heads=heads)
                try:
                    step, state, batch, n, _, task = own_case(
                        "transformer", jnp.bfloat16, b, opts, dopts, "synthetic"
                    )
                    if group == "microbatch":
                        state = (state.params, state.model_state,
                                 jax.tree.map(jnp.zeros_like, state.params))  # fmt: skip
                        step = accumulate_step(task, jnp.bfloat16)
                    emb = vocab * d + seq * d  # token and position tables: lookups
                    r, _ = time_steps(step, state, batch, min_s, reps)
                    tok_s = b * seq / r["step_time_s"]
                    fpt = gpt_flops_per_token(n - emb, layers, d, seq)
                    row.update(params=n, tokens_per_s=tok_s, flops_per_token=fpt, **r)
                    if peak:
                        row["mfu"] = tok_s * fpt / peak
                    # the process's peak so far: one case's own only in a fresh process
                    row["peak_bytes_in_use"] = (dev.memory_stats() or {}).get("peak_bytes_in_use")
                    fits[shape] = True
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                record(row)
                jax.clear_caches()

    groups = {"own": run_own, "paper": run_paper, "gpt": run_gpt,
              "sweep": lambda: run_gpt("sweep"),
              "microbatch": lambda: run_gpt("microbatch")}  # fmt: skip
    for g in only:
        groups[g]()
    (out / "gpu_steps.json").write_text(json.dumps(doc, indent=1))  # also when none matched
    print(f"wrote {out / 'gpu_steps.json'}: {len(doc['cases'])} cases")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
