"""Compute by shape on a lent GPU (issue 52): the per-shape times ``refdl.perf.gemm`` prices.

Two parts, each in its own process (PyTorch's and JAX's allocators do not share a card):

- ``gemm`` (PyTorch, cuBLAS): DeepBench's 160 training GEMM shapes
  (``docs/published/gemm_deepbench.csv``, transposes as listed) in fp32 without TF32,
  fp32 with TF32 and bf16. Each is captured ``R`` times in a CUDA graph and replayed,
  so a small product's time is the kernel's, not Python's launch; the time of ``R``
  calls launched one by one is kept beside it (``eager_ms``). The same operands are
  used each time, so a small product's matrices sit in the L2 cache, as DeepBench's did.
- ``attention`` (JAX, the call refdl's transformer makes:
  ``jax.nn.dot_product_attention(..., is_causal=True, implementation="cudnn")``): the
  fused attention core's forward and forward + backward in bf16 over sequence lengths
  256 ... 8,192 at 16,384 tokens, heads of 64 and 128.

Writes ``OUT/gemm.json`` / ``OUT/attention.json`` after every case (a call cut short
keeps what it measured). ``scripts/bench_gemm_shapes.py --measured OUT/gemm.json``
judges the shape models on them.

    python3 scripts/measure_shapes.py --out DIR --only gemm
    python3 scripts/measure_shapes.py --out DIR --only attention
    python3 scripts/measure_shapes.py --out DIR --only gemm --quick    # CPU dry run
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "docs" / "published" / "gemm_deepbench.csv"
# (name, torch dtype name, TF32 allowed)
PRECISIONS = (("fp32", "float32", False), ("tf32", "float32", True), ("bf16", "bfloat16", False))
# Attention: (heads, head dim) at 16,384 tokens a call, causal.
ATTENTION_HEADS = ((16, 64), (32, 128))
ATTENTION_SEQ = (256, 512, 1024, 2048, 4096, 8192)
TOKENS = 16384


def shapes(quick: bool) -> list[tuple[int, int, int, bool, bool]]:
    """DeepBench's distinct (m, n, k, A transposed, B transposed), in file order."""
    seen: dict[tuple, None] = {}
    with SHAPES.open() as fh:
        for r in csv.DictReader(line for line in fh if not line.startswith("#")):
            key = (int(r["m"]), int(r["n"]), int(r["k"]), r["a_t"] == "T", r["b_t"] == "T")
            seen.setdefault(key)
    out = list(seen)
    if quick:
        return [(min(m, 256), min(n, 256), min(k, 256), a, b) for m, n, k, a, b in out[:6]]
    return out


def write(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc, indent=1))


