#!/usr/bin/python3
"""Writes a corpus of CPython-written pickles plus what Python knows of each.

    make_pickle_corpus.py --out DIR     # DIR/<case>.p<protocol>.pkl + .json
    make_pickle_corpus.py --self-test   # checks this script's own oracles

Every case is pickled with protocols 0 to 5 by CPython's C pickler
(`pickle.dumps`, the same pickler torch.save uses). Next to each pickle a JSON
description records facts established by Python itself, so the C++ tests
compare ucp's pickle VM with CPython rather than with itself:

  {"file": "ints.p2.pkl", "case": "ints", "protocol": 2,
   "malicious": false,          # true: never loaded by anything
   "root": {...node...},
   "nodes": [node, ...],        # first-visit pre-order, see below
   "nodes_truncated": false,
   "same": [[path_a, path_b], ...],   # `a is b` in the loaded object
   "has_cycle": false,
   "globals": ["collections.OrderedDict", ...],  # GLOBAL/STACK_GLOBAL refs as
                                                 # written, sorted, unique
   "opcodes": ["BINPUT", ...]}  # sorted unique opcode names in the stream

A node is {"path": [...], "kind": K, ...} with K one of None bool int float
str bytes bytearray tuple list dict set frozenset global object, plus
  "repr"  Python repr() for None/bool/int/float/str/bytes/bytearray,
  "len"   for tuple/list/dict/set/frozenset and dict-like objects,
  "set_reprs" sorted repr() of set/frozenset elements (when all are scalars),
  "class" type(x).__module__ + '.' + __qualname__ for objects,
  "name"  module.qualname for classes/functions (pickled as globals).
Traversal (as in the torch fixture descriptions): descend into exact dict,
collections.OrderedDict, exact list and exact tuple; path components are str
or int dict keys (other keys as {"key_repr": repr(key)}) and int indices. A
container met again is not descended twice; its second path goes to "same"
together with its first path (a cycle when it is its own ancestor).
"""
import argparse
import collections
import datetime
import decimal
import fractions
import functools
import io
import json
import math
import os
import pathlib
import pickle
import pickletools
import random
import sys
import tempfile
import types
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "stubs"))

import numpy as np  # noqa: E402

import ucp_corpus_types as ct  # noqa: E402
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402
from deepspeed.utils.tensor_fragment import fragment_address  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402

PROTOCOLS = (0, 1, 2, 3, 4, 5)
MAX_NODES = 6000
MAX_SAME = 400

# --------------------------------------------------------------------------
# Cases


def ints():
    values = [0, 1, 2, 100]
    for k in (7, 8, 15, 16, 31, 32, 63, 64):
        for base in (2 ** k, -(2 ** k)):
            values += [base - 1, base, base + 1]
    values += [2 ** 100, -(2 ** 100), 2 ** 100 - 1, 10 ** 30, -(10 ** 30)]
    values += [2 ** 2040 - 1, 2 ** 2040, -(2 ** 2040), 2 ** 2100, -(2 ** 2100) + 7]
    return values


def floats():
    return [0.0, -0.0, 1.0, -1.5, 0.1, 1 / 3, 2.5, 100.0, 1e-05, 0.0001,
            1e-07, 1e15, 1e16, 1e22, 123456789012345678.0,
            1.2345678901234568e+17, 5e-324, 1.7976931348623157e308,
            float("inf"), float("-inf"), float("nan"), 3.14159, -2e-310]


def strings():
    return ["", "a", "abc", "it's", 'say "hi"', "both ' and \"", "back\\slash",
            "tab\tnl\ncr\r", "\x00\x01\x1f\x7f", "\x80\x9f\xa0\xad", "é",
            "ü€", "日本語テキスト", "😀 non-BMP 𝄞", "\u200b zero width",
            "\u2028 line sep", "\ufeff bom", "\ud800 lone surrogate",
            "\U000e0001 tag", "\u0378 unassigned", "x" * 300, "y" * 70000,
            "ascii only"]


def bytes_case():
    return {"empty": b"", "zero": b"\x00", "all": bytes(range(256)),
            "quote1": b"it's", "quote2": b'say "x"', "both": b"'\"",
            "text": b"abc" * 100, "long": bytes(range(256)) * 300,
            "ba_empty": bytearray(), "ba": bytearray(b"xyz"),
            "ba_all": bytearray(range(256)), "shared": [b"dup!", b"dup!"]}


def sizes():
    out = {}
    for n in range(6):
        out["tuple%d" % n] = tuple(range(n))
        out["list%d" % n] = list(range(n))
        out["dict%d" % n] = {"k%d" % i: i for i in range(n)}
        out["set%d" % n] = set(range(n))
        out["frozenset%d" % n] = frozenset(range(n))
        out["strtuple%d" % n] = tuple("s%d" % i for i in range(n))
    return out


