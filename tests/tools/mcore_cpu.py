"""megatron-core's real DistributedDataParallel and DistributedOptimizer on CPU (gloo), for the
tests' oracles: the objects training builds (get_megatron_optimizer over DDP-wrapped model
chunks), their own sharded_state_dict / load_state_dict, a few real Adam steps.

Both are CUDA-bound: they allocate on torch.cuda.current_device(), ask param.type() for
'torch.cuda.BFloat16Tensor', make their flag buffers with device='cuda', create CUDA streams.
shims() lets them run on CPU from the outside (nothing of megatron-core is copied or changed);
it is the one CPU shim of the tools that run megatron-core's optimizers (megatron_torch_dist.py
through ddp_and_optimizer, megatron_legacy_real.py, megatron_fsdp.py):

* torch.cuda.current_device() is "cpu" (Megatron-FSDP's callers: 0, it builds
  torch.device("cuda", current_device())); tensors asked for on "cuda" (or a device index) are
  made on the CPU; DeviceMesh.from_group's "cuda" meshes are CPU ones;
* Tensor.type() without arguments names a CPU tensor as its CUDA type (the only use megatron's
  optimizers make of it is that check; Megatron-FSDP's callers leave it off);
* CUDA streams, synchronize and empty_cache are no-ops;
* the distributed optimizer's load keeps the Adam step load_state_dict set (_adam_step_shim).

Call shims() in each rank (after init_process_group). megatron's optimizers choose their Adam at
import: without Transformer Engine or apex, torch's AdamW (per-param `step` tensors; the
distributed optimizer keeps the step in its param groups' `step`).
"""
import contextlib
import functools

import torch

_DONE = False


class _NoStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return None

    def wait_event(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _on_cpu(device):
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return "cpu"
    return device


def shims(current_device="cpu", cuda_type=True):
    """Patches torch (in this process only) so that megatron-core's DDP, Megatron-FSDP and
    distributed optimizer run on CPU. current_device: what torch.cuda.current_device() returns
    ("cpu"; Megatron-FSDP needs an index, 0). cuda_type: Tensor.type() names CPU tensors as
    CUDA ones (the optimizers' constructors accept only 'torch.cuda.*Tensor' params).
    Idempotent (called again, with the same arguments only); a no-op on a machine with CUDA."""
    global _DONE
    if _DONE:
        assert _DONE == (current_device, cuda_type), \
            f"shims{(current_device, cuda_type)} after shims{_DONE}"
        return
    if torch.cuda.is_available():
        return
    _DONE = (current_device, cuda_type)
    torch.cuda.Stream = _NoStream
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.default_stream = lambda *a, **k: _NoStream()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.current_device = lambda: current_device
    torch.Tensor.cuda = lambda self, *a, **k: self

    def cpu(fn):
        @functools.wraps(fn)
        def wrapped(*a, **k):
            if "device" in k:
                k["device"] = _on_cpu(k["device"])
            return fn(*a, **k)
        return wrapped
    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like",
                 "empty_like", "ones_like"):
        setattr(torch, name, cpu(getattr(torch, name)))

    from torch.distributed.device_mesh import DeviceMesh
    from_group = DeviceMesh.from_group

    def cpu_mesh(group, device_type, *a, **k):
        return from_group(group, "cpu", *a, **k)
    DeviceMesh.from_group = staticmethod(cpu_mesh)

    if cuda_type:
        tensor_type = torch.Tensor.type

        def cuda_type_(self, *a, **k):
            t = tensor_type(self, *a, **k)
            if not a and not k and isinstance(t, str) and t.startswith("torch.") and \
                    not t.startswith("torch.cuda."):
                return "torch.cuda." + t[len("torch."):]
            return t
        torch.Tensor.type = cuda_type_
    _adam_step_shim()


