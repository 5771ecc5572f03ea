"""torch's private parts behind ``eae_func.compat``: each still there and still computing what its
public counterpart computes, so a torch that changes one fails here, by name, not silently."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd.graph import get_gradient_edge

from eae_func import compat


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**16))
def test_pull_back_unchecked_is_torch_autograd_grad(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(cols, cols, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64, requires_grad=True)
    unused = torch.randn(3, dtype=torch.float64, requires_grad=True)
    outs = [torch.tanh(x @ w), (x * 2).sum(0)]
    cots = [torch.randn_like(o) for o in outs]
    want = torch.autograd.grad(outs, [w, x, unused], cots, allow_unused=True, retain_graph=True)
    got = compat.pull_back_unchecked([get_gradient_edge(o) for o in outs], cots, [w, x, unused])
    assert got[2] is None and want[2] is None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_saved_tensor_hook_and_dispatch_mode_internals():
    from torch.utils._python_dispatch import TorchDispatchMode

    def pack(t):
        return t

    assert compat.saved_hooks_enabled()
    before = compat.saved_hooks_on_top()
    with torch.autograd.graph.saved_tensors_hooks(pack, pack):
        assert compat.saved_hooks_on_top()[0] is pack
    with torch.autograd.graph.disable_saved_tensors_hooks("off"):
        assert not compat.saved_hooks_enabled()
    assert compat.saved_hooks_on_top() == before

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    n = compat.dispatch_modes_on()
    with Mode() as mode:
        assert compat.dispatch_modes_on() == n + 1 and compat.innermost_dispatch_mode() is mode
    assert compat.dispatch_modes_on() == n


def test_functorch_wrapped_tells_a_transform_tensor_from_data():
    seen = []
    torch.func.vmap(lambda t: seen.append(compat.functorch_wrapped(t)) or t)(torch.ones(2, 3))
    assert seen == [True] and not compat.functorch_wrapped(torch.ones(2))


def test_unhooked_step_steps_without_the_step_hooks():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    p.grad = torch.ones(2)
    compat.unhooked_step(opt)
    assert torch.equal(p.detach(), torch.full((2,), 0.5)) and calls == []
    opt.step()
    assert calls == ["pre", "post"]


def test_eager_random_compile_patches_torch_compile_config():
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    with compat.eager_random_compile(7):
        assert inductor_config.fallback_random is True and dynamo_config.recompile_limit == 7
    assert dynamo_config.recompile_limit != 7 or inductor_config.fallback_random is not True


def test_the_fsdp_state_internals(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():  # pragma: no cover - a process group from elsewhere
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = fully_shard(torch.nn.Sequential(torch.nn.Linear(2, 2)), mesh=init_device_mesh("cpu", (1,)))
        compat.fsdp_lazy_init(model)
        groups = compat.fsdp_param_groups(model)
        assert isinstance(groups, list) and len(groups) == 1
    finally:
        dist.destroy_process_group()


def test_torchs_pytrees_flatten_as_eae_func_relies_on():
    """What eae_func reads of ``torch.utils._pytree``: leaves in order, a spec that unflattens, key
    paths, its registry of nodes, a registered class flattened."""
    pytree = compat.pytree
    tree = {"b": [torch.ones(1), (torch.zeros(2), None)], "a": torch.full((3,), 2.0)}
    leaves, spec = pytree.tree_flatten(tree)
    assert [t.shape for t in leaves if t is not None] == [(1,), (2,), (3,)]  # dicts in insertion order
    assert pytree.tree_structure(pytree.tree_unflatten(leaves, spec)) == spec
    assert pytree.tree_leaves(tree) == leaves
    paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(tree)[0]]
    assert paths == ["['b'][0]", "['b'][1][0]", "['b'][1][1]", "['a']"]
    assert dict in pytree.SUPPORTED_NODES and isinstance(pytree.GetAttrKey("x"), pytree.GetAttrKey)
    assert pytree.SequenceKey(0).idx == 0

    class Pair:
        def __init__(self, x, y):
            self.x, self.y = x, y

    pytree.register_pytree_node(Pair, lambda p: ([p.x, p.y], None), lambda xs, _: Pair(*xs))
    try:
        assert len(pytree.tree_leaves(Pair(torch.ones(1), torch.ones(2)))) == 2
    finally:
        pytree.SUPPORTED_NODES.pop(Pair)


def test_the_pipelining_methods_eae_func_overrides_keep_their_signatures():
    """``distributed/stage.py`` overrides three private methods of pipelining's ``PipelineStage``: a
    torch that renames one, or changes its arguments, would silently stop calling the override."""
    import inspect

    from torch.distributed.pipelining import PipelineStage

    from eae_func.distributed.stage import RangeStage

    for name in ("_compute_outputs", "_send_meta", "_recv_meta"):
        theirs, ours = inspect.signature(getattr(PipelineStage, name)), inspect.signature(getattr(RangeStage, name))
        assert list(theirs.parameters) == list(ours.parameters), (name, theirs, ours)
        assert getattr(RangeStage, name) is not getattr(PipelineStage, name)


def test_the_dispatch_mode_and_op_overload_eae_func_names_ops_by():
    seen = []

    class Ops(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Ops():
        torch.ones(2).mul(3)
    assert torch.ops.aten.mul.Tensor in seen and all(isinstance(f, compat.OpOverload) for f in seen)