def batching():
    out = {}
    for n in (999, 1000, 1001, 2000, 2001):
        out["list%d" % n] = list(range(n))
        out["dict%d" % n] = {i: -i for i in range(n)}
        out["odict%d" % n] = collections.OrderedDict((i, i) for i in range(n))
        out["set%d" % n] = set(range(n))
        ls = ct.ListSub(range(n))
        out["listsub%d" % n] = ls
    out["tuple1001"] = tuple(range(1001))
    return out


def nested():
    return {"a": {"b": {"c": [1, (2, [3, {"d": 4}])]}},
            "deep": functools.reduce(lambda acc, _: [acc], range(50), "bottom"),
            "keys": {1: "one", -5: "neg", (1, 2): "tuple-key", 2.5: "float-key",
                     None: "none-key", False: "false-key", b"k": "bytes-key"}}


def state_dict():
    sd = collections.OrderedDict()
    sd["embedding.weight"] = [[0.1, 0.2], [0.3, 0.4]]
    sd["layers.0.weight"] = [1.0, 2.0]
    sd["layers.0.bias"] = [0.0]
    sd._metadata = collections.OrderedDict(
        [("", {"version": 1}), ("embedding", {"version": 1}),
         ("layers", {"version": 1}), ("layers.0", {"version": 2})])
    return {"model": sd, "iteration": 10}


def many_strings():
    words = ["str-%04d" % i for i in range(420)]
    return {"words": words, "again": words[::7], "pairs": [(w, w) for w in words[:30]]}


def shared():
    x = [1, 2]
    s = "shared-string"
    t = (1, 2, 3)
    d = {"inner": x}
    return {"a": x, "b": x, "c": (x, x), "s1": s, "s2": s, "t": [t, t],
            "d1": d, "d2": [d, d]}


def self_ref():
    lst = [1]
    lst.append(lst)
    d = {}
    d["self"] = d
    a = []
    b = {"a": a}
    a.append(b)
    return {"list": lst, "dict": d, "mutual": a}


def recursive_tuple():
    lst = []
    t = (lst,)
    lst.append(t)
    lst2 = []
    t4 = (lst2, 1, 2, 3)
    lst2.append(t4)
    return [t, t4]


def namespace():
    return argparse.Namespace(lr=0.1, train_iters=10, name="gpt", layers=[1, 2],
                              fp16=True, tokenizer=None, seq_length=2048,
                              model_type=ModelType.encoder_or_decoder)


def simple_namespace():
    return types.SimpleNamespace(a=1, b="x", c=[1.5])


def paths():
    return [pathlib.PurePosixPath("/ckpt/step-100"), pathlib.PosixPath("/tmp/x"),
            pathlib.PurePosixPath("relative/path")]


def enums():
    return [ct.Color.RED, ct.Level.HIGH, ModelType.encoder_or_decoder,
            ZeroStageEnum.weights, ZeroStageEnum.optimizer_states, ct.Color,
            {"stage": ZeroStageEnum.gradients}]


def numpy_arrays():
    return {"f32": np.arange(6, dtype=np.float32).reshape(2, 3),
            "f64": np.array([1.5, -2.25, np.nan]),
            "i64": np.array([-(2 ** 62), 0, 7], dtype=np.int64),
            "bool": np.array([True, False, True]),
            "u8": np.arange(10, dtype=np.uint8),
            "f16": np.array([0.5, 1.0], dtype=np.float16),
            "i32_2d": np.arange(12, dtype=np.int32).reshape(3, 4),
            "fortran": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
            "empty": np.zeros((0, 4), dtype=np.float32),
            "scalar0d": np.array(3.0)}


def numpy_rng():
    rs = np.random.RandomState(1234)
    rs.rand(5)
    return rs.get_state()


def python_random():
    r = random.Random(1234)
    r.random()
    return r.getstate()


def bytes_io():
    b = io.BytesIO(b"transformer-engine extra state \x00\x01\xff")
    b.seek(5)
    return {"extra_state": b}


def dataclasses_case():
    return {"point": ct.Point(1, 2.5, ["a"]),
            "frag": fragment_address(numel=91, start=0),
            "frags": [fragment_address(numel=3, start=i) for i in range(3)]}