def _adam_step_shim():
    """megatron-core 0.16 with torch's Adam (no Transformer Engine / apex: the only Adam on
    CPU) cannot load its own distributed-optimizer state: load_state_dict sets every param's
    `step` from the checkpoint's param groups ("Native PyTorch state dict requires step"), then
    _set_main_param_and_optimizer_states copies each key the param's state holds, `step`
    included, from the loaded tensors, which have none in the fully_reshardable form (KeyError
    'step') and the loading optimizer's own pre-load step in the dp_reshardable form (a
    LocalNonpersistentObject); load_parameter_state of a --ckpt-format torch distrib_optim.pt
    fails the same way (its tensors: param, exp_avg, exp_avg_sq). With Transformer Engine's
    FusedAdam, training's Adam on GPUs, no param state has a `step`. The shim hides `step`
    from that copy, so the step stays the one load_state_dict took from the checkpoint's
    groups (what the code means to do: "the optimizer state of STEP is handled specifically and
    is read from param_groups"); the main param and moments are copied by megatron-core's own
    method."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    real = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(real, "_ucp_shim", False):
        return

    @functools.wraps(real)
    def set_states(self, model_param, tensors):
        state = None
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
        step = state.pop("step", None) if state is not None else None
        try:
            real(self, model_param, {k: v for k, v in tensors.items() if k != "step"})
        finally:
            if step is not None:
                state["step"] = step
    set_states._ucp_shim = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def ddp_and_optimizer(models, lr=1e-3, distributed=True):
    """Training's objects for `models` (the model chunks of this rank, bf16): each wrapped in
    megatron-core's DistributedDataParallel (--use-distributed-optimizer, grads in fp32, no
    overlap: one bucket per chunk, bucketing off for chunks after the first as training's
    get_model does), and get_megatron_optimizer's optimizer over them (a ChainedOptimizer of one
    DistributedOptimizer; distributed=False: without --use-distributed-optimizer, of one
    Float16OptimizerWithFloat16Params). Returns (ddp chunks, optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    shims()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=distributed)
    chunks = [DistributedDataParallel(config=m.config, ddp_config=ddp_config, module=m,
                                      disable_bucketing=i > 0)
              for i, m in enumerate(models)]
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr / 10, weight_decay=0.1,
                        adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, bf16=True,
                        params_dtype=torch.bfloat16, use_distributed_optimizer=distributed,
                        clip_grad=0.0),
        chunks)
    return chunks, opt


def train_steps(chunks, opt, steps=2):
    """`steps` real optimizer steps of the distributed optimizer (its own step(): grads copied
    from the DDP buffers to the fp32 main shards, torch's AdamW on those, the updated main
    params copied back to the bf16 model params and all-gathered over DP). The gradient of each
    param is a fixed function of the param's own values, sin(1000 w + step) / 100 (its sign
    as good as random for weights of Megatron's init, so the steps keep the model's structure),
    so every DP rank and every TP rank holding a replica computes the same one: what DDP's
    reduce-scatter would give them."""
    for s in range(steps):
        for c in chunks:
            c.zero_grad_buffer()
            for p in c.module.parameters():
                if p.requires_grad:
                    w = p.detach().float()
                    p.main_grad.copy_(torch.sin(1000 * w + s) / 100)
        ok, _, _ = opt.step()
        assert ok, "the optimizer step was skipped"


def held_steps(opt):
    """The set of Adam steps the optimizer's torch AdamW holds (one per param state)."""
    out = set()
    for o in getattr(opt, "chained_optimizers", [opt]):
        for st in o.optimizer.state.values():
            if "step" in st:
                out.add(float(st["step"]))
    return out


def allocate_state(opt):
    """What a training job must do before loading into a fresh distributed optimizer over
    torch's Adam (no Transformer Engine / apex): its sharded_state_dict(is_loading=True) calls
    state_dict(), which reads each param's `step`, which torch's Adam creates at its first step.
    The optimizer's own _init_optimizer_states_with_dummy_values takes that step with zero
    gradients (step 1, zero moments); the load must overwrite all of it."""
    for o in getattr(opt, "chained_optimizers", [opt]):
        if len(o.optimizer.state) == 0:
            o._init_optimizer_states_with_dummy_values()
