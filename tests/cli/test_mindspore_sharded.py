"""Sharded MindSpore saves (rank_R/ folders + a parallel strategy file)
against the real MindSpore (the tests' PyPI environment, CPU).

The oracle is MindSpore's own transform_checkpoints: it cuts an unsharded
checkpoint of a network trained with nn.Adam into the rank files a strategy
lays out, and merges rank files back. Strategy files are built with
MindSpore's own protobuf classes (mindspore.train.node_strategy_pb2), in each
form the format has: one tensor map per tensor (classic), optimizer-parallel
shards (opt_weight_shard_size/step), the "extend" form (several device axes
per tensor dim), and a merged pipeline strategy ("<stage>-<name>").

- ucp reads MindSpore's rank files with the strategy to exactly the unsharded
  checkpoint load_checkpoint returns (bit for bit);
- ucp writes, for a strategy, rank files equal to transform_checkpoints' own,
  record for record, and transform_checkpoints merges them back to the source;
- a sharded save converts to another strategy as transform_checkpoints does;
- MindFormers save folders (rank_R/<prefix>rank_R-<epoch>_<step>.ckpt,
  meta.json per rank): the newest step every rank has, ucp resume falling
  back past a missing or damaged rank file;
- `ucp export` of a sharded save gives the consolidated weights;
- what ucp cannot read is one clear error line.
"""
import glob
import json
import os
import pathlib
import shutil
import sys
import tempfile

os.environ.setdefault("GLOG_v", "3")
import h5py  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tools"))
import oracle_checks  # noqa: E402

from testmain import UCP, one_error_line, run  # noqa: E402
import testmain  # noqa: E402
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
MOMENTS = ("moment1.", "moment2.")


def ms():
    import mindspore
    mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
    return mindspore


def train_and_save(path, steps=2, seed=1, append=None):
    """A network (fc1: 8 -> 12, fc2: 12 -> 4) trained `steps` steps with
    nn.Adam, saved by save_checkpoint; returns load_checkpoint's numpy."""
    m = ms()
    from mindspore import nn, Tensor
    m.set_seed(seed)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Dense(8, 12)
            self.fc2 = nn.Dense(12, 4)

        def construct(self, x):
            return self.fc2(m.ops.relu(self.fc1(x)))

    net = Net()
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    loss_fn = nn.MSELoss()
    grad_fn = m.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    for i in range(steps):
        rs = np.random.RandomState(i)
        _, g = grad_fn(Tensor(rs.randn(3, 8).astype(np.float32)),
                       Tensor(rs.randn(3, 4).astype(np.float32)))
        opt(g)
    items = [{"name": p.name, "data": p} for p in net.trainable_params()]
    items += [{"name": p.name, "data": p} for p in (opt.moment1 + opt.moment2)]
    items += [{"name": n, "data": getattr(opt, n)}
              for n in ("global_step", "learning_rate", "beta1_power", "beta2_power")]
    path.parent.mkdir(parents=True, exist_ok=True)
    m.save_checkpoint(items, str(path), append_dict=append)
    return {k: v.asnumpy() for k, v in m.load_checkpoint(str(path)).items()}


# Layouts: name -> (dev_matrix, tensor_map, opt_weight_shard_size, _step);
# a tensor map of lists is the extend form. Moments get their param's.
LAYOUTS = {
    "tp": {"fc1.weight": ([2, 2], [0, -1], 0, 0), "fc1.bias": ([2, 2], [0], 0, 0),
           "fc2.weight": ([2, 2], [-1, 1], 0, 0), "fc2.bias": ([2, 2], [-1], 0, 0)},
    "opt": {"fc1.weight": ([2, 2], [0, -1], 2, 2), "fc1.bias": ([2, 2], [0], 2, 2),
            "fc2.weight": ([2, 2], [-1, 1], 2, 1), "fc2.bias": ([2, 2], [-1], 4, 1)},
    "ext": {"fc1.weight": ([2, 2], [[1, 0], [-1]], 0, 0),
            "fc1.bias": ([2, 2], [[0, 1], []], 0, 0),
            "fc2.weight": ([2, 2], [[-1], [1, 0]], 0, 0),
            "fc2.bias": ([2, 2], [[-1], []], 0, 0)},
    # two pipeline stages of two devices: fc1 on ranks 0-1, fc2 on 2-3
    "pp": {"0-fc1.weight": ([2], [0, -1], 0, 0), "0-fc1.bias": ([2], [0], 0, 0),
           "1-fc2.weight": ([2], [-1, 0], 0, 0), "1-fc2.bias": ([2], [-1], 0, 0)},
    # eight devices, dev matrix [2, 2, 2]: dp x mp x mp, optimizer shard over dp
    "w8": {"fc1.weight": ([2, 2, 2], [1, 0], 2, 4), "fc1.bias": ([2, 2, 2], [1], 0, 0),
           "fc2.weight": ([2, 2, 2], [[-1], [1, 0]], 0, 0),
           "fc2.bias": ([2, 2, 2], [-1], 2, 1)},
    # the optimizer shard over the leading axis with dims mapped against the
    # device order (dim 0 by the innermost axis): MindSpore re-lays the
    # devices by tensor dim for it
    "odd": {"fc1.weight": ([2, 2, 2], [0, 1], 2, 4), "fc1.bias": ([2, 2, 2], [0], 2, 4),
            "fc2.weight": ([2, 2, 2], [-1, 1], 2, 1), "fc2.bias": ([2, 2, 2], [-1], 2, 1)},
}


def write_strategy(path, layouts, stage=None):
    """A strategy file as MindSpore writes it (its own protobuf classes)."""
    from mindspore.train import node_strategy_pb2 as pb
    m = pb.ParallelStrategyMap()
    m.current_stage = stage or 0
    for name, (dev, tmap, size, step) in layouts.items():
        stage_prefix, bare = (name.split("-", 1) + [""])[:2] if "-" in name else ("", name)
        for full in [bare] + [p + bare for p in MOMENTS]:
            item = m.parallel_layout_item.add()
            item.param_name = f"{stage_prefix}-{full}" if stage_prefix else full
            lay = item.parallel_layouts
            lay.dev_matrix.add().dim.extend(dev)
            if tmap and isinstance(tmap[0], list):
                for t in tmap:
                    lay.tensor_map.add().dim.extend(t)
            else:
                lay.tensor_map.add().dim.extend(tmap)
            lay.param_split_shape.add()
            lay.indices_offset.add()
            lay.field = 0
            lay.opt_weight_shard_size = size
            lay.opt_weight_shard_step = step
    pathlib.Path(path).write_bytes(m.SerializeToString())


def world(layouts):
    stages = {n.split("-")[0] for n in layouts if "-" in n} or {"0"}
    return int(np.prod(next(iter(layouts.values()))[0])) * len(stages)


def transform(src, dst, prefix, src_strategy, dst_strategy):
    from mindspore.parallel import transform_checkpoints
    transform_checkpoints(str(src), str(dst), prefix,
                          None if src_strategy is None else str(src_strategy),
                          None if dst_strategy is None else str(dst_strategy))


