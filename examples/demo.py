"""lort demo: train and run a small BERT (random weights) through ONNX Runtime.

Prints what ran where (ORT groups vs PyTorch), checks the losses against eager PyTorch,
and times inference and training steps against eager.
"""

import copy
import statistics
import time

import torch

import lort
from lort.testing.models import bert, output_tensor


def timeit(fn, repeats=15):
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main():
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    model, (ids, mask) = bert(batch=4, seq=32, layers=2, hidden=64)
    print(f"model: transformers BertModel, 2 layers, hidden 64, random weights; input {tuple(ids.shape)}")

    report = lort.explain(model, ids, mask)
    print(report)

    # Training: 10 AdamW steps, eager and lort side by side.
    eager_model, lort_model = model, copy.deepcopy(model)
    compiled = torch.compile(lort_model, backend="lort")
    opt_e = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    opt_l = torch.optim.AdamW(lort_model.parameters(), lr=1e-3)

    def train_step(m, opt):
        opt.zero_grad()
        loss = output_tensor(m(ids, mask)).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.item()

    print("\nstep  eager loss   lort loss")
    for step in range(10):
        le, ll = train_step(eager_model, opt_e), train_step(compiled, opt_l)
        print(f"{step:>4}  {le:.6f}   {ll:.6f}")
        assert abs(le - ll) <= 1e-3 * abs(le) + 1e-6, "lort's loss differs from eager's"

    t_train_e = timeit(lambda: train_step(eager_model, opt_e))
    t_train_l = timeit(lambda: train_step(compiled, opt_l))

    # Inference at batch 1.
    one_ids, one_mask = ids[:1], mask[:1]
    eager_model.eval()
    lort_model.eval()
    infer = torch.compile(lort_model, backend="lort")
    with torch.no_grad():
        ref = output_tensor(lort_model(one_ids, one_mask))  # the same weights, eager
        out = output_tensor(infer(one_ids, one_mask))
        err = (out - ref).abs().max().item()
        assert err < 1e-4, f"lort inference differs from eager by {err}"
        t_inf_e = timeit(lambda: eager_model(one_ids, one_mask), 50)
        t_inf_l = timeit(lambda: infer(one_ids, one_mask), 50)
    print(f"\ninference batch 1: max abs diff vs eager (same weights) {err:.2e}")
    print(f"{'':<22}{'eager ms':>10}{'lort ms':>10}{'speed-up':>10}")
    print(f"{'train step (batch 4)':<22}{t_train_e * 1e3:>10.2f}{t_train_l * 1e3:>10.2f}{t_train_e / t_train_l:>9.2f}x")
    print(f"{'inference (batch 1)':<22}{t_inf_e * 1e3:>10.2f}{t_inf_l * 1e3:>10.2f}{t_inf_e / t_inf_l:>9.2f}x")
    print(f"ORT sessions built: {lort.stats.sessions_created}, ORT runs: {lort.stats.ort_runs}")


if __name__ == "__main__":
    main()
