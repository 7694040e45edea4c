"""DDP and FSDP2 through lort on 2 gloo ranks (CPU): both DDP forms, the warning where
Dynamo gives lort no graph, and fully_shard; losses and final weights against eager DDP.

The ranks run in subprocesses (one worker script, every form in turn, to pay the imports
once); each prints its ORT run counts, which the test checks per rank."""

import json
import textwrap

import pytest

from lort.testing.ranks import run_ranks

STEPS = 3

_WORKER = textwrap.dedent(
    """
    import json, os, sys, warnings
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import lort
    from lort.backend import LortBackend

    rank, world, port, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    W = 256  # over 1 MiB of parameters: DDPOptimizer splits the outer form's graph in two buckets

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(W, W), torch.nn.Linear(W, W)

        def forward(self, x):
            return x + self.b(self.a(x).tanh())

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = torch.nn.Linear(8, W), torch.nn.Linear(W, 4)
            self.blocks = torch.nn.ModuleList([Block(), Block()])

        def forward(self, x):
            h = self.inp(x).relu()
            for block in self.blocks:
                h = block(h)
            return self.out(h)

    def net():
        torch.manual_seed(0)
        return Net()

    def sequential():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, W), torch.nn.Tanh(), torch.nn.Linear(W, 4))

    # Each rank its own batch: DDP averages the gradients across ranks.
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    y = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank + 10))

    def train(model, params):
        opt = torch.optim.SGD(params, lr=0.1)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    def weights(module):
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in module.state_dict().items()}

    def check(form, got, want):
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6, msg=lambda m: f"{form} losses: {m}")
        assert got[1].keys() == want[1].keys(), form
        for k in want[1]:
            torch.testing.assert_close(got[1][k], want[1][k], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{form} weight {k}: {m}")

    def eager(make):
        m = make()
        return train(DDP(m), m.parameters()), weights(m)

    def lort_warnings(caught):
        return [str(w.message) for w in caught if str(w.message).startswith("lort: torch.compile(DistributedDataParallel")]

    def run(form, make, wrap):
        torch._dynamo.reset()
        backend = LortBackend({"executor": "ort", "disk_cache": False})
        m = make()
        before = lort.stats.ort_runs
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = wrap(m, backend)
            got = (train(model, m.parameters()), weights(m))
        return got, backend, lort.stats.ort_runs - before, lort_warnings(caught)

    result = {}
    want = eager(net)

    def split_in_buckets(backend):
        # Both forms run the compiled frame inside DDP's forward, where Dynamo's
        # DDPOptimizer splits the graph at DDP's buckets: each piece is a lort graph.
        kinds = [r.kind for r in backend.records]
        assert kinds.count("forward") >= 2 and kinds.count("forward") == kinds.count("backward"), kinds

    # DDP(torch.compile(model)): every step through ORT.
    got, backend, runs, warned = run("inner", net, lambda m, b: DDP(torch.compile(m, backend=b)))
    check("inner", got, want)
    split_in_buckets(backend)
    assert runs == steps * sum(len(r.groups) for r in backend.records) > 0, runs
    assert not warned, warned
    result["inner"] = runs

    # torch.compile(DDP(model)): DDP's forward graph-breaks, Net.forward is compiled.
    got, backend, runs, warned = run("outer", net, lambda m, b: torch.compile(DDP(m), backend=b))
    check("outer", got, want)
    split_in_buckets(backend)
    assert runs == steps * sum(len(r.groups) for r in backend.records) > 0, runs
    assert not warned, warned
    result["outer"] = runs

    # torch.compile(DDP(nn.Sequential)): Dynamo skips torch.nn's frames, lort gets no
    # graph; lort warns once, and the model trains eagerly (correctly).
    want_seq = eager(sequential)
    got, backend, runs, warned = run("sequential", sequential, lambda m, b: torch.compile(DDP(m), backend=b))
    check("sequential", got, want_seq)
    assert backend.records == [] and runs == 0, (backend.records, runs)
    assert len(warned) == 1 and "DDP(torch.compile(model, backend='lort'))" in warned[0], warned
    assert "torch.nn.modules.container.Sequential.forward" in warned[0], warned
    _, _, _, again = run("sequential again", sequential, lambda m, b: torch.compile(DDP(m), backend=b))
    assert again == [], again  # once per process
    result["sequential"] = runs

    # FSDP2: each block compiled, then sharded; FSDP's hooks (all-gather, reduce-scatter)
    # run eagerly between the compiled blocks.
    from torch.distributed.fsdp import fully_shard

    def fsdp(m, backend):
        for block in m.blocks:
            block.compile(backend=backend)
            fully_shard(block)
        fully_shard(m)
        return m

    got, backend, runs, warned = run("fsdp2", net, fsdp)
    check("fsdp2", got, want)
    assert [r.kind for r in backend.records][:2] == ["forward", "backward"], backend.records
    assert runs > 0 and runs % steps == 0, runs
    result["fsdp2"] = runs

    dist.destroy_process_group()
    print("RESULT " + json.dumps(result))
    print(f"rank {rank} ok")
    """
)


def test_ddp_both_forms_and_fsdp2_on_two_gloo_ranks(tmp_path):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    outs = run_ranks(str(script), 2, [STEPS], env={"OMP_NUM_THREADS": "1", "LORT_DISK_CACHE": "0", "LORT_EXECUTOR": "ort"})
    results = []
    for out in outs:
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    for rank, runs in enumerate(results):
        # ORT ran on every rank in every form that gives lort graphs, and in none for the other.
        assert runs["inner"] > 0 and runs["outer"] > 0 and runs["fsdp2"] > 0, (rank, runs)
        assert runs["sequential"] == 0, (rank, runs)
    assert results[0] == results[1], results  # same graphs, same runs on both ranks