def load(path):
    return {k: v.asnumpy() for k, v in ms().load_checkpoint(str(path)).items()}


def only_ckpt(folder):
    files = sorted(glob.glob(str(pathlib.Path(folder) / "*.ckpt")))
    assert len(files) == 1, files
    return files[0]


def same_arrays(got, want, what):
    """Same keys, dtypes, shapes and bytes; returns the number of elements compared."""
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for k in want:
        a, b = got[k], want[k]
        assert a.dtype == b.dtype and a.shape == b.shape, (what, k, a.shape, b.shape)
        assert a.tobytes() == b.tobytes(), (what, k)
    return sum(int(np.asarray(b).size) for b in want.values())


# Fewest values one comparison must reach: one rank's share of the 160-value net (its params,
# 2 moments each, the scalars) at the widest layouts here, a pipeline stage holding fc2 only.
MIN_VALUES = 8


def assert_same(got, want, what):
    """same_arrays with the count rule and a negative control (oracle_checks.checked)."""
    oracle_checks.checked(lambda g: same_arrays(g, want, what), got, MIN_VALUES, str(what))


def universal(h5):
    out = {}
    with h5py.File(h5, "r") as f:
        for p in f["params"]:
            for k in f["params"][p]:
                out[(p, k)] = f["params"][p][k][()]
        return out, int(f.attrs["iteration"])


def universal_is(got, want, h5):
    """The universal file's atoms (universal()) against MindSpore's records; returns the
    number of values compared."""
    assert sorted({p for p, _ in got}) == sorted(NAMES), sorted(got)
    n = 0
    for name in NAMES:
        for kind, key in (("fp32", name), ("exp_avg", "moment1." + name),
                          ("exp_avg_sq", "moment2." + name)):
            a, b = got[(name, kind)], want[key]
            assert a.shape == b.shape and a.tobytes() == b.tobytes(), (h5, name, kind)
            n += int(b.size)
    return n


def assert_universal_is(h5, want):
    got, iteration = universal(h5)
    assert iteration == int(want["global_step"][0]), iteration
    # 160 params x 3 state kinds; a changed value fails the comparison (the control changes
    # one of the compared atoms).
    assert sorted({p for p, _ in got}) == sorted(NAMES), sorted(got)
    got = {(n, kind): v for (n, kind), v in got.items() if kind in ("fp32", "exp_avg", "exp_avg_sq")}
    oracle_checks.checked(lambda g: universal_is(g, want, h5), got, 3 * 160, str(h5))


def sharded_by_mindspore(t, name):
    """(source load_checkpoint, MindSpore's rank files for layout `name`,
    its strategy file)."""
    want = train_and_save(t / "src" / "rank_0" / "net.ckpt")
    write_strategy(t / f"{name}.ckpt", LAYOUTS[name])
    transform(t / "src", t / name, "r", None, t / f"{name}.ckpt")
    assert len(list((t / name).glob("rank_*"))) == world(LAYOUTS[name])
    return want, t / name, t / f"{name}.ckpt"


def read_case(name):
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        want, save, strategy = sharded_by_mindspore(t, name)
        run("to-universal", save, "--strategy", strategy, "-o", t / "u.h5", "-q")
        assert_universal_is(t / "u.h5", want)
        # The other records (learning_rate, beta powers) come back too.
        run("convert", save, "--strategy", strategy, "-o", t / "one", "--format",
            "mindspore", "-q")
        assert_same(load(only_ckpt(t / "one" / "rank_0")), want, "merged by ucp")


def write_case(name):
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        want, theirs, strategy = sharded_by_mindspore(t, name)
        run("convert", t / "src", "-o", t / "ours", "--format", "mindspore",
            "--target-strategy", strategy, "-q")
        for r in range(world(LAYOUTS[name])):
            assert_same(load(only_ckpt(t / "ours" / f"rank_{r}")),
                        load(only_ckpt(theirs / f"rank_{r}")), f"rank {r}")
            meta = json.loads((t / "ours" / f"rank_{r}" / "meta.json").read_text())
            assert meta["last_ckpt_file"] == pathlib.Path(
                only_ckpt(t / "ours" / f"rank_{r}")).name, meta
        assert (t / "ours" / "strategy.ckpt").read_bytes() == strategy.read_bytes()
        transform(t / "ours", t / "merged", "m", t / "ours" / "strategy.ckpt", None)
        assert_same(load(t / "merged" / "rank_0" / "m0.ckpt"), want, "merged by MindSpore")
        # ucp reads its own output without being told the strategy.
        run("to-universal", t / "ours", "-o", t / "u.h5", "-q")
        assert_universal_is(t / "u.h5", want)


def test_read_tensor_parallel():
    read_case("tp")


def test_read_optimizer_parallel():
    read_case("opt")


def test_read_extend_layout():
    read_case("ext")


def test_read_pipeline_stages():
    read_case("pp")


def test_write_tensor_parallel():
    write_case("tp")


def test_write_optimizer_parallel():
    write_case("opt")


def test_write_extend_layout():
    write_case("ext")


def test_write_pipeline_stages():
    write_case("pp")


def test_write_eight_ranks():
    write_case("w8")
    read_case("w8")


def load_st(path):
    return {k: v.asnumpy() for k, v in
            ms().load_checkpoint(str(path), format="safetensors").items()}


def only_st(folder):
    files = sorted(glob.glob(str(pathlib.Path(folder) / "*.safetensors")))
    assert len(files) == 1, files
    return files[0]


