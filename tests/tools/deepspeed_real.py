"""The real DeepSpeed (the tests' PyPI environment, CPU, gloo) as the oracle of
ucp's DeepSpeed driver: it makes checkpoints and loads ucp's.

  deepspeed_real.py make --world W --stage S --dtype fp32|bf16|fp16 --out DIR
      W local ranks train a small MLP (Adam, 2 steps) with ZeRO stage S and
      save DIR/global_step2 + latest with engine.save_checkpoint; rank 0 then
      writes what the engine holds in memory, through DeepSpeed's own API
      (deepspeed.utils.safe_get_full_fp32_param / _optimizer_state, module
      params gathered at stage 3): DIR/reference_module_params.pt,
      reference_fp32_master.pt, reference_optim_state.pt and meta.json (the
      layout of ../shared/fixtures/deepspeed-0.14.5, so check_deepspeed.py
      reads both; meta.json's optimizer_facts: each param group's params, lr,
      weight decay, betas and eps, the fp16 loss scaler's state, the engine's
      step counters).
      --model rich (ZeRO 0-2): an embedding tied to the output head, a frozen
      weight and two param groups of their own lr and weight decay (AdamW),
      trained on token ids.
  deepspeed_real.py load --world W --stage S --dtype fp32|bf16|fp16 --dir DIR
                         --truth TRAINED_DIR --scratch TMP [--universal]
      a fresh engine at W ranks and stage S loads DIR (engine.load_checkpoint;
      --universal: DeepSpeed's load_universal path for a universal folder) and
      its module params, fp32 masters and step are compared with TRAINED_DIR's
      references bit for bit, and so are its Adam moments, as DeepSpeed's
      ds_to_universal finds them in a re-save of the engine (after a native
      ZeRO 1/2 load DeepSpeed's safe_get_full_optimizer_state fails on some
      ranks); the engine is made with other groups' hyper-parameters (rich
      model), and its param groups, loss scaler and step counters must then
      equal the source's optimizer_facts. Prints one JSON line
      {"ok": bool, "checked": n, "failures": [...]}; exit status 0 iff ok.

fp16: DeepSpeed's CPU accelerator reports fp16 unsupported ("Type fp16 is not
supported on your device") although torch computes in fp16 on CPU; for fp16
runs the rank processes make it report fp16 supported (is_fp16_supported,
supported_dtypes) and nothing else: the engine then runs its own fp16 paths
(FP16_UnfusedOptimizer at ZeRO 0, the ZeRO optimizers with their dynamic
loss scaler, fp16 module params).

The ranks are processes forked from the launching process after it imported
torch and DeepSpeed (`command()`: a test calls it in its own process), with
MASTER_PORT chosen by binding a free port. DeepSpeed's shared-memory all-reduce
op is not built (preload()): gloo does the all-reduces.
"""
import argparse
import contextlib
import json
import multiprocessing
import os
import pathlib
import shutil
import socket
import sys
import tempfile
import time
import traceback