def deepspeed_like():
    return {
        "optimizer_state_dict": {
            "zero_stage": ZeroStageEnum.weights,
            "loss_scaler": LossScaler(1.0),
            "dynamic_loss_scaler": DynamicLossScaler(),
            "overflow": False,
            "partition_count": [2],
            "ds_version": "0.14.5",
            "param_slice_mappings": [collections.OrderedDict(
                [("fc1.weight", fragment_address(numel=91, start=0)),
                 ("fc1.bias", fragment_address(numel=13, start=91))])],
        },
        "sparse_tensor_module_names": set(),
        "skipped_steps": 0, "global_steps": 2, "global_samples": 8,
        "dp_world_size": 2, "mp_world_size": 1,
        "ds_config": {"train_batch_size": 8, "zero_optimization": {"stage": 3}},
    }


def megatron_like():
    rng = random.Random(7)
    return {
        "args": namespace(),
        "checkpoint_version": 3.0,
        "iteration": 10,
        "rng_state": [{"random_rng_state": rng.getstate(),
                       "np_rng_state": numpy_rng(),
                       "rng_tracker_states": {"model-parallel-rng": b"\x01\x02"}}],
        "num_floating_point_operations_so_far": 123456789012,
    }


def misc_objects():
    ls = ct.ListSub([1, 2, 3])
    ls.note = "attr on a list subclass"
    ds = ct.DictSub(a=1, b=[2])
    ds.flag = True
    return {
        "listsub": ls, "dictsub": ds, "named": ct.NamedT(1, "two"),
        "inner": ct.Outer.Inner(5), "slotted": ct.Slotted(1, "b"),
        "plain": ct.Plain(x=1, y=[1, 2], z={"k": None}),
        "defaultdict": collections.defaultdict(list, {"a": [1]}),
        "counter": collections.Counter("abracadabra"),
        "deque": collections.deque([1, 2, 3], maxlen=5),
        "datetime": datetime.datetime(2024, 1, 2, 3, 4, 5, 678),
        "date": datetime.date(2020, 2, 29),
        "timedelta": datetime.timedelta(days=1, seconds=2),
        "decimal": decimal.Decimal("1.50"),
        "fraction": fractions.Fraction(3, 7),
        "complex": complex(1, -2),
        "range": range(1, 10, 2),
        "slice": slice(1, None, 2),
        "uuid": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "partial": functools.partial(max, 1),
        "classes": [int, ct.Plain, collections.OrderedDict, len, math.sqrt],
        "singletons": [Ellipsis, NotImplemented],
        "set_of_str": {"alpha", "beta", "gamma"},
        "frozen_mixed": frozenset([1, "x", (2, 3)]),
    }


def misc_objects_p0():
    objects = misc_objects()
    del objects["slotted"]
    return objects


def kw_only():
    return [ct.KwOnly(1, 2, scale=3), ct.KwOnly(scale=0)]


def scalar_none():
    return None


def scalar_int():
    return 2 ** 70


def scalar_str():
    return "root string"


def scalar_float():
    return 1e-05


def perf():
    # ~5 MB, ~120k nodes: the C++ test times Unpickle on it.
    return {"key%06d" % i: [i, float(i) / 7, "v" * 180 + str(i), (i, -i)]
            for i in range(20000)}


class _Evil:
    def __init__(self, func, arg):
        self.func = func
        self.arg = arg

    def __reduce__(self):
        return (self.func, (self.arg,))


def malicious_system():
    return {"payload": _Evil(os.system, "echo pwned-by-pickle")}


def malicious_eval():
    return [_Evil(eval, "__import__('os').system('echo pwned')")]


CASES = {
    "ints": ints, "floats": floats, "strings": strings, "bytes": bytes_case,
    "sizes": sizes, "batching": batching, "nested": nested,
    "state_dict": state_dict, "many_strings": many_strings, "shared": shared,
    "self_ref": self_ref, "recursive_tuple": recursive_tuple,
    "namespace": namespace, "simple_namespace": simple_namespace,
    "paths": paths, "enums": enums, "numpy_arrays": numpy_arrays,
    "numpy_rng": numpy_rng, "python_random": python_random,
    "bytes_io": bytes_io, "dataclasses": dataclasses_case,
    "deepspeed_like": deepspeed_like, "megatron_like": megatron_like,
    "misc_objects": misc_objects, "scalar_none": scalar_none,
    "scalar_int": scalar_int, "scalar_str": scalar_str,
    "scalar_float": scalar_float, "perf": perf,
}
# Cases only meaningful for some protocols.
PROTOCOLS_OF = {
    # Below protocol 4 CPython writes functools.partial(cls.__new__, ...) for
    # __getnewargs_ex__, which names no class; protocols 4/5 use NEWOBJ_EX.
    "kw_only": (4, 5),
    "perf": (2, 4),
    # io.BytesIO and __slots__ objects cannot be pickled below protocol 2.
    "bytes_io": (2, 3, 4, 5),
    "misc_objects": (2, 3, 4, 5),
    "misc_objects_p0": (0, 1),
}
CASES["kw_only"] = kw_only
CASES["misc_objects_p0"] = misc_objects_p0
MALICIOUS = {"malicious_system": malicious_system,
             "malicious_eval": malicious_eval}