def test_safetensors_rank_files():
    """MindSpore's other container, save_checkpoint(format="safetensors"):
    ucp reads an unsharded file, and a sharded save of such rank files
    (MindSpore's own rank files for an optimizer-parallel strategy, made
    safetensors by its ckpt_to_safetensors), to exactly the source; with
    --file-format safetensors it writes rank files holding, record for record,
    transform_checkpoints' .ckpt rank files, which MindSpore merges back; a
    safetensors source is written as safetensors unless --file-format ckpt.
    (transform_checkpoints(output_format="safetensors") is not the oracle:
    MindSpore 2.10 writes there, for a weight split on a dim other than 0, the
    flat first elements instead of the slice, and its own merge then gives
    wrong weights back; ucp's files merge to the source.)"""
    m = ms()
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        want = train_and_save(t / "src" / "rank_0" / "net.ckpt")
        one = t / "one" / "rank_0" / "net.safetensors"
        one.parent.mkdir(parents=True)
        m.save_checkpoint([{"name": k, "data": m.Tensor(v)} for k, v in want.items()],
                          str(one), format="safetensors")
        assert_same(load_st(one), want, "MindSpore's own safetensors file")
        run("to-universal", one, "-o", t / "one.h5", "-q")
        assert_universal_is(t / "one.h5", want)
        run("convert", t / "one", "-o", t / "same", "--format", "mindspore", "-q")
        assert_same(load_st(only_st(t / "same" / "rank_0")), want, "safetensors kept")
        run("convert", t / "one", "-o", t / "ckpt", "--format", "mindspore",
            "--file-format", "ckpt", "-q")
        assert_same(load(only_ckpt(t / "ckpt" / "rank_0")), want, "as .ckpt")
        # MindSpore's sharded save, as safetensors rank files, read.
        write_strategy(t / "opt.ckpt", LAYOUTS["opt"])
        transform(t / "src", t / "theirs", "r", None, t / "opt.ckpt")
        n = world(LAYOUTS["opt"])
        for r in range(n):
            m.ckpt_to_safetensors(only_ckpt(t / "theirs" / f"rank_{r}"),
                                  str(t / "theirs_st" / f"rank_{r}"))
            assert_same(load_st(only_st(t / "theirs_st" / f"rank_{r}")),
                        load(only_ckpt(t / "theirs" / f"rank_{r}")), ("converted", r))
        run("to-universal", t / "theirs_st", "--strategy", t / "opt.ckpt", "-o",
            t / "u.h5", "-q")
        assert_universal_is(t / "u.h5", want)
        # Written for the strategy: MindSpore's rank files, merged back by it.
        p = run("convert", t / "src", "-o", t / "ours", "--format", "mindspore",
                "--target-strategy", t / "opt.ckpt", "--file-format", "safetensors")
        assert 'format="safetensors"' in p.stdout, p.stdout
        for r in range(n):
            mine = only_st(t / "ours" / f"rank_{r}")
            assert_same(load_st(mine), load(only_ckpt(t / "theirs" / f"rank_{r}")),
                        f"rank {r}")
            meta = json.loads((t / "ours" / f"rank_{r}" / "meta.json").read_text())
            assert meta["last_ckpt_file"] == pathlib.Path(mine).name, meta
        transform(t / "ours", t / "merged", "m", t / "ours" / "strategy.ckpt", None)
        assert_same(load(t / "merged" / "rank_0" / "m0.ckpt"), want, "merged by MindSpore")
        p = run("convert", t / "src", "-o", t / "bad", "--format", "mindspore",
                "--file-format", "h5", expect=2)
        one_error_line(p, "--file-format h5", "ckpt or safetensors", kind="usage error")
        assert not (t / "bad").exists()
    mindformers_safetensors_folder()  # (in this process: MindSpore imported once)

def test_optimizer_shard_against_the_device_order():
    read_case("odd")
    write_case("odd")


def test_remove_redundancy_saves_read():
    """A save made with remove_redundancy keeps each replicated slice on one
    rank only (transform_checkpoints refuses those): the rank files are
    rewritten with MindSpore's own save_checkpoint keeping each parameter's
    slice on the first rank that has it (the global_step and other records
    included); ucp still reads the whole checkpoint, bit for bit."""
    m = ms()
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        want, save, strategy = sharded_by_mindspore(t, "tp")
        seen, dropped = set(), 0
        for r in range(world(LAYOUTS["tp"])):
            f = only_ckpt(save / f"rank_{r}")
            kept = []
            for k, v in m.load_checkpoint(f).items():
                key = (k, v.asnumpy().tobytes())
                if key in seen and k in NAMES:
                    dropped += 1
                    continue
                seen.add(key)
                kept.append({"name": k, "data": v})
            os.remove(f)
            m.save_checkpoint(kept, f)
        assert dropped >= len(NAMES), dropped
        run("to-universal", save, "--strategy", strategy, "-o", t / "u.h5", "-q")
        assert_universal_is(t / "u.h5", want)
        # A slice that no rank keeps is a gap, refused naming the param.
        f = only_ckpt(save / "rank_0")
        kept = [{"name": k, "data": v} for k, v in m.load_checkpoint(f).items()
                if k != "fc1.weight"]
        os.remove(f)
        m.save_checkpoint(kept, f)
        p = run("to-universal", save, "--strategy", strategy, "-o", t / "x.h5", expect=3)
        one_error_line(p, "fc1.weight", kind="format error")
        assert not (t / "x.h5").exists()


def test_a_strategy_of_other_names():
    """Written for a strategy that names none of the params: refused (exit 2,
    nothing written); one naming only some: the others whole on every rank,
    said in the summary, and the rank files still what transform_checkpoints
    writes for that strategy."""
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        train_and_save(t / "src" / "rank_0" / "net.ckpt")
        write_strategy(t / "other.ckpt", {"layer.0.w": ([2, 2], [0, -1], 0, 0)})
        p = run("convert", t / "src", "-o", t / "x", "--format", "mindspore",
                "--target-strategy", t / "other.ckpt", expect=2)
        one_error_line(p, "other.ckpt", "names none", "fc1.weight", kind="usage error")
        assert not (t / "x").exists()
        some = {k: v for k, v in LAYOUTS["tp"].items() if k.startswith("fc1")}
        write_strategy(t / "some.ckpt", some)
        r = json.loads(run("convert", t / "src", "-o", t / "ours", "--format", "mindspore",
                           "--target-strategy", t / "some.ckpt", "--json").stdout)
        notes = " ".join(r["target"]["notes"]) if "target" in r else json.dumps(r)
        assert "fc2.weight" in notes and "whole on every rank" in notes, r
        transform(t / "src", t / "theirs", "r", None, t / "some.ckpt")
        for rank in range(4):
            assert_same(load(only_ckpt(t / "ours" / f"rank_{rank}")),
                        load(only_ckpt(t / "theirs" / f"rank_{rank}")), f"rank {rank}")


def test_json_strategy_files():
    """The JSON variant of a strategy file (a .json name; the form MindSpore's
    _build_json_strategy reads: parallel_layout_item by name, with
    dev_matrix, tensor_map, field and the optimizer shard), read and written
    as transform_checkpoints does with the same file."""
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        want = train_and_save(t / "src" / "rank_0" / "net.ckpt")
        items = {}
        for name, (dev, tmap, size, step) in LAYOUTS["opt"].items():
            for p in ("",) + MOMENTS:
                items[p + name] = {"dev_matrix": dev, "tensor_map": tmap, "field": 0,
                                   "opt_weight_shard_size": size,
                                   "opt_weight_shard_step": step}
        (t / "s.json").write_text(json.dumps({"parallel_layout_item": items}))
        transform(t / "src", t / "theirs", "r", None, t / "s.json")
        run("convert", t / "src", "-o", t / "ours", "--format", "mindspore",
            "--target-strategy", t / "s.json", "-q")
        assert (t / "ours" / "strategy.json").read_bytes() == (t / "s.json").read_bytes()
        for r in range(4):
            assert_same(load(only_ckpt(t / "ours" / f"rank_{r}")),
                        load(only_ckpt(t / "theirs" / f"rank_{r}")), f"rank {r}")
        run("to-universal", t / "theirs", "--strategy", t / "s.json", "-o", t / "u.h5", "-q")
        assert_universal_is(t / "u.h5", want)