def api_note(*what):
    """DeepSpeed's API failing where it is expected to (ZeRO 0 fp32 has no
    separate master; moments after a native ZeRO 1/2 load): the comparison
    then reports what is missing. Shown with UCP_DEBUG=1 only."""
    if os.environ.get("UCP_DEBUG"):
        print(*map(repr, what), file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def preload():
    """Imports torch and DeepSpeed once in the process that forks the ranks (each rank
    would otherwise spend about 3 s of CPU importing them itself)."""
    import importlib
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401
    import torch  # noqa: F401
    # What deepspeed.initialize, the ZeRO optimizers, save and load import lazily (torch's
    # dynamo among them: about 1.5 s of CPU per rank); some are not in every version.
    for name in ("deepspeed.checkpoint.ds_to_universal", "deepspeed.runtime.engine",
                 "deepspeed.runtime.zero.muon.muon_optimizer", "torch._dynamo",
                 "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.stage_1_and_2",
                 "deepspeed.runtime.zero.partition_parameters", "deepspeed.runtime.bf16_optimizer",
                 "deepspeed.runtime.fp16.fused_optimizer",
                 "deepspeed.runtime.fp16.unfused_optimizer", "deepspeed.ops.op_builder.all_ops",
                 "deepspeed.runtime.superoffload", "deepspeed.module_inject"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # No shared-memory all-reduce op: DeepSpeed JIT-compiles it with the C++ compiler on first
    # use for CPU (over a minute of CPU and 1.5 GB per compiler process, once per DeepSpeed
    # version, and again whenever another version's build took its cache folder). It only
    # speeds up all-reduce; gloo's does the same job, and checkpoints are what is tested.
    getattr(importlib.import_module("deepspeed.ops"), "__compatible_ops__")[
        "deepspeed_shm_comm"] = False


def rank_process(a, rank, world, port, folder):
    """A forked rank: its stdout and stderr to files of `folder`, torchrun's environment, the
    command; leaves with the command's status and without the interpreter's teardown (where
    DeepSpeed's comm threads once aborted a rank: "terminate called without an active
    exception")."""
    status = 1
    try:
        for fd, name in ((1, "out"), (2, "err")):
            f = os.open(os.path.join(folder, f"{name}{rank}"), os.O_WRONLY | os.O_CREAT, 0o600)
            os.dup2(f, fd)
            os.close(f)
        # The interpreter's own streams (fds 1 and 2), whatever the launcher had in their place.
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        # a.rank_fn: a test's own rank function (launch() with its own namespace)
        fn = getattr(a, "rank_fn", None) or (rank_make if a.cmd == "make" else rank_load)
        status = fn(a) or 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001: reported through stderr and the status
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def launch(a, timeout=600):
    """Runs command `a` as a.world ranks forked from this process (torch and DeepSpeed imported
    here first); returns (rank 0's stdout, exit codes). A failed rank's stderr is shown."""
    preload()
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryDirectory(prefix="ucp-dsrank-") as t:
        ctx = multiprocessing.get_context("fork")
        procs = [ctx.Process(target=rank_process, args=(a, r, a.world, port, t))
                 for r in range(a.world)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        # A rank still running at the deadline is a failure, whatever it would have
        # reported: killed, its status is KILLED (never 0 nor NOT_FINITE).
        codes = []
        for r, proc in enumerate(procs):
            if proc.is_alive():
                proc.kill()
                proc.join()
                sys.stderr.write(f"rank {r} was still running after {timeout} s: killed\n")
                codes.append(KILLED)
            else:
                codes.append(proc.exitcode)
        for r, code in enumerate(codes):
            if code not in (0, NOT_FINITE):
                err = pathlib.Path(t, f"err{r}").read_text(errors="replace")
                sys.stderr.write(f"--- rank {r} (exit {code}):\n{err[-3000:]}\n")
        return pathlib.Path(t, "out0").read_text(errors="replace"), codes


def ds_to_universal(input_folder, output_folder):
    """DeepSpeed's own converter in this process (its main; one worker each: no child
    processes), its chatter kept off stdout. Returns None, or the failure's traceback."""
    from deepspeed.checkpoint import ds_to_universal as d2u
    argv, sys.argv = sys.argv, [
        "ds_to_universal", "--input_folder", str(input_folder), "--output_folder",
        str(output_folder), "--inject_missing_state", "--num_extract_workers", "1",
        "--num_merge_workers", "1"]
    try:
        with contextlib.redirect_stdout(sys.stderr):
            d2u.main(d2u.parse_arguments())
    except BaseException:  # noqa: BLE001 (SystemExit too): reported as a failure
        return traceback.format_exc()[-1500:]
    finally:
        sys.argv = argv
    return None


# --- in a rank process ---------------------------------------------------------

VOCAB = 11  # the rich model's vocabulary
MOE_EXPERTS = 4  # the moe model's experts


def model_and_engine(stage, dtype, extra=None, model="mlp", perturb=False, ep=2):
    """The engine of `model` at ZeRO `stage`. perturb: every param group's lr, weight decay,
    betas and eps differ from the ones the source trained with (a load must bring the
    source's back from the checkpoint). ep: the moe model's expert-parallel size."""
    import deepspeed
    import torch
    import torch.nn as nn

    class MLP(nn.Module):
        # odd sizes: flat partitions need padding at worlds 2 and 3
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(7, 13)
            self.fc2 = nn.Linear(13, 5)

        def forward(self, x, y):
            return nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))).float(), y.float())

    class Rich(nn.Module):
        """An embedding tied to the output head (one Parameter in two modules: DeepSpeed's
        shared_params), a frozen weight (requires_grad=False, its module's bias trained),
        odd sizes."""
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 6)
            self.fc1 = nn.Linear(6, 9)
            self.proj = nn.Linear(9, 6)
            self.norm = nn.LayerNorm(6)
            self.head = nn.Linear(6, VOCAB, bias=False)
            self.head.weight = self.embed.weight
            self.proj.weight.requires_grad_(False)

        def forward(self, x, y):
            h = self.proj(torch.relu(self.fc1(self.embed(x))))
            logits = self.head(self.norm(h)).float()
            return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(6, 5)
            self.fc2 = nn.Linear(5, 6)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    class Moe(nn.Module):
        """deepspeed.moe.layer.MoE (MOE_EXPERTS experts over `ep` ranks, top-1 gate)
        between two dense layers; each expert initialised from its global index, so
        that experts differ whatever rank holds them."""
        def __init__(self):
            super().__init__()
            from deepspeed.moe.layer import MoE
            self.fc_in = nn.Linear(7, 6)
            self.moe = MoE(hidden_size=6, expert=Expert(), num_experts=MOE_EXPERTS,
                           ep_size=ep, k=1, min_capacity=4)
            self.fc_out = nn.Linear(6, 5)
            local = self.moe.num_local_experts
            # DeepSpeed's expert-parallel groups are consecutive ranks (checked in globally(),
            # once deepspeed.initialize has made them)
            ep_rank = torch.distributed.get_rank() % ep
            experts = self.moe.deepspeed_moe.experts.deepspeed_experts
            for i, e in enumerate(experts):
                g = torch.Generator().manual_seed(500 + ep_rank * local + i)
                with torch.no_grad():
                    for q in e.parameters():
                        q.copy_(torch.randn(q.shape, generator=g) * 0.3)

        def forward(self, x, y):
            h, _, _ = self.moe(torch.relu(self.fc_in(x)))
            return nn.functional.mse_loss(self.fc_out(h).float(), y.float())

    if dtype == "fp16":  # the module docstring: the CPU accelerator's fp16 flag only
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        acc.is_fp16_supported = lambda: True
        acc.supported_dtypes = lambda: [torch.float, torch.half, torch.bfloat16]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    net = {"mlp": MLP, "rich": Rich, "moe": Moe}[model]()
    params = net.parameters()
    if model == "moe":  # DeepSpeed's expert groups (ZeRO partitions them over expert DP)
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        params = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(net.parameters()), "name": "params"})
    opt = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}
    if model == "rich":
        # Two param groups (the weights with decay, the rest without; each its own lr);
        # the frozen weight in none.
        k = 3 if perturb else 1
        decay = [p for n, p in net.named_parameters() if p.requires_grad and n.endswith("weight")
                 and not n.startswith("norm")]
        rest = [p for n, p in net.named_parameters() if p.requires_grad
                and all(p is not q for q in decay)]
        params = [{"params": decay, "lr": 1e-2 * k, "weight_decay": 0.1 * k},
                  {"params": rest, "lr": 5e-3 * k, "weight_decay": 0.0 + 0.05 * (k - 1)}]
        opt = {"type": "AdamW", "params": {"lr": 1e-2 * k, "torch_adam": True,
                                           "betas": [0.8, 0.9] if perturb else [0.9, 0.999],
                                           "eps": 1e-6 if perturb else 1e-8}}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": opt, "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    cfg.update(extra or {})
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=params, config=cfg)
    return engine


