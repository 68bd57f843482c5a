"""Does ``torch.optim.Muon`` compute Muon on FSDP2's sharded (DTensor) parameters?

Two gloo ranks on this machine shard one ``Linear(8, 16)`` with ``fully_shard``; one
Muon step (lr 1, no momentum, no weight decay) is compared with PyTorch's own
Newton-Schulz (``torch.optim._muon._zeropower_via_newtonschulz``, bf16 inside as
torch's) of the whole gradient, and of each rank's row shard alone. The spread bf16
itself explains is printed beside (the same iteration in float64).

    .venv/bin/python scripts/torch_muon_fsdp2.py    # ~10 s; needs PyTorch (the .venv has it)
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COEF = (3.4445, -4.7750, 2.0315)


def ns64(g: torch.Tensor) -> torch.Tensor:
    """The same iteration in float64 (no bf16)."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    a, b, c = COEF
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


def rank_main(rank: int, port: int, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.optim._muon import _zeropower_via_newtonschulz as ns

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 16, bias=False)
    w0, x = m.weight.detach().clone(), torch.randn(6, 8)
    g = torch.autograd.grad(m(x).pow(2).sum(), m.weight)[0]
    whole, exact = ns(g, COEF, 5, 1e-7), ns64(g)
    pieces = torch.cat([ns(p, COEF, 5, 1e-7) for p in g.chunk(2, 0)])
    fully_shard(m, mesh=init_device_mesh("cpu", (2,)))
    opt = torch.optim.Muon(list(m.parameters()), lr=1.0, weight_decay=0.0, momentum=0.0,
                           nesterov=False)  # fmt: skip
    m(x).pow(2).sum().backward()
    opt.step()
    update = (w0 - m.weight.detach().full_tensor()) / (16 / 8) ** 0.5  # torch's lr scale
    if rank == 0:
        rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
        out.update(whole=rel(update, whole), shards=rel(update, pieces), bf16=rel(whole, exact))
    dist.destroy_process_group()


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(rank_main, args=(port, out), nprocs=2, join=True)
    print(f"torch {torch.__version__}: FSDP2 + torch.optim.Muon, one step of a 16x8 matrix")
    print(f"  vs Newton-Schulz of the whole gradient (torch's, bf16): {out['whole']:.3f}")
    print(f"  vs Newton-Schulz of each rank's shard alone:            {out['shards']:.3f}")
    print(f"  bf16's own spread (torch's iteration vs float64):       {out['bf16']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
