"""A silent data corruption, injected from outside the tool: put this directory on PYTHONPATH of one rank.

Every matmul-family result of torch's public operators (torch.mm, torch.matmul, Tensor.__matmul__, torch.addmm,
torch.bmm, F.linear) comes back slightly wrong in one element: +2% of (|value| + 1), no error, no NaN, as from a
GPU with a marginal multiplier. NUMERICS_FAULT picks what is hit:
  forward   (default) every result of those operators
  backward  only the gradient flowing back through F.linear (autograd's own matmuls), never a forward result
  flaky     only every third call of torch.matmul: an intermittent fault (what --soak's repeats are for)
Processes that are not ranks (the node monitor) are left alone. NUMERICS_FAULT_LOCAL_RANK=k hits only the process
whose LOCAL_RANK is k (a node check's worker for GPU k, with the whole node's PYTHONPATH set: a fault of one GPU).
"""
import os

MODE = os.environ.get("NUMERICS_FAULT", "forward")


def _spot(t):
    return (t.numel() * 2) // 3 + 5 if t.numel() > 8 else 0


def _install():
    import torch
    import torch.nn.functional as F

    def corrupt(out):
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.numel() == 0:
            return out
        with torch.no_grad():
            flat = out.view(-1) if out.is_contiguous() else out.reshape(-1)
            k = _spot(out)
            v = flat[k].double()
            bump = torch.zeros_like(out).view(-1)
            bump[k] = (0.02 * (v.abs() + 1)).to(out.dtype)
        return out + bump.view_as(out)

    def corrupt_out(out):  # an out= result: changed in place
        with torch.no_grad():
            flat = out.view(-1)
            k = _spot(out)
            flat[k] += 0.02 * (flat[k].abs() + 1)
        return out

    def wrap(fn):
        def wrapped(*args, **kw):
            res = fn(*args, **kw)
            if kw.get("out") is not None:
                return corrupt_out(kw["out"])
            return corrupt(res)
        return wrapped

    class BadGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return corrupt(g.clone())

    if MODE == "flaky":
        matmul, calls = torch.matmul, [0]

        def flaky(*args, **kw):
            calls[0] += 1
            out = matmul(*args, **kw)
            return corrupt(out) if calls[0] % 3 == 0 else out
        torch.matmul = flaky
        return
    if MODE == "backward":
        linear = F.linear

        def linear_bad_backward(*args, **kw):
            out = linear(*args, **kw)
            return BadGrad.apply(out) if out.requires_grad else out
        F.linear = linear_bad_backward
        return
    for name in ("mm", "matmul", "addmm", "bmm"):
        setattr(torch, name, wrap(getattr(torch, name)))
    F.linear = wrap(F.linear)
    matmul = torch.Tensor.__matmul__
    torch.Tensor.__matmul__ = lambda self, other: corrupt(matmul(self, other))


WHERE = os.environ.get("NUMERICS_FAULT_LOCAL_RANK")
if "_AIV_NODE_MONITOR" not in os.environ and (WHERE is None or os.environ.get("LOCAL_RANK") == WHERE):
    _install()