def test_export_of_a_sharded_save():
    """`ucp export` of a sharded save (optimizer-parallel layout): the
    consolidated weights as Hugging Face safetensors, read back by the
    safetensors library equal to the unsharded checkpoint's."""
    from safetensors.numpy import load_file
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        want, save, strategy = sharded_by_mindspore(t, "opt")
        run("export", save, "--strategy", strategy, "-o", t / "hf", "-q")
        got = load_file(str(t / "hf" / "model.safetensors"))
        assert sorted(got) == sorted(NAMES), sorted(got)
        for n in NAMES:
            assert got[n].dtype == want[n].dtype and got[n].tobytes() == want[n].tobytes(), n


def test_inspect_lists_the_records():
    """`ucp inspect` on a .ckpt file and on a sharded save lists every record
    with the dims each rank stores, as MindSpore's load_checkpoint returns
    them, and which ranks hold it."""
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        want, save, strategy = sharded_by_mindspore(t, "pp")
        one = json.loads(run("inspect", t / "src" / "rank_0" / "net.ckpt", "--json").stdout)
        (inv,) = one["checkpoints"]
        assert one["errors"] == [] and inv["format"] == "mindspore", one
        assert [r["tag"] for r in inv["records"]] == list(want), inv["records"]
        for r in inv["records"]:
            assert tuple(r["dims"]) == want[r["tag"]].shape or \
                (r["dims"] == [] and want[r["tag"]].shape in ((), (1,))), r
        shutil.copy(strategy, save / "strategy.ckpt")
        text = run("inspect", save).stdout
        assert "4 ranks" in text and "fc2.weight" in text, text
        (inv,) = json.loads(run("inspect", save, "--json").stdout)["checkpoints"]
        for r in range(4):
            got = load(only_ckpt(save / f"rank_{r}"))
            for rec in inv["records"]:
                assert (r in rec["ranks"]) == (rec["tag"] in got), (r, rec)
                if rec["tag"] in got and r == rec["ranks"][0]:
                    assert tuple(rec["dims"]) == got[rec["tag"]].shape or rec["dims"] == [], rec
        # A damaged .ckpt: the reader's reason, not "not a torch.save file".
        data = (t / "src" / "rank_0" / "net.ckpt").read_bytes()
        (t / "cut.ckpt").write_bytes(data[:len(data) // 2])
        p = run("inspect", t / "cut.ckpt", expect=3)
        one_error_line(p, "cut.ckpt", "damaged", kind="format error")


def test_sharded_to_sharded_is_what_transform_checkpoints_gives():
    """tp (4 ranks) -> pp (2 stages x 2) and -> w8 (8 ranks) in one step,
    rank files equal to transform_checkpoints' own conversion."""
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        _, src, src_strategy = sharded_by_mindspore(t, "tp")
        for dst in ("pp", "w8"):
            write_strategy(t / f"{dst}.ckpt", LAYOUTS[dst])
            transform(src, t / f"theirs-{dst}", "x", src_strategy, t / f"{dst}.ckpt")
            run("convert", src, "--strategy", src_strategy, "-o", t / f"ours-{dst}",
                "--target-strategy", t / f"{dst}.ckpt", "-q")
            for r in range(world(LAYOUTS[dst])):
                assert_same(load(only_ckpt(t / f"ours-{dst}" / f"rank_{r}")),
                            load(only_ckpt(t / f"theirs-{dst}" / f"rank_{r}")),
                            f"{dst} rank {r}")


def locate(whole, part):
    """The offset of `part` in `whole` on the grid of its shape (the only
    block equal to it: the values are random)."""
    import itertools
    if part.shape == whole.shape:
        return [0] * whole.ndim
    grid = [range(0, w, p) for w, p in zip(whole.shape, part.shape)]
    hits = [o for o in itertools.product(*grid)
            if whole[tuple(slice(a, a + n) for a, n in zip(o, part.shape))].tobytes()
            == part.tobytes()]
    assert len(hits) == 1, (part.shape, whole.shape, hits)
    return list(hits[0])


def checkpoint2(root, rank_files, want, iteration=2, batch=8, balanced=None):
    """A MindFormers Checkpoint 2.0 save folder (mindformers/checkpoint/checkpoint.py
    save_checkpoint: per rank, MindSpore's save_checkpoint(format="safetensors") of the model's
    params as model-RRRRRRR-WWWWWWW and of the optimizer's other entries as opt-...;
    common.json; for more than one rank metadata.json, each slice at its global offset; the
    tracker last) made of the records of `rank_files` (MindSpore's own rank files), re-saved by
    MindSpore; a slice's offset is where it lies in the whole tensor `want`. `balanced`: a
    remove_redundancy save instead (fully_parallel.py's BalancedSaveStrategy): each slice once,
    saved by one of the ranks holding it (model slices by the first, optimizer slices by the
    last rank if it holds them, else the first), the ranks with something to save numbered as
    the files of each kind."""
    m = ms()
    it = root / f"iteration_{iteration:08d}"
    it.mkdir(parents=True)
    world = len(rank_files)
    sdm, storage = {}, {}
    # (kind, file index, file count) -> [(name, Tensor)]
    files = {}
    recs = [m.load_checkpoint(str(f)) for f in rank_files]
    saver = {}  # balanced: (kind, name, offset) -> (rank, Tensor)
    for r, rec in enumerate(recs):
        for kind, names in (("model", [k for k in rec if k in NAMES]),
                            ("opt", [k for k in rec if k not in NAMES])):
            for k in names:
                if not balanced:
                    files.setdefault((kind, r, world), []).append((k, rec[k]))
                    continue
                key = (kind, k, tuple(locate(want[k], rec[k].asnumpy())))
                if key not in saver or (kind == "opt" and r == world - 1):
                    saver[key] = (r, rec[k])
    for kind in ("model", "opt"):
        savers = sorted({r for (kd, _, _), (r, _) in saver.items() if kd == kind})
        for (kd, k, _), (r, v) in saver.items():
            if kd == kind:
                files.setdefault((kind, savers.index(r), len(savers)), []).append((k, v))
    for (kind, i, n), items in sorted(files.items(), key=lambda x: x[0]):
        fname = f"{kind}-{i:07d}-{n:07d}"
        m.save_checkpoint([{"name": k, "data": v} for k, v in items], str(it / fname),
                          format="safetensors")
        for k, v in items:
            local = v.asnumpy()
            off = locate(want[k], local)
            e = sdm.setdefault(k, {
                "properties": {"dtype": str(v.dtype).lower(), "replica_id": 0,
                               "allow_shape_mismatch": False, "allow_to_save": True},
                "global_shape": list(want[k].shape),
                "axis_fragmentations": [g // x for g, x in zip(want[k].shape, local.shape)],
                "layout": None, "chunk": []})
            chunk = {"global_offset": off, "local_shape": list(local.shape)}
            if chunk not in e["chunk"]:
                e["chunk"].append(chunk)
            storage.setdefault(str((k, tuple(off))), []).append(
                {"file_name": fname + ".safetensors", "storage_rank": i,
                 "rank_group": list(range(world))})
    (it / "common.json").write_text(json.dumps(
        {"epoch_num": 1, "step_num": iteration, "global_step": iteration, "loss_scale": 1.0,
         "global_batch_size": batch, "consumed_samples": iteration * batch,
         "ckpt_status": 0}, indent=4))
    if world > 1 or balanced:
        (it / "metadata.json").write_text(json.dumps(
            {"state_dict_metadata": sdm, "storage_data": storage}, separators=(",", ":")))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return it


def test_checkpoint2_one_rank():
    """MindFormers' Checkpoint 2.0 (iteration_N/ of safetensors files) of one rank: read to
    what load_checkpoint gives for the source, converted to a .ckpt that loads the same; the
    save folder, the iteration folder and --checkpoint iteration_N all read it."""
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        want = train_and_save(t / "src" / "net.ckpt")
        it = checkpoint2(t / "save", [t / "src" / "net.ckpt"], want)
        for path, extra in ((t / "save", ()), (it, ()),
                            (t / "save", ("--checkpoint", it.name))):
            run("to-universal", path, *extra, "-o", t / "u.h5", "-q")
            assert_universal_is(t / "u.h5", want)
            (t / "u.h5").unlink()
        p = run("to-universal", t / "save", "--checkpoint", "iteration_00000009", "-o",
                t / "x.h5", expect=2)
        one_error_line(p, "iteration_00000009", "iteration_00000002", kind="usage error")
        run("convert", t / "save", "-o", t / "one", "--format", "mindspore", "-q")
        assert_same(load(only_ckpt(t / "one" / "rank_0")), want, "from Checkpoint 2.0")
        # A newer iteration folder the tracker does not name is a save that did not finish:
        # resume takes the tracker's, saying why.
        shutil.copytree(it, t / "save" / "iteration_00000004")
        (t / "save" / "iteration_00000004" / "common.json").unlink()
        r = json.loads(run("resume", t / "save", "--json").stdout)
        assert r["load"].endswith("iteration_00000002") and r["iteration"] == 2, r
        assert [s["name"] for s in r["skipped"]] == ["iteration_00000004"], r
        assert "did not finish" in r["skipped"][0]["reason"], r


def test_checkpoint2_sharded():
    """Checkpoint 2.0 of four ranks (MindSpore's own rank files of the "tp" layout, its
    replicated slices on two ranks each): metadata.json places every slice, to exactly the
    unsharded source; resume takes the tracker's iteration with MindFormers' data skip; a
    missing rank file or metadata.json is one clear error."""
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        want, ranks, _ = sharded_by_mindspore(t, "tp")
        files = [only_ckpt(ranks / f"rank_{r}") for r in range(world(LAYOUTS["tp"]))]
        it = checkpoint2(t / "save", files, want)
        run("to-universal", t / "save", "-o", t / "u.h5", "-q")
        assert_universal_is(t / "u.h5", want)
        r = json.loads(run("resume", t / "save", "--json", "--global-batch-size", 4).stdout)
        assert r["consumed_samples"] == 2 * 8 and r["data_skip_steps"] == 2 * 8 // 4, r
        assert r["load"].endswith("iteration_00000002") or r["load"] == str(t / "save"), r
        # MindFormers reshards Checkpoint 2.0 at load: it fits a Checkpoint 2.0 job of another
        # layout as it is; a job of .ckpt rank files gets them written.
        r = json.loads(run("resume", t / "save", "--json", "--format", "mindspore",
                           "--checkpoint2", "--strategy", t / "tp.ckpt").stdout)
        assert not r["reshaped"] and r["load"].endswith("iteration_00000002"), r
        r = json.loads(run("resume", t / "save", "--json", "--format", "mindspore",
                           "--strategy", t / "tp.ckpt", "-o", t / "ranks").stdout)
        assert r["reshaped"] and (t / "ranks" / "rank_3").is_dir(), r
        before = sorted(str(p) for p in t.rglob("*"))
        (it / "model-0000001-0000004.safetensors").rename(t / "aside")
        p = run("to-universal", t / "save", "-o", t / "x.h5", expect=3)
        one_error_line(p, "rank 1", "missing", kind="format error")
        (t / "aside").rename(it / "model-0000001-0000004.safetensors")
        (it / "metadata.json").rename(t / "aside")
        p = run("to-universal", t / "save", "-o", t / "x.h5", expect=3)
        one_error_line(p, "metadata.json", kind="format error")
        assert not (t / "x.h5").exists()
        (t / "aside").rename(it / "metadata.json")
        assert sorted(str(p) for p in t.rglob("*")) == before


def test_checkpoint2_balanced():
    """A remove_redundancy Checkpoint 2.0 save (each slice once, fewer files than ranks, and
    as many of each kind as ranks saved some of it): read to exactly the source."""
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        want, ranks, _ = sharded_by_mindspore(t, "tp")
        files = [only_ckpt(ranks / f"rank_{r}") for r in range(world(LAYOUTS["tp"]))]
        it = checkpoint2(t / "save", files, want, balanced=True)
        model = sorted(it.glob("model-*.safetensors"))
        opt = sorted(it.glob("opt-*.safetensors"))
        assert 1 <= len(model) < 4 and 1 <= len(opt) and len(model) != len(opt), (model, opt)
        run("to-universal", t / "save", "-o", t / "u.h5", "-q")
        assert_universal_is(t / "u.h5", want)
        first = run("inspect", t / "save").stdout.splitlines()[0]
        assert first.startswith(f"{it}  (MindFormers Checkpoint 2.0, "
                                f"{len(model) + len(opt)} safetensors files"), first


def load_safetensors(path):
    return {k: v.asnumpy()
            for k, v in ms().load_checkpoint(str(path), format="safetensors").items()}


def test_checkpoint2_written():
    """--checkpoint2 writes a MindFormers Checkpoint 2.0 save folder: unsharded, MindSpore's own
    load_checkpoint(format="safetensors") finds the params in the model file and the rest in
    the optimizer file, together the source's records; for the "tp" strategy, each rank's two
    files hold exactly the records of MindSpore's transform_checkpoints rank file; ucp reads
    both back to the source."""
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        want, theirs, strategy = sharded_by_mindspore(t, "tp")
        run("convert", t / "src", "-o", t / "one", "--format", "mindspore", "--checkpoint2",
            "-q")
        it = t / "one" / "iteration_00000002"
        assert (t / "one" / "latest_checkpointed_iteration.txt").read_text() == "2"
        model = load_safetensors(it / "model-0000000-0000001.safetensors")
        assert sorted(model) == sorted(NAMES), sorted(model)
        assert_same({**model, **load_safetensors(it / "opt-0000000-0000001.safetensors")},
                    want, "Checkpoint 2.0 written by ucp")
        assert not (it / "metadata.json").exists()
        common = json.loads((it / "common.json").read_text())
        assert common["global_step"] == 2 and common["step_num"] == 2, common
        run("to-universal", t / "one", "-o", t / "u1.h5", "-q")
        assert_universal_is(t / "u1.h5", want)
        run("convert", t / "src", "-o", t / "four", "--format", "mindspore", "--checkpoint2",
            "--target-strategy", strategy, "-q")
        it = t / "four" / "iteration_00000002"
        for r in range(world(LAYOUTS["tp"])):
            got = {**load_safetensors(it / f"model-{r:07d}-0000004.safetensors"),
                   **load_safetensors(it / f"opt-{r:07d}-0000004.safetensors")}
            assert_same(got, load(only_ckpt(theirs / f"rank_{r}")), f"rank {r}")
        run("to-universal", t / "four", "-o", t / "u4.h5", "-q")
        assert_universal_is(t / "u4.h5", want)


def mindformers_save(t, steps, layout="tp", ext="ckpt"):
    """A MindFormers-style save: output/checkpoint/rank_R/
    llama_rank_R-1_<step>.<ext> for each step (ext "safetensors": MindSpore's
    ckpt_to_safetensors of them, as CheckpointConfig(format="safetensors")
    saves), meta.json per rank naming the last, and
    output/strategy/ckpt_strategy_rank_R.ckpt per rank."""
    out = t / "output"
    write_strategy(t / "s.ckpt", LAYOUTS[layout])
    n = world(LAYOUTS[layout])
    wants = {}
    for step in steps:
        # MindFormers' append_dict: the step and the global batch size
        wants[step] = train_and_save(
            t / "plain" / str(step) / "rank_0" / "net.ckpt", steps=step,
            append={"epoch_num": 1, "step_num": step, "global_batch_size": 8})
        transform(t / "plain" / str(step), t / "cut" / str(step), "r", None, t / "s.ckpt")
        for r in range(n):
            d = out / "checkpoint" / f"rank_{r}"
            d.mkdir(parents=True, exist_ok=True)
            name = f"llama_rank_{r}-1_{step}.{ext}"
            cut = t / "cut" / str(step) / f"rank_{r}" / f"r{r}.ckpt"
            if ext == "ckpt":
                shutil.copy(cut, d / name)
            else:
                ms().ckpt_to_safetensors(str(cut), str(t / "st" / str(step) / str(r)))
                shutil.copy(t / "st" / str(step) / str(r) / f"r{r}.safetensors", d / name)
            (d / "meta.json").write_text(json.dumps(
                {"last_epoch": 1, "last_step": step, "last_ckpt_file": name}))
    (out / "strategy").mkdir()
    for r in range(n):
        shutil.copy(t / "s.ckpt", out / "strategy" / f"ckpt_strategy_rank_{r}.ckpt")
    return out / "checkpoint", wants


def test_mindformers_folder_newest_step_on_every_rank():
    """The strategy is found in output/strategy/; the newest step is the one
    every rank has and no rank's meta.json is behind; --checkpoint picks
    another step (rank 0's file names it)."""
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        ckpt, wants = mindformers_save(t, [1, 2, 3])
        run("to-universal", ckpt, "-o", t / "a.h5", "-q")
        assert_universal_is(t / "a.h5", wants[3])
        # Rank 2 never wrote step 3; rank 1's meta.json still says step 2.
        (ckpt / "rank_2" / "llama_rank_2-1_3.ckpt").unlink()
        run("to-universal", ckpt, "-o", t / "b.h5", "-q")
        assert_universal_is(t / "b.h5", wants[2])
        (ckpt / "rank_1" / "meta.json").write_text(json.dumps(
            {"last_epoch": 1, "last_step": 1, "last_ckpt_file": "llama_rank_1-1_1.ckpt"}))
        run("to-universal", ckpt, "-o", t / "c.h5", "-q")
        assert_universal_is(t / "c.h5", wants[1])
        run("to-universal", ckpt, "--checkpoint", "llama_rank_0-1_2.ckpt", "-o",
            t / "d.h5", "-q")
        assert_universal_is(t / "d.h5", wants[2])


def mindformers_safetensors_folder():
    """A MindFormers folder of safetensors rank files: the newest step every
    rank has, ucp resume falling back past a cut rank file and writing the
    new layout as safetensors rank files (MindSpore loads each), --checkpoint
    naming one."""
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        ckpt, wants = mindformers_save(t, [1, 2], ext="safetensors")
        run("to-universal", ckpt, "-o", t / "a.h5", "-q")
        assert_universal_is(t / "a.h5", wants[2])
        run("to-universal", ckpt, "--checkpoint", "llama_rank_0-1_1.safetensors", "-o",
            t / "b.h5", "-q")
        assert_universal_is(t / "b.h5", wants[1])
        f = ckpt / "rank_3" / "llama_rank_3-1_2.safetensors"
        f.write_bytes(f.read_bytes()[:-7])
        r = json.loads(run("resume", ckpt, "-o", t / "load", "--format", "mindspore",
                           "--json").stdout)
        assert r["iteration"] == 1 and r["reshaped"], r
        assert [s["name"] for s in r["skipped"]] == ["llama_rank_0-1_2.safetensors"], r
        assert "llama_rank_3-1_2.safetensors" in r["skipped"][0]["reason"], r
        assert_same(load_st(only_st(t / "load" / "rank_0")), wants[1], "resumed whole")


def test_resume_falls_back_past_a_damaged_rank_file():
    """ucp resume over a MindFormers folder: a cut rank file of the newest
    step makes it take the step before, saying why, with the data skip
    scaled to the new global batch size; asked for the same
    strategy it hands the save out as is, for another it writes the new
    layout (what transform_checkpoints writes)."""
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        ckpt, wants = mindformers_save(t, [1, 2])
        f = ckpt / "rank_3" / "llama_rank_3-1_2.ckpt"
        f.write_bytes(f.read_bytes()[:-100])  # cut inside a record
        strategy = ckpt.parent / "strategy" / "ckpt_strategy_rank_0.ckpt"
        p = run("resume", ckpt, "--format", "mindspore", "--strategy", strategy,
                "-o", t / "work", "--global-batch-size", 4, "--json")
        r = json.loads(p.stdout)
        assert r["ok"] and not r["reshaped"] and r["iteration"] == 2 - 1, r
        # MindFormers' data skip: step_num x saved / new global batch size.
        assert r["consumed_samples"] == 1 * 8 and r["data_skip_steps"] == 1 * 8 // 4, r
        assert "llama_rank_3-1_2.ckpt" in json.dumps(r["skipped"]), r["skipped"]
        write_strategy(t / "pp.ckpt", LAYOUTS["pp"])
        p = run("resume", ckpt, "--format", "mindspore", "--strategy", t / "pp.ckpt",
                "-o", t / "work2", "--json")
        r = json.loads(p.stdout)
        assert r["ok"] and r["reshaped"], r
        transform(t / "cut" / "1", t / "theirs", "x", t / "s.ckpt", t / "pp.ckpt")
        for rank in range(4):
            assert_same(load(only_ckpt(pathlib.Path(r["load"]) / f"rank_{rank}")),
                        load(only_ckpt(t / "theirs" / f"rank_{rank}")), f"rank {rank}")


def test_what_it_cannot_read_is_one_clear_error():
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        want, save, strategy = sharded_by_mindspore(t, "tp")
        # No strategy beside it.
        p = run("to-universal", save, "-o", t / "x.h5", expect=3)
        one_error_line(p, "strategy", "--strategy", kind="format error")
        # A strategy for another world size.
        write_strategy(t / "pp8.ckpt", {"fc1.weight": ([2, 2, 2], [0, -1], 0, 0)})
        p = run("to-universal", save, "--strategy", t / "pp8.ckpt", "-o", t / "x.h5",
                expect=3)
        one_error_line(p, "4 rank folders", "8 ranks", kind="format error")
        # A strategy that says a split param is whole on every rank: the
        # ranks' different slices are replicas that differ.
        other = dict(LAYOUTS["tp"])
        other["fc1.weight"] = ([2, 2], [-1, -1], 0, 0)
        write_strategy(t / "bad.ckpt", other)
        p = run("to-universal", save, "--strategy", t / "bad.ckpt", "-o", t / "x.h5",
                expect=3)
        one_error_line(p, "rank_0", "rank_1", "fc1.weight", kind="format error")
        # One that cuts a dim into parts that do not divide it.
        other["fc1.weight"] = ([3], [0, -1], 0, 0)
        write_strategy(t / "bad.ckpt", other)
        p = run("to-universal", save, "--strategy", t / "bad.ckpt", "-o", t / "x.h5",
                expect=3)
        one_error_line(p, "bad.ckpt", "fc1.weight", "3 devices", kind="format error")
        # A damaged strategy file.
        (t / "junk.ckpt").write_bytes(b"\x1a\xff\xff\xff")
        p = run("to-universal", save, "--strategy", t / "junk.ckpt", "-o", t / "x.h5",
                expect=3)
        one_error_line(p, "junk.ckpt", "strategy", kind="format error")
        # A rank folder without the step's file.
        os.remove(only_ckpt(save / "rank_1"))
        p = run("to-universal", save, "--strategy", strategy, "-o", t / "x.h5", expect=3)
        one_error_line(p, "rank_1", kind="format error")
        assert not (t / "x.h5").exists()
        # --strategy on one file is a usage error.
        p = run("to-universal", save / "rank_0" / "r0.ckpt", "--strategy", strategy,
                "-o", t / "x.h5", expect=2)
        one_error_line(p, "--strategy", kind="usage error")


# MindFormers' LLaMA (mindformers/models/llama) as its shard() calls cut it
# over model-parallel devices, written down here from its source: the tensor
# dim each weight is split along over mp (None: replicated), with the
# MatMul strategy it comes from (weights are [out, in], transpose_b).
MF_SPLIT = {
    "attention.wq.weight": 0,     # ((dp*cp, 1), (mp, 1))   llama_transformer.py
    "attention.wk.weight": 0,
    "attention.wv.weight": 0,
    "attention.wo.weight": 1,     # ((dp*cp, mp), (1, mp))
    "feed_forward.w1.weight": 0,  # ((dp, 1), (mp, 1))      llama_layer.py
    "feed_forward.w3.weight": 0,
    "feed_forward.w2.weight": 1,  # ((dp, mp), (1, mp))
    "attention_norm.weight": None,
    "ffn_norm.weight": None,
}
MF_LAYERS, MF_HIDDEN, MF_KV, MF_FFN, MF_VOCAB = 4, 8, 4, 12, 10


def mindformers_llama(path):
    """A MindFormers-named LLaMA checkpoint (AdamW's adam_m./adam_v. moments,
    global_step) saved by MindSpore's save_checkpoint; returns
    load_checkpoint's numpy and {param: (stage of pp 2 as LayerSetting puts
    it, split dim)}."""
    m = ms()
    from mindspore import Tensor
    shapes = {"model.tok_embeddings.embedding_weight": ([MF_VOCAB, MF_HIDDEN], 0, None)}
    for i in range(MF_LAYERS):
        stage = i // (MF_LAYERS // 2)  # LayerSetting: (layer_id + offset) // (layers / pp)
        for suffix, dim in MF_SPLIT.items():
            shape = {"attention.wq.weight": [MF_HIDDEN, MF_HIDDEN],
                     "attention.wk.weight": [MF_KV, MF_HIDDEN],
                     "attention.wv.weight": [MF_KV, MF_HIDDEN],
                     "attention.wo.weight": [MF_HIDDEN, MF_HIDDEN],
                     "feed_forward.w1.weight": [MF_FFN, MF_HIDDEN],
                     "feed_forward.w3.weight": [MF_FFN, MF_HIDDEN],
                     "feed_forward.w2.weight": [MF_HIDDEN, MF_FFN]}.get(suffix, [MF_HIDDEN])
            shapes[f"model.layers.{i}.{suffix}"] = (shape, stage, dim)
    # vocab_emb_dp (MindFormers' default): embedding and head replicated
    shapes["model.norm_out.weight"] = ([MF_HIDDEN], 1, None)
    shapes["lm_head.weight"] = ([MF_VOCAB, MF_HIDDEN], 1, None)
    rs = np.random.RandomState(7)
    items = []
    for prefix in ("", "adam_m.", "adam_v."):
        for n, (shape, _, _) in shapes.items():
            a = rs.randn(*shape).astype(np.float32)
            items.append({"name": prefix + n, "data": Tensor(a)})
    items.append({"name": "global_step", "data": Tensor(np.array([5], np.int32))})
    items.append({"name": "learning_rate", "data": Tensor(np.array([1e-4], np.float32))})
    path.parent.mkdir(parents=True, exist_ok=True)
    m.save_checkpoint(items, str(path))
    return load(path), {n: (st, d) for n, (_, st, d) in shapes.items()}


def strategy_layouts(path):
    """{name: (stage of the file, dev_matrix, tensor_map)} of a strategy file,
    read with MindSpore's own protobuf classes."""
    from mindspore.train import node_strategy_pb2 as pb
    m = pb.ParallelStrategyMap()
    m.ParseFromString(pathlib.Path(path).read_bytes())
    out = {}
    for item in m.parallel_layout_item:
        lay = item.parallel_layouts
        assert len(lay.dev_matrix) == 1 and len(lay.tensor_map) == 1, item
        assert lay.opt_weight_shard_size == 0 and lay.field == 0, item
        out[item.param_name] = (m.current_stage, list(lay.dev_matrix[0].dim),
                                list(lay.tensor_map[0].dim))
    return out


def test_tp_pp_dp_derive_the_strategy():
    """`--format mindspore --tp T --pp P --dp D` without a strategy file: ucp
    lays a MindFormers LLaMA out as MindFormers' shard() calls do (the
    mindformers-llama layout) and writes the strategy beside the rank files.
    The strategy (read by MindSpore's protobuf classes) splits each weight
    along the dim MindFormers' source splits it (MF_SPLIT, written from it),
    moments as their param, stages as LayerSetting places the layers;
    transform_checkpoints cuts the source with that strategy into exactly
    ucp's rank files, and merges ucp's rank files back into the source
    (pipeline stages through merge_pipeline_strategys)."""
    from mindspore.parallel import merge_pipeline_strategys
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        want, expect = mindformers_llama(t / "src" / "rank_0" / "llama.ckpt")
        for tp, pp, dp in ((2, 1, 2), (2, 2, 1), (2, 2, 2)):
            out = t / f"t{tp}p{pp}d{dp}"
            run("convert", t / "src", "-o", out, "--format", "mindspore", "--tp", tp,
                "--pp", pp, "--dp", dp, "-q")
            n = tp * pp * dp
            assert sorted(p.name for p in out.glob("rank_*")) == \
                sorted(f"rank_{r}" for r in range(n)), list(out.iterdir())
            if pp == 1:
                strategy = out / "strategy.ckpt"
                files = [strategy]
            else:
                files = sorted((out / "strategy").glob("*.ckpt"))
                assert [f.name for f in files] == [
                    f"ckpt_strategy_rank_{s * tp * dp}.ckpt" for s in range(pp)], files
                strategy = t / f"merged{tp}{pp}{dp}.ckpt"
                merge_pipeline_strategys(str(out / "strategy"), str(strategy))
            got = {}
            for f in files:
                got.update(strategy_layouts(f))
            for name, (stage, dim) in expect.items():
                tmap = [-1] * want[name].ndim
                if dim is not None:
                    tmap[dim] = 0  # the tp axis: the last of dev_matrix [dp, tp]
                for prefix in ("", "adam_m.", "adam_v."):
                    assert got.pop(prefix + name) == (stage if pp > 1 else 0, [dp, tp], tmap), \
                        (tp, pp, dp, prefix + name)
            assert not got, sorted(got)  # nothing else named (global_step is whole)
            theirs = t / f"theirs{tp}{pp}{dp}"
            transform(t / "src", theirs, "r", None, strategy)
            for r in range(n):
                assert_same(load(only_ckpt(out / f"rank_{r}")),
                            load(only_ckpt(theirs / f"rank_{r}")), (tp, pp, dp, r))
            transform(out, t / f"merged{tp}{pp}{dp}", "m", strategy, None)
            assert_same(load(t / f"merged{tp}{pp}{dp}" / "rank_0" / "m0.ckpt"), want,
                        (tp, pp, dp, "merged by MindSpore"))
            # ucp reads its own output (strategy found beside it) to the source.
            run("convert", out, "-o", t / f"back{tp}{pp}{dp}", "--format", "mindspore", "-q")
            assert_same(load(only_ckpt(t / f"back{tp}{pp}{dp}" / "rank_0")), want,
                        (tp, pp, dp, "back"))
        # The resume hint names the output everywhere and how MindSpore merges the stages.
        p = run("convert", t / "src", "-o", t / "hint", "--format", "mindspore", "--tp", 2,
                "--pp", 2)
        assert "<output>" not in p.stdout and \
            f'merge_pipeline_strategys("{t / "hint" / "strategy"}"' in p.stdout, p.stdout
        # The same hint in --json's "resume" (it kept "<output>" there).
        p = run("convert", t / "src", "-o", t / "hint_json", "--format", "mindspore", "--tp", 2,
                "--pp", 2, "--json")
        hint = json.loads(p.stdout)["resume"]
        assert "<output>" not in hint and \
            f'merge_pipeline_strategys("{t / "hint_json" / "strategy"}"' in hint, hint
        # ucp resume on a new device count: the same rank files, in its load folder.
        p = run("resume", t / "src", "--format", "mindspore", "--tp", 2, "--dp", 2, "--json")
        r = json.loads(p.stdout)
        assert r["reshaped"], r
        for rank in range(4):
            assert_same(load(only_ckpt(pathlib.Path(r["load"]) / f"rank_{rank}")),
                        load(only_ckpt(t / "t2p1d2" / f"rank_{rank}")), ("resume", rank))
        # A save laid out so already is handed out as it is; at another layout, rewritten.
        r = json.loads(run("resume", t / "t2p1d2", "--format", "mindspore", "--tp", 2, "--dp", 2,
                           "--json").stdout)
        assert not r["reshaped"] and pathlib.Path(r["load"]) == t / "t2p1d2", r
        r = json.loads(run("resume", t / "t2p1d2", "--format", "mindspore", "--tp", 2, "--pp", 2,
                           "--json").stdout)
        assert r["reshaped"], r
        for rank in range(4):
            assert_same(load(only_ckpt(pathlib.Path(r["load"]) / f"rank_{rank}")),
                        load(only_ckpt(t / "t2p2d1" / f"rank_{rank}")), ("resume pp", rank))


def test_tp_pp_dp_refusals():
    """What --tp/--pp/--dp cannot lay out is one clear error line, nothing
    written: names no layout describes (a plain network), a dim tp does not
    divide, a fused weight the layout does not describe, --tp with --strategy."""
    m = ms()
    from mindspore import Tensor
    with tempfile.TemporaryDirectory(prefix="ucp-mss-") as t:
        t = pathlib.Path(t)
        train_and_save(t / "net" / "rank_0" / "net.ckpt")
        p = run("convert", t / "net", "-o", t / "o1", "--format", "mindspore", "--tp", 2,
                expect=2)
        one_error_line(p, "--tp 2", "fc1.weight", "--strategy", kind="usage error")
        assert not (t / "o1").exists()
        mindformers_llama(t / "llama" / "rank_0" / "llama.ckpt")
        p = run("convert", t / "llama", "-o", t / "o2", "--format", "mindspore", "--tp", 3,
                expect=4)
        one_error_line(p, "model.layers.0.attention.wq.weight", "tp 3", kind="layout error")
        assert not (t / "o2").exists()
        write_strategy(t / "s.ckpt", LAYOUTS["tp"])
        p = run("convert", t / "llama", "-o", t / "o3", "--format", "mindspore", "--tp", 2,
                "--target-strategy", t / "s.ckpt", expect=2)
        one_error_line(p, "--strategy", "--tp", kind="usage error")
        assert not (t / "o3").exists()
        # MindFormers' qkv_concat: w_qkv is cut by an mp-dependent
        # interleaving the layout does not describe.
        f = only_ckpt(t / "llama" / "rank_0")
        items = [{"name": k, "data": v} for k, v in m.load_checkpoint(f).items()]
        items.append({"name": "model.layers.0.attention.w_qkv.weight",
                      "data": Tensor(np.zeros((16, MF_HIDDEN), np.float32))})
        os.remove(f)
        m.save_checkpoint(items, f)
        p = run("convert", t / "llama", "-o", t / "o4", "--format", "mindspore", "--tp", 2,
                expect=2)
        one_error_line(p, "--tp 2", kind="usage error")
        assert not (t / "o4").exists()


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