# --------------------------------------------------------------------------
# Facts


def kind_of(x):
    t = type(x)
    if x is None:
        return "None"
    for py, name in ((bool, "bool"), (int, "int"), (float, "float"),
                     (str, "str"), (bytes, "bytes"), (bytearray, "bytearray"),
                     (tuple, "tuple"), (list, "list"), (dict, "dict"),
                     (set, "set"), (frozenset, "frozenset")):
        if t is py:
            return name
    if x is Ellipsis or x is NotImplemented:
        return "global"
    if isinstance(x, (type, types.FunctionType, types.BuiltinFunctionType)):
        return "global"
    return "object"


SCALARS = ("None", "bool", "int", "float", "str", "bytes", "bytearray")


def global_name(x):
    if x is Ellipsis:
        return "builtins.Ellipsis"
    if x is NotImplemented:
        return "builtins.NotImplemented"
    return x.__module__ + "." + x.__qualname__


def is_dict_like(x):
    return type(x) is dict or type(x) is collections.OrderedDict


def key_component(k):
    if type(k) in (str, int):
        return k
    return {"key_repr": repr(k)}


def has_identity(x):
    """Objects whose identity in the loaded graph reflects memo sharing.

    CPython caches (), '', b'' and one-character str/bytes, and small ints,
    so those may be identical without sharing in the pickle."""
    k = kind_of(x)
    if k in ("None", "bool", "int", "float", "global"):
        return False
    if k in ("str", "bytes") and len(x) < 2:
        return False
    if k == "tuple" and len(x) == 0:
        return False
    return True


def describe_node(x, path):
    k = kind_of(x)
    node = {"path": path, "kind": k}
    if k in SCALARS:
        node["repr"] = repr(x)
    if k in ("tuple", "list", "dict", "set", "frozenset"):
        node["len"] = len(x)
    if k in ("set", "frozenset") and all(kind_of(e) in SCALARS for e in x):
        node["set_reprs"] = sorted(repr(e) for e in x)
    if k == "object":
        node["class"] = type(x).__module__ + "." + type(x).__qualname__
        if type(x) is collections.OrderedDict:
            node["len"] = len(x)
    if k == "global":
        node["name"] = global_name(x)
    return node


def traverse(root):
    """First-visit pre-order walk; returns nodes, same-pairs, has_cycle."""
    nodes, same = [], []
    first_path = {}
    has_cycle = False
    truncated = False
    # Explicit stack of (object, path, ancestors-ids).
    todo = [(root, [], frozenset())]
    while todo:
        x, path, ancestors = todo.pop()
        if has_identity(x):
            if id(x) in first_path:
                if len(same) < MAX_SAME:
                    same.append([first_path[id(x)], path])
                if id(x) in ancestors:
                    has_cycle = True
                continue
            first_path[id(x)] = path
        if len(nodes) >= MAX_NODES:
            truncated = True
            continue
        nodes.append(describe_node(x, path))
        inner = ancestors | {id(x)}
        children = []
        if is_dict_like(x):
            children = [(v, path + [key_component(k)]) for k, v in x.items()]
        elif type(x) in (list, tuple):
            children = [(v, path + [i]) for i, v in enumerate(x)]
        for child, child_path in reversed(children):
            todo.append((child, child_path, inner))
    return nodes, same, has_cycle, truncated


def stream_facts(data):
    """Globals (as written) and opcode names, read with pickletools only."""
    globals_, opcodes = set(), set()
    pushed = []  # values pushed by string opcodes / memo gets (others: None)
    memo = {}
    for op, arg, _ in pickletools.genops(data):
        opcodes.add(op.name)
        name = op.name
        if name == "GLOBAL" or name == "INST":
            module, _, gname = arg.partition(" ")
            globals_.add(module + "." + gname)
            pushed.append(None)
        elif name == "STACK_GLOBAL":
            module, gname = pushed[-2], pushed[-1]
            globals_.add("%s.%s" % (module, gname))
            pushed[-2:] = [None]
        elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
                      "UNICODE"):
            pushed.append(arg)
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[arg] = pushed[-1] if pushed else None
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            pushed.append(memo.get(arg))
        elif name not in ("MARK", "PROTO", "FRAME", "STOP"):
            pushed.append(None)
    return sorted(globals_), sorted(opcodes)