def batch(model, dtype, g):
    import torch
    if model == "rich":
        return (torch.randint(0, VOCAB, (2, 5), generator=g),
                torch.randint(0, VOCAB, (2, 5), generator=g))
    n = 8 if model == "moe" else 2  # moe: tokens for every expert
    x = torch.randn(n, 7, generator=g)
    y = torch.randn(n, 5, generator=g)
    if dtype in ("bf16", "fp16"):
        x = x.to(torch.bfloat16 if dtype == "bf16" else torch.float16)
    return x, y


SCALER_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


def every_expert(engine, name):
    """The moe model: a local expert param's name as every expert-parallel rank's
    global one (an expert group lists each rank's experts); [name] otherwise."""
    moe = getattr(engine.module, "moe", None)
    head, sep, tail = name.partition(EXPERT_INFIX)
    if moe is None or not sep:
        return [name]
    local, dot, rest = tail.partition(".")
    return [f"{head}{sep}{e * moe.num_local_experts + int(local)}{dot}{rest}"
            for e in range(moe.ep_size)]


def optimizer_facts(engine):
    """What the engine's optimizer keeps beside the tensors: each param group's params (by
    name), lr, weight decay, betas and eps; the loss scaler's state (fp16: DeepSpeed's
    DynamicLossScaler at ZeRO 1-3, the unfused optimizer's loss_scale_config at ZeRO 0);
    the engine's step counters."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)  # the torch optimizer under DeepSpeed's wrapper
    names = {id(p): n for n, p in engine.module.named_parameters()}
    lists = None
    for attr in ("bit16_groups", "bf16_groups", "fp16_groups"):
        if isinstance(getattr(opt, attr, None), list):
            lists = getattr(opt, attr)
            break
    if lists is None:
        lists = [g["params"] for g in inner.param_groups]
    groups = []
    for i, g in enumerate(inner.param_groups):
        groups.append({"params": sorted(n for p in lists[i]
                                        for n in every_expert(engine, names.get(id(p), "?"))),
                       **{k: list(g[k]) if k == "betas" else g[k]
                          for k in ("lr", "weight_decay", "betas", "eps")}})
    scaler = getattr(opt, "loss_scaler", None) or getattr(opt, "loss_scale_config", None)
    facts = {"groups": groups, "global_steps": engine.global_steps,
             "skipped_steps": engine.skipped_steps}
    if engine.fp16_enabled() and scaler is not None:
        facts["loss_scaler"] = {k: getattr(scaler, k, None) for k in SCALER_KEYS}
        facts["loss_scaler"]["dynamic"] = getattr(scaler, "dynamic",
                                                  getattr(scaler, "dynamic_loss_scale", None))
    return facts


def full_state(engine, p, key):
    """Optimizer state `key` of ZeRO 1/2 (or BF16_Optimizer) param p, whole: DeepSpeed's
    safe_get_full_optimizer_state (each rank's fragment placed, summed over the data-parallel
    group), except that every rank takes part in the all-reduce. DeepSpeed's raises on a rank
    whose fragment has no linked optimizer view (seen with two param groups), and that rank
    then skips the collective the others are in; here the fragment is then read from the
    optimizer state of the flat fp32 partition the param's fp32 fragment lies in. None on
    every rank when some rank finds none."""
    import torch
    from deepspeed import comm as dist
    buf = torch.zeros(p.numel(), dtype=torch.float32)
    missing = torch.zeros(1)
    m = p._hp_mapping
    if m is not None:
        frag = None
        try:
            frag = m.get_hp_fragment(key)
        except Exception as e:  # noqa: BLE001: the fragment is looked for below
            api_note("get_hp_fragment", key, e)
            inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
            where = m.hp_fragment.untyped_storage().data_ptr()
            for flat, st in inner.state.items():
                if key in st and flat.untyped_storage().data_ptr() == where:
                    a = m.hp_fragment_address
                    frag = st[key].narrow(0, a.start, a.numel)
        if frag is None:
            missing += 1
        else:
            a = m.lp_fragment_address
            buf.narrow(0, a.start, a.numel).copy_(frag.reshape(-1))
    dist.all_reduce(buf, group=p._dp_group)
    dist.all_reduce(missing, group=p._dp_group)
    return None if missing.item() else buf.reshape(p.shape)


def in_memory(engine, stage, with_optimizer=True):
    """Module params (fp32), masters and Adam moments as the engine holds them."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    named = list(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            module = {n: p.detach().clone().float() for n, p in named}
    else:
        module = {n: p.detach().clone().float() for n, p in named}
    # ZeRO 0 with bf16 (FP16_UnfusedOptimizer in DeepSpeed 0.19) keeps fp32
    # copies beside the module's params, which DeepSpeed's API does not map.
    copies = {}
    opt = engine.optimizer
    if stage == 0 and hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):
        for low, high in zip(opt.fp16_groups, opt.fp32_groups):
            for p16, p32 in zip(low, high):
                copies[id(p16)] = p32
    master, optim = {}, {}
    engine.ucp_adam_steps = {}  # where the inner torch Adam's state is at hand
    for n, p in named:
        if not p.requires_grad:  # frozen: no master, no moments (and no collective)
            master[n] = None
            for k in ("exp_avg", "exp_avg_sq") if with_optimizer else ():
                optim[f"{n}::{k}"] = None
            continue
        if id(p) in copies:
            p32 = copies[id(p)]
            master[n] = p32.detach().clone()
            for k in ("exp_avg", "exp_avg_sq") if with_optimizer else ():
                optim[f"{n}::{k}"] = opt.optimizer.state[p32][k].detach().clone()
            engine.ucp_adam_steps[n] = float(opt.optimizer.state[p32]["step"])
            continue
        try:
            t = safe_get_full_fp32_param(p)
        except Exception as e:  # ZeRO 0 fp32: no separate master
            api_note("safe_get_full_fp32_param", n, e)
            t = None
        master[n] = None if t is None else t.detach().clone()
        for k in ("exp_avg", "exp_avg_sq") if with_optimizer else ():
            try:
                if hasattr(p, "_hp_mapping") and not hasattr(p, "ds_id"):
                    t = full_state(engine, p, k)
                else:
                    t = safe_get_full_optimizer_state(p, k)
            except Exception as e:
                api_note("safe_get_full_optimizer_state", n, k, e)
                t = None
            if t is None and stage == 0 and p in getattr(engine.optimizer, "state", {}):
                t = engine.optimizer.state[p].get(k)  # plain torch Adam
                engine.ucp_adam_steps[n] = float(engine.optimizer.state[p]["step"])
            optim[f"{n}::{k}"] = None if t is None else t.detach().clone()
    return module, master, optim


