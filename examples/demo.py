"""lort demo: train and run a small BERT (random weights) through ONNX Runtime.

Trains with every fusion group in ORT (executor="ort") and checks the losses against
eager PyTorch, prints what ran where, then shows what lort's default (executor="auto",
which times lort's ORT graph, eager PyTorch and, compiled in the background, inductor,
and keeps the fastest) chooses, and times training and inference against eager.
"""

import copy
import statistics
import time

import torch

import lort
from lort.testing.models import bert, output_tensor


def timeit(fns, repeats=15):
    """The median seconds of each of ``fns``, called round-robin (one after the other,
    ``repeats`` times) so that each sees the same state of the machine."""
    for fn in fns:
        fn()
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, times in zip(fns, samples):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return [statistics.median(times) for times in samples]


def settle(backend, call, timeout=900.0):
    """Calls ``call`` until executor='auto' has chosen every graph's engine: inductor is
    compiled in a subprocess from a graph's second call on, then timed against the
    placement running (lort.compile.engines)."""
    start = time.perf_counter()
    while any(ref() is not None and ref().engine is None for ref in backend.switches):
        if time.perf_counter() - start > timeout:
            return
        call()
        time.sleep(0.05)


def where(backend):
    """Where each captured graph ran: ORT groups, eager PyTorch or inductor (executor='auto')."""
    parts = []
    for r in backend.records:
        if r.executor in ("pytorch", "inductor"):
            parts.append(f"{r.kind}: {'eager PyTorch' if r.executor == 'pytorch' else 'inductor'}")
        else:
            parts.append(f"{r.kind}: {r.ort_nodes}/{r.ort_nodes + r.torch_nodes} ATen nodes in ORT")
    return "; ".join(parts)


def main():
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    model, (ids, mask) = bert(batch=4, seq=32, layers=2, hidden=64)
    print(f"model: transformers BertModel, 2 layers, hidden 64, random weights; input {tuple(ids.shape)}")

    def train_step(m, opt):
        opt.zero_grad()
        loss = output_tensor(m(ids, mask)).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.item()

    # Training through ORT: every group of the forward and backward graphs in ORT.
    eager_model, ort_model, auto_model = model, copy.deepcopy(model), copy.deepcopy(model)
    ort_backend = lort.LortBackend({"executor": "ort"})
    ort_compiled = torch.compile(ort_model, backend=ort_backend)
    opt_e = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    opt_o = torch.optim.AdamW(ort_model.parameters(), lr=1e-3)
    print("\ntraining, every group in ORT (executor='ort'): 10 AdamW steps against eager")
    print("step  eager loss   lort loss")
    for step in range(10):
        le, lo = train_step(eager_model, opt_e), train_step(ort_compiled, opt_o)
        print(f"{step:>4}  {le:.6f}   {lo:.6f}")
        assert abs(le - lo) <= 1e-3 * abs(le) + 1e-6, "lort's loss differs from eager's"
    print()
    print(lort.ExplainReport(ort_backend.records))

    # lort's default: executor="auto" keeps each graph where it timed faster.
    auto_backend = lort.LortBackend()
    auto_compiled = torch.compile(auto_model, backend=auto_backend)
    opt_a = torch.optim.AdamW(auto_model.parameters(), lr=1e-3)
    train_step(auto_compiled, opt_a)
    train_step(auto_compiled, opt_a)  # the second call starts inductor's compile
    settle(auto_backend, lambda: train_step(auto_compiled, opt_a))
    print(f"\ntraining with the default executor='auto' (lort's graph, eager PyTorch or inductor, timed): "
          f"{where(auto_backend)}")

    t_train_e, t_train_o, t_train_a = timeit([lambda: train_step(eager_model, opt_e),
                                              lambda: train_step(ort_compiled, opt_o),
                                              lambda: train_step(auto_compiled, opt_a)])

    # Inference at batch 1, lort's default.
    one_ids, one_mask = ids[:1], mask[:1]
    eager_model.eval()
    auto_model.eval()
    infer_backend = lort.LortBackend()
    infer = torch.compile(auto_model, backend=infer_backend)
    with torch.no_grad():
        ref = output_tensor(auto_model(one_ids, one_mask))  # the same weights, eager
        out = output_tensor(infer(one_ids, one_mask))
        settle(infer_backend, lambda: infer(one_ids, one_mask))
        err = (out - ref).abs().max().item()
        assert err < 1e-4, f"lort inference differs from eager by {err}"
        t_inf_e, t_inf_l = timeit([lambda: eager_model(one_ids, one_mask), lambda: infer(one_ids, one_mask)], 50)
    print(f"inference batch 1 (executor='auto'): {where(infer_backend)}; max abs diff vs eager {err:.2e}")

    print(f"\n{'':<34}{'eager ms':>10}{'lort ms':>10}{'speed-up':>10}")
    rows = [
        ("train step, all in ORT (batch 4)", t_train_e, t_train_o),
        ("train step, auto (batch 4)", t_train_e, t_train_a),
        ("inference, auto (batch 1)", t_inf_e, t_inf_l),
    ]
    for label, te, tl in rows:
        print(f"{label:<34}{te * 1e3:>10.2f}{tl * 1e3:>10.2f}{te / tl:>9.2f}x")
    print(f"ORT sessions built: {lort.stats.sessions_created}, ORT runs: {lort.stats.ort_runs}")


if __name__ == "__main__":
    main()