def run_gemm(out: Path, quick: bool) -> None:
    import torch

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    doc = {
        "date": datetime.date.today().isoformat(),
        "command": "python3 scripts/measure_shapes.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "method": "CUDA graph of R products, replayed 5 times, median per product"
        if cuda
        else "CPU dry run: wall clock",
        "rows": [],
    }
    path = out / "gemm.json"

    def timed(fn, r: int) -> float:
        """Seconds a call of ``fn``, over ``r`` calls launched one by one."""
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(r):
                fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1e3 / r
        t0 = time.perf_counter()
        for _ in range(r):
            fn()
        return (time.perf_counter() - t0) / r

    for name, dtype_name, tf32 in PRECISIONS:
        dtype = getattr(torch, dtype_name)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        for m, n, k, a_t, b_t in shapes(quick):
            row = {"precision": name, "m": m, "n": n, "k": k, "a_t": a_t, "b_t": b_t}
            try:
                g = torch.Generator(device=dev).manual_seed(0)
                a = torch.randn((k, m) if a_t else (m, k), device=dev, dtype=dtype, generator=g)
                b = torch.randn((n, k) if b_t else (k, n), device=dev, dtype=dtype, generator=g)
                a, b = (a.t() if a_t else a), (b.t() if b_t else b)
                c = torch.empty((m, n), device=dev, dtype=dtype)

                def call(a=a, b=b, c=c):
                    torch.matmul(a, b, out=c)

                for _ in range(3):
                    call()
                eager = timed(call, 20)
                reps = int(min(200, max(5, 3e-3 / max(eager, 1e-7))))
                row["eager_ms"] = eager * 1e3
                row["graph_products"] = reps
                if cuda:
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        call()
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for _ in range(reps):
                            call()
                    graph.replay()
                    torch.cuda.synchronize()
                    runs = [timed(graph.replay, 1) / reps for _ in range(5)]
                else:
                    runs = [timed(call, 3) for _ in range(3)]
                t = statistics.median(runs)
                row.update(time_ms=t * 1e3, tflops=2.0 * m * n * k / t / 1e12,
                           spread=(max(runs) - min(runs)) / t)  # fmt: skip
                del a, b, c
            except Exception as e:  # out of memory, say: recorded, the rest go on
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            doc["rows"].append(row)
            write(path, doc)
        done = [r for r in doc["rows"] if r["precision"] == name and "time_ms" in r]
        best = max((r["tflops"] for r in done), default=0.0)
        print(f"gemm {name}: {len(done)} shapes, best {best:.1f} TFLOP/s", flush=True)
    if cuda:
        torch.cuda.empty_cache()


def run_attention(out: Path, quick: bool) -> None:
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    doc = {
        "date": datetime.date.today().isoformat(),
        "command": "python3 scripts/measure_shapes.py " + " ".join(sys.argv[1:]),
        "device": getattr(dev, "device_kind", str(dev)),
        "jax": jax.__version__,
        "call": 'jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")',
        "method": "jitted call, n calls back to back (n so >= 0.2 s), median of 5 runs",
        "rows": [],
    }
    path = out / "attention.json"
    impl = "cudnn" if gpu else "xla"

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

    def loss(q, k, v):
        return attend(q, k, v).astype(jnp.float32).sum()

    fwd = jax.jit(attend)
    both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    heads = ((2, 16),) if quick else ATTENTION_HEADS
    seqs = (64, 128) if quick else ATTENTION_SEQ
    tokens = 256 if quick else TOKENS
    for h, d in heads:
        for s in seqs:
            b = max(1, tokens // s)
            key = jax.random.key(0)
            q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (b, s, h, d), jnp.bfloat16)
                       for i in range(3))  # fmt: skip
            for name, fn in (("forward", fwd), ("forward+backward", both)):
                row = {"pass": name, "batch": b, "seq": s, "heads": h, "head_dim": d}
                try:
                    jax.block_until_ready(fn(q, k, v))
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(q, k, v))
                    one = max(time.perf_counter() - t0, 1e-6)
                    n = max(3, min(500, int(0.2 / one)))
                    runs = []
                    for _ in range(5):
                        t0 = time.perf_counter()
                        for _ in range(n):
                            r = fn(q, k, v)
                        jax.block_until_ready(r)
                        runs.append((time.perf_counter() - t0) / n)
                    t = statistics.median(runs)
                    # Full (non-causal) count, as refdl's FLOPs count attention: 4 b s^2 h d
                    # a forward pass, twice that for the backward.
                    flops = 4.0 * b * s * s * h * d * (1 if name == "forward" else 3)
                    row.update(time_ms=t * 1e3, tflops_full_count=flops / t / 1e12,
                               spread=(max(runs) - min(runs)) / t, calls_timed=5 * n)  # fmt: skip
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                doc["rows"].append(row)
                write(path, doc)
                print(f"attention {name:16s} b={b:<3d} s={s:<5d} h={h} d={d}: "
                      + (f"{row['time_ms']:.3f} ms" if "time_ms" in row else row["error"]),
                      flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", required=True, choices=("gemm", "attention"))
    ap.add_argument("--quick", action="store_true", help="a few small shapes, for a dry run")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    {"gemm": run_gemm, "attention": run_attention}[args.only](out, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
