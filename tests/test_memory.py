"""Peak live bytes of the reverse sweep do not grow with depth beyond what it must hold.

Wide inner layers (the tape) and narrow boundaries: a full autograd tape grows
by one stage's internals per stage; the EAE sweep holds one stage's tape plus
the boundaries, costates and parameter gradients, which the test subtracts.
"""

import torch
from torch import nn

import eae_func as ef
from live_bytes import LiveBytes

WIDTH, INNER, BATCH = 16, 256, 1024


def chain_of(depth):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, INNER), nn.Tanh(), nn.Linear(INNER, INNER), nn.Tanh(),
                                          nn.Linear(INNER, WIDTH)) for _ in range(depth)])
    return model, torch.randn(BATCH, WIDTH)


def loss_fn(out):
    return out.square().mean()


def peaks(depth):
    model, x = chain_of(depth)
    chain, params = ef.from_module(model, loss=loss_fn)
    with LiveBytes() as eae:
        ef.sweep(chain, params, x)
    with LiveBytes() as tape:
        loss_fn(model(x)).backward()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    must_hold = param_bytes + depth * x.numel() * x.element_size()  # grads; boundaries, then costates in their place
    return eae.peak - must_hold, tape.peak - param_bytes


def test_live_bytes_do_not_grow_with_depth():
    stage_tape = 2 * BATCH * INNER * 4  # two saved (BATCH, INNER) float32 tensors per stage (the tanh outputs)
    (e4, a4), (e8, a8), (e16, a16) = peaks(4), peaks(8), peaks(16)
    # the instrument sees autograd's tape grow by at least a stage's tape per stage ...
    assert a8 - a4 > 4 * stage_tape * 0.75 and a16 - a8 > 8 * stage_tape * 0.75
    # ... and the EAE sweep's does not grow at all beyond the bytes it must hold
    assert abs(e8 - e4) < 0.1 * stage_tape and abs(e16 - e8) < 0.1 * stage_tape
    assert e16 < 2 * stage_tape

