"""The training decoder's tests (CPU and GPU) read a decoder the same way: the hidden states
and every parameter's gradient of one fixed random weighting of them, against HF's decoder in
float64 (autograd through the reference), beside HF's own decoder in the test's dtype."""
import copy

from ws_lab import oracle


def hidden_and_grads(forward, module, ids, weight) -> list:
    """[the hidden states] + each parameter's gradient of ``(forward(ids) · weight).sum()``."""
    module.zero_grad(set_to_none=True)
    hidden = forward(ids)
    (hidden * weight.to(hidden.dtype)).sum().backward()
    return [hidden.detach()] + [p.grad.clone() for p in module.parameters()]


def errors_against_float64(decoder, lab_model, hf, ids, weight) -> list:
    """[(name, the lab decoder's rel-L2, HF's own decoder's rel-L2)] against HF's decoder in
    float64, for the hidden states and each parameter's gradient. ``lab_model``: the HF model
    whose parameters ``decoder`` trains (a copy of ``hf``)."""
    reference = copy.deepcopy(hf).double()
    want = hidden_and_grads(lambda i: reference.model(i).last_hidden_state, reference, ids,
                            weight)
    own = hidden_and_grads(lambda i: hf.model(i).last_hidden_state, hf, ids, weight)
    got = hidden_and_grads(decoder, lab_model, ids, weight)
    hf.zero_grad(set_to_none=True)
    names = ["hidden"] + [name for name, _ in hf.named_parameters()]
    assert len(names) == len(got) == len(want)
    return [(name, oracle.rel_l2(g, w), oracle.rel_l2(o, w))
            for name, g, o, w in zip(names, got, own, want)]