EXPERT_INFIX = "deepspeed_moe.experts.deepspeed_experts."


def globally(engine, dicts):
    """The moe model: `dicts` (name or name::kind -> tensor, each rank its own local experts)
    under DeepSpeed's global expert names (the layer files' `...deepspeed_experts.{G}...`),
    merged over all ranks: every rank gets every expert (the ranks of one expert-data-parallel
    group hold equal copies; a difference between them is reported as a failure list)."""
    import torch
    from deepspeed.utils import groups
    moe = engine.module.moe
    ep_rank = groups._get_expert_parallel_rank(moe.expert_group_name)
    assert ep_rank == torch.distributed.get_rank() % moe.ep_size, "Moe's expert init is wrong"
    base = ep_rank * moe.num_local_experts

    def rename(k):
        head, sep, tail = k.partition(EXPERT_INFIX)
        if not sep:
            return k
        local, dot, rest = tail.partition(".")
        return f"{head}{sep}{base + int(local)}{dot}{rest}"

    mine = [{rename(k): v for k, v in d.items()} for d in dicts]
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    merged = [{} for _ in dicts]
    differ = []
    for theirs in everyone:
        for m, d in zip(merged, theirs):
            for k, v in d.items():
                if k in m and m[k] is not None and v is not None and not torch.equal(m[k], v):
                    differ.append(f"{k}: expert-data-parallel copies differ")
                m.setdefault(k, v)
    return merged, differ