def facts(case, protocol, data, obj, malicious):
    globals_, opcodes = stream_facts(data)
    out = {"file": "%s.p%d.pkl" % (case, protocol), "case": case,
           "protocol": protocol, "malicious": malicious,
           "globals": globals_, "opcodes": opcodes}
    if malicious:
        return out
    nodes, same, has_cycle, truncated = traverse(obj)
    out.update({"root": nodes[0], "nodes": nodes, "nodes_truncated": truncated,
                "same": same, "has_cycle": has_cycle})
    return out


def write_corpus(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    count = 0
    for table, malicious in ((CASES, False), (MALICIOUS, True)):
        for case, build in table.items():
            protocols = PROTOCOLS_OF.get(case, PROTOCOLS)
            if malicious:
                protocols = (2, 4)
            for protocol in protocols:
                obj = build()
                data = pickle.dumps(obj, protocol=protocol)
                if not malicious:
                    # The description is of what a load produces.
                    obj = pickle.loads(data)
                base = os.path.join(out_dir, "%s.p%d" % (case, protocol))
                with open(base + ".pkl", "wb") as f:
                    f.write(data)
                with open(base + ".json", "w") as f:
                    json.dump(facts(case, protocol, data, obj, malicious), f,
                              indent=1, ensure_ascii=True, allow_nan=False)
                count += 1
    return count


# --------------------------------------------------------------------------
# Self-test: the oracles above against independent Python facts.


class _RecordingUnpickler(pickle.Unpickler):
    def __init__(self, f):
        super().__init__(f)
        self.seen = set()

    def find_class(self, module, name):
        self.seen.add(module + "." + name)
        return super().find_class(module, name)


def self_test():
    import check_pickle_roundtrip as roundtrip
    with tempfile.TemporaryDirectory() as tmp:
        n = write_corpus(tmp)
        assert n >= 100, n
        for name in sorted(os.listdir(tmp)):
            if not name.endswith(".json"):
                continue
            with open(os.path.join(tmp, name)) as f:
                desc = json.load(f)
            with open(os.path.join(tmp, desc["file"]), "rb") as f:
                data = f.read()
            if desc["protocol"] >= 2:
                assert data[0] == 0x80 and data[1] == desc["protocol"], name
            else:
                assert data[0] != 0x80, name
            if desc["malicious"]:
                assert any(g in ("posix.system", "os.system", "nt.system",
                                 "builtins.eval", "__builtin__.eval")
                           for g in desc["globals"]), desc["globals"]
                continue
            # Globals from the opcode scan == classes the unpickler asked for.
            rec = _RecordingUnpickler(io.BytesIO(data))
            obj = rec.load()
            assert rec.seen == set(desc["globals"]), (name, rec.seen,
                                                      desc["globals"])
            # The description is reproducible from a fresh load.
            again = facts(desc["case"], desc["protocol"], data, obj, False)
            assert json.loads(json.dumps(again, allow_nan=False)) == desc, name
            assert roundtrip.equal(obj, pickle.loads(data)), name
        # The round-trip comparison must be able to fail.
        nan = float("nan")
        lst = [1]
        assert roundtrip.equal([nan, -0.0], [nan, -0.0])
        assert not roundtrip.equal(-0.0, 0.0)
        assert not roundtrip.equal(1, 1.0)
        assert not roundtrip.equal(np.zeros(3), np.ones(3))
        assert not roundtrip.equal(np.zeros(3, np.float32), np.zeros(3))
        assert not roundtrip.equal([lst, lst], [[1], [1]])  # sharing differs
        assert not roundtrip.equal(ct.Plain(a=1), ct.Plain(a=2))
        assert roundtrip.equal(ct.Plain(a=[1]), ct.Plain(a=[1]))
        assert not roundtrip.equal(collections.OrderedDict(a=1, b=2),
                                   collections.OrderedDict(b=2, a=1))
        assert not roundtrip.equal({"a": 1}, collections.OrderedDict(a=1))
        cyc1 = [1]
        cyc1.append(cyc1)
        cyc2 = [1]
        cyc2.append(cyc2)
        assert roundtrip.equal(cyc1, cyc2)
        assert not roundtrip.equal(cyc1, [1, [1, []]])
    print("make_pickle_corpus self-test passed (%d pickles)" % n)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder to write the corpus into")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        sys.path.insert(0, HERE)
        self_test()
        return
    if not args.out:
        parser.error("--out is required")
    n = write_corpus(args.out)
    print("wrote %d pickles to %s" % (n, args.out))


if __name__ == "__main__":
    main()