def rank_make(a):
    import deepspeed
    import torch
    engine = model_and_engine(a.stage, a.dtype, model=a.model, ep=a.ep)
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(99 + rank)
    for _ in range(2):
        x, y = batch(a.model, a.dtype, g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(a.out, tag="global_step2")
    module, master, optim = in_memory(engine, a.stage)
    if a.model == "moe":
        (module, master, optim), differ = globally(engine, (module, master, optim))
        assert not differ, differ
    # DeepSpeed 0.14.5 at ZeRO 3 on CPU now and then trains to NaN when the
    # machine is loaded (seen 1 run in 8 with 4 makes at once on 2 cores; the
    # same seeds give finite numbers otherwise). A NaN source proves nothing
    # (and NaN's bf16 bytes depend on torch's code path): the launcher trains
    # again.
    finite = all(t is None or bool(torch.isfinite(t).all())
                 for d in (module, master, optim) for t in d.values())
    bad = torch.tensor([0 if finite else 1])
    torch.distributed.all_reduce(bad)
    if int(bad):
        torch.distributed.barrier()
        return NOT_FINITE
    if rank == 0:
        out = pathlib.Path(a.out)
        torch.save(module, out / "reference_module_params.pt")
        torch.save(master, out / "reference_fp32_master.pt")
        torch.save(optim, out / "reference_optim_state.pt")
        shapes = {n: list(t.shape) for n, t in module.items()}
        meta = dict(deepspeed_version=deepspeed.__version__, torch_version=torch.__version__,
                    zero_stage=a.stage, dtype=a.dtype, world_size=torch.distributed.get_world_size(),
                    model=a.model, steps=2, tag="global_step2", param_shapes=shapes,
                    adam_steps=engine.ucp_adam_steps,
                    optimizer_wrapper=type(engine.optimizer).__name__,
                    frozen=[n for n, p in engine.module.named_parameters()
                            if not p.requires_grad],
                    tied={"head.weight": "embed.weight"} if a.model == "rich" else {},
                    **({"ep": a.ep, "num_experts": MOE_EXPERTS} if a.model == "moe" else {}),
                    optimizer_facts=optimizer_facts(engine))
        (out / "meta.json").write_text(json.dumps(meta, indent=1))
    torch.distributed.barrier()


NOT_FINITE = 3  # a rank process's exit status: the trained state is not finite
KILLED = "killed"  # launch()'s status of a rank still running at the deadline


def rank_load(a):
    import deepspeed
    import torch
    extra = {"checkpoint": {"load_universal": True}} if a.universal else None
    engine = model_and_engine(a.stage, a.dtype, extra, model=a.model, perturb=True, ep=a.ep)
    path, _ = engine.load_checkpoint(a.dir)
    failures = []
    if path is None:
        failures.append(f"load_checkpoint({a.dir}) found nothing")
    if engine.global_steps != 2:
        failures.append(f"global_steps {engine.global_steps}, expected 2")
    truth = pathlib.Path(a.truth)
    want_module = torch.load(truth / "reference_module_params.pt")
    want_master = torch.load(truth / "reference_fp32_master.pt")
    want_optim = torch.load(truth / "reference_optim_state.pt")
    # After a native ZeRO 1/2 load DeepSpeed leaves the optimizer fragments
    # unlinked (safe_get_full_optimizer_state fails on some ranks): the Adam
    # moments are read from a re-save instead, by DeepSpeed's ds_to_universal.
    module, master, _ = in_memory(engine, a.stage, with_optimizer=False)
    optim = {}
    resaved_master = {}
    rank = torch.distributed.get_rank()
    if a.model == "moe":
        # Every expert's numbers from the ranks holding it; DeepSpeed's ds_to_universal
        # converts no MoE checkpoint (deepspeedai/DeepSpeed#5716), so the moments are the
        # engine's own (full_state: the fragment from the flat partition's state where
        # DeepSpeed's API finds none).
        module, master, optim = in_memory(engine, a.stage)
        (module, master, optim), differ = globally(engine, (module, master, optim))
        failures += differ
    elif a.stage == 0:  # not partitioned: every rank holds all of it
        optim = in_memory(engine, a.stage)[2]
    else:
        resave = pathlib.Path(a.scratch) / "resave"
        engine.save_checkpoint(str(resave), tag="resaved")
        torch.distributed.barrier()
        if rank == 0:
            universal = pathlib.Path(a.scratch) / "resave_universal"
            error = ds_to_universal(resave / "resaved", universal)
            if error is not None:
                failures.append(f"ds_to_universal of the re-save failed: {error}")
            else:
                for n in want_module:
                    for k in ("exp_avg", "exp_avg_sq"):
                        if want_optim.get(f"{n}::{k}") is None:
                            continue  # a frozen param: no moments
                        d = torch.load(universal / "zero" / n / f"{k}.pt", weights_only=False)
                        # {'param': t, 'cat_dim': ...}, or t alone and flat
                        # at ZeRO 3
                        t = d["param"] if isinstance(d, dict) else d
                        shape = want_module[n].shape
                        optim[f"{n}::{k}"] = t.view(shape) if t.numel() == shape.numel() else t
                    d = torch.load(universal / "zero" / n / "fp32.pt", weights_only=False)
                    t = d["param"] if isinstance(d, dict) else d
                    shape = want_module[n].shape
                    resaved_master[n] = t.view(shape) if t.numel() == shape.numel() else t
    # DeepSpeed 0.14.x reports stale fp32 masters in memory after a universal
    # load at ZeRO 1/2 (safe_get_full_fp32_param; its re-save holds the right
    # ones): there only the re-save's masters are compared.
    stale_masters = (a.universal and a.stage in (1, 2)
                     and tuple(map(int, deepspeed.__version__.split(".")[:2])) < (0, 15))
    checked = 0

    def bits(t):
        return t.contiguous().reshape(-1).view(torch.uint8)

    def same(got, want, what):
        nonlocal checked
        if want is None:
            return
        checked += 1
        if got is None:
            failures.append(f"{what}: the engine reports none")
        elif got.dtype != want.dtype or got.shape != want.shape:
            failures.append(f"{what}: {got.dtype} {tuple(got.shape)}, expected {want.dtype} "
                            f"{tuple(want.shape)}")
        elif not torch.equal(bits(got), bits(want)):
            failures.append(f"{what}: values differ")
        elif checked == 1 and want.numel() > 0:
            # The comparison's own negative control: one changed byte is seen.
            changed = bits(want).clone()
            changed[-1] ^= 1
            if torch.equal(bits(got), changed):
                failures.append(f"{what}: a changed byte compares equal")

    for n, t in want_module.items():
        same(module.get(n), t, f"module {n}")
        # ZeRO 0 fp32 keeps no separate master: the module params are it.
        want = want_master.get(n) if want_master.get(n) is not None else t
        if not stale_masters:
            same(master.get(n) if master.get(n) is not None else module.get(n), want,
                 f"fp32 master {n}")
        if rank == 0 and a.stage != 0 and a.model != "moe":
            same(resaved_master.get(n), want, f"fp32 master {n} (re-saved)")
    if a.stage == 0 or rank == 0 or a.model == "moe":
        for k, t in want_optim.items():
            same(optim.get(k), t, f"optimizer state {k}")
    # The param groups (membership and hyper-parameters; the engine was made with other
    # ones), the loss scaler and the step counters.
    want_facts = json.loads((truth / "meta.json").read_text()).get("optimizer_facts")
    if want_facts is not None:
        got_facts = optimizer_facts(engine)
        for key, want in want_facts.items():
            if key == "groups":
                if len(got_facts["groups"]) != len(want):
                    failures.append(f"{len(got_facts['groups'])} param groups, expected "
                                    f"{len(want)}")
                for i, (g, w) in enumerate(zip(got_facts["groups"], want)):
                    for k, v in w.items():
                        checked += 1
                        if g.get(k) != v:
                            failures.append(f"param group {i} {k}: {g.get(k)!r}, expected {v!r}")
            elif key == "loss_scaler":
                for k, v in want.items():
                    checked += 1
                    got = (got_facts.get("loss_scaler") or {}).get(k)
                    if got != v:
                        failures.append(f"loss scaler {k}: {got!r}, expected {v!r}")
            else:
                checked += 1
                if got_facts.get(key) != want:
                    failures.append(f"{key}: {got_facts.get(key)!r}, expected {want!r}")
    if not verdict(failures, checked):
        sys.exit(1)


def verdict(failures, checked):
    """Every rank's verdict, decided together: rank 0 prints the JSON line the test reads
    ({"ok", "checked", "failures": rank 0's}); True when no rank failed."""
    import torch
    bad = torch.tensor([len(failures)])
    torch.distributed.all_reduce(bad)
    if torch.distributed.get_rank() == 0:
        print(json.dumps({"ok": int(bad) == 0, "checked": checked, "failures": failures}),
              flush=True)
    torch.distributed.barrier()
    return int(bad) == 0


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    ld = sub.add_parser("load")
    ld.add_argument("--dir", required=True)
    ld.add_argument("--truth", required=True)
    ld.add_argument("--universal", action="store_true")
    ld.add_argument("--scratch", required=True, help="a folder for the re-save")
    for p in (m, ld):
        p.add_argument("--world", type=int, required=True)
        p.add_argument("--stage", type=int, required=True, choices=[0, 1, 2, 3])
        p.add_argument("--dtype", required=True, choices=["fp32", "bf16", "fp16"])
        p.add_argument("--model", default="mlp", choices=["mlp", "rich", "moe"],
                       help="rich: two param groups, a frozen weight, tied weights; moe: "
                       "deepspeed.moe.layer.MoE with 4 experts")
        p.add_argument("--ep", type=int, default=2, help="moe: the expert-parallel size")
    return ap.parse_args([str(x) for x in argv])


def command(argv, timeout=600):
    """One `make` or `load` (the arguments as on the command line) in this process: its ranks
    forked from here, killed at `timeout` seconds. Returns (rank 0's stdout, every rank exited
    0 before the deadline)."""
    a = parse(argv)
    for attempt in range(1, 4):
        out, codes = launch(a, timeout)
        if a.cmd != "make" or any(c not in (0, NOT_FINITE) for c in codes) \
                or NOT_FINITE not in codes:
            break
        print(f"DeepSpeed trained to a non-finite state (attempt {attempt}); training again",
              flush=True)
        shutil.rmtree(a.out, ignore_errors=True)
    return out, all(c == 0 for c in codes)


def main():
    out, ok = command(sys.argv[1:])
    sys.stdout.write(out)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
